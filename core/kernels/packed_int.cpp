// Matrix products on 4-bit and 8-bit block-quantized weights and on fp8 (e4m3) weights, on CPUs with AVX512-VNNI
// and AVX512-BF16 (fw/layers/packed_int.py packs the weights and calls this).
//
// Why: a quantized model is quantized to be read faster. Dequantizing a layer's weight to bf16 on every call
// (fw's reference paths) costs more than the bytes it saved; these kernels read each packed weight once and
// multiply its integer codes directly with the activations quantized to int8 (vpdpbusd), as llama.cpp does.
//
// Weights: blocks of 32 inputs. A 4-bit weight is w = d * q + m with q in 0..15 (GGUF Q4_0/Q4_1, GPTQ and
// AWQ groups all take this form); an 8-bit weight is w = d * q with q in -127..127 (GGUF Q8_0, row-wise int8).
// d and m are fp16, one per output row and block. An fp8 weight is w = s * e4m3 code, s fp32 per row and block.
//
// Layout: output rows in tiles of 16 (the last tile padded with zero rows), the tile's blocks in input order,
// each (tile, block) a record of fixed size:
//   q4: 256 bytes of codes, then 16 fp16 d, then 16 fp16 m                         (320 bytes, 5 bits/weight)
//   q8: 512 bytes of codes, then 16 fp16 d, then 16 int16 sum(q) of the row         (576 bytes)
//   f8: 512 bytes of e4m3 codes, then 16 fp32 s                                      (576 bytes)
//   i8: as f8, the codes int8 in sign-magnitude form (bit 7 the sign, bits 0..6 |q|)  (576 bytes)
// Records are whole cache lines (5 and 9 of 64 bytes): a 64-byte load never straddles two.
// Codes are ordered so that one 64-byte vector holds, for each of the 16 rows, 4 consecutive inputs
// (row r at bytes 4r..4r+3): vpdpbusd with 4 activation bytes broadcast gives 16 row sums at once.
// q4 vector p (0..3) packs two such vectors: its low nibbles are inputs 8p..8p+3, its high nibbles 8p+4..8p+7.
// f8 vector j (0..7) holds inputs 4j..4j+3 of the 16 rows: in 128-bit lane l (rows 4l..4l+3), bytes 0..7 are
// inputs 4j, 4j+1 of each row in turn and bytes 8..15 inputs 4j+2, 4j+3. Widened to bf16 by byte unpacks
// (Bf16Lookup) they become two vectors of the 16 rows' pairs, which one vdpbf16ps each multiplies with a
// broadcast activation pair.
//
// Activations: each row's block of 32 is quantized to int8 with scale amax / 127 (round to nearest even),
// and its code sum kept, as llama.cpp's Q8_1; a row's heavy blocks (mark_heavy_blocks), where outlier channels
// make one term's rounding coarse, take the rounding residual as a second int8 term. Products choose those
// blocks by the row alone at any size, so a row's result does not depend on how many rows share the step: a
// request answers the same alone, batched, or after a cached prefix (an LM head's logits in a padded compiled
// step equal the eager step's). Then, per row and block, exactly in int32:
//   q4: sum_k (d q_k + m) x_k ~ dx (d sum(q_k xq_k) + m sum(xq_k))
//   q8: vpdpbusd takes unsigned x bytes: xq + 128, and sum((xq + 128) q) - 128 sum(q) = sum(xq q).
//   f8: activations rounded to bf16 (exact when they are bf16), each e4m3 code widened exactly to bf16 by a
//       table lookup; products exact, sums fp32 (vdpbf16ps), as fw's dense bf16 kernel.
//   i8: the f8 kernel with a table of the integers 0..127 (every one a bf16): W8A16, no activation rounding.
// Results are fp32 sums over blocks in input order, written as fp32 or rounded once to bf16.
// silu_q4 / silu_q8: a SiLU MLP's [gate; up] product with the activation applied as its tiles are written,
// silu(gate) * up rounded exactly as cpu_ops.silu_mul rounds the plain product's output (built without FP
// contraction, as cpu_ops is).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "fw_simd.h"  // load16 (fw/csrc, on the include path of fw.cpp_ops builds)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define FW_PACKED_INT 1
#include <immintrin.h>
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define FW_PACKED_F8 1  // the f8 kernel: vdpbf16ps and vpermi2b as well
#endif
#endif

