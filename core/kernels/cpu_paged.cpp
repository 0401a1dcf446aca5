// The cpu_paged attention kernel (backends/attention/cpu_paged.py builds it). One (query row, KV head)
// per task: scores of its query heads against the keys the row sees, read page by page through the
// block table, softmax in fp32, values accumulated in fp32. A prompt row is a decode ending at its position.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fw_simd.h"  // load16, exp16 (fw/csrc, on the include path of fw.cpp_ops builds)

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
using fw_simd::exp16;
using fw_simd::load16;

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

// Before the softmax: optional soft-capping of the scaled scores, cap * tanh(s * scale / cap) (the scale is
// then folded in: returns the scale the softmax must still apply), and -inf for the first `masked` keys
// (those before a sliding window's start within the first page read).
inline float cap_and_mask(float* row, int64_t len, float scale, float softcap, int64_t masked) {
  if (softcap > 0.f) {
    for (int64_t j = masked; j < len; ++j) row[j] = softcap * std::tanh(row[j] * scale / softcap);
    scale = 1.f;
  }
  for (int64_t j = 0; j < masked; ++j) row[j] = -std::numeric_limits<float>::infinity();
  return scale;
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define FW_BF16_DOT 1
// bf16 x bf16 -> fp32 dot products with vdpbf16ps (exact products, fp32 sums).

constexpr int64_t kAheadPages = 4;  // how far score_bf16 prefetches K and V (8 pages: slower again)

// Bring n bf16 from p into the cache, one line at a time.
template <_mm_hint Hint>
inline void prefetch_rows(const c10::BFloat16* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < n * 2; o += 64) _mm_prefetch(c + o, Hint);
}

inline float reduce_256(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 dot16(__m256 acc, __m256i a, __m256i b) {
  return _mm256_dpbf16_ps(acc, (__m256bh)a, (__m256bh)b);
}
inline __m512 dot32(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// Raw scores[g * len + j] = q_g . k_j (unscaled) for GB heads, q bf16 [GB, D]: 32 products per
// instruction, 4 keys at a time. Also prefetches the V pages for values_bf16.
template <int GB>
void score_bf16(const uint16_t* q, int64_t D, const c10::BFloat16* k_head, const c10::BFloat16* v_head,
                const int64_t* table, int64_t len, int64_t P, float* scores) {
  for (int64_t j0 = 0; j0 < len; j0 += P) {
    const c10::BFloat16* page = k_head + table[j0 / P] * P * D;
    const int64_t n = std::min(P, len - j0);
    // Pages are scattered, so the hardware prefetchers stop at each page's end: fetch K and V four pages
    // ahead into L2 (all four at the start), and K's next page on into L1. Against K two pages ahead
    // into L1 and only this page's V: 10-13% faster at batch 64 with the cache in DRAM.
    for (int64_t a = j0 == 0 ? 1 : kAheadPages; a <= kAheadPages && j0 + a * P < len; ++a) {
      const int64_t rows = std::min(P, len - j0 - a * P) * D;
      prefetch_rows<_MM_HINT_T1>(k_head + table[j0 / P + a] * P * D, rows);
      prefetch_rows<_MM_HINT_T1>(v_head + table[j0 / P + a] * P * D, rows);
    }
    if (j0 == 0) prefetch_rows<_MM_HINT_T1>(v_head + table[0] * P * D, n * D);
    if (j0 + P < len) prefetch_rows<_MM_HINT_T0>(k_head + table[j0 / P + 1] * P * D, std::min(P, len - j0 - P) * D);
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      const c10::BFloat16* k = page + t * D;
      __m512 acc[GB][4];
      for (int g = 0; g < GB; ++g)
        for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 32) {
        __m512i kv[4];
        for (int u = 0; u < 4; ++u) kv[u] = _mm512_loadu_si512(k + u * D + c);
        for (int g = 0; g < GB; ++g) {
          __m512i qv = _mm512_loadu_si512(q + g * D + c);
          for (int u = 0; u < 4; ++u) acc[g][u] = dot32(acc[g][u], kv[u], qv);
        }
      }
      for (int g = 0; g < GB; ++g)
        _mm_storeu_ps(scores + g * len + j0 + t, reduce4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
    }
    for (; t < n; ++t) {
      const c10::BFloat16* k = page + t * D;
      __m256 acc[GB];
      for (int g = 0; g < GB; ++g) acc[g] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) {
        __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + c));
        for (int g = 0; g < GB; ++g)
          acc[g] = dot16(acc[g], kv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * D + c)));
      }
      for (int g = 0; g < GB; ++g) scores[g * len + j0 + t] = reduce_256(acc[g]);
    }
  }
}

