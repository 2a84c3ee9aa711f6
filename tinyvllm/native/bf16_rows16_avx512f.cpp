// The exact GEMV over Q4_0 / Q4_1 matrices in the 16-row layout against bf16 activations on
// AVX-512 Foundation, for CPUs without AVX512-BF16 (Skylake-SP to Ice Lake): the AVX2 kernel
// (bf16_rows16_avx2.cpp) with a group's 16 rows in one register instead of two halves.
//
// Why: a layout vector is 64 bytes, one 32-bit lane per output row, so AVX-512 takes each
// weight position of a block for all 16 rows in one mask, one int -> float conversion and one
// FMA against the broadcast activation: half the instructions of the AVX2 kernel. Every lane
// runs the AVX2 kernel's operations in the same order, so the outputs are the same bits.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include <type_traits>

#include "common.h"
#include "rows16_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

namespace tv {

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3;
constexpr int kGroup = kRows16Group;
constexpr int kShift[8] = {0, 4, 8, 12, 16, 20, 24, 28};  // weight position n's bit

// q * 2^shift of weight position n for the 16 rows of layout vector v, as floats.
template <int N>
inline __m512 weights16(__m512i v) {
  if (N == 7) return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 28));
  return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15 << kShift[N])));
}

// Groups [g0, g1) against input rows m0 .. m0 + M; out [.][N] bf16.
template <int Fmt, int M>
void groups_tile16(const uint8_t* w, const float* xp, const float* xs, int64_t nb, int64_t m0,
                   int64_t g0, int64_t g1, const void* bias, int b_dt, uint16_t* out,
                   int64_t N) {
  constexpr int64_t kBlock = kGroup * (Fmt == kQ4_1 ? 20 : 18);
  constexpr int C = M == 1 ? 4 : M == 2 ? 2 : 1;  // as the AVX2 kernel: same sums, same order
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* base = w + g * nb * kBlock;
    __m512 acc[M], lin[M];
    for (int m = 0; m < M; ++m) acc[m] = lin[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = base + b * kBlock;
      rows16_prefetch(p, kBlock);
      __m512 t[M][C];
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) t[m][c] = _mm512_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);
        const auto step = [&](auto n_const) {
          constexpr int n = decltype(n_const)::value;
          const __m512 q = weights16<n>(v);
          for (int m = 0; m < M; ++m) {
            const float* xv = xp + ((m0 + m) * nb + b) * 32 + 8 * j + n;
            t[m][n % C] = _mm512_fmadd_ps(q, _mm512_set1_ps(*xv), t[m][n % C]);
          }
        };
        step(std::integral_constant<int, 0>{});
        step(std::integral_constant<int, 1>{});
        step(std::integral_constant<int, 2>{});
        step(std::integral_constant<int, 3>{});
        step(std::integral_constant<int, 4>{});
        step(std::integral_constant<int, 5>{});
        step(std::integral_constant<int, 6>{});
        step(std::integral_constant<int, 7>{});
      }
      const __m512 d =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
      // Q4_0's min is -8 d: d * (-8 sum) is the same product (a power of two).
      const __m512 mn =
          Fmt == kQ4_1
              ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)))
              : d;
      for (int m = 0; m < M; ++m) {
        __m512 s = t[m][0];
        for (int c = 1; c < C; ++c) s = _mm512_add_ps(s, t[m][c]);
        const float sum = xs[(m0 + m) * nb + b];
        acc[m] = _mm512_fmadd_ps(s, d, acc[m]);
        lin[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(Fmt == kQ4_1 ? sum : -8.0f * sum), lin[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      alignas(64) float res[kGroup];
      _mm512_store_ps(res, _mm512_add_ps(acc[m], lin[m]));
      for (int r = 0; r < kGroup; ++r) {
        const int64_t n = kGroup * g + r;
        const float bv = bias ? load(bias, n, b_dt) : 0.0f;
        out[(m0 + m) * N + n] = f32_to_bf16(res[r] + bv);
      }
    }
  }
}

using TileFn = void (*)(const uint8_t*, const float*, const float*, int64_t, int64_t, int64_t,
                        int64_t, const void*, int, uint16_t*, int64_t);

template <int Fmt>
TileFn tile_for(int M) {
  switch (M) {
    case 1: return groups_tile16<Fmt, 1>;
    case 2: return groups_tile16<Fmt, 2>;
    case 3: return groups_tile16<Fmt, 3>;
    default: return groups_tile16<Fmt, 4>;
  }
}

}  // namespace

void linear_rows16_bf16_avx512f(const uint16_t* x, const uint8_t* w, int fmt, const void* bias,
                                int b_dt, uint16_t* out, int M, int64_t N, int64_t K,
                                int nthreads) {
  const int64_t nb = K / 32;
  float* buf = static_cast<float*>(checked_aligned_alloc((M * K + M * nb) * 4));
  float* xs = buf + M * K;
  rows16_exact_rows(x, M, K, buf, xs);
  rows16_parallel(N, M, nthreads, [&](int64_t g0, int64_t g1, int64_t m0, int tile) {
    (fmt == kQ4_1 ? tile_for<kQ4_1>(tile) : tile_for<kQ4_0>(tile))(
        w, buf, xs, nb, m0, g0, g1, bias, b_dt, out, N);
  });
  free(buf);
}

}  // namespace tv

#pragma GCC pop_options
