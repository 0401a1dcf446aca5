"""Compiled execution: `--enable-torch-compile` runs the model's step through
torch.compile, one static-shape graph per shape bucket, with the compile
caches kept per configuration under `--compile-cache-dir` (docs/compile.md).

* `attach(engine)` (`fw.compile.engine_step`): called by the engine when the
  flag is set; builds the `CompiledStep`, compiles every bucket (warm-up)
  unless `--skip-warmup`, and hands it to the model runner.
* `warm_artifacts(context)` (`fw.compile.warm`): the compiled steps as `fw warm-cache`
  artifacts.
"""

from __future__ import annotations

from typing import Any

from fw.compile.buckets import StepBuckets
from fw.compile.engine_step import attach
from fw.compile.step import CompiledStep

__all__ = ["CompiledStep", "StepBuckets", "attach", "warm_artifacts"]


def warm_artifacts(context: Any) -> list:
    # here: fw.compile.warm is fw warm-cache's (tooling, which starts engines): kept off the engine's import path
    from fw.compile.warm import warm_artifacts as make

    return make(context)
