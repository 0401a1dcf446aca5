"""Where fw keeps what it derives once and reuses: converted GGUF tokenizers, built kernels."""

from __future__ import annotations

from pathlib import Path

from fw import env


def cache_dir() -> Path:
    """`$FW_CACHE_DIR`, else `~/.cache/fw`. Plugins put their own subfolder under it."""
    return Path(env.CACHE_DIR.get() or Path.home() / ".cache" / "fw")