namespace {

constexpr int64_t TILE = 16;        // output rows per tile
constexpr int64_t BLOCK = 32;       // inputs per block
constexpr int64_t Q4_RECORD = 320;  // bytes per (tile, block)
constexpr int64_t Q8_RECORD = 576;
constexpr int64_t F8_RECORD = 576;
constexpr int64_t PREFETCH_AHEAD = 4608;  // bytes: records are requested this far ahead of the one in use

// Q4, Q8: 4-bit / 8-bit weights, activations in one int8 term but two in each row's heavy blocks; Q8B: Q8's
// products without a branch (few rows).
enum class Kind { Q4, Q8, Q8B, F8, I8 };

constexpr int64_t BRANCHLESS_MAX_ROWS = 4;  // up to here 8-bit products run both terms and keep one by a mask
constexpr double HEAVY_FACTOR = 3.0;  // a row's blocks this far above its mean take the residual term

constexpr int64_t record_bytes(Kind kind) {
  return kind == Kind::Q4 ? Q4_RECORD : kind == Kind::F8 || kind == Kind::I8 ? F8_RECORD : Q8_RECORD;
}

constexpr int MR = 8;               // activation rows per pass over a tile's blocks: the weights stay in registers
constexpr int WIDE_ROWS = 64;       // the same for the widening kinds (f8, i8), their sums in memory

bool available() {
#ifdef FW_PACKED_INT
  return true;
#else
  return false;
#endif
}

bool f8_available() {
#ifdef FW_PACKED_F8
  return true;
#else
  return false;
#endif
}

#ifdef FW_PACKED_INT

// Activations quantized per (row, block): codes (int8, or uint8 = int8 + 128 for q8), scale, scale * sum.
// Block-major: a block's codes, scales and flags for consecutive rows lie side by side, so a tile kernel
// addresses all of its rows from one pointer per block.
struct QuantizedRows {
  int64_t M = 0, KB = 0;
  std::vector<int8_t> codes;   // [2 terms, KB, M, 32]
  std::vector<float> scale;    // [2 terms, KB, M]
  std::vector<float> scaled_sum;  // [2 terms, KB, M]: scale * sum of the block's int8 codes
  std::vector<uint8_t> heavy;  // [KB, M]: the row's blocks whose residual term is used
  const int8_t* block_codes(int64_t term, int64_t b, int64_t row) const { return codes.data() + ((term * KB + b) * M + row) * BLOCK; }
  int64_t at(int64_t term, int64_t b, int64_t row) const { return (term * KB + b) * M + row; }
};

// What a tile kernel reads of the activations: int8 blocks (q4, q8) or bf16 rows (f8), K inputs a row.
struct Acts {
  const QuantizedRows* q = nullptr;
  const uint16_t* bf16 = nullptr;  // row r at bf16 + r * ld
  int64_t ld = 0;
  int64_t K = 0;
};

// A row's heavy blocks: those whose squared first-term scale is at least HEAVY_FACTOR times the row's mean over
// its blocks (so at most KB / HEAVY_FACTOR of them). The first term's rounding error in a block grows with its
// scale, and a few blocks holding outlier channels carry most of it; their residual term removes it there.
// `whole` (a tensor-parallel rank's slice of each row): row r's sum of squared scales over the whole row, of
// `whole_blocks` blocks, so the rank chooses the blocks one process would (the mean is the whole row's).
void mark_heavy_blocks(int64_t M, int64_t KB, QuantizedRows& out, const double* whole, int64_t whole_blocks) {
  out.heavy.resize(size_t(M * KB));
  const double blocks = double(whole ? whole_blocks : KB);
  for (int64_t r = 0; r < M; ++r) {
    const float* scale = out.scale.data() + r;  // the row's first term, block b at b * M
    double total = 0.0;
    if (whole) total = whole[r];
    else for (int64_t b = 0; b < KB; ++b) total += double(scale[b * M]) * double(scale[b * M]);
    for (int64_t b = 0; b < KB; ++b)
      out.heavy[size_t(b * M + r)] = double(scale[b * M]) * double(scale[b * M]) * blocks >= HEAVY_FACTOR * total;
  }
}

// One row's block as int8 codes in `terms` terms: codes q1 with scale s1 = amax / 127, then the rounding
// residual x - s1 q1 (at most s1 / 2) as codes q2 with scale s1 / 254, so s1 q1 + s2 q2 is x within amax / 64,516.
template <typename T>
inline void quantize_block(const T* src, int64_t terms, bool offset128, QuantizedRows& out, int64_t r, int64_t b) {
  __m512 v0 = fw_simd::load16(src), v1 = fw_simd::load16(src + 16);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
  float d = amax / 127.0f;
  for (int64_t term = 0; term < terms; ++term) {
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv));  // round to nearest even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    __m128i c0 = _mm512_cvtsepi32_epi8(q0), c1 = _mm512_cvtsepi32_epi8(q1);
    if (offset128) {
      const __m128i flip = _mm_set1_epi8(char(0x80));
      c0 = _mm_xor_si128(c0, flip);
      c1 = _mm_xor_si128(c1, flip);
    }
    const int64_t ib = out.at(term, b, r);
    int8_t* dst = out.codes.data() + ib * BLOCK;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), c0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), c1);
    out.scale[size_t(ib)] = d;
    out.scaled_sum[size_t(ib)] = d * float(sum);
    if (term + 1 == terms) break;
    const __m512 vd = _mm512_set1_ps(d);  // the residual: what the codes leave, for the next term
    v0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q0), vd, v0);
    v1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q1), vd, v1);
    d /= 254.0f;
  }
}

