"""`CompiledStep`: a model's forward step under torch.compile, one static-shape graph per bucket.

Two compiled regions, so the number of graphs is the sum of the bucket counts,
not their product:

* the body, (input ids, positions) [T] -> hidden states [T, hidden], compiled
  for every token bucket: a step's T real tokens are padded up to the next
  bucket (token id 0 at position 0; fw.compile.ops keeps padding rows away
  from the attention backend and the KV cache, and every other layer works row
  by row, so real rows are untouched);
* the head, the sampled rows' hidden states [S, hidden] -> fp32 logits
  [S, vocab], compiled for every batch bucket (rows padded with row 0).

`dynamic=False`: each bucket gets a graph specialised to its shape (no
symbolic sizes, no guards that a new size could fail), and warm-up compiles
them all, so serving never compiles. Where torch can (fw.compile.graphs), a
bucket's graph is captured ahead of time and kept as a file in the cache key's
folder, so the next start loads it without tracing; warm-up then runs only the
smallest token bucket and the head's buckets once, as a check. `num_compiles`
counts every graph built or loaded (`num_loaded` of them from their files,
`num_traced` traced by dynamo here); the engine exposes it as
`num_compilations` in its stats and on /metrics.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fw.compile.buckets import StepBuckets
from fw.compile.cache import CacheEntry
from fw.compile.graphs import GraphFiles, available, portable_guards
from fw.compile.isolated import compile_isolated
from fw.compile.modes import check_compile_mode
from fw.compile.ops import step_context
from fw.compile.traceable import make_traceable
from fw.config import COMPILE_MODES
from fw.errors import FwError

logger = logging.getLogger("fw.compile")


class _FromContext:
    """Passed as the attention metadata argument of a compiled forward: the attention op reads the
    real metadata from fw.compile.ops.step_context, so none of it (Python lists that change every
    step) is traced or guarded on."""

    def __repr__(self) -> str:
        return "<attention metadata from fw.compile's step context>"


STEP_METADATA = _FromContext()


class CompiledStep:
    def __init__(self, model: nn.Module, buckets: StepBuckets, mode: str = "default",
                 cache: CacheEntry | None = None):
        if mode not in COMPILE_MODES:
            raise FwError(f"--compile-mode must be one of {', '.join(COMPILE_MODES)}; got {mode!r}")
        device = next(model.parameters(), torch.empty(0)).device
        check_compile_mode(mode, device.type)
        self.model = model
        self.buckets = buckets
        self.cache = cache
        self.num_compiles = 0
        self.num_loaded = 0  # graphs loaded from their files: no dynamo trace
        self.num_traced = 0  # graphs dynamo traced in this process
        self.compiled_tokens: set[int] = set()  # buckets whose graph exists (compiled or loaded)
        self.compiled_batch: set[int] = set()
        self.head_compiled = True  # False once the head turned out not to be traceable (runs eagerly)
        self._warned: set[str] = set()
        # here: inductor's modules cost start-up time; only compiling needs them
        from torch._inductor import list_mode_options

        self._patches = list_mode_options(mode, dynamic=False)
        self.traceable = make_traceable(model)
        limit = max(len(buckets.tokens), len(buckets.batch)) + 8

        def body(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions, STEP_METADATA)

        def head(hidden: torch.Tensor) -> torch.Tensor:
            return model.compute_logits(hidden).float()

        # Isolated: this step's graphs (and its recompile limit) are its own, not shared with another
        # engine's model in the same process, whose forward is the same code object.
        # No guards on the model's modules and parameters: a loaded fw model does not change its structure,
        # and checking ~300 of them before every call cost 2-4% of a batch-1 decode step.
        # Saved graphs keep only the guards that serialise (fw.compile.graphs), a subset of these.
        self._aot = available()
        guards = portable_guards if self._aot else torch.compiler.skip_guard_on_all_nn_modules_unsafe
        options = {"fullgraph": True, "dynamic": False, "backend": self._backend, "recompile_limit": limit,
                   "options": {"guard_filter_fn": guards}}
        self._body = compile_isolated(body, **options)
        self._head = compile_isolated(head, **options)
        self._graphs: dict[str, dict[int, Callable]] = {"tokens": {}, "batch": {}}  # the captured graphs
        self._files = GraphFiles(cache.graphs_dir if cache is not None else None, model)

    # -- compilation -----------------------------------------------------------------------

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx  # here: inductor's modules cost start-up time

        compiled = compile_fx(gm, example_inputs, config_patches=self._patches or None)
        self.num_compiles += 1
        return compiled

    @contextmanager
    def _torch_cache(self) -> Iterator[None]:
        """Torch's compile caches in this key's folder while a graph may be compiled."""
        if self.cache is None:
            yield
            return
        # here: inductor's modules cost start-up time
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        self.cache.inductor_dir.mkdir(parents=True, exist_ok=True)
        with temporary_cache_dir(str(self.cache.inductor_dir)):
            yield

    # -- running ---------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        """Hidden states [T, hidden] of one step's T tokens (the model's forward, padded to a bucket)."""
        n = input_ids.shape[0]
        bucket = self.buckets.token_bucket(n)
        with self._context(n, meta):
            if bucket is None:
                self._warn_once("tokens", f"a step of {n} tokens is above the largest token bucket "
                                          f"{self.buckets.tokens[-1]}: it runs uncompiled")
                return self.model(input_ids, positions, meta)
            if bucket != n:
                input_ids = F.pad(input_ids, (0, bucket - n))
                positions = F.pad(positions, (0, bucket - n))
            hidden = self._call("tokens", bucket, (input_ids, positions))
        return hidden[:n]

    def padded_rows(self, rows: list[int]) -> list[int]:
        """`rows` padded with row 0 up to their batch bucket (unchanged above the largest bucket or with the
        head uncompiled): the index `logits` selects with, which the runner uploads with the step's metadata."""
        bucket = self.buckets.batch_bucket(len(rows))
        if bucket is None or not self.head_compiled:
            return rows
        return rows + [0] * (bucket - len(rows))

    def logits(self, hidden: torch.Tensor, rows: list[int], index: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [len(rows), vocab] of the given rows of `hidden`; `index` is `padded_rows(rows)` already on
        the device when the caller has it (else it is made here)."""
        n = len(rows)
        bucket = self.buckets.batch_bucket(n)
        if bucket is None or not self.head_compiled:
            if bucket is None:
                self._warn_once("batch", f"a step sampling {n} rows is above the largest batch bucket "
                                         f"{self.buckets.batch[-1]}: its output layer runs uncompiled")
            if index is None or index.shape[0] != n:
                index = torch.tensor(rows, device=hidden.device)
            return self.model.compute_logits(hidden.index_select(0, index)).float()
        if index is None or index.shape[0] != bucket:
            index = torch.tensor(rows + [0] * (bucket - n), device=hidden.device)
        selected = hidden.index_select(0, index)
        with self._context(0):
            logits = self._call("batch", bucket, (selected,))
        return logits[:n]

    def _context(self, num_tokens: int, meta: Any = None):
        return step_context(self.traceable.layers, meta, num_tokens, self.traceable.weights)

    def _done(self, dim: str) -> set[int]:
        return self.compiled_tokens if dim == "tokens" else self.compiled_batch

    def _prepare(self, dim: str, bucket: int, example: tuple) -> Callable:
        """The bucket's captured graph (with fw.compile.graphs): loaded from its file, else traced, compiled
        and saved; `example` gives the inputs' shapes. Nothing runs."""
        graph = self._graphs[dim].get(bucket)
        if graph is None:
            with self._torch_cache(), torch.inference_mode():  # Inductor's kernels live in the key's folder
                graph = self._files.load(dim, bucket)
                if graph is not None:
                    self.num_loaded += 1
                    self.num_compiles += 1
                else:
                    graph = (self._body if dim == "tokens" else self._head).aot_compile((example, {}))
                    self.num_traced += 1
                    self._files.save(dim, bucket, graph)
                    graph.disable_guard_check()  # fw picks the graph by bucket (fw.compile.graphs says why)
            self._graphs[dim][bucket] = graph
            self._done(dim).add(bucket)
        return graph

    def _call(self, dim: str, bucket: int, args: tuple) -> torch.Tensor:
        """Run the bucket's graph (building or loading it at its first use)."""
        if self._aot:
            return self._prepare(dim, bucket, args)(*args)
        with self._compiling_if(bucket not in self._done(dim)):
            out = (self._body if dim == "tokens" else self._head)(*args)
        self._done(dim).add(bucket)
        return out

    @contextmanager
    def _compiling_if(self, first_use: bool) -> Iterator[None]:
        with self._torch_cache() if first_use else nullcontext():
            yield

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("%s (raise --bucket-%s-max to compile it)", message, what)

    # -- warm-up ---------------------------------------------------------------------------

    @torch.inference_mode()
    def compile_all(self) -> None:
        """The warm-up: every bucket's graph compiled or loaded before serving. Captured graphs are not
        run, except the smallest token bucket and the head's buckets (cheap), once on padding only (no KV
        page is touched) as a check; without capture (an older torch) every bucket runs once, which is
        what compiles it or loads it from torch's caches."""
        device = next(self.model.parameters()).device
        hidden = None
        for bucket in self.buckets.tokens:
            ids = torch.zeros(bucket, dtype=torch.long, device=device)
            out = self._run_body(ids, bucket, run=hidden is None or not self._aot)
            hidden = out if hidden is None else hidden
        for bucket in self.buckets.batch:
            rows = torch.zeros(bucket, hidden.shape[-1], dtype=hidden.dtype, device=device)
            self._run_head(rows, bucket)

    def _run_body(self, ids: torch.Tensor, bucket: int, run: bool = True) -> torch.Tensor | None:
        args = (ids, torch.zeros_like(ids))  # two tensors: aliasing would be guarded on
        try:
            with self._context(0):
                if not run:
                    self._prepare("tokens", bucket, args)
                    return None
                hidden = self._call("tokens", bucket, args)
        except Exception as exc:
            raise FwError(
                f"torch.compile could not compile this model's forward step ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); run without "
                f"--enable-torch-compile") from exc
        return hidden

    def _run_head(self, rows: torch.Tensor, bucket: int) -> None:
        if not self.head_compiled:
            return
        try:
            with self._context(0):
                self._call("batch", bucket, (rows,))
        except Exception as exc:  # e.g. a family's own compute_logits over an opaque packed weight
            self.head_compiled = False
            self.compiled_batch.clear()
            logger.warning("the output layer of %s cannot be compiled (%s: %s); it runs uncompiled",
                           type(self.model).__name__, type(exc).__name__,
                           str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            return
