// Matrix products on 4-bit and 8-bit block-quantized weights, on CPUs with AVX512-VNNI (fw/layers/packed_int.py
// packs the weights and calls this).
//
// Why: a quantized model is quantized to be read faster. Dequantizing a layer's weight to bf16 on every call
// (fw's reference paths) costs more than the bytes it saved; these kernels read each packed weight once and
// multiply its integer codes directly with the activations quantized to int8 (vpdpbusd), as llama.cpp does.
//
// Weights: blocks of 32 inputs. A 4-bit weight is w = d * q + m with q in 0..15 (GGUF Q4_0/Q4_1, GPTQ and
// AWQ groups all take this form); an 8-bit weight is w = d * q with q in -127..127 (GGUF Q8_0, row-wise int8).
// d and m are fp16, one per output row and block.
//
// Layout: output rows in tiles of 16 (the last tile padded with zero rows), the tile's blocks in input order,
// each (tile, block) a record of fixed size:
//   q4: 256 bytes of codes, then 16 fp16 d, then 16 fp16 m                         (320 bytes, 5 bits/weight)
//   q8: 512 bytes of codes, then 16 fp16 d, then 16 int32 128 * sum(q) of the row  (608 bytes)
// Codes are ordered so that one 64-byte vector holds, for each of the 16 rows, 4 consecutive inputs
// (row r at bytes 4r..4r+3): vpdpbusd with 4 activation bytes broadcast gives 16 row sums at once.
// q4 vector p (0..3) packs two such vectors: its low nibbles are inputs 8p..8p+3, its high nibbles 8p+4..8p+7.
//
// Activations: each row's block of 32 is quantized to int8 with scale amax / 127 (round to nearest even),
// and its code sum kept, as llama.cpp's Q8_1. Then, per row and block, exactly in int32:
//   q4: sum_k (d q_k + m) x_k ~ dx (d sum(q_k xq_k) + m sum(xq_k))
//   q8: vpdpbusd takes unsigned x bytes: xq + 128, and sum((xq + 128) q) - 128 sum(q) = sum(xq q).
// Results are fp32 sums over blocks in input order, written as fp32 or rounded once to bf16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fw_simd.h"  // load16 (fw/csrc, on the include path of fw.cpp_ops builds)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define FW_PACKED_INT 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 16;        // output rows per tile
constexpr int64_t BLOCK = 32;       // inputs per block
constexpr int64_t Q4_RECORD = 320;  // bytes per (tile, block)
constexpr int64_t Q8_RECORD = 608;
constexpr int MR = 4;               // activation rows per pass over a tile's blocks

bool available() {
#ifdef FW_PACKED_INT
  return true;
#else
  return false;
#endif
}

#ifdef FW_PACKED_INT

// Activations quantized per (row, block): codes (int8, or uint8 = int8 + 128 for q8), scale, scale * sum.
struct QuantizedRows {
  std::vector<int8_t> codes;   // [M, K]
  std::vector<float> scale;    // [M, KB]
  std::vector<float> scaled_sum;  // [M, KB]: scale * sum of the block's int8 codes
};

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t ldx, bool offset128, QuantizedRows& out) {
  const int64_t KB = K / BLOCK;
  out.codes.resize(size_t(M * K));
  out.scale.resize(size_t(M * KB));
  out.scaled_sum.resize(size_t(M * KB));
  at::parallel_for(0, M * KB, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / KB, b = i % KB;
      const T* src = x + r * ldx + b * BLOCK;
      __m512 v0 = fw_simd::load16(src), v1 = fw_simd::load16(src + 16);
      const __m512 sign = _mm512_set1_ps(-0.0f);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
      const float d = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512 vinv = _mm512_set1_ps(inv);
      __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv));  // round to nearest even
      __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      __m128i c0 = _mm512_cvtsepi32_epi8(q0), c1 = _mm512_cvtsepi32_epi8(q1);
      if (offset128) {
        const __m128i flip = _mm_set1_epi8(char(0x80));
        c0 = _mm_xor_si128(c0, flip);
        c1 = _mm_xor_si128(c1, flip);
      }
      int8_t* dst = out.codes.data() + r * K + b * BLOCK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), c0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), c1);
      out.scale[size_t(i)] = d;
      out.scaled_sum[size_t(i)] = d * float(sum);
    }
  });
}

inline __m512 load_half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One tile (16 output rows) times `rows` (1..MR) activation rows, over all KB blocks: acc[r] = 16 row sums.
template <int ROWS>
void q4_tile(const uint8_t* tile, int64_t KB, const QuantizedRows& a, int64_t m0, int64_t K, __m512* acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* rec = tile + b * Q4_RECORD;
    __m512i w[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(rec + 64 * p);
      w[2 * p] = _mm512_and_si512(v, low);
      w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 d = load_half16(rec + 256), m = load_half16(rec + 288);
    for (int r = 0; r < ROWS; ++r) {
      const int32_t* x = reinterpret_cast<const int32_t*>(a.codes.data() + (m0 + r) * K + b * BLOCK);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains: half the latency
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(x[j]));
        s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(x[j + 1]));
      }
      const int64_t ib = (m0 + r) * KB + b;
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(sums, _mm512_mul_ps(d, _mm512_set1_ps(a.scale[size_t(ib)])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.scaled_sum[size_t(ib)]), acc[r]);
    }
  }
}