// Each row's blocks in one int8 term, then its heavy blocks (mark_heavy_blocks) in two: the second term exists
// only where a product uses it (the 8-bit branchless products read it elsewhere too, and mask it out).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t ldx, bool offset128, QuantizedRows& out,
                   const double* whole, int64_t whole_blocks) {
  const int64_t KB = K / BLOCK;
  out.M = M;
  out.KB = KB;
  out.codes.resize(size_t(2 * M * K));
  out.scale.resize(size_t(2 * M * KB));
  out.scaled_sum.resize(size_t(2 * M * KB));
  at::parallel_for(0, M * KB, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_block(x + (i / KB) * ldx + (i % KB) * BLOCK, 1, offset128, out, i / KB, i % KB);
  });
  mark_heavy_blocks(M, KB, out, whole, whole_blocks);
  at::parallel_for(0, M * KB, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / KB, b = i % KB;
      if (out.heavy[size_t(b * M + r)]) quantize_block(x + r * ldx + b * BLOCK, 2, offset128, out, r, b);
    }
  });
}

inline __m512 load_half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Prefetch instructions never fault: past the weight's end they are dropped.
template <int64_t RECORD>
inline void prefetch_record(const uint8_t* p) {
  for (int64_t line = 0; line < RECORD; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// The integer sums of `ROWS` activation rows with one block's 8 weight vectors: s[c][r] += w[j] . x_r[j] for
// the words j of chain c (chains split the 8 words so few rows still have independent dot products in flight).
// Rows advance in lockstep, word by word: each vpdpbusd waits on its own row's previous one only, so the
// products issue at the machine's rate (row by row, each row's short chains waited on their latency).
// x: the block's codes of the rows, 32 bytes (8 words) a row.
template <int ROWS, int CHAINS, bool UNSIGNED_X>
inline void block_sums(const __m512i* w, const int32_t* x, __m512i (&s)[CHAINS][ROWS]) {
  for (int c = 0; c < CHAINS; ++c)
    for (int r = 0; r < ROWS; ++r) s[c][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      __m512i& sum = s[j % CHAINS][r];
      const __m512i xj = _mm512_set1_epi32(x[8 * r + j]);
      sum = UNSIGNED_X ? _mm512_dpbusd_epi32(sum, xj, w[j])   // unsigned x, signed w
                       : _mm512_dpbusd_epi32(sum, w[j], xj);  // unsigned w, signed x
    }
  for (int c = 1; c < CHAINS; ++c)
    for (int r = 0; r < ROWS; ++r) s[0][r] = _mm512_add_epi32(s[0][r], s[c][r]);
}

// Two chains per row up to 2 rows (their latency would show), one from 3 rows on.
template <int ROWS>
constexpr int chains_for() { return ROWS <= 2 ? 2 : 1; }

template <int ROWS>
inline bool any_heavy(const uint8_t* h) {
  bool any = false;
  for (int r = 0; r < ROWS; ++r) any |= h[r] != 0;
  return any;
}

// One tile (16 output rows) times `rows` (1..MR) activation rows, over all KB blocks: out[r] = 16 row sums.
// Each row comes as two int8 terms (quantize_rows' residual) with scales s and s / 254, the second taken in
// the row's heavy blocks only (computed for all rows of a block where any row needs it). Their integer sums S1
// and S2 combine exactly in int32 as 254 S1 + S2 (at most 254 * 60,960 + 60,960 in size), so a row costs one
// conversion and one scale, times s / 254.
template <int ROWS>
void q4_tile(const uint8_t* tile, int64_t KB, const Acts& acts, int64_t m0, __m512* out) {
  constexpr int CH = chains_for<ROWS>();
  const QuantizedRows& a = *acts.q;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* rec = tile + b * Q4_RECORD;
    prefetch_record<Q4_RECORD>(rec + PREFETCH_AHEAD);
    __m512i w[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(rec + 64 * p);
      w[2 * p] = _mm512_and_si512(v, low);
      w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 d = load_half16(rec + 256), m = load_half16(rec + 288);
    const int64_t i1 = a.at(0, b, m0), i2 = a.at(1, b, m0);  // the rows' first terms, and their residuals
    const uint8_t* heavy = a.heavy.data() + b * a.M + m0;
    __m512i s1[CH][ROWS], s2[CH][ROWS];
    block_sums<ROWS, CH, false>(w, reinterpret_cast<const int32_t*>(a.block_codes(0, b, m0)), s1);
    const bool any = any_heavy<ROWS>(heavy);
    if (any) block_sums<ROWS, CH, false>(w, reinterpret_cast<const int32_t*>(a.block_codes(1, b, m0)), s2);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      if (any && heavy[r]) {
        const __m512i both = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(s1[0][r], 8), _mm512_slli_epi32(s1[0][r], 1)),
                                              s2[0][r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(d, _mm512_set1_ps(a.scale[size_t(i2 + r)])),
                                 acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.scaled_sum[size_t(i1 + r)] + a.scaled_sum[size_t(i2 + r)]), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[0][r]), _mm512_mul_ps(d, _mm512_set1_ps(a.scale[size_t(i1 + r)])),
                                 acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.scaled_sum[size_t(i1 + r)]), acc[r]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = acc[r];
}

// As q4_tile, for 8-bit weights: unsigned activation codes (int8 + 128) times signed weights,
// corrected by 128 * sum(q) per weight row; two terms 254 * S1 + S2 in the row's heavy blocks. BRANCHLESS (few
// rows, memory-bound): every block computes both terms and keeps the second's by a mask, the same result bit for
// bit as the branch, which cost decode a third of its bandwidth (docs/performance.md).
template <int ROWS, bool BRANCHLESS>
void q8_tile(const uint8_t* tile, int64_t KB, const Acts& acts, int64_t m0, __m512* out) {
  constexpr int CH = chains_for<ROWS>();
  const QuantizedRows& a = *acts.q;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* rec = tile + b * Q8_RECORD;
    prefetch_record<Q8_RECORD>(rec + PREFETCH_AHEAD);
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(rec + 64 * j);
    const __m512 d = load_half16(rec + 512);
    const __m512i correction =  // 128 * sum(q) per row
        _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 544))), 7);
    const int64_t i1 = a.at(0, b, m0), i2 = a.at(1, b, m0);
    const uint8_t* heavy = a.heavy.data() + b * a.M + m0;
    __m512i s1[CH][ROWS], s2[CH][ROWS];
    block_sums<ROWS, CH, true>(w, reinterpret_cast<const int32_t*>(a.block_codes(0, b, m0)), s1);
    const bool any = BRANCHLESS || any_heavy<ROWS>(heavy);
    if (any) block_sums<ROWS, CH, true>(w, reinterpret_cast<const int32_t*>(a.block_codes(1, b, m0)), s2);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const bool h = heavy[r];
      const __m512i first = _mm512_sub_epi32(s1[0][r], correction);
      if (BRANCHLESS || (any && h)) {
        const __m512i second = _mm512_sub_epi32(s2[0][r], correction);
        const __m512i both = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(first, 8), _mm512_slli_epi32(first, 1)), second);
        const __m512i kept = BRANCHLESS ? _mm512_mask_blend_epi32(__mmask16(-int(h)), first, both) : both;
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(kept), _mm512_mul_ps(d, _mm512_set1_ps(a.scale[size_t((h ? i2 : i1) + r)])),
                                 acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first), _mm512_mul_ps(d, _mm512_set1_ps(a.scale[size_t(i1 + r)])),
                                 acc[r]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = acc[r];
}

