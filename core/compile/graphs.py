"""One bucket's compiled graph kept as a file, so a warm start loads it instead of tracing it again.

Why: with only torch's FX-graph and AOTAutograd caches, every start still ran dynamo over the whole
model once per bucket to find those caches' keys; on SmolLM2 that was ~4 s a bucket, most of a
68-81 s warm start (docs/compile.md). torch's AOT compile (`torch.compile(fn).aot_compile`, dynamo's
precompile) captures a bucket's graph, its guards and Inductor's compiled code in one serialisable
object; `torch.compiler.load_compiled_function` brings it back without tracing (times: docs/compile.md).

Each file sits in its cache key's folder (`<key>/graphs/<tokens|batch>-<bucket>.bin`), so fw's key
still decides what a start may load, and Inductor's compiled kernels stay in the key's `inductor/`
folder (the loader needs them there). The file keeps the guards that serialise (the inputs' tensor
metadata, torch's global state), none on the model's modules and parameters, which a loaded fw model
never changes (the live-compiled path skips those too). fw does not check them before each call: it
picks the graph by bucket itself and makes its inputs (contiguous, the bucket's shape, the step's
dtype, in inference mode), and the global state includes the thread count, which fw's ThreadGovernor
changes while serving: a captured graph failing that guard would stop the step (a live-compiled one
recompiled the bucket, seconds, mid-serving). Inductor's glue kernels keep the thread count they were
compiled for; the opaque kernels (attention, linears, norms) follow the governor.
The model is not in the file: it is passed in again at load (`external_data`).

On a torch without `aot_compile`, `available` is False and the caller compiles as before."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger("fw.compile")

GRAPHS = "graphs"  # the folder of the files inside a cache key's folder


def available() -> bool:
    """Whether this torch captures graphs ahead of time and loads them back (torch 2.13 does; the GPU
    machine's 2.11 may not): then torch.compile'd functions get `aot_compile`."""
    return (getattr(torch._dynamo.config, "enable_aot_compile", False)
            and hasattr(torch.compiler, "load_compiled_function")
            and hasattr(torch.compiler, "keep_portable_guards_unsafe"))


def portable_guards(entries: list) -> list[bool]:
    """The guard filter of a graph that is saved: the portable guards (only those can be serialised),
    none on the model's modules."""
    keep = torch.compiler.keep_portable_guards_unsafe(entries)
    skip_modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [a and b for a, b in zip(keep, skip_modules)]


def graph_name(dim: str, bucket: int) -> str:
    return f"{dim}-{bucket}.bin"


class GraphFiles:
    """The saved graphs of one cache key; `folder` None keeps nothing (a step without a cache)."""

    def __init__(self, folder: Path | None, model: torch.nn.Module):
        self.folder = folder
        self.model = model

    def path(self, dim: str, bucket: int) -> Path | None:
        return None if self.folder is None else self.folder / graph_name(dim, bucket)

    def load(self, dim: str, bucket: int) -> Callable | None:
        """The saved graph, or None when there is none or it cannot be loaded (then it is built again)."""
        path = self.path(dim, bucket)
        if path is None or not path.is_file():
            return None
        try:
            with open(path, "rb") as f, torch.inference_mode():  # the guards' dispatch keys are those of a step
                graph = torch.compiler.load_compiled_function(f, external_data={"model": self.model})
        except Exception as exc:  # a file from another torch build, a truncated file: compile it again
            logger.warning("compiled graph %s could not be loaded (%s: %s); compiling it again", path,
                           type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            return None
        graph.disable_guard_check()  # see the module
        return graph

    def save(self, dim: str, bucket: int, graph: Any) -> None:
        """Write the graph atomically (torch writes a temporary file and renames it)."""
        path = self.path(dim, bucket)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            graph.save_compiled_function(str(path), external_data={"model": self.model})
        except Exception as exc:  # it still runs here; the next start compiles it again
            logger.warning("compiled graph %s could not be saved (%s: %s); the next start compiles it again",
                           path, type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "")
