// Fused element-wise ops of a decoder layer on CPU (fw/layers/cpu_ops.py builds and calls them).
//
// Why: a small model's decode step is dominated by the per-op cost of ~20 tiny element-wise torch ops
// per layer (norms, rotary, SiLU * up), and in prefill by their memory passes. Each op here is one pass.
// Numerics follow Hugging Face's torch code op by op: every intermediate that HF rounds to the model
// dtype is rounded here too (round_to<T>), so results equal the unfused torch path up to the order of
// fp32 sums. Built with -ffp-contract=off so a * b + c never becomes one fused multiply-add.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "fw_simd.h"

namespace {

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float round_to<float>(float x) {
  return x;
}

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// Rows per parallel task: enough work per task that scheduling costs stay small.
inline int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// out = norm(x) * weight, with residual handling:
//   residual undefined: normalise x.
//   residual defined:   residual <- x + residual (rounded to T), then normalise it.
// gemma (weight_offset != 0): round(n * (offset + w)), n in fp32 (Gemma's numerics);
// otherwise round(w * round(n)) (Llama's).
template <typename T>
void rms_norm_impl(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps,
                   double weight_offset, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  T* rp = residual ? residual->mutable_data_ptr<T>() : nullptr;
  T* op = out.mutable_data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0, os = out.stride(0);
  const float offset = float(weight_offset);
  const bool gemma = weight_offset != 0.0;
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      T* orow = op + r * os;
      const T* src = xr;
#ifdef __AVX512F__
      using namespace fw_simd;
      __m512 acc = _mm512_setzero_ps();
      if (rp) {
        T* rr = rp + r * rs;
        for (int64_t i = 0; i < n; i += 16) {
          const __mmask16 m = tail_mask(n - i);
          const __m512 v = round16<T>(_mm512_add_ps(load16(xr + i, m), load16(rr + i, m)));
          store16(rr + i, v, m);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        src = rr;
      } else {
        for (int64_t i = 0; i < n; i += 16) {
          const __m512 v = load16(xr + i, tail_mask(n - i));
          acc = _mm512_fmadd_ps(v, v, acc);
        }
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / float(n) + float(eps));
      const __m512 vinv = _mm512_set1_ps(inv), voff = _mm512_set1_ps(offset);
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 normed = _mm512_mul_ps(load16(src + i, m), vinv);
        const __m512 w = load16(wp + i, m);
        store16(orow + i, gemma ? _mm512_mul_ps(normed, _mm512_add_ps(voff, w)) : _mm512_mul_ps(w, round16<T>(normed)), m);
      }
#else
      if (rp) {
        T* rr = rp + r * rs;
        for (int64_t i = 0; i < n; ++i) rr[i] = static_cast<T>(load(xr, i) + load(rr, i));
        src = rr;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const float v = load(src, i);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / float(n) + float(eps));
      if (gemma) {
        for (int64_t i = 0; i < n; ++i) orow[i] = static_cast<T>((load(src, i) * inv) * (offset + load(wp, i)));
      } else {
        for (int64_t i = 0; i < n; ++i) orow[i] = static_cast<T>(load(wp, i) * round_to<T>(load(src, i) * inv));
      }
#endif
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be 2-D with contiguous rows");
  TORCH_CHECK(out.sizes() == x.sizes() && out.stride(1) == 1, "rms_norm: out must match x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "rms_norm: bad weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), "rms_norm: dtypes");
}

template <typename F>
void dispatch(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: f(float()); break;
    case at::kBFloat16: f(c10::BFloat16()); break;
    case at::kHalf: f(c10::Half()); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t);
  }
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double weight_offset, at::Tensor out) {
  check_norm(x, weight, out);
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(x, nullptr, weight, eps, weight_offset, out);
  });
}

void add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps,
                  double weight_offset, at::Tensor out) {
  check_norm(x, weight, out);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  dispatch(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(x, &residual, weight, eps, weight_offset, out);
  });
}

// In place, rotate-half rotary on x [T, N * D] (N heads; the first R dims of each head rotate):
//   x1' = round(round(x1 * c) + round(-x2 * s)),  x2' = round(round(x2 * c) + round(x1 * s))
// with c, s = cos[t], sin[t] ([T, R], R/2 frequencies repeated twice), as HF's q * cos + rotate_half(q) * sin.
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  const int64_t rows = x.size(0), heads = x.size(1) / head_dim, R = cos.size(1), half = R / 2;
  T* xp = x.mutable_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  const int64_t xs = x.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, rows, grain(x.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cp + r * cs;
      const T* s = sp + r * ss;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + r * xs + h * head_dim;
        int64_t i = 0;
#ifdef __AVX512F__
        using namespace fw_simd;
        for (; i < half; i += 16) {
          const __mmask16 m = tail_mask(half - i);
          const __m512 x1 = load16(v + i, m), x2 = load16(v + i + half, m);
          const __m512 c1 = load16(c + i, m), s1 = load16(s + i, m);
          const __m512 c2 = load16(c + i + half, m), s2 = load16(s + i + half, m);
          const __m512 neg = _mm512_set1_ps(-0.f);
          const __m512 a = _mm512_add_ps(round16<T>(_mm512_mul_ps(x1, c1)),
                                         round16<T>(_mm512_mul_ps(_mm512_xor_ps(x2, neg), s1)));
          const __m512 b = _mm512_add_ps(round16<T>(_mm512_mul_ps(x2, c2)), round16<T>(_mm512_mul_ps(x1, s2)));
          store16(v + i, a, m);
          store16(v + i + half, b, m);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = load(v, i), x2 = load(v, i + half);
          const float a = round_to<T>(x1 * load(c, i)) + round_to<T>(-x2 * load(s, i));
          const float b = round_to<T>(x2 * load(c, i + half)) + round_to<T>(x1 * load(s, i + half));
          v[i] = static_cast<T>(a);
          v[i + half] = static_cast<T>(b);
        }
      }
    }
  });
}