#ifdef FW_PACKED_F8
// bf16 of every non-negative e4m3 code (0..127), split into low and high bytes: a code's value is exactly a
// normal bf16 (e4m3 subnormals included, which vdpbf16ps would flush to zero as bf16 subnormals).
struct Bf16Table {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  explicit Bf16Table(float (*value)(int)) {
    for (int i = 0; i < 128; ++i) {
      const float v = value(i);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      lo[i] = uint8_t(bits >> 16);
      hi[i] = uint8_t(bits >> 24);
    }
  }
};
float e4m3_value(int i) {
  const int e = i >> 3, m = i & 7;
  return e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
}
float integer_value(int i) { return float(i); }
const Bf16Table kE4m3(e4m3_value);
const Bf16Table kInt8(integer_value);  // |q| of an int8 weight in sign-magnitude form (i8)

// 64 sign-magnitude codes (e4m3, or i8's integers) -> two vectors of 32 bf16: vpermi2b looks up each code's low
// and high byte in the table (7 bits of index),
// the sign bit joins the high byte, and the byte unpacks pair them (within each 128-bit lane: bytes 0..7 of a
// lane to `first`, 8..15 to `second`; pack() orders the codes for this).
struct Bf16Lookup {
  explicit Bf16Lookup(const Bf16Table& t)
      : lo0(_mm512_load_si512(t.lo)), lo1(_mm512_load_si512(t.lo + 64)), hi0(_mm512_load_si512(t.hi)),
        hi1(_mm512_load_si512(t.hi + 64)) {}
  __m512i lo0, lo1, hi0, hi1;
  inline void widen(const uint8_t* p, __m512bh& first, __m512bh& second) const {
    const __m512i c = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c,
                                                 _mm512_set1_epi8(char(0x80)), 0xF8);  // hi | (c & 0x80)
    first = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    second = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
  }
};

// One activation row's sums over a record's 32 inputs (x: its 16 bf16 pairs): two chains of vdpbf16ps, added.
// Every widening pass computes a row this way, so a row's result does not depend on the rows beside it.
inline __m512 widened_sums(const __m512bh* w, const int32_t* x) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  for (int p = 0; p < 16; p += 2) {
    s0 = _mm512_dpbf16_ps(s0, w[p], (__m512bh)_mm512_set1_epi32(x[p]));
    s1 = _mm512_dpbf16_ps(s1, w[p + 1], (__m512bh)_mm512_set1_epi32(x[p + 1]));
  }
  return _mm512_add_ps(s0, s1);
}

