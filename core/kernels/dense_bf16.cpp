// Dense bf16 matrix products on CPUs with AVX512-BF16, the weight in fw's blocked layout
// (fw/layers/dense.py builds and calls this).
//
// Why: a decode step multiplies a few rows by every weight once, so each weight streams from DRAM every
// step. oneDNN's packed kernel waits on those loads: on SmolLM2's four projections at 64 rows it ran at
// ~600 GFLOP/s streamed against ~800 with the weights cache-resident. This kernel prefetches the next
// chunk of the weight while it computes on the current one, and runs the same shapes at ~850 streamed
// (at 1 row it reads the weights at ~41 GB/s, oneDNN at ~29). Measurements: docs/performance.md.
//
// Layout: W [N, K] -> a tensor of shape [N, K / 2, 2] holding blocks of 48 output columns (three vectors
// of 16 fp32 sums; the last block has the N % 48 columns left, if any); within a block, for each input pair
// (2p, 2p + 1), the block's columns' two weights side by side, so one vdpbf16ps multiplies a broadcast
// input pair with 16 columns' weight pairs. A block's weights are contiguous and blocks follow each other,
// so a thread streams its blocks in order. The shape keeps N, and no plain weight is 3-D.
//
// Numerics: each output is an fp32 sum over k in order within chunks of 128 inputs, two products at a
// time (vdpbf16ps: exact products, fp32 sums), the chunks' sums added in order, then + bias in fp32, rounded to bf16 once (nearest even): what oneDNN does on
// these CPUs up to the order of the fp32 sums. With fp32_out the sums are returned unrounded (the LM
// head: bf16 logits of a 135M model are 0.125 apart at their size, and ties flipped greedy answers).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fw_simd.h"  // exp16, round16 (fw/csrc, on the include path of fw.cpp_ops builds)

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FW_DENSE_BF16 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NR = 48;    // output columns per block
constexpr int MR = 8;         // rows per micro-tile: 8 x 3 accumulators + 3 weight vectors in registers
constexpr int64_t KC = 64;    // input pairs per chunk: 64 x 48 x 2 bf16 = 12 KiB of weight, L1-resident beside
                              // the next chunk being prefetched (two 18 KiB chunks overflowed the 32 KiB L1)
constexpr int64_t MC = 64;    // rows whose sums stay in the per-thread buffer (64 x 48 fp32 = 12 KiB)
constexpr int64_t MOUT = 512; // rows per parallel region: a block's weights are reused from L2 across them
constexpr int PF_PER_PAIR = 3;  // prefetched lines per input pair: a 1-row tile prefetches a whole chunk

bool available() {
#ifdef FW_DENSE_BF16
  return true;
#else
  return false;
#endif
}

// Packs rows of w block by block; row_of(b, c) is the weight row of block b's column c, cols_of(b) how many
// columns block b has. Every block but the last has 48.
template <typename RowOf, typename ColsOf>
at::Tensor pack_blocks(const at::Tensor& w, at::IntArrayRef shape, int64_t NB, RowOf row_of, ColsOf cols_of) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "pack_bf16: a bf16 CPU weight [N, K]");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack_bf16: K must be even, got ", w.size(1));
  const at::Tensor src = w.contiguous();
  const int64_t KP = w.size(1) / 2;
  at::Tensor out = at::empty(shape, w.options());
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src.const_data_ptr());  // one input pair per word
  uint32_t* d = reinterpret_cast<uint32_t*>(out.mutable_data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = cols_of(b);
      for (int64_t c = 0; c < cols; ++c)
        for (int64_t p = 0; p < KP; ++p) d[b * KP * NR + p * cols + c] = s[row_of(b, c) * KP + p];
    }
  });
  return out;
}

at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_bf16: a weight [N, K]");
  const int64_t N = w.size(0);
  return pack_blocks(w, {N, w.size(1) / 2, 2}, (N + NR - 1) / NR, [](int64_t b, int64_t c) { return b * NR + c; },
                     [N](int64_t b) { return std::min(NR, N - b * NR); });
}

// A gate/up weight [2I, K] (gate rows, then up rows) for a SiLU MLP: block b holds gate outputs
// [24b, 24b + h) and then the same up outputs, h = min(24, I - 24b), so one block's sums finish
// silu(gate) * up for h outputs. Shaped [2, I, K / 2, 2].
constexpr int64_t HALF = NR / 2;