// In place: row <- softmax(scale * row) in fp32, written out as bf16 into pb[0, len) (RNE), pb[len] = 0.
inline void softmax_bf16(float* row, int64_t len, float scale, uint16_t* pb) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(row + j));
  const __mmask16 tail = __mmask16((1u << (len - j)) - 1);
  vm = _mm512_mask_max_ps(vm, tail, vm, _mm512_maskz_loadu_ps(tail, row + j));
  const float m = _mm512_reduce_max_ps(vm);
  const __m512 ms = _mm512_set1_ps(m * scale), vscale = _mm512_set1_ps(scale);
  __m512 vs = _mm512_setzero_ps();
  for (j = 0; j + 16 <= len; j += 16) {
    __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), vscale, ms));
    _mm512_storeu_ps(row + j, e);
    vs = _mm512_add_ps(vs, e);
  }
  if (tail) {
    __m512 e = exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, row + j), vscale, ms));
    _mm512_mask_storeu_ps(row + j, tail, e);
    vs = _mm512_mask_add_ps(vs, tail, vs, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vs));
  for (j = 0; j + 16 <= len; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row + j), inv)));
  if (tail)
    _mm256_mask_storeu_epi16(pb + j, tail,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + j), inv)));
  pb[len] = 0;
}

// out[g] = sum_j p_j v_j for GB heads over NC * 16 lanes of D from c0: keys two at a time, their V rows
// interleaved into bf16 pairs (v_j[d], v_j+1[d]) and dotted with the pair (p_j, p_j+1) broadcast, fp32 sums.
// pairs[g * npairs + i] = (p_2i, p_2i+1) as bf16 bits, low half first. Needs P even.
template <int GB, int NC>
void values_bf16(const uint32_t* pairs, int64_t npairs, int64_t D, int64_t c0, const c10::BFloat16* v_head,
                 const int64_t* table, int64_t len, int64_t P, float* out) {
  constexpr int NL = NC / 2;  // 512-bit loads per row
  __m512 acc[GB][NC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < len; j0 += P) {
    const c10::BFloat16* page = v_head + table[j0 / P] * P * D + c0;
    const int64_t n = std::min(P, len - j0);
    if (j0 + P < len) prefetch_rows<_MM_HINT_T0>(v_head + table[j0 / P + 1] * P * D + c0, std::min(P, len - j0 - P) * D);
    const uint32_t* pp = pairs + j0 / 2;
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
      const c10::BFloat16* r = page + t * D;
      __m512i il[NC];
      for (int l = 0; l < NL; ++l) {
        __m512i a = _mm512_loadu_si512(r + 32 * l);
        __m512i b = _mm512_loadu_si512(r + D + 32 * l);
        il[2 * l] = _mm512_unpacklo_epi16(a, b);
        il[2 * l + 1] = _mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < GB; ++g) {
        const __m512i w = _mm512_set1_epi32(int(pp[g * npairs + t / 2]));
        for (int c = 0; c < NC; ++c) acc[g][c] = dot32(acc[g][c], il[c], w);
      }
    }
    if (t < n) {  // an odd last key: paired with zeros (the row after it may hold anything)
      const c10::BFloat16* r = page + t * D;
      __m512i il[NC];
      for (int l = 0; l < NL; ++l) {
        __m512i a = _mm512_loadu_si512(r + 32 * l);
        il[2 * l] = _mm512_unpacklo_epi16(a, _mm512_setzero_si512());
        il[2 * l + 1] = _mm512_unpackhi_epi16(a, _mm512_setzero_si512());
      }
      for (int g = 0; g < GB; ++g) {
        const __m512i w = _mm512_set1_epi32(int(pp[g * npairs + t / 2]));
        for (int c = 0; c < NC; ++c) acc[g][c] = dot32(acc[g][c], il[c], w);
      }
    }
  }
  // acc[g][2l + h] lane 4m + i holds d = c0 + 32l + 8m + 4h + i: back to d order.
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < GB; ++g)
    for (int l = 0; l < NL; ++l) {
      float* o = out + g * D + c0 + 32 * l;
      _mm512_storeu_ps(o, _mm512_permutex2var_ps(acc[g][2 * l], lo_idx, acc[g][2 * l + 1]));
      _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(acc[g][2 * l], hi_idx, acc[g][2 * l + 1]));
    }
}