// widened_sums of two rows, their four chains interleaved (each row's the same as alone): one row's two chains
// leave vdpbf16ps waiting on its latency.
inline void widened_sums2(const __m512bh* w, const int32_t* x, const int32_t* y, __m512& sx, __m512& sy) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
  for (int p = 0; p < 16; p += 2) {
    s0 = _mm512_dpbf16_ps(s0, w[p], (__m512bh)_mm512_set1_epi32(x[p]));
    t0 = _mm512_dpbf16_ps(t0, w[p], (__m512bh)_mm512_set1_epi32(y[p]));
    s1 = _mm512_dpbf16_ps(s1, w[p + 1], (__m512bh)_mm512_set1_epi32(x[p + 1]));
    t1 = _mm512_dpbf16_ps(t1, w[p + 1], (__m512bh)_mm512_set1_epi32(y[p + 1]));
  }
  sx = _mm512_add_ps(s0, s1);
  sy = _mm512_add_ps(t0, t1);
}

// `rows` activation rows (ROWS of them when ROWS > 0, their sums in registers; else up to WIDE_ROWS, in
// memory) over all KB blocks of one tile: each record widened once for all the rows. Above MR rows a pass
// takes up to WIDE_ROWS, where widening the records again for every MR rows dominated large steps.
template <int ROWS>
void f8_tile(const uint8_t* tile, int64_t KB, const Acts& a, int64_t m0, __m512* acc, const Bf16Table& codes,
             int rows = ROWS) {
  const Bf16Lookup table(codes);
  const int n = ROWS > 0 ? ROWS : rows;
  for (int r = 0; r < n; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* rec = tile + b * F8_RECORD;
    prefetch_record<F8_RECORD>(rec + PREFETCH_AHEAD);
    __m512bh w[16];
    for (int j = 0; j < 8; ++j) table.widen(rec + 64 * j, w[2 * j], w[2 * j + 1]);
    const __m512 s = _mm512_loadu_ps(rec + 512);
    auto row = [&](int r) { return reinterpret_cast<const int32_t*>(a.bf16 + (m0 + r) * a.ld + b * BLOCK); };
    int r = 0;
    for (; r + 2 <= n; r += 2) {
      __m512 sx, sy;
      widened_sums2(w, row(r), row(r + 1), sx, sy);
      acc[r] = _mm512_fmadd_ps(sx, s, acc[r]);
      acc[r + 1] = _mm512_fmadd_ps(sy, s, acc[r + 1]);
    }
    if (r < n) acc[r] = _mm512_fmadd_ps(widened_sums(w, row(r)), s, acc[r]);
  }
}

#endif

template <int ROWS, Kind KIND>
void tile_rows(const uint8_t* tile, int64_t KB, const Acts& a, int64_t m0, __m512* acc) {
  if constexpr (KIND == Kind::Q4) q4_tile<ROWS>(tile, KB, a, m0, acc);
  else if constexpr (KIND == Kind::Q8) q8_tile<ROWS, false>(tile, KB, a, m0, acc);
  else if constexpr (KIND == Kind::Q8B) q8_tile<ROWS, true>(tile, KB, a, m0, acc);
#ifdef FW_PACKED_F8
  else if constexpr (KIND == Kind::F8) f8_tile<ROWS>(tile, KB, a, m0, acc, kE4m3);
  else f8_tile<ROWS>(tile, KB, a, m0, acc, kInt8);
#endif
}