at::Tensor pack_bf16_gated(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 2 == 0, "pack_bf16_gated: a weight [2 * I, K]");
  const int64_t I = w.size(0) / 2;
  return pack_blocks(
      w, {2, I, w.size(1) / 2, 2}, (I + HALF - 1) / HALF,
      [I](int64_t b, int64_t c) {
        const int64_t h = std::min(HALF, I - b * HALF);
        return c < h ? b * HALF + c : I + b * HALF + (c - h);
      },
      [I](int64_t b) { return 2 * std::min(HALF, I - b * HALF); });
}

#ifdef FW_DENSE_BF16
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? 0 : __mmask16((1u << n) - 1); }

// The columns of one block: how many, and which lanes of each of the three vectors they fill.
struct Cols {
  int64_t n;
  __mmask16 m0, m1, m2;
  explicit Cols(int64_t cols) : n(cols), m0(lanes(cols)), m1(lanes(cols - 16)), m2(lanes(cols - 32)) {}
};

// sums[R rows][48] (+)= a[R rows, 2 * kpairs] . w[kpairs, cols, 2], while prefetching `npf` lines from
// `pf` into L1 (PF_PER_PAIR a pair, for the chunk the caller reads next). A chunk is summed on its own
// and then added to the running sums: two levels of fp32 sums err less than one chain over all of K.
template <int R, bool Full>
inline void micro(const int32_t* __restrict a, int64_t lda32, const uint16_t* __restrict w, const Cols& cols,
                  int64_t kpairs, float* __restrict sums, bool first, const char* pf, int64_t npf) {
  // named accumulators: GCC keeps these in registers, where an array of vectors spilled every iteration
  __m512 c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32, c40, c41, c42, c50, c51, c52, c60, c61,
      c62, c70, c71, c72;
#define FW_INIT(r) \
  if (R > r) c##r##0 = c##r##1 = c##r##2 = _mm512_setzero_ps();
  FW_INIT(0) FW_INIT(1) FW_INIT(2) FW_INIT(3) FW_INIT(4) FW_INIT(5) FW_INIT(6) FW_INIT(7)
#undef FW_INIT
  // A full block's pairs are 48 columns apart and load whole; the last block may be narrower (masked).
  const int64_t stride = Full ? NR * 2 : cols.n * 2;
  const __mmask16 m0 = cols.m0, m1 = cols.m1, m2 = cols.m2;
#define FW_ROW(r)                                                                               \
  if (R > r) {                                                                                  \
    const __m512bh av = (__m512bh)_mm512_set1_epi32(a[r * lda32 + p]);                          \
    c##r##0 = _mm512_dpbf16_ps(c##r##0, w0, av);                                                \
    c##r##1 = _mm512_dpbf16_ps(c##r##1, w1, av);                                                \
    c##r##2 = _mm512_dpbf16_ps(c##r##2, w2, av);                                                \
  }
#define FW_PAIR                                                                                 \
  {                                                                                             \
    const uint16_t* wp = w + p * stride;                                                        \
    const __m512bh w0 = Full ? (__m512bh)_mm512_loadu_si512(wp) : (__m512bh)_mm512_maskz_loadu_epi32(m0, wp), \
                   w1 = Full ? (__m512bh)_mm512_loadu_si512(wp + 32) : (__m512bh)_mm512_maskz_loadu_epi32(m1, wp + 32), \
                   w2 = Full ? (__m512bh)_mm512_loadu_si512(wp + 64) : (__m512bh)_mm512_maskz_loadu_epi32(m2, wp + 64); \
    FW_ROW(0) FW_ROW(1) FW_ROW(2) FW_ROW(3) FW_ROW(4) FW_ROW(5) FW_ROW(6) FW_ROW(7)             \
  }
  // The pairs that also prefetch (PF_PER_PAIR lines each), then the rest: no test per pair.
  const int64_t pf_pairs = std::min(kpairs, (npf + PF_PER_PAIR - 1) / PF_PER_PAIR);
  int64_t p = 0;
  for (; p < pf_pairs; ++p) {
    for (int q = 0; q < PF_PER_PAIR; ++q) _mm_prefetch(pf + (p * PF_PER_PAIR + q) * 64, _MM_HINT_T0);
    FW_PAIR
  }
  for (; p < kpairs; ++p) FW_PAIR
#undef FW_PAIR
#undef FW_ROW
#define FW_STORE(r)                                                                             \
  if (R > r) {                                                                                  \
    float* row = sums + r * NR;                                                                 \
    _mm512_storeu_ps(row, first ? c##r##0 : _mm512_add_ps(_mm512_loadu_ps(row), c##r##0));      \
    _mm512_storeu_ps(row + 16, first ? c##r##1 : _mm512_add_ps(_mm512_loadu_ps(row + 16), c##r##1)); \
    _mm512_storeu_ps(row + 32, first ? c##r##2 : _mm512_add_ps(_mm512_loadu_ps(row + 32), c##r##2)); \
  }
  FW_STORE(0) FW_STORE(1) FW_STORE(2) FW_STORE(3) FW_STORE(4) FW_STORE(5) FW_STORE(6) FW_STORE(7)
#undef FW_STORE
}

template <bool Full>
void micro_rows(int rows, const int32_t* a, int64_t lda32, const uint16_t* w, const Cols& cols, int64_t kpairs,
                float* sums, bool first, const char* pf, int64_t npf) {
  switch (rows) {
    case 8: micro<8, Full>(a, lda32, w, cols, kpairs, sums, first, pf, npf); break;
    case 7: micro<7, Full>(a, lda32, w, cols, kpairs, sums, first, pf, npf); break;
    case 6: micro<6, Full>(a, lda32, w, cols, kpairs, sums, first, pf, npf); break;
    case 5: micro<5, Full>(a, lda32, w, cols, kpairs, sums, first, pf, npf); break;
    case 4: micro<4, Full>(a, lda32, w, cols, kpairs, sums, first, pf, npf); break;
    case 3: micro<3, Full>(a, lda32, w, cols, kpairs, sums, first, pf, npf); break;
    case 2: micro<2, Full>(a, lda32, w, cols, kpairs, sums, first, pf, npf); break;
    default: micro<1, Full>(a, lda32, w, cols, kpairs, sums, first, pf, npf); break;
  }
}

inline void store_row(uint16_t* out, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(out, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store_row(float* out, __mmask16 m, __m512 v) {
  // fp32 output is the LM head's logits: 12.6 MB at 64 rows, read once by the sampler later. Full,
  // aligned vectors bypass the cache (no read for ownership, no eviction of the weights' next chunks).
  if (m == 0xFFFF && reinterpret_cast<uintptr_t>(out) % 64 == 0) _mm512_stream_ps(out, v);
  else _mm512_mask_storeu_ps(out, m, v);
}

// rows [m0, m0 + rows) x block nb of out = sums + bias, rounded to bf16 or kept fp32 (OutT)
template <typename OutT>
void write_block(const float* sums, int64_t rows, const uint16_t* bias, int64_t nb, const Cols& cols, OutT* out,
                 int64_t ldo) {
  const int64_t n0 = nb * NR;
  const __mmask16 m[3] = {cols.m0, cols.m1, cols.m2};
  __m512 b[3];
  for (int j = 0; j < 3; ++j)
    b[j] = bias == nullptr ? _mm512_setzero_ps()
                           : _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m[j], bias + n0 + 16 * j)), 16));
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < 3; ++j)
      if (m[j]) store_row(out + r * ldo + n0 + 16 * j, m[j], _mm512_add_ps(_mm512_loadu_ps(sums + r * NR + 16 * j), b[j]));
}
#endif

