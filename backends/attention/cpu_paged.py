"""The `cpu_paged` attention backend: `sdpa` with a C++ decode kernel for CPU.

Batched decode in `sdpa` gathers every sequence's pages into a padded
[Hkv, B, L, D] copy and runs two bmm's over it; at batch 64 that copy and the
padding cost more than the attention itself. This kernel reads K and V once,
straight from the paged cache through the block table: per (sequence, KV
head) it scores the group's query heads against the keys, softmaxes in fp32
and accumulates the values in fp32. Prefill chunks keep sdpa's code path.

The kernel is compiled at first use with torch's cpp_extension (-O3
-march=native, OpenMP through ATen's parallel_for) and cached under the fw
cache dir, keyed by the source, the torch version and the CPU's flags."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from dataclasses import dataclass
from typing import Any

import torch

from fw.backends.attention.sdpa import SdpaBackend, _State
from fw.errors import FwError
from fw.layers.attention import AttentionMetadata
from fw.paths import cache_dir
from fw.plugins import AttentionBackendSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.0"

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(c10::Half x) { return static_cast<float>(x); }
inline float to_f32(c10::BFloat16 x) {
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp for x <= 0 (softmax after subtracting the max): 2^n * poly(r), |rel err| ~ 2e-7.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// [sum(a), sum(b), sum(c), sum(d)]: one transposing tree instead of four horizontal reductions.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  __m256 t = _mm256_add_ps(_mm512_castps512_ps256(s),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// scores[g * len + j] = q_g . k_j for GB query heads, keys read page by page, 4 keys at a time.
template <int GB, typename T>
void score_avx512(const float* q, int64_t D, const T* k_head, const int64_t* table, int64_t len,
                  int64_t P, float* scores) {
  for (int64_t j0 = 0; j0 < len; j0 += P) {
    const T* page = k_head + table[j0 / P] * P * D;
    const int64_t n = std::min(P, len - j0);
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      const T* k = page + t * D;
      __m512 acc[GB][4];
      for (int g = 0; g < GB; ++g)
        for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) {
        __m512 kv[4];
        for (int u = 0; u < 4; ++u) kv[u] = load16(k + u * D + c);
        for (int g = 0; g < GB; ++g) {
          __m512 qv = _mm512_loadu_ps(q + g * D + c);
          for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_fmadd_ps(qv, kv[u], acc[g][u]);
        }
      }
      for (int g = 0; g < GB; ++g)
        _mm_storeu_ps(scores + g * len + j0 + t, reduce4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
    }
    for (; t < n; ++t) {
      const T* k = page + t * D;
      __m512 acc[GB];
      for (int g = 0; g < GB; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) {
        __m512 kv = load16(k + c);
        for (int g = 0; g < GB; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + c), kv, acc[g]);
      }
      for (int g = 0; g < GB; ++g) scores[g * len + j0 + t] = _mm512_reduce_add_ps(acc[g]);
    }
  }
}

// out[g] = sum_j p[g * len + j] * v_j for GB query heads, 16 lanes of D at a time; two interleaved
// accumulator sets so consecutive FMAs do not wait on each other.
template <int GB, typename T>
void accumulate_avx512(const float* probs, int64_t D, const T* v_head, const int64_t* table, int64_t len,
                       int64_t P, float* out) {
  for (int64_t c = 0; c < D; c += 16) {
    __m512 acc[2][GB];
    for (int g = 0; g < GB; ++g) acc[0][g] = acc[1][g] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < len; j0 += P) {
      const T* page = v_head + table[j0 / P] * P * D + c;
      const int64_t n = std::min(P, len - j0);
      const float* p = probs + j0;
      int64_t t = 0;
      for (; t + 2 <= n; t += 2) {
        __m512 v0 = load16(page + t * D), v1 = load16(page + (t + 1) * D);
        for (int g = 0; g < GB; ++g) {
          acc[0][g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * len + t]), v0, acc[0][g]);
          acc[1][g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * len + t + 1]), v1, acc[1][g]);
        }
      }
      if (t < n) {
        __m512 v0 = load16(page + t * D);
        for (int g = 0; g < GB; ++g) acc[0][g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * len + t]), v0, acc[0][g]);
      }
    }
    for (int g = 0; g < GB; ++g) _mm512_storeu_ps(out + g * D + c, _mm512_add_ps(acc[0][g], acc[1][g]));
  }
}

template <typename T>
void heads_avx512(int64_t G, const float* q, int64_t D, const T* k_head, const T* v_head, const int64_t* table,
                  int64_t len, int64_t P, float* scores, bool values, float* out) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int gb = int(std::min<int64_t>(4, G - g0));
    const float* qg = q + g0 * D;
    float* sg = scores + g0 * len;
    float* og = out + g0 * D;
#define FW_DISPATCH(N)                                                        \
  case N:                                                                     \
    if (values) accumulate_avx512<N>(sg, D, v_head, table, len, P, og);       \
    else score_avx512<N>(qg, D, k_head, table, len, P, sg);                   \
    break;
    switch (gb) { FW_DISPATCH(1) FW_DISPATCH(2) FW_DISPATCH(3) FW_DISPATCH(4) }
#undef FW_DISPATCH
  }
}
#endif

// In place: row <- softmax(row), in fp32.
inline void softmax(float* row, int64_t len) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < len; ++j) m = std::max(m, row[j]);
  float sum = 0.f;
  int64_t j = 0;
#ifdef __AVX512F__
  __m512 vm = _mm512_set1_ps(m), vs = _mm512_setzero_ps();
  for (; j + 16 <= len; j += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), vm));
    _mm512_storeu_ps(row + j, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#endif
  for (; j < len; ++j) {
    row[j] = std::exp(row[j] - m);
    sum += row[j];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < len; ++i) row[i] *= inv;
}

// One (sequence, KV head): its G query heads attend over the first `len` cached positions.
template <typename T>
void attend(const T* q, int64_t q_stride_h, const T* k_head, const T* v_head, const int64_t* table, int64_t len, int64_t P,
            int64_t G, int64_t D, float scale, T* out, std::vector<float>& buf) {
  buf.resize(size_t(G * D * 2 + G * len));
  float* qf = buf.data();
  float* acc = qf + G * D;
  float* scores = acc + G * D;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f32(q[g * q_stride_h + d]) * scale;
#ifdef __AVX512F__
  const bool vec = D % 16 == 0;
#else
  const bool vec = false;
#endif
  if (vec) {
#ifdef __AVX512F__
    heads_avx512<T>(G, qf, D, k_head, v_head, table, len, P, scores, false, acc);
#endif
  } else {
    for (int64_t j = 0; j < len; ++j) {
      const T* k = k_head + (table[j / P] * P + j % P) * D;
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * to_f32(k[d]);
        scores[g * len + j] = s;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) softmax(scores + g * len, len);
  if (vec) {
#ifdef __AVX512F__
    heads_avx512<T>(G, qf, D, k_head, v_head, table, len, P, scores, true, acc);
#endif
  } else {
    std::fill(acc, acc + G * D, 0.f);
    for (int64_t j = 0; j < len; ++j) {
      const T* v = v_head + (table[j / P] * P + j % P) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * len + j];
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * to_f32(v[d]);
      }
    }
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = T(acc[i]);
}

template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), pages = k_cache.size(1), P = k_cache.size(2);
  const int64_t G = H / Hkv, max_blocks = block_tables.size(1);
  const int64_t q_stride_b = q.stride(0), q_stride_h = q.stride(1);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k_cache.const_data_ptr<T>();
  const T* vp = v_cache.const_data_ptr<T>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = seq_lens.const_data_ptr<int64_t>();
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t offset = (b * H + h * G) * D;
      attend<T>(qp + b * q_stride_b + h * G * q_stride_h, q_stride_h, kp + h * pages * P * D, vp + h * pages * P * D, tables + b * max_blocks, lens[b],
                P, G, D, float(scale), op + offset, buf);
    }
  });
}

void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "the caches and out must be contiguous, q along D");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(3), "head mismatch");
  TORCH_CHECK(out.sizes() == q.sizes() && block_tables.size(0) == q.size(0), "batch mismatch");
  switch (q.scalar_type()) {
    case at::kFloat: decode_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); break;
    case at::kBFloat16: decode_impl<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); break;
    case at::kHalf: decode_impl<c10::Half>(q, k_cache, v_cache, block_tables, seq_lens, scale, out); break;
    default: TORCH_CHECK(false, "cpu_paged: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(fw_cpu_paged, m) {
  m.def("decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "Tensor(a!) out) -> ()");
  m.impl("decode", c10::DispatchKey::CPU, TORCH_FN(decode));
}
"""

