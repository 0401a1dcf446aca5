"""The compiled model steps as a `fw warm-cache` artifact: one item per bucket.

`check` works out the cache key the server would use for the same flags
(without loading the model) and reports each bucket hit when that key's
manifest lists it. `build`, unless every bucket hits, starts an engine with
the flags, whose warm-up compiles every bucket into the cache (or waits for
another process compiling the same key, then finds it compiled), and drops it
again."""

from __future__ import annotations

import dataclasses
import gc
import logging

from fw.compile.buckets import StepBuckets
from fw.compile.cache import CacheEntry, cache_key, cache_root, key_inputs
from fw.errors import FwError
from fw.warm.artifact import WarmContext, WarmItem

logger = logging.getLogger("fw.compile")

# A warm-cache engine runs no requests: a few KV pages instead of --kv-cache-memory (not part of the key).
_WARM_KV_BLOCKS = 16


class CompiledStepsArtifact:
    name = "torch.compile buckets"
    owner = "core"

    def entry(self, context: WarmContext) -> CacheEntry | None:
        """The cache entry the server would use, or None while the model's files are missing."""
        from fw.warm import resolve  # here: warm-cache tooling, loaded only by `fw warm-cache`

        if context.source is None:
            return None
        cfg = context.config
        plan = resolve.plan(context)
        plan.check("model", "device", "architecture", "dtype")
        if cfg.attention_backend == "auto":
            plan.check("attention_backend")
        inputs = key_inputs(cfg, plan, StepBuckets.from_config(cfg), context.plugins)
        return CacheEntry(cache_root(cfg), cache_key(inputs))

    def check(self, context: WarmContext) -> list[WarmItem]:
        cfg = context.config
        if not cfg.enable_torch_compile:
            return []
        buckets = StepBuckets.from_config(cfg)
        entry = self.entry(context)
        if entry is None:
            return [WarmItem(f"{dim}={b}", False, "model files not present yet")
                    for dim, values in (("tokens", buckets.tokens), ("batch", buckets.batch)) for b in values]
        done = entry.compiled_buckets() if entry.inductor_dir.is_dir() else {"tokens": set(), "batch": set()}
        return [WarmItem(f"{dim}={b}", b in done[dim], f"key {entry.key} in {entry.root}")
                for dim, values in (("tokens", buckets.tokens), ("batch", buckets.batch)) for b in values]

    def build(self, context: WarmContext) -> list[WarmItem]:
        from fw.warm import resolve  # here: warm-cache tooling, loaded only by `fw warm-cache`

        cfg = context.config
        if not cfg.enable_torch_compile:
            return []
        target = context.options.get("target_device")
        if target:
            # here: the plan's rules load the model loader; --target-device only
            from fw.plan.rules import resolve_device

            if resolve.device(context) != resolve_device(cfg.device):
                raise FwError(f"compiled steps are built by running them: --target-device {target} is not the "
                              f"device here; run fw warm-cache on a machine with that device")
        before = self.check(context)
        if all(item.hit for item in before):
            return before  # nothing to compile: no engine to start
        from fw.engine.engine import LLMEngine  # here: fw.compile's light modules (buckets, cache) must not load the engine

        engine = LLMEngine(dataclasses.replace(cfg, skip_warmup=False, num_kv_blocks=_WARM_KV_BLOCKS),
                           context.plugins)
        compiled = engine.runner.compiled
        key = compiled.cache.key if compiled is not None and compiled.cache is not None else None
        del engine, compiled
        gc.collect()
        after = {item.name: item for item in self.check(context)}
        out = []
        for item in before:
            now = after.get(item.name)
            if now is None or not now.hit:
                raise FwError(f"warm-up did not compile bucket {item.name} into the compile cache (engine key {key})")
            out.append(WarmItem(item.name, item.hit, now.detail))
        return out


def warm_artifacts(context: WarmContext) -> list:
    """fw warm-cache's entry point (fw.commands.warm_cache.collect calls it), when the flags enable compilation: on a
    CPU, the fw_packed C++ op the graphs call, then the compiled steps."""
    if not context.config.enable_torch_compile:
        return []
    # here: fw.compile.ops imports torch; warm-cache's collector lists artifacts first
    from fw.compile.ops import PACKED_SOURCE
    from fw.warm.cpp import CppOpsArtifact, cpu_target  # here: warm-cache tooling, loaded only by `fw warm-cache`

    return [CppOpsArtifact("fw_packed", PACKED_SOURCE, owner="core", applies=cpu_target), CompiledStepsArtifact()]
