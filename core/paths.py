"""Where fw keeps what it derives once and reuses: converted GGUF tokenizers, built kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$FW_CACHE_DIR`, else `~/.cache/fw`. Plugins put their own subfolder under it."""
    return Path(os.environ.get("FW_CACHE_DIR") or Path.home() / ".cache" / "fw")
