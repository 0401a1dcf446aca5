"""The `flash-attn` attention backend: FlashAttention 2's varlen kernel over the paged KV cache, on
NVIDIA GPUs, through `flash_attn` (Dao-AILab) or `vllm_flash_attn` (vLLM's build of it).

Both expose `flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
softmax_scale, causal, window_size, softcap, block_table)`: with `block_table`, k and v are the paged
cache [pages, page_size, Hkv, D] and one call attends every sequence of the step (decodes and
prefill chunks, each a causal query block aligned to the end of its keys), GQA included.

Neither package is a dependency: `pip install 'fw[flash-attn]'` adds flash-attn, whose wheels are
built per torch and CUDA version. vllm-flash-attn 2.6.2 on PyPI pins torch 2.4.0, so it is not an
extra (installing it would replace the torch fw runs on); where it is installed and loads, it is
used. `available()` imports the package once and says why it cannot run (not installed, built for
another torch, no CUDA), so `--attention-backend flash-attn` on CPU fails with those reasons and
auto never picks it.

Page sizes: upstream flash-attn's paged kernel needs pages of a multiple of 256 tokens;
vllm_flash_attn takes multiples of 16. The spec declares the sizes of the package found."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any, Callable

import torch

from fw.layers.attention import AttentionBackend, AttentionMetadata
from fw.plugins import AttentionBackendSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.0"

# Preferred first: vLLM's build takes the small pages fw uses by default.
_MODULES = ("vllm_flash_attn", "flash_attn")
_PAGE_SIZES = {"vllm_flash_attn": (16, 32, 64, 128, 256, 512), "flash_attn": (256, 512, 1024)}


def _installed() -> str | None:
    """The first of the packages that is installed (found without importing it), or None."""
    return next((m for m in _MODULES if importlib.util.find_spec(m) is not None), None)


@functools.cache
def _load() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """(flash_attn_varlen_func, None), or (None, why it cannot run here)."""
    name = _installed()
    missing = ("neither flash_attn nor vllm_flash_attn is installed (pip install 'fw[flash-attn]': a flash-attn "
               "wheel built for this torch and CUDA)")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else " is a CPU-only build")
        return None, (f"needs an NVIDIA GPU with CUDA, and none is usable here ({build})"
                      + ("" if name else f"; {missing}"))
    if name is None:
        return None, missing
    try:
        module = importlib.import_module(name)
        return module.flash_attn_varlen_func, None
    except Exception as exc:  # an extension built for another torch fails with undefined symbols
        return None, (f"{name} is installed but does not load with torch {torch.__version__} "
                      f"({type(exc).__name__}: {exc}); reinstall it built for this torch")


def _unavailable() -> str | None:
    return _load()[1]


class FlashAttnBackend(AttentionBackend):
    """Stores new K/V in the paged cache, then one flash_attn_varlen_func call per layer."""

    @staticmethod
    def kv_cache_shape(num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """[2 (K, V), pages, page_size, kv heads, head dim]: the paged layout the kernel reads."""
        return (2, num_blocks, page_size, num_kv_heads, head_dim)

    @classmethod
    def prepare(cls, meta: AttentionMetadata) -> dict[str, Any]:
        seq_lens = meta.seq_lens_tensor.to(torch.int32)
        cu_k = torch.zeros(len(meta.seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_k[1:])
        return {
            "cu_seqlens_q": meta.query_start_loc.to(torch.int32),
            "cu_seqlens_k": cu_k,
            "max_seqlen_q": max(meta.query_lens, default=0),
            "max_seqlen_k": max(meta.seq_lens, default=0),
            "block_table": meta.block_tables.to(torch.int32),
        }

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        varlen, why = _load()
        if varlen is None:
            raise RuntimeError(f"flash-attn backend cannot run: {why}")
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [pages, page_size, Hkv, D]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        # transformers' window: a query at p sees (p - window, p], i.e. window - 1 keys to its left
        window = (self.sliding_window - 1, 0) if self.sliding_window else (-1, -1)
        return varlen(q, k_cache, v_cache, softmax_scale=self.scale, causal=True, window_size=window,
                      softcap=self.logit_softcap or 0.0, **meta.backend_state)


@hookimpl
def fw_register_attention_backends(register) -> None:
    installed = _installed()
    register(AttentionBackendSpec(
        name="flash-attn",
        backend_cls=FlashAttnBackend,
        devices=("cuda",),
        dtypes=("bfloat16", "float16"),
        head_sizes=tuple(range(8, 257, 8)),
        page_sizes=_PAGE_SIZES[installed or "vllm_flash_attn"],
        supports_sliding_window=True,
        supports_logit_softcap=True,
        priority=40,  # CUDA only: above triton (20), flex (10) and sdpa (0) there
        # verified_on: none yet (no flash_attn wheel on the H200 of the first GPU run), so on a GPU auto
        # prefers the verified triton; --attention-backend flash-attn still names it, with a warning.
        available=_unavailable,
        description="FlashAttention 2 varlen kernel over the paged KV cache (flash_attn or vllm_flash_attn; "
                    "NVIDIA GPUs, fp16/bf16; pip install 'fw[flash-attn]')",
    ))
