"""The engine's side of `--enable-torch-compile`: `attach(engine)` builds the engine's `CompiledStep`,
compiles every bucket (unless --skip-warmup) and hands it to the model runner.

Why a module of its own: the engine calls it, while `fw.commands.warm_cache.compiled` (fw warm-cache's compiled-steps
artifact) starts an engine; with `attach` in `fw.compile`'s `__init__`, beside the warm-cache entry
point, the engine and fw.compile imported each other in a circle."""

from __future__ import annotations

import logging
import time
from typing import Any

from fw.compile.buckets import StepBuckets
from fw.compile.cache import CacheEntry, cache_key, cache_root, evict, key_inputs, new_manifest
from fw.compile.step import CompiledStep
from fw.warm import startup

logger = logging.getLogger("fw.compile")


def attach(engine: Any) -> CompiledStep:
    """Compile `engine`'s model step (and warm it up unless --skip-warmup); the runner then uses it."""
    from torch._dynamo.utils import counters  # here: torch._dynamo costs start-up time; only compiling needs it

    config, loaded = engine.config, engine.loaded
    buckets = StepBuckets.from_config(config)
    inputs = key_inputs(config, loaded.plan, buckets, engine.plugins)
    entry = CacheEntry(cache_root(config), cache_key(inputs))
    with startup.phase(startup.COMPILE):
        step = CompiledStep(loaded.model, buckets, config.compile_mode or "default", entry)
        if not config.skip_warmup:
            hits_before = counters["inductor"]["fxgraph_cache_hit"]
            start = time.perf_counter()
            with entry.exclusive():  # a second process compiling the same key waits, then hits
                step.compile_all()
                seconds = time.perf_counter() - start
                entry.write_manifest(new_manifest(entry.key, inputs, sorted(step.compiled_tokens),
                                                  sorted(step.compiled_batch), step.num_compiles, seconds))
            hits = counters["inductor"]["fxgraph_cache_hit"] - hits_before
            logger.info("torch.compile: %d graphs for %d token and %d batch buckets in %.1f s (%d loaded from "
                        "their files, %d traced, %d of those from Inductor's cache), key %s in %s",
                        step.num_compiles, len(buckets.tokens), len(buckets.batch), seconds, step.num_loaded,
                        step.num_traced, hits, entry.key, entry.root)
            evict(entry.root, config.compile_cache_size_mb * 2**20, keep=entry.key)
    entry.touch()
    engine.runner.compiled = step
    return step