void rotary(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % head_dim == 0, "rotary: x must be [T, N * D]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0), "rotary: cos/sin [T, R]");
  TORCH_CHECK(cos.stride(1) == 1 && sin.stride(1) == 1 && cos.size(1) % 2 == 0 && cos.size(1) <= head_dim,
              "rotary: bad rotary dim");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rotary: dtypes");
  dispatch(x.scalar_type(), "rotary", [&](auto tag) { rotary_impl<decltype(tag)>(x, cos, sin, head_dim); });
}

// out = round(round(silu(gate)) * up), gate and up the two halves of gate_up [T, 2 * I];
// silu(g) = g / (1 + exp(-g)) in fp32, as torch computes it.
template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = out.size(1);
  const T* gp = gate_up.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * gs;
      const T* u = g + inter;
      T* o = op + r * os;
      int64_t i = 0;
#ifdef __AVX512F__
      using namespace fw_simd;
      for (; i < inter; i += 16) {
        const __mmask16 m = tail_mask(inter - i);
        store16(o + i, _mm512_mul_ps(round16<T>(silu16(load16(g + i, m))), load16(u + i, m)), m);
      }
#endif
      for (; i < inter; ++i) {
        const float x = load(g, i);
        o[i] = static_cast<T>(round_to<T>(x / (1.f + std::exp(-x))) * load(u, i));
      }
    }
  });
}

void silu_mul(const at::Tensor& gate_up, at::Tensor out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "silu_mul: 2-D inputs with contiguous rows");
  TORCH_CHECK(gate_up.size(1) == 2 * out.size(1) && gate_up.size(0) == out.size(0), "silu_mul: shapes");
  TORCH_CHECK(gate_up.scalar_type() == out.scalar_type(), "silu_mul: dtypes");
  dispatch(gate_up.scalar_type(), "silu_mul", [&](auto tag) { silu_mul_impl<decltype(tag)>(gate_up, out); });
}

// out[r] = the index of the first maximum of row r (a NaN counts as the maximum, as in torch.argmax).
template <typename T>
void argmax_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.const_data_ptr<T>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * xs;
      int64_t i = 0, best = 0;
      float best_v = -std::numeric_limits<float>::infinity();
#ifdef __AVX512F__
      using namespace fw_simd;
      if (n >= 16) {  // per lane: the first maximum among the indices it sees
        __m512 vmax = load16(row);
        __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), cur = vidx;
        __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
        const __m512i step = _mm512_set1_epi32(16);
        for (i = 16; i + 16 <= n && n < (int64_t(1) << 31); i += 16) {
          cur = _mm512_add_epi32(cur, step);
          const __m512 v = load16(row + i);
          nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
          vmax = _mm512_mask_mov_ps(vmax, gt, v);
          vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
        }
        if (nan) {
          i = 0;  // rare: let the scalar loop find the first NaN
        } else {
          alignas(64) float vals[16];
          alignas(64) int32_t idx[16];
          _mm512_store_ps(vals, vmax);
          _mm512_store_si512(idx, vidx);
          best_v = vals[0], best = idx[0];
          for (int l = 1; l < 16; ++l)
            if (vals[l] > best_v || (vals[l] == best_v && idx[l] < best)) best_v = vals[l], best = idx[l];
        }
      }
#endif
      for (; i < n; ++i) {
        const float v = load(row, i);
        if (std::isnan(v)) {
          best = i;
          break;
        }
        if (v > best_v || i == 0) best_v = v, best = i;
      }
      op[r] = best;
    }
  });
}

void argmax(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "argmax: x must be 2-D, rows contiguous, not empty");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == x.size(0) && out.scalar_type() == at::kLong && out.is_contiguous(),
              "argmax: out must be int64 [rows]");
  dispatch(x.scalar_type(), "argmax", [&](auto tag) { argmax_impl<decltype(tag)>(x, out); });
}

}  // namespace

TORCH_LIBRARY(fw_cpu_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float weight_offset, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, float weight_offset, "
        "Tensor(b!) out) -> ()");
  m.def("rotary(Tensor(a!) x, Tensor cos, Tensor sin, int head_dim) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary", c10::DispatchKey::CPU, TORCH_FN(rotary));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("argmax(Tensor x, Tensor(a!) out) -> ()");
  m.impl("argmax", c10::DispatchKey::CPU, TORCH_FN(argmax));
}