// M rows of activations, MR at a time per tile (q4_tile reads each row's two quantized terms itself); the
// widening kinds (f8, i8) take up to WIDE_ROWS at a time above MR.
template <Kind KIND>
void run(const Acts& a, const uint8_t* w, int64_t M, int64_t N, bool fp32_out, void* out) {
  const int64_t KB = a.K / BLOCK, NT = (N + TILE - 1) / TILE;
  const int64_t tile_bytes = KB * record_bytes(KIND);
  constexpr bool wide = KIND == Kind::F8 || KIND == Kind::I8;
  constexpr int64_t PASS = wide ? WIDE_ROWS : MR;
  at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    __m512 acc[PASS];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = w + t * tile_bytes;
      const int64_t n0 = t * TILE;
      const __mmask16 mask = N - n0 >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
      for (int64_t m0 = 0; m0 < M; m0 += PASS) {
        const int rows = int(std::min<int64_t>(PASS, M - m0));
#ifdef FW_PACKED_F8
        if constexpr (wide) {
          if (rows > MR) f8_tile<0>(tile, KB, a, m0, acc, KIND == Kind::F8 ? kE4m3 : kInt8, rows);
        }
#endif
        if (!wide || rows <= MR) switch (rows) {
          case 8: tile_rows<8, KIND>(tile, KB, a, m0, acc); break;
          case 7: tile_rows<7, KIND>(tile, KB, a, m0, acc); break;
          case 6: tile_rows<6, KIND>(tile, KB, a, m0, acc); break;
          case 5: tile_rows<5, KIND>(tile, KB, a, m0, acc); break;
          case 4: tile_rows<4, KIND>(tile, KB, a, m0, acc); break;
          case 3: tile_rows<3, KIND>(tile, KB, a, m0, acc); break;
          case 2: tile_rows<2, KIND>(tile, KB, a, m0, acc); break;
          default: tile_rows<1, KIND>(tile, KB, a, m0, acc); break;
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

// silu(gate) * up from a weight whose first N / 2 rows are a SiLU MLP's gate and the rest its up projection
// (N / 2 a multiple of TILE): gate tile t and up tile t + N / 32 side by side, rounded as cpu_ops.silu_mul rounds
// the plain product's output, out = round(round(silu(round(g))) * round(u)) in T, the activations' dtype.
template <Kind KIND, typename T>
void run_silu(const Acts& a, const uint8_t* w, int64_t M, int64_t N, T* out) {
  const int64_t KB = a.K / BLOCK, H = N / 2, HT = H / TILE;
  const int64_t tile_bytes = KB * record_bytes(KIND);
  at::parallel_for(0, HT, 1, [&](int64_t t0, int64_t t1) {
    __m512 g[MR], u[MR];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* gate = w + t * tile_bytes;
      const uint8_t* up = w + (t + HT) * tile_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int rows = int(std::min<int64_t>(MR, M - m0));
        switch (rows) {
#define FW_SILU_ROWS(R) \
  case R: tile_rows<R, KIND>(gate, KB, a, m0, g); tile_rows<R, KIND>(up, KB, a, m0, u); break;
          FW_SILU_ROWS(8) FW_SILU_ROWS(7) FW_SILU_ROWS(6) FW_SILU_ROWS(5)
          FW_SILU_ROWS(4) FW_SILU_ROWS(3) FW_SILU_ROWS(2)
#undef FW_SILU_ROWS
          default: tile_rows<1, KIND>(gate, KB, a, m0, g); tile_rows<1, KIND>(up, KB, a, m0, u); break;
        }
        for (int r = 0; r < rows; ++r) {
          const __m512 gr = fw_simd::round16<T>(g[r]);
          fw_simd::store16(out + (m0 + r) * H + t * TILE,
                           _mm512_mul_ps(fw_simd::round16<T>(fw_simd::silu16(gr)), fw_simd::round16<T>(u[r])));
        }
      }
    }
  });
}
#endif

void check_weight(const at::Tensor& x, const at::Tensor& w, int64_t N, Kind kind, const char* op) {
  const int64_t record = record_bytes(kind);
  const bool f8 = kind == Kind::F8 || kind == Kind::I8;
  TORCH_CHECK(f8 ? f8_available() : available(), op, ": this build has no kernel for it (",
              f8 ? "AVX512-BF16 or AVX512-VBMI" : "AVX512-VNNI", " missing)");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a float32 or bfloat16 CPU tensor [M, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0, op, ": K = ", K, " is not a multiple of ", BLOCK);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.numel() == (N + TILE - 1) / TILE * (K / BLOCK) * record,
              op, ": the packed weight does not hold ", N, " x ", K, " weights");
}

#ifdef FW_PACKED_INT
// x as bf16 rows the f8 kernel can read in place, or a rounded copy (nearest even) in `copy`.
const uint16_t* bf16_rows(const at::Tensor& x, std::vector<uint16_t>& copy, int64_t& ld) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    ld = x.stride(0);
    return reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  }
  copy.resize(size_t(M * K));
  ld = K;
  const float* src = x.const_data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(copy.data() + r * K + k),
                            fw_simd::to_bf16_bits(_mm512_loadu_ps(src + r * x.stride(0) + k)));
  });
  return copy.data();
}
#endif

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t N, bool fp32_out, int kind_index,
                  const std::optional<at::Tensor>& whole_row_squares = std::nullopt, int64_t whole_row_blocks = 0,
                  bool silu = false) {
  static const char* names[] = {"linear_q4", "linear_q8", "linear_f8", "linear_i8"};
  static const char* silu_names[] = {"silu_q4", "silu_q8"};
  const char* op = silu ? silu_names[kind_index] : names[kind_index];
  static const Kind kinds[] = {Kind::Q4, Kind::Q8, Kind::F8, Kind::I8};
  const Kind kind = kinds[kind_index];
  check_weight(x_in, w, N, kind, op);
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!silu || N % (2 * TILE) == 0, op, ": the [gate; up] weight's N = ", N, " rows are not a multiple of ",
              2 * TILE);
  at::Tensor out = at::empty({M, silu ? N / 2 : N}, x.options().dtype(fp32_out ? at::kFloat : x.scalar_type()));