// The keys a thread's next task starts with (none: len 0). A task reads only a dozen pages or so; without
// this each one began by waiting on memory for its first pages (score_bf16 prefetches from its second on).
struct NextTask {
  const c10::BFloat16* k_head = nullptr;
  const int64_t* table = nullptr;
  int64_t len = 0;
};

// One (sequence, KV head) in bf16: D % 32 == 0, P even, scale > 0. Scores from q exactly as given (the
// scale is applied to the fp32 scores); the fp32 softmax is rounded to bf16 for the value pass, as
// bf16 sdpa does.

void attend_bf16(const c10::BFloat16* q, int64_t q_stride_h, const c10::BFloat16* k_head,
                 const c10::BFloat16* v_head, const int64_t* table, int64_t len, int64_t P, int64_t G, int64_t D,
                 float scale, float softcap, int64_t masked, c10::BFloat16* out, std::vector<float>& buf,
                 std::vector<uint32_t>& ubuf, const NextTask& next) {
  const int64_t npairs = len / 2 + 1;
  buf.resize(size_t(G * D + G * len));
  ubuf.resize(size_t(G * D / 2 + G * npairs));
  float* acc = buf.data();
  float* scores = acc + G * D;
  uint16_t* qb = reinterpret_cast<uint16_t*>(ubuf.data());
  uint32_t* pairs = ubuf.data() + G * D / 2;
  for (int64_t g = 0; g < G; ++g)
    std::memcpy(qb + g * D, q + g * q_stride_h, size_t(D) * sizeof(uint16_t));
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int gb = int(std::min<int64_t>(4, G - g0));
    const uint16_t* qg = qb + g0 * D;
    float* sg = scores + g0 * len;
    switch (gb) {
      case 1: score_bf16<1>(qg, D, k_head, v_head, table, len, P, sg); break;
      case 2: score_bf16<2>(qg, D, k_head, v_head, table, len, P, sg); break;
      case 3: score_bf16<3>(qg, D, k_head, v_head, table, len, P, sg); break;
      case 4: score_bf16<4>(qg, D, k_head, v_head, table, len, P, sg); break;
    }
  }
  // K is read: while softmax and values run from cache, the next task's first keys come from memory
  // (6-7% faster at batch 64 with the cache in DRAM, docs/performance.md).
  for (int64_t a = 0; a < kAheadPages && a * P < next.len; ++a)
    prefetch_rows<_MM_HINT_T1>(next.k_head + next.table[a] * P * D, std::min(P, next.len - a * P) * D);
  for (int64_t g = 0; g < G; ++g) {
    const float rest = cap_and_mask(scores + g * len, len, scale, softcap, masked);
    softmax_bf16(scores + g * len, len, rest, reinterpret_cast<uint16_t*>(pairs + g * npairs));
  }
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int gb = int(std::min<int64_t>(4, G - g0));
    const uint32_t* pg = pairs + g0 * npairs;
    float* og = acc + g0 * D;
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      const bool full = D - c0 >= 64;
#define FW_DISPATCH(N)                                                                     \
  case N:                                                                                  \
    if (full) values_bf16<N, 4>(pg, npairs, D, c0, v_head, table, len, P, og);             \
    else values_bf16<N, 2>(pg, npairs, D, c0, v_head, table, len, P, og);                  \
    break;
      switch (gb) { FW_DISPATCH(1) FW_DISPATCH(2) FW_DISPATCH(3) FW_DISPATCH(4) }