_lock = threading.Lock()
_built = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _missing_toolchain() -> str | None:
    """Why the kernel cannot be built here, checked without building it."""
    if not (shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler (c++/g++) on PATH to build the cpu_paged kernel"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the PyPI wheel ships the binary)
        except ImportError:
            return "ninja is not installed (pip install ninja) to build the cpu_paged kernel"
    return None


def _ensure_ninja_on_path() -> None:
    """The ninja wheel's binary is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load_kernel() -> None:
    """Build (or load the cached build of) the kernel once per process; registers torch.ops.fw_cpu_paged."""
    global _built
    if _built:
        return
    with _lock:
        if _built:
            return
        from torch.utils import cpp_extension

        key = hashlib.sha256("\0".join([_SOURCE, torch.__version__, _cpu_flags()]).encode()).hexdigest()[:16]
        build_dir = cache_dir() / "cpu_paged" / key
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            _ensure_ninja_on_path()
            source = build_dir / "cpu_paged.cpp"
            if not source.exists() or source.read_text() != _SOURCE:
                tmp = build_dir / f"cpu_paged.cpp.{os.getpid()}"
                tmp.write_text(_SOURCE)
                tmp.replace(source)  # atomic: a concurrent builder never sees half a file
            cpp_extension.load(
                name=f"fw_cpu_paged_{key}", sources=[str(source)], build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False,
            )
        except Exception as exc:  # compiler errors, missing ninja, unwritable cache dir
            raise FwError(
                f"could not build the cpu_paged attention kernel in {build_dir}: {exc}\n"
                "Pass --attention-backend sdpa to run without it."
            ) from exc
        _built = True


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b, K_b/V_b the first seq_lens[b] positions of the
    pages block_tables[b] lists, read from k_cache/v_cache [Hkv, pages, page_size, D] of KV head
    h // (H // Hkv). q and out: [B, H, D]."""
    load_kernel()
    torch.ops.fw_cpu_paged.decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out)


