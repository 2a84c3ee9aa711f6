// Int8-activation GEMVs over GGUF Q4_0 / Q4_1 / Q8_0 matrices in the 16-row layout
// (rows16_layout.cpp) for CPUs with AVX512-VNNI (opt-in `int8_activations`; not exact: the
// arithmetic of int8_kernels.cpp, the same integer dot products per block, fp32 scaling in
// another order). One int32 lane is one output row: a vpdpbusd multiplies 4 weights of each
// of the 16 rows with the same 4 activations (broadcast), a block's 8 of them add up in the
// integer domain, and the block's scales are one vector for all 16 rows: ~30 instructions per
// 512 weights, no horizontal sums. int8_rows16_avx2.cpp is the same on AVX2.
// Per block, with s = sum_i q_i qx_i over the stored unsigned values q and S = sum_i qx_i:
//   Q4_1: d dx s + m dx S;   Q4_0: d dx (s - 8 S);   Q8_0: d dx (s - 128 S)
// (the offsets start the integer sum; int8_act.h rounds the activations).

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

// After the target pragma: its inline AVX-512 functions compile for that target.
#include "avx512_math.h"
#include "int8_act.h"
#include "rows16_kernels.h"

namespace tv {

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 4;
constexpr int kGroup = kRows16Group;  // one row per int32 lane of a zmm

int64_t gguf_block_bytes(int fmt) { return fmt == kQ4_1 ? 20 : fmt == kQ4_0 ? 18 : 34; }

void quantize_rows(const void* x, int x_dt, int fmt, int M, Int8Rows& a) {
  const int32_t offset = fmt == kQ4_0 ? -8 : fmt == kQ8_0 ? -128 : 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < a.nb; ++b) {
      const int64_t i = m * a.nb + b;
      int32_t sum;
      int8_act_block(x, x_dt, m * a.K + 32 * b, a.q + m * a.K + 32 * b, a.dx + i, &sum);
      a.s0[i] = offset * sum;
      a.sx[i] = a.dx[i] * static_cast<float>(sum);
    }
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The sums of block b of one group (16 rows, at p) for input rows m0 .. m0 + M into acc.
template <int Fmt, int M>
__attribute__((always_inline)) inline void group_block(const uint8_t* p, int64_t b,
                                                       const Int8Rows& a, int64_t m0,
                                                       __m512 (&acc)[M]) {
  constexpr int kVecs = Fmt == kQ8_0 ? 8 : 4;
  constexpr int64_t kScales = 64 * kVecs;
  rows16_prefetch(p, kGroup * gguf_block_bytes(Fmt));
  __m512i w[8];
  if (Fmt == kQ8_0) {
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(p + 64 * j);
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(p + 64 * j);
      w[2 * j] = _mm512_and_si512(v, m4);
      w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
  }
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      p + kScales)));
  __m512 mn = _mm512_setzero_ps();
  if (Fmt == kQ4_1)
    mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kScales + 32)));
  for (int m = 0; m < M; ++m) {
    const int64_t i = (m0 + m) * a.nb + b;
    const int8_t* xq = a.q + (m0 + m) * a.K + 32 * b;
    // Two chains halve the latency of the 8 dependent vpdpbusd.
    __m512i s0 = Fmt == kQ4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(a.s0[i]);
    __m512i s1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      // Q4: w[2 j'] holds weights 8 j' + [0, 4), w[2 j' + 1] 8 j' + [4, 8); Q8_0: 4 j + [0, 4).
      s0 = _mm512_dpbusd_epi32(s0, w[j], bcast4(xq + 4 * j));
      s1 = _mm512_dpbusd_epi32(s1, w[j + 1], bcast4(xq + 4 * j + 4));
    }
    const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[i]));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), dd, acc[m]);
    if (Fmt == kQ4_1) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.sx[i]), acc[m]);
  }
}

// Stores 16 sums (+ bias) at out[i .. i + 16) in dtype dt, rounding as common.h's `store`.
inline void store16(void* out, int64_t i, __m512 v, const void* bias, int b_dt, int64_t n,
                    int dt) {
  if (bias) v = _mm512_add_ps(v, int8_act_load16(bias, b_dt, n));
  if (dt == 0) return _mm512_storeu_ps(static_cast<float*>(out) + i, v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                      _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// Groups [g0, g1) against input rows m0 .. m0 + M; out [.][N] in x_dt.
template <int Fmt, int M>
void groups_tile(const uint8_t* w, const Int8Rows& a, int64_t m0, int64_t g0, int64_t g1,
                 const void* bias, int b_dt, void* out, int64_t N, int dt) {
  constexpr int64_t kBlock = kGroup * (Fmt == kQ4_1 ? 20 : Fmt == kQ4_0 ? 18 : 34);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* base = w + g * a.nb * kBlock;
    __m512 even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= a.nb; b += 2) {  // two accumulators: the fmadd chain is not the bound
      group_block<Fmt, M>(base + b * kBlock, b, a, m0, even);
      group_block<Fmt, M>(base + (b + 1) * kBlock, b + 1, a, m0, odd);
    }
    if (b < a.nb) group_block<Fmt, M>(base + b * kBlock, b, a, m0, even);
    for (int m = 0; m < M; ++m)
      store16(out, (m0 + m) * N + kGroup * g, _mm512_add_ps(even[m], odd[m]), bias, b_dt,
              kGroup * g, dt);
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

void linear_rows16_int8_avx512(const void* x, int x_dt, const uint8_t* w, int fmt,
                               const void* bias, int b_dt, void* out, int M, int64_t N, int64_t K,
                               int nthreads) {
  Int8Rows a(M, K);
  quantize_rows(x, x_dt, fmt, M, a);
  rows16_parallel(N, M, nthreads, [&](int64_t g0, int64_t g1, int64_t m0, int tile) {
    tile_fn(fmt, tile)(w, a, m0, g0, g1, bias, b_dt, out, N, x_dt);
  });
}

}  // namespace tv

#pragma GCC pop_options