// Input pairs are read as 32-bit words: rows must start 4-byte aligned.
at::Tensor aligned_input(const at::Tensor& x_in, int64_t KP) {
  TORCH_CHECK(available(), "linear_bf16: this build has no AVX512-BF16 kernel");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "linear_bf16: x must be a bf16 CPU tensor [M, K]");
  TORCH_CHECK(x_in.size(1) == 2 * KP, "linear_bf16: x has ", x_in.size(1), " features, the weight ", 2 * KP);
  const bool aligned = x_in.stride(1) == 1 && x_in.stride(0) % 2 == 0 &&
                       reinterpret_cast<uintptr_t>(x_in.const_data_ptr()) % 4 == 0;
  return aligned ? x_in : x_in.contiguous();
}

#ifdef FW_DENSE_BF16
// The product of x [M, 2 KP] with the packed blocks at wa (NB of them, `elements` bf16 in all), block by
// block; write(sums, rows, m0, nb, cols) takes each finished [rows x cols] tile of fp32 sums. Threads
// split the blocks; each streams its blocks in order, prefetching one chunk ahead.
template <typename ColsOf, typename Write>
void run_blocks(const at::Tensor& x, const uint16_t* wa, int64_t NB, int64_t KP, int64_t elements, ColsOf cols_of,
                Write write) {
  const int64_t M = x.size(0);
  const int32_t* xa = reinterpret_cast<const int32_t*>(x.const_data_ptr());
  const int64_t lda32 = x.stride(0) / 2;
  const int64_t panel = KP * NR * 2;  // bf16 elements per (full) block
  const char* weight_end = reinterpret_cast<const char*>(wa + elements);
  for (int64_t mo = 0; mo < M; mo += MOUT) {
    const int64_t mend = std::min(M, mo + MOUT);
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> sums(size_t(MC * NR));
      for (int64_t nb = b0; nb < b1; ++nb) {
        const uint16_t* block = wa + nb * panel;
        const Cols cols(cols_of(nb));
        for (int64_t m0 = mo; m0 < mend; m0 += MC) {
          const int64_t mc = std::min(MC, mend - m0), tiles = (mc + MR - 1) / MR;
          for (int64_t k0 = 0; k0 < KP; k0 += KC) {
            const int64_t kc = std::min(KC, KP - k0);
            const uint16_t* chunk = block + k0 * cols.n * 2;
            // The first pass over a block reads it from memory: meanwhile, bring in the chunk after this
            // one (the next block's first chunk after the last), split across this chunk's tiles.
            const char* ahead = reinterpret_cast<const char*>(chunk + kc * cols.n * 2);
            const int64_t per_tile = m0 == mo ? (KC * NR * 4 / 64 + tiles - 1) / tiles : 0;
            for (int64_t t = 0; t < tiles; ++t) {
              const char* pf = ahead + t * per_tile * 64;
              const int64_t npf = std::max<int64_t>(0, std::min<int64_t>(per_tile, (weight_end - pf) / 64));
              const int rows = int(std::min<int64_t>(MR, mc - t * MR));
              (cols.n == NR ? micro_rows<true> : micro_rows<false>)(rows, xa + (m0 + t * MR) * lda32 + k0, lda32,
                                                                   chunk, cols, kc, sums.data() + t * MR * NR,
                                                                   k0 == 0, pf, npf);
            }
          }
          write(sums.data(), mc, m0, nb, cols);
        }
      }
      _mm_sfence();  // streaming stores (fp32 logits) are done before the region ends
    });
  }
}

