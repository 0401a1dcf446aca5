"""Runs the collected artifacts in order, building (or with `check` only asking)
each, and prints the report: one line per item, then `hits=N misses=M`.

A line reads `STATUS  ARTIFACT [OWNER] ITEM: DETAIL`, STATUS being `hit`
(already cached), `miss` (--check: would be built), `built` (made now) or
`FAILED`; an artifact with nothing to prepare for these flags shows `-`. When
the model files fail, the rest is skipped: it all needs them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from fw.errors import FwError
from fw.warm.artifact import WarmContext
from fw.commands.warm_cache.collect import Contribution

logger = logging.getLogger("fw.warm")

MODEL_FILES = "model files"


@dataclass
class Summary:
    hits: int = 0
    misses: int = 0
    failed: int = 0

    def line(self) -> str:
        return f"hits={self.hits} misses={self.misses}" + (f" failed={self.failed}" if self.failed else "")


def run(contributions: list[Contribution], context: WarmContext, build: bool,
        emit: Callable[[str], None] = print) -> Summary:
    summary = Summary()
    for c in contributions:
        if c.artifact is None:
            summary.failed += 1
            emit(f"FAILED  plugin {c.owner}: {c.error}")
            continue
        a = c.artifact
        title = f"{a.name} [{a.owner}]"
        start = time.perf_counter()
        try:
            items = a.build(context) if build else a.check(context)
        except Exception as exc:  # reported per artifact; the others still run
            summary.failed += 1
            message = str(exc) if isinstance(exc, FwError) else f"{type(exc).__name__}: {exc}"
            logger.debug("%s failed", title, exc_info=True)
            emit(f"FAILED  {title}: {message}")
            if a.name == MODEL_FILES:
                emit("        (the other artifacts need the model files: skipped)")
                break
            continue
        seconds = time.perf_counter() - start
        if not items:
            emit(f"-       {title}: nothing to prepare for these flags")
        for item in items:
            status = "hit" if item.hit else ("built" if build else "miss")
            summary.hits += item.hit
            summary.misses += not item.hit
            timing = f" ({seconds:.1f} s)" if build and not item.hit and len(items) == 1 else ""
            emit(f"{status:<7} {title} {item.name}: {item.detail}{timing}".rstrip(": "))
    return summary


def describe_target(context: WarmContext) -> str | None:
    """What the flags resolved to (device, dtype, attention backend), as far as it is known."""
    memo = {**context.memo, "attention_backend": _attention(context)}
    parts = [f"{key}={str(memo[key]).removeprefix('torch.')}" for key in ("device", "dtype", "attention_backend")
             if memo.get(key) is not None]
    return ("for " + " ".join(parts)) if parts else None


def _attention(context: WarmContext) -> str | None:
    cfg = context.config
    return context.memo.get("attention_backend") or (cfg.attention_backend if cfg.attention_backend != "auto"
                                                     else None)
