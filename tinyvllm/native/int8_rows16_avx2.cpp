// Int8-activation GEMVs over GGUF Q4_0 / Q4_1 / Q8_0 matrices in the 16-row layout
// (rows16_layout.cpp) for AVX2 CPUs without AVX512-VNNI (opt-in `int8_activations`; not
// exact): the arithmetic of int8_rows16.cpp, the same integer dot products per block and the
// same fp32 steps, on 8 rows per vector (a 64-byte layout vector is two halves of 8 rows).
//
// Why: AVX2 has no vpdpbusd, but vpmaddubsw multiplies 32 unsigned weight bytes with 32
// signed activation bytes and adds neighbours into int16. A Q4 block's 8 products per row
// lane stay below 2^15 (|q x| <= 15 * 127, 16 per lane), so they add up in int16 and widen
// once per block (vpmaddwd): ~30 instructions per 8 rows x 32 weights, where the exact fp32
// kernel converts every weight to a float (~4 instructions per 8 weights). Q8_0's products
// reach 255 * 127, too much for int16 with the stored unsigned bytes: its weights go back to
// signed, multiply as |q| x sign(q) (vpsignb), and widen per vector.
//
// Per block, with s the exact integer dot: Q4_1: d dx s + m dx S; Q4_0: d dx (s - 8 S) (the
// offset starts the sum); Q8_0: d dx s over the signed q.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "rows16_kernels.h"

namespace tv {

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 4;
constexpr int kGroup = kRows16Group;

constexpr int64_t group_block_bytes(int fmt) {
  return kGroup * (fmt == kQ4_1 ? 20 : fmt == kQ4_0 ? 18 : 34);
}

inline __m256 act8(const void* x, int x_dt, int64_t i) {
  return x_dt == 0 ? load8(static_cast<const float*>(x) + i)
                   : load8(static_cast<const uint16_t*>(x) + i);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// int8_act.h's rounding on AVX2: 32 values at x + off -> int8 q (in order), dx, sum of q.
void act_block(const void* x, int x_dt, int64_t off, int8_t* q, float* dx, int32_t* sum) {
  __m256 v[4];
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = act8(x, x_dt, off + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  }
  const float d = hmax(amax) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  __m256i qi[4];
  for (int i = 0; i < 4; ++i)  // round to nearest even (MXCSR default), as torch.round
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
  // The packs work per 128-bit lane: dwords come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] |
  // q0[4:8] q1[4:8] q2[4:8] q3[4:8]; the permute restores the order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                           _mm256_packs_epi32(qi[2], qi[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  *dx = d;
  *sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                     _mm256_add_epi32(qi[2], qi[3])));
}

// Q4_0's integer sums start at -8 S; Q8_0's weights are signed here (no offset).
void quantize_rows(const void* x, int x_dt, int fmt, int M, Int8Rows& a) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < a.nb; ++b) {
      const int64_t i = m * a.nb + b;
      int32_t sum;
      act_block(x, x_dt, m * a.K + 32 * b, a.q + m * a.K + 32 * b, a.dx + i, &sum);
      a.s0[i] = fmt == kQ4_0 ? -8 * sum : 0;
      a.sx[i] = a.dx[i] * static_cast<float>(sum);
    }
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// A Q4 half (8 rows) of a block, its nibbles split: w[2 j] weights 8 j + [0, 4) of each row
// lane, w[2 j + 1] weights 8 j + [4, 8).
inline void q4_half(const uint8_t* p, __m256i (&w)[8]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j));
    w[2 * j] = _mm256_and_si256(v, m4);
    w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  }
}

// Exact integer dots of 8 rows with one input row's 32 int8 activations xq.
inline __m256i q4_dot(const __m256i (&w)[8], const int8_t* xq) {
  __m256i s = _mm256_maddubs_epi16(w[0], bcast4(xq));
  __m256i t = _mm256_maddubs_epi16(w[1], bcast4(xq + 4));
  for (int j = 2; j < 8; j += 2) {  // 8 products of <= 2 * 15 * 127 each: no int16 overflow
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], bcast4(xq + 4 * j)));
    t = _mm256_add_epi16(t, _mm256_maddubs_epi16(w[j + 1], bcast4(xq + 4 * j + 4)));
  }
  return _mm256_madd_epi16(_mm256_add_epi16(s, t), _mm256_set1_epi16(1));
}

inline __m256i q8_dot(const uint8_t* p, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i s = _mm256_setzero_si256(), t = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    const __m256i w = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j)), flip);  // signed q
    const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(w),
                                              _mm256_sign_epi8(bcast4(xq + 4 * j), w));
    if (j % 2) t = _mm256_add_epi32(t, _mm256_madd_epi16(prod, ones));
    else s = _mm256_add_epi32(s, _mm256_madd_epi16(prod, ones));
  }
  return _mm256_add_epi32(s, t);
}