#ifdef FW_PACKED_INT
  if (M == 0) return out;
  thread_local QuantizedRows q;  // reused: a decode step calls this ~120 times with the same sizes
  thread_local std::vector<uint16_t> rounded;
  Acts a;
  a.K = K;
  if (kind == Kind::F8 || kind == Kind::I8) {
    a.bf16 = bf16_rows(x, rounded, a.ld);
  } else {
    const bool q8 = kind == Kind::Q8;  // unsigned codes (+128) for vpdpbusd's first operand
    const double* whole = nullptr;
    if (whole_row_squares.has_value()) {
      const at::Tensor& t = *whole_row_squares;
      TORCH_CHECK(t.scalar_type() == at::kDouble && t.dim() == 1 && t.size(0) == M && t.is_contiguous(), op,
                  ": whole_row_squares must be a contiguous float64 vector of one value per row of x");
      TORCH_CHECK(whole_row_blocks >= K / BLOCK, op, ": whole_row_blocks must count the whole row's blocks");
      whole = t.const_data_ptr<double>();
    }
    if (x.scalar_type() == at::kFloat)
      quantize_rows(x.const_data_ptr<float>(), M, K, x.stride(0), q8, q, whole, whole_row_blocks);
    else quantize_rows(x.const_data_ptr<c10::BFloat16>(), M, K, x.stride(0), q8, q, whole, whole_row_blocks);
    a.q = &q;
  }
  const bool write_fp32 = out.scalar_type() == at::kFloat;
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  const Kind tiles = kind == Kind::Q8 && M <= BRANCHLESS_MAX_ROWS ? Kind::Q8B : kind;  // the tile kernel to run
  if (silu) {
    auto go = [&](auto* o) {
      if (tiles == Kind::Q4) run_silu<Kind::Q4>(a, wp, M, N, o);
      else if (tiles == Kind::Q8B) run_silu<Kind::Q8B>(a, wp, M, N, o);
      else run_silu<Kind::Q8>(a, wp, M, N, o);
    };
    if (write_fp32) go(out.mutable_data_ptr<float>());
    else go(out.mutable_data_ptr<c10::BFloat16>());
  } else if (tiles == Kind::Q4) run<Kind::Q4>(a, wp, M, N, write_fp32, out.data_ptr());
  else if (tiles == Kind::Q8B) run<Kind::Q8B>(a, wp, M, N, write_fp32, out.data_ptr());
  else if (tiles == Kind::Q8) run<Kind::Q8>(a, wp, M, N, write_fp32, out.data_ptr());
#ifdef FW_PACKED_F8
  else if (tiles == Kind::F8) run<Kind::F8>(a, wp, M, N, write_fp32, out.data_ptr());
  else run<Kind::I8>(a, wp, M, N, write_fp32, out.data_ptr());
#endif
#endif
  return out;
}

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& w, int64_t N, bool fp32_out,
                     const std::optional<at::Tensor>& whole_row_squares, int64_t whole_row_blocks) {
  return linear(x, w, N, fp32_out, 0, whole_row_squares, whole_row_blocks);
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t N, bool fp32_out,
                     const std::optional<at::Tensor>& whole_row_squares, int64_t whole_row_blocks) {
  return linear(x, w, N, fp32_out, 1, whole_row_squares, whole_row_blocks);
}

at::Tensor linear_f8(const at::Tensor& x, const at::Tensor& w, int64_t N, bool fp32_out) {
  return linear(x, w, N, fp32_out, 2);
}

at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& w, int64_t N, bool fp32_out) {
  return linear(x, w, N, fp32_out, 3);
}

at::Tensor silu_q4(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  return linear(x, w, N, false, 0, std::nullopt, 0, true);
}

at::Tensor silu_q8(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  return linear(x, w, N, false, 1, std::nullopt, 0, true);
}

// Rows `ids` of a packed weight of `rows` x `cols`, [len(ids), cols] in `dtype`: an embedding read from its tied
// head's records. Each value is computed as QuantBlocks.dequantize does, in fp32 (d * q, then + m for 4-bit; this
// file builds without FMA contraction) and rounded once. Plain C++, so any CPU builds it.
float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <typename T>
void rows_q8_into(const uint8_t* w, const int64_t* id, int64_t n, int64_t KB, T* out) {
  constexpr int64_t CODES = BLOCK * TILE;  // a record's codes: [8 words of 4 inputs][16 rows][4], then 16 fp16 d
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t tile = id[i] / TILE, r = id[i] % TILE;
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* rec = w + (tile * KB + b) * Q8_RECORD;
        const float d = half_at(rec + CODES + 2 * r);
        T* o = out + (i * KB + b) * BLOCK;
        for (int64_t j = 0; j < BLOCK / 4; ++j)
          for (int64_t t = 0; t < 4; ++t)
            o[4 * j + t] = static_cast<T>(static_cast<float>(static_cast<int8_t>(rec[j * 4 * TILE + 4 * r + t])) * d);
      }
    }
  });
}