#undef FW_DISPATCH
    }
  }
  for (int64_t i = 0; i < G * D; i += 16)  // D % 32 == 0; RNE as c10::BFloat16(float)
    fw_simd::store16(out + i, _mm512_loadu_ps(acc + i));
}
#endif
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
            int64_t G, int64_t D, float scale, float softcap, int64_t masked, T* out, std::vector<float>& buf) {
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
  for (int64_t g = 0; g < G; ++g) {
    cap_and_mask(scores + g * len, len, 1.f, softcap, masked);  // q was scaled already
    softmax(scores + g * len, len);
  }
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
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                 double softcap, at::Tensor& out) {
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
#ifdef FW_BF16_DOT
  constexpr bool is_bf16 = std::is_same<T, c10::BFloat16>::value;
  const bool dot = is_bf16 && D % 32 == 0 && P % 2 == 0 && scale > 0;
#endif
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
#ifdef FW_BF16_DOT
    std::vector<uint32_t> ubuf;
#endif
    // Task i's pages: a sliding window sees keys [len - window, len), so the pages wholly before it are skipped
    // (and the rest of the first page masked).
    auto pages_of = [&](int64_t i, const int64_t*& table, int64_t& len, int64_t& masked) {
      const int64_t b = i / Hkv;
      const int64_t start = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      table = tables + b * max_blocks + start / P;
      len = lens[b] - (start / P) * P;
      masked = start % P;
    };
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t offset = (b * H + h * G) * D;
      const int64_t* table;
      int64_t len, masked;
      pages_of(i, table, len, masked);
#ifdef FW_BF16_DOT
      if constexpr (is_bf16) {
        if (dot) {
          NextTask next;
          if (i + 1 < end) {
            int64_t unused;
            pages_of(i + 1, next.table, next.len, unused);
            const int64_t hn = (i + 1) % Hkv;
            next.k_head = reinterpret_cast<const c10::BFloat16*>(kp) + hn * pages * P * D;
          }
          attend_bf16(qp + b * q_stride_b + h * G * q_stride_h, q_stride_h, kp + h * pages * P * D,
                      vp + h * pages * P * D, table, len, P, G, D, float(scale), float(softcap), masked,
                      op + offset, buf, ubuf, next);
          continue;
        }
      }
#endif
      attend<T>(qp + b * q_stride_b + h * G * q_stride_h, q_stride_h, kp + h * pages * P * D, vp + h * pages * P * D,
                table, len, P, G, D, float(scale), float(softcap), masked, op + offset, buf);
    }
  });
}

void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
            at::Tensor out) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "the caches and out must be contiguous, q along D");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(3), "head mismatch");
  TORCH_CHECK(out.sizes() == q.sizes() && block_tables.size(0) == q.size(0), "batch mismatch");
  switch (q.scalar_type()) {
    case at::kFloat: decode_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, out); break;
    case at::kBFloat16: decode_impl<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, out); break;
    case at::kHalf: decode_impl<c10::Half>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, out); break;
    default: TORCH_CHECK(false, "cpu_paged: unsupported dtype ", q.scalar_type());
  }
}

// k_cache[h, slot[t]] = k[t, h] and the same for v: the step's new keys and values into their pages,
// straight from the strided q|k|v projection output (no transposed copies).
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1, "store_kv: k, v [T, Hkv, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && k_cache.size(0) == k.size(1) && k_cache.size(3) == k.size(2),
              "store_kv: caches [Hkv, pages, page_size, D] matching k");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.is_contiguous() && slots.scalar_type() == at::kLong,
              "store_kv: slots int64 [T]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(), "store_kv: dtypes");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t per_head = k_cache.size(1) * k_cache.size(2), bytes = D * k.element_size();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < per_head, "store_kv: slot ", sp[t], " outside the cache");
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  char* kc = static_cast<char*>(k_cache.mutable_data_ptr());
  char* vc = static_cast<char*>(v_cache.mutable_data_ptr());
  const int64_t es = k.element_size();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t dst = ((h * per_head) + sp[t]) * bytes;
        std::memcpy(kc + dst, kp + (t * k.stride(0) + h * k.stride(1)) * es, size_t(bytes));
        std::memcpy(vc + dst, vp + (t * v.stride(0) + h * v.stride(1)) * es, size_t(bytes));
      }
  });
}

}  // namespace

TORCH_LIBRARY(fw_cpu_paged, m) {
  m.def("decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window, float softcap, "
        "Tensor(a!) out) -> ()");
  m.impl("decode", c10::DispatchKey::CPU, TORCH_FN(decode));
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, TORCH_FN(store_kv));
}