@dataclass
class _PagedState(_State):
    decodes: int = 0  # the first `decodes` sequences; sdpa's own num_decodes stays 0


class CpuPagedBackend(SdpaBackend):
    """sdpa's cache layout, KV writes and prefill; decodes run through the C++ kernel."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        load_kernel()  # at model build, not in the first step; a failed build is reported up front

    @classmethod
    def prepare(cls, meta: AttentionMetadata) -> _PagedState:
        """sdpa's prefill state, with its decode count moved aside so sdpa's forward skips the gather."""
        state = super().prepare(meta)
        return _PagedState(0, None, None, state.prefills, decodes=state.num_decodes)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = super().forward(q, k, v, kv_cache, meta)  # writes the new K/V, runs the prefill chunks
        d = meta.backend_state.decodes
        if d:
            paged_decode(q[:d], kv_cache[0], kv_cache[1], meta.block_tables[:d], meta.seq_lens_tensor[:d],
                         self.scale, out[:d])
        return out


@hookimpl
def fw_register_attention_backends(register) -> None:
    register(AttentionBackendSpec(
        name="cpu_paged",
        backend_cls=CpuPagedBackend,
        devices=("cpu",),
        dtypes=("float32", "bfloat16", "float16"),
        priority=10,
        available=_missing_toolchain,
        description="sdpa with a C++ CPU decode kernel reading K/V straight from the paged cache "
                    "(built at first use; needs a C++ compiler and ninja)",
    ))