template <typename T>
void rows_q4_into(const uint8_t* w, const int64_t* id, int64_t n, int64_t KB, T* out) {
  // a record: codes [4 quarters of 8 inputs][16 rows][4 bytes] (byte t of quarter p: input 8p + t in the low
  // nibble, 8p + 4 + t in the high one), then 16 fp16 scales d, then 16 fp16 offsets m
  constexpr int64_t CODES = BLOCK * TILE / 2;
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t tile = id[i] / TILE, r = id[i] % TILE;
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* rec = w + (tile * KB + b) * Q4_RECORD;
        const float d = half_at(rec + CODES + 2 * r), m = half_at(rec + CODES + 2 * TILE + 2 * r);
        T* o = out + (i * KB + b) * BLOCK;
        for (int64_t p = 0; p < 4; ++p)
          for (int64_t t = 0; t < 4; ++t) {
            const uint8_t byte = rec[p * 4 * TILE + 4 * r + t];
            o[8 * p + t] = static_cast<T>(static_cast<float>(byte & 15) * d + m);
            o[8 * p + 4 + t] = static_cast<T>(static_cast<float>(byte >> 4) * d + m);
          }
      }
    }
  });
}

// The rows op around one of the two `*_into` loops above: the arguments checked, then `into` run for `dtype`.
template <typename Into>
at::Tensor gathered_rows(const char* op, int64_t record, const at::Tensor& w, const at::Tensor& ids_in, int64_t rows,
                         int64_t cols, at::ScalarType dtype, Into&& into) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              op, ": the weight must come from pack");
  const int64_t KB = cols / BLOCK;
  TORCH_CHECK(cols > 0 && cols % BLOCK == 0 && rows > 0 && w.numel() == (rows + TILE - 1) / TILE * KB * record,
              op, ": ", rows, " x ", cols, " weights do not fit the weight's ", w.numel(), " bytes");
  TORCH_CHECK(ids_in.dim() == 1 && !ids_in.is_floating_point() && ids_in.device().is_cpu(),
              op, ": ids must be a 1-D integer CPU tensor");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, op, ": row ", id[i], " is outside the weight's ", rows, " rows");
  at::Tensor out = at::empty({n, cols}, w.options().dtype(dtype));
  const uint8_t* wp = w.const_data_ptr<uint8_t>();
  switch (dtype) {
    case at::kBFloat16: into(wp, id, n, KB, out.mutable_data_ptr<c10::BFloat16>()); break;
    case at::kHalf: into(wp, id, n, KB, out.mutable_data_ptr<c10::Half>()); break;
    case at::kFloat: into(wp, id, n, KB, out.mutable_data_ptr<float>()); break;
    default: TORCH_CHECK(false, op, ": dtype must be bfloat16, float16 or float32, got ", dtype);
  }
  return out;
}

at::Tensor rows_q8(const at::Tensor& w, const at::Tensor& ids, int64_t rows, int64_t cols, at::ScalarType dtype) {
  return gathered_rows("rows_q8", Q8_RECORD, w, ids, rows, cols, dtype,
                       [](auto... args) { rows_q8_into(args...); });
}

at::Tensor rows_q4(const at::Tensor& w, const at::Tensor& ids, int64_t rows, int64_t cols, at::ScalarType dtype) {
  return gathered_rows("rows_q4", Q4_RECORD, w, ids, rows, cols, dtype,
                       [](auto... args) { rows_q4_into(args...); });
}

}  // namespace

TORCH_LIBRARY(fw_packed_int, m) {
  m.def("rows_q8(Tensor w, Tensor ids, int rows, int cols, ScalarType dtype) -> Tensor");
  m.impl("rows_q8", c10::DispatchKey::CPU, TORCH_FN(rows_q8));
  m.def("rows_q4(Tensor w, Tensor ids, int rows, int cols, ScalarType dtype) -> Tensor");
  m.impl("rows_q4", c10::DispatchKey::CPU, TORCH_FN(rows_q4));
  m.def("available() -> bool");
  m.impl("available", TORCH_FN(available));
  m.def("f8_available() -> bool");
  m.impl("f8_available", TORCH_FN(f8_available));
  m.def("linear_q4(Tensor x, Tensor w, int N, bool fp32_out=False, Tensor? whole_row_squares=None, "
        "int whole_row_blocks=0) -> Tensor");
  m.impl("linear_q4", c10::DispatchKey::CPU, TORCH_FN(linear_q4));
  m.def("linear_q8(Tensor x, Tensor w, int N, bool fp32_out=False, Tensor? whole_row_squares=None, "
        "int whole_row_blocks=0) -> Tensor");
  m.impl("linear_q8", c10::DispatchKey::CPU, TORCH_FN(linear_q8));
  m.def("silu_q4(Tensor x, Tensor w, int N) -> Tensor");
  m.impl("silu_q4", c10::DispatchKey::CPU, TORCH_FN(silu_q4));
  m.def("silu_q8(Tensor x, Tensor w, int N) -> Tensor");
  m.impl("silu_q8", c10::DispatchKey::CPU, TORCH_FN(silu_q8));
  m.def("linear_f8(Tensor x, Tensor w, int N, bool fp32_out=False) -> Tensor");
  m.impl("linear_f8", c10::DispatchKey::CPU, TORCH_FN(linear_f8));
  m.def("linear_i8(Tensor x, Tensor w, int N, bool fp32_out=False) -> Tensor");
  m.impl("linear_i8", c10::DispatchKey::CPU, TORCH_FN(linear_i8));
}
