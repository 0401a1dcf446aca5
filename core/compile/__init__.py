"""Compiled execution: `--enable-torch-compile` runs the model's step through
torch.compile, one static-shape graph per shape bucket, with the compile
caches kept per configuration under `--compile-cache-dir` (docs/compile.md).

* `attach(engine)` (`fw.compile.engine_step`): called by the engine when the
  flag is set; builds the `CompiledStep`, compiles every bucket (warm-up)
  unless `--skip-warmup`, and hands it to the model runner.
* `fw warm-cache` prepares the compiled steps ahead (its artifact lives with the
  command, in `fw.commands.warm_cache.compiled`).
"""

from __future__ import annotations

from fw.compile.buckets import StepBuckets
from fw.compile.engine_step import attach
from fw.compile.step import CompiledStep

__all__ = ["CompiledStep", "StepBuckets", "attach"]

