"""Compiled execution: `--enable-torch-compile` runs the model's step through
torch.compile, one static-shape graph per shape bucket, with the compile
caches kept per configuration under `--compile-cache-dir` (docs/compile.md).

* `attach(engine)`: called by the engine when the flag is set; builds the
  `CompiledStep`, compiles every bucket (warm-up) unless `--skip-warmup`, and
  hands it to the model runner.
* `warm_artifacts(context)`: the compiled steps as `fw warm-cache` artifacts.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fw.compile.buckets import StepBuckets
from fw.compile.step import CompiledStep

logger = logging.getLogger("fw.compile")

__all__ = ["CompiledStep", "StepBuckets", "attach", "warm_artifacts"]


def attach(engine: Any) -> CompiledStep:
    """Compile `engine`'s model step (and warm it up unless --skip-warmup); the runner then uses it."""
    from torch._dynamo.utils import counters

    from fw.compile.cache import CacheEntry, cache_key, cache_root, evict, key_inputs, new_manifest
    from fw.warm import startup

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
            logger.info("torch.compile: %d graphs for %d token and %d batch buckets in %.1f s (%d from the "
                        "cache), key %s in %s", step.num_compiles, len(buckets.tokens), len(buckets.batch),
                        seconds, hits, entry.key, entry.root)
            evict(entry.root, config.compile_cache_size_mb * 2**20, keep=entry.key)
    entry.touch()
    engine.runner.compiled = step
    return step


def warm_artifacts(context: Any) -> list:
    from fw.compile.warm import warm_artifacts as make

    return make(context)