inline __m512 bf16_round(__m512 v) { return fw_simd::round16<c10::BFloat16>(v); }

// One block of a gated weight: h gate sums, then h up sums per row. silu: out[r, o0 + i] =
// round(round(silu(round(gate))) * round(up)), as fw.layers.cpu_ops.silu_mul computes it from a bf16
// gate|up; otherwise gate -> out[r, o0 + i] and up -> out[r, I + o0 + i] (the plain product's columns).
void write_gated(const float* sums, int64_t rows, int64_t o0, int64_t h, int64_t I, bool silu, uint16_t* out,
                 int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < h; j += 16) {
      const __mmask16 m = lanes(h - j);
      const __m512 g = bf16_round(_mm512_maskz_loadu_ps(m, sums + r * NR + j));
      const __m512 u = bf16_round(_mm512_maskz_loadu_ps(m, sums + r * NR + h + j));
      uint16_t* o = out + r * ldo + o0 + j;
      if (silu) {
        store_row(o, m, _mm512_mul_ps(bf16_round(fw_simd::silu16(g)), u));
      } else {
        store_row(o, m, g);
        store_row(o + I, m, u);
      }
    }
}
#endif

at::Tensor linear_bf16(const at::Tensor& x_in, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                       bool fp32_out) {
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 2 && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous(),
              "linear_bf16: the weight must come from pack_bf16");
  const int64_t N = wp.size(0), NB = (N + NR - 1) / NR, KP = wp.size(1);
  const at::Tensor x = aligned_input(x_in, KP);
  const uint16_t* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N && b.scalar_type() == at::kBFloat16, "linear_bf16: bias bf16 [N]");
    bp = reinterpret_cast<const uint16_t*>(b.const_data_ptr());
  }
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  if (x.size(0) == 0) return out;
#ifdef FW_DENSE_BF16
  void* oa = out.mutable_data_ptr();
  run_blocks(x, reinterpret_cast<const uint16_t*>(wp.const_data_ptr()), NB, KP, N * KP * 2,
             [N](int64_t nb) { return std::min(NR, N - nb * NR); },
             [&](const float* sums, int64_t rows, int64_t m0, int64_t nb, const Cols& cols) {
               if (fp32_out) write_block(sums, rows, bp, nb, cols, static_cast<float*>(oa) + m0 * N, N);
               else write_block(sums, rows, bp, nb, cols, static_cast<uint16_t*>(oa) + m0 * N, N);
             });