// The sums of block b of one group (16 rows, at p) for input rows m0 .. m0 + M into acc
// (acc[m][h]: rows 8 h .. 8 h + 8).
template <int Fmt, int M>
__attribute__((always_inline)) inline void group_block(const uint8_t* p, int64_t b,
                                                       const Int8Rows& a, int64_t m0,
                                                       __m256 (&acc)[M][2]) {
  constexpr int64_t kScales = Fmt == kQ8_0 ? 512 : 256;
  rows16_prefetch(p, group_block_bytes(Fmt));
  for (int h = 0; h < 2; ++h) {
    const __m256 d = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kScales + 16 * h)));
    __m256 mn = _mm256_setzero_ps();
    if (Fmt == kQ4_1)
      mn = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kScales + 32 + 16 * h)));
    __m256i w[8];
    if (Fmt != kQ8_0) q4_half(p + 32 * h, w);
    for (int m = 0; m < M; ++m) {
      const int64_t i = (m0 + m) * a.nb + b;
      const int8_t* xq = a.q + (m0 + m) * a.K + 32 * b;
      __m256i s = Fmt == kQ8_0 ? q8_dot(p + 32 * h, xq) : q4_dot(w, xq);
      if (Fmt == kQ4_0) s = _mm256_add_epi32(s, _mm256_set1_epi32(a.s0[i]));
      const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(a.dx[i]));
      acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dd, acc[m][h]);
      if (Fmt == kQ4_1) acc[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.sx[i]), acc[m][h]);
    }
  }
}

// 8 sums (+ bias) at out[i .. i + 8) in dtype dt, rounded as common.h's `store`.
inline void store8(void* out, int64_t i, __m256 v, const void* bias, int b_dt, int64_t n,
                   int dt) {
  if (bias) v = _mm256_add_ps(v, act8(bias, b_dt, n));
  if (dt == 0) return _mm256_storeu_ps(static_cast<float*>(out) + i, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int r = 0; r < 8; ++r) store(out, i + r, tmp[r], dt);
}

// Groups [g0, g1) against input rows m0 .. m0 + M; out [.][N] in dtype dt.
template <int Fmt, int M>
void groups_tile(const uint8_t* w, const Int8Rows& a, int64_t m0, int64_t g0, int64_t g1,
                 const void* bias, int b_dt, void* out, int64_t N, int dt) {
  constexpr int64_t kBlock = group_block_bytes(Fmt);
  // One input row: even and odd blocks in separate accumulators (the FMA chain would bound
  // it); more rows have independent chains already.
  constexpr int kChains = M == 1 ? 2 : 1;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* base = w + g * a.nb * kBlock;
    __m256 acc[kChains][M][2];
    for (int c = 0; c < kChains; ++c)
      for (int m = 0; m < M; ++m) acc[c][m][0] = acc[c][m][1] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + kChains <= a.nb; b += kChains)
      for (int c = 0; c < kChains; ++c)
        group_block<Fmt, M>(base + (b + c) * kBlock, b + c, a, m0, acc[c]);
    if (b < a.nb) group_block<Fmt, M>(base + b * kBlock, b, a, m0, acc[0]);
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) {
        const __m256 v = kChains == 2 ? _mm256_add_ps(acc[0][m][h], acc[kChains - 1][m][h])
                                      : acc[0][m][h];
        const int64_t n = kGroup * g + 8 * h;
        store8(out, (m0 + m) * N + n, v, bias, b_dt, n, dt);
      }
  }
}

using TileFn = void (*)(const uint8_t*, const Int8Rows&, int64_t, int64_t, int64_t, const void*,
                        int, void*, int64_t, int);

template <int Fmt>
TileFn tile_for(int M) {
  switch (M) {
    case 1: return groups_tile<Fmt, 1>;
    case 2: return groups_tile<Fmt, 2>;
    case 3: return groups_tile<Fmt, 3>;
    default: return groups_tile<Fmt, 4>;
  }
}

TileFn tile_fn(int fmt, int M) {
  return fmt == kQ4_1 ? tile_for<kQ4_1>(M) : fmt == kQ4_0 ? tile_for<kQ4_0>(M)
                                                          : tile_for<kQ8_0>(M);
}

}  // namespace

void linear_rows16_int8_avx2(const void* x, int x_dt, const uint8_t* w, int fmt,
                             const void* bias, int b_dt, void* out, int M, int64_t N, int64_t K,
                             int nthreads) {
  Int8Rows a(M, K);
  quantize_rows(x, x_dt, fmt, M, a);
  rows16_parallel(N, M, nthreads, [&](int64_t g0, int64_t g1, int64_t m0, int tile) {
    tile_fn(fmt, tile)(w, a, m0, g0, g1, bias, b_dt, out, N, x_dt);
  });
}

}  // namespace tv
