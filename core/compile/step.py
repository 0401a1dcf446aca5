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
them all, so serving never compiles. `num_compiles` counts every graph the
backend is asked to build (a cache hit still counts: dynamo traced it); the
engine exposes it as `num_compilations` in its stats and on /metrics.
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
        options = {"fullgraph": True, "dynamic": False, "backend": self._backend, "recompile_limit": limit,
                   "options": {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}}
        self._body = compile_isolated(body, **options)
        self._head = compile_isolated(head, **options)

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
            with self._compiling_if(bucket not in self.compiled_tokens):
                hidden = self._body(input_ids, positions)
            self.compiled_tokens.add(bucket)
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
        with self._context(0), self._compiling_if(bucket not in self.compiled_batch):
            logits = self._head(selected)
        self.compiled_batch.add(bucket)
        return logits[:n]

    def _context(self, num_tokens: int, meta: Any = None):
        return step_context(self.traceable.layers, meta, num_tokens, self.traceable.weights)

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
        """The warm-up: run every bucket once on padding only (no KV page is touched), which compiles
        its graph or loads it from the compile cache, and runs it once."""
        device = next(self.model.parameters()).device
        hidden_size = None
        for bucket in self.buckets.tokens:
            ids = torch.zeros(bucket, dtype=torch.long, device=device)
            hidden = self._run_body(ids, bucket)
            hidden_size, dtype = hidden.shape[-1], hidden.dtype
        for bucket in self.buckets.batch:
            rows = torch.zeros(bucket, hidden_size, dtype=dtype, device=device)
            self._run_head(rows, bucket)

    def _run_body(self, ids: torch.Tensor, bucket: int) -> torch.Tensor:
        try:
            with self._context(0), self._compiling_if(bucket not in self.compiled_tokens):
                hidden = self._body(ids, torch.zeros_like(ids))  # two tensors: aliasing would be guarded on
        except Exception as exc:
            raise FwError(
                f"torch.compile could not compile this model's forward step ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); run without "
                f"--enable-torch-compile") from exc
        self.compiled_tokens.add(bucket)
        return hidden

    def _run_head(self, rows: torch.Tensor, bucket: int) -> None:
        if not self.head_compiled:
            return
        try:
            with self._context(0), self._compiling_if(bucket not in self.compiled_batch):
                self._head(rows)
        except Exception as exc:  # e.g. a family's own compute_logits over an opaque packed weight
            self.head_compiled = False
            logger.warning("the output layer of %s cannot be compiled (%s: %s); it runs uncompiled",
                           type(self.model).__name__, type(exc).__name__,
                           str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            return
        self.compiled_batch.add(bucket)