#endif
  return out;
}

// x @ [gate | up]^T for a weight from pack_bf16_gated: with silu, silu(gate) * up [M, I]; else the plain
// product [M, 2I] (gate columns, then up).
at::Tensor linear_bf16_gated(const at::Tensor& x_in, const at::Tensor& wp, bool silu) {
  TORCH_CHECK(wp.dim() == 4 && wp.size(0) == 2 && wp.size(3) == 2 && wp.scalar_type() == at::kBFloat16 &&
                  wp.is_contiguous(),
              "linear_bf16_gated: the weight must come from pack_bf16_gated");
  const int64_t I = wp.size(1), NB = (I + HALF - 1) / HALF, KP = wp.size(2);
  const at::Tensor x = aligned_input(x_in, KP);
  at::Tensor out = at::empty({x.size(0), silu ? I : 2 * I}, x.options());
  if (x.size(0) == 0) return out;
#ifdef FW_DENSE_BF16
  uint16_t* oa = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t ldo = out.size(1);
  run_blocks(x, reinterpret_cast<const uint16_t*>(wp.const_data_ptr()), NB, KP, 2 * I * KP * 2,
             [I](int64_t nb) { return 2 * std::min(HALF, I - nb * HALF); },
             [&](const float* sums, int64_t rows, int64_t m0, int64_t nb, const Cols& cols) {
               write_gated(sums, rows, nb * HALF, cols.n / 2, I, silu, oa + m0 * ldo, ldo);
             });
#endif
  return out;
}

// Rows `ids` of a weight from pack_bf16, [len(ids), K]: an embedding read from its tied head's blocks (a
// block's row c is the word at p * cols + c of each input pair p). Copies words, so any CPU builds it.
at::Tensor rows_bf16(const at::Tensor& wp, const at::Tensor& ids_in) {
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 2 && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous() &&
                  wp.device().is_cpu(),
              "rows_bf16: the weight must come from pack_bf16");
  TORCH_CHECK(ids_in.dim() == 1 && !ids_in.is_floating_point() && ids_in.device().is_cpu(),
              "rows_bf16: ids must be a 1-D integer CPU tensor");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t N = wp.size(0), KP = wp.size(1), n = ids.numel(), whole = N / NR * NR;
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "rows_bf16: row ", id[i], " is outside the weight's ", N, " rows");
  at::Tensor out = at::empty({n, 2 * KP}, wp.options());
  const uint32_t* w = reinterpret_cast<const uint32_t*>(wp.const_data_ptr());
  uint32_t* o = reinterpret_cast<uint32_t*>(out.mutable_data_ptr());
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = id[i] / NR, c = id[i] % NR, cols = b * NR < whole ? NR : N - whole;
      const uint32_t* src = w + b * KP * NR + c;
      for (int64_t p = 0; p < KP; ++p) o[i * KP + p] = src[p * cols];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fw_dense, m) {
  m.def("rows_bf16(Tensor w, Tensor ids) -> Tensor");
  m.impl("rows_bf16", c10::DispatchKey::CPU, TORCH_FN(rows_bf16));
  m.def("available() -> bool");
  m.impl("available", TORCH_FN(available));
  m.def("pack_bf16(Tensor w) -> Tensor");
  m.impl("pack_bf16", c10::DispatchKey::CPU, TORCH_FN(pack_bf16));
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.impl("linear_bf16", c10::DispatchKey::CPU, TORCH_FN(linear_bf16));
  m.def("pack_bf16_gated(Tensor w) -> Tensor");
  m.impl("pack_bf16_gated", c10::DispatchKey::CPU, TORCH_FN(pack_bf16_gated));
  m.def("linear_bf16_gated(Tensor x, Tensor w, bool silu) -> Tensor");
  m.impl("linear_bf16_gated", c10::DispatchKey::CPU, TORCH_FN(linear_bf16_gated));
}