template <int ROWS>
void q8_tile(const uint8_t* tile, int64_t KB, const QuantizedRows& a, int64_t m0, int64_t K, __m512* acc) {
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* rec = tile + b * Q8_RECORD;
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(rec + 64 * j);
    const __m512 d = load_half16(rec + 512);
    const __m512i correction = _mm512_loadu_si512(rec + 544);
    for (int r = 0; r < ROWS; ++r) {
      const int32_t* x = reinterpret_cast<const int32_t*>(a.codes.data() + (m0 + r) * K + b * BLOCK);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {  // unsigned activations, signed weights
        s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(x[j]), w[j]);
        s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(x[j + 1]), w[j + 1]);
      }
      const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), correction);
      const int64_t ib = (m0 + r) * KB + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(d, _mm512_set1_ps(a.scale[size_t(ib)])),
                               acc[r]);
    }
  }
}

template <int ROWS, bool Q4>
void tile_rows(const uint8_t* tile, int64_t KB, const QuantizedRows& a, int64_t m0, int64_t K, __m512* acc) {
  if constexpr (Q4) q4_tile<ROWS>(tile, KB, a, m0, K, acc);
  else q8_tile<ROWS>(tile, KB, a, m0, K, acc);
}

template <bool Q4>
void run(const QuantizedRows& a, const uint8_t* w, int64_t M, int64_t N, int64_t K, bool fp32_out, void* out) {
  const int64_t KB = K / BLOCK, NT = (N + TILE - 1) / TILE;
  const int64_t tile_bytes = KB * (Q4 ? Q4_RECORD : Q8_RECORD);
  at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    __m512 acc[MR];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = w + t * tile_bytes;
      const int64_t n0 = t * TILE;
      const __mmask16 mask = N - n0 >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int rows = int(std::min<int64_t>(MR, M - m0));
        switch (rows) {
          case 4: tile_rows<4, Q4>(tile, KB, a, m0, K, acc); break;
          case 3: tile_rows<3, Q4>(tile, KB, a, m0, K, acc); break;
          case 2: tile_rows<2, Q4>(tile, KB, a, m0, K, acc); break;
          default: tile_rows<1, Q4>(tile, KB, a, m0, K, acc); break;
        }
        for (int r = 0; r < rows; ++r) {
          if (fp32_out) {
            _mm512_mask_storeu_ps(static_cast<float*>(out) + (m0 + r) * N + n0, mask, acc[r]);
          } else {
            _mm256_mask_storeu_epi16(static_cast<c10::BFloat16*>(out) + (m0 + r) * N + n0, mask,
                                     fw_simd::to_bf16_bits(acc[r]));
          }
        }
      }
    }
  });
}
#endif

void check_weight(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t record, const char* op) {
  TORCH_CHECK(available(), op, ": this build has no AVX512-VNNI kernel");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a float32 or bfloat16 CPU tensor [M, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0, op, ": K = ", K, " is not a multiple of ", BLOCK);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.numel() == (N + TILE - 1) / TILE * (K / BLOCK) * record,
              op, ": the packed weight does not hold ", N, " x ", K, " weights");
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t N, bool fp32_out, bool q4) {
  const char* op = q4 ? "linear_q4" : "linear_q8";
  check_weight(x_in, w, N, q4 ? Q4_RECORD : Q8_RECORD, op);
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : x.scalar_type()));
#ifdef FW_PACKED_INT
  if (M == 0) return out;
  thread_local QuantizedRows a;  // reused: a decode step calls this ~120 times with the same sizes
  if (x.scalar_type() == at::kFloat) quantize_rows(x.const_data_ptr<float>(), M, K, x.stride(0), !q4, a);
  else quantize_rows(x.const_data_ptr<c10::BFloat16>(), M, K, x.stride(0), !q4, a);
  const bool write_fp32 = out.scalar_type() == at::kFloat;
  if (q4) run<true>(a, w.const_data_ptr<uint8_t>(), M, N, K, write_fp32, out.data_ptr());
  else run<false>(a, w.const_data_ptr<uint8_t>(), M, N, K, write_fp32, out.data_ptr());
#endif
  return out;
}

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& w, int64_t N, bool fp32_out) {
  return linear(x, w, N, fp32_out, true);
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t N, bool fp32_out) {
  return linear(x, w, N, fp32_out, false);
}

}  // namespace

TORCH_LIBRARY(fw_packed_int, m) {
  m.def("available() -> bool");
  m.impl("available", TORCH_FN(available));
  m.def("linear_q4(Tensor x, Tensor w, int N, bool fp32_out=False) -> Tensor");
  m.impl("linear_q4", c10::DispatchKey::CPU, TORCH_FN(linear_q4));
  m.def("linear_q8(Tensor x, Tensor w, int N, bool fp32_out=False) -> Tensor");
  m.impl("linear_q8", c10::DispatchKey::CPU, TORCH_FN(linear_q8));
}
