// The exact GEMV over Q4_0 / Q4_1 matrices in the 16-row layout (rows16_layout.cpp) against
// bf16 activations on AVX2: the arithmetic of the file layout's kernels (scale * (q . x) +
// min * sum(x) per block, every product exact, fp32 sums) in another summation order, as
// bf16_rows16.cpp does with AVX512-BF16.
//
// Why: the file layout's AVX2 kernel widens every 8 weights of a row from bytes, splits the
// nibbles, converts and multiplies, then ends every block of every row with scale arithmetic
// and every row with a horizontal sum; a core runs it at ~4.5 GB/s, less than half of what
// DRAM gives it. Here one 32-bit lane is one output row, so each weight position of a block is
// one mask and one int -> float conversion for 8 rows, and one FMA against its activation
// broadcast to all lanes; a block's scales are one vector for 8 rows.
//
// Lane r of a layout vector j holds row r's weights 8 j + i (bits 8 i .. 8 i + 4) and
// 8 j + 4 + i (bits 8 i + 4 .. 8 i + 8), i < 4. Masking weight w at bit s leaves q_w * 2^s
// (exact in an int32 and in its float, for s <= 24), so the activations are pre-scaled by
// 2^-s once per call (exact: a power of two) and the product is q_w * x_w again; the top
// nibble (s = 28, past an int32's sign) is shifted down instead. Activations below 2^-100 in
// magnitude would lose bits as fp32 subnormals when pre-scaled; they are far below any sum's
// last bit.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "common.h"
#include "rows16_kernels.h"

namespace tv {

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3;
constexpr int kGroup = kRows16Group;

constexpr int kShift[8] = {0, 4, 8, 12, 16, 20, 24, 28};  // weight position n's bit

// q * 2^shift of weight position n for the 8 rows of lane vector v, as floats.
template <int N>
inline __m256 weights(__m256i v) {
  if (N == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15 << kShift[N])));
}

// Groups [g0, g1) against input rows m0 .. m0 + M; out [.][N] bf16.
template <int Fmt, int M>
void groups_tile(const uint8_t* w, const float* xp, const float* xs, int64_t nb, int64_t m0,
                 int64_t g0, int64_t g1, const void* bias, int b_dt, uint16_t* out, int64_t N) {
  constexpr int64_t kBlock = kGroup * (Fmt == kQ4_1 ? 20 : 18);
  // Independent FMA chains per input row and half: enough in flight for the FMA latency.
  constexpr int C = M == 1 ? 4 : M == 2 ? 2 : 1;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* base = w + g * nb * kBlock;
    __m256 acc[M][2], lin[M][2];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) acc[m][h] = lin[m][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = base + b * kBlock;
      rows16_prefetch(p, kBlock);
      __m256 t[M][2][C];
      for (int m = 0; m < M; ++m)
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < C; ++c) t[m][h][c] = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        __m256i v[2];
        for (int h = 0; h < 2; ++h)
          v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h));
        const auto step = [&](auto n_const) {
          constexpr int n = decltype(n_const)::value;
          for (int h = 0; h < 2; ++h) {
            const __m256 q = weights<n>(v[h]);
            for (int m = 0; m < M; ++m) {
              const float* xv = xp + ((m0 + m) * nb + b) * 32 + 8 * j + n;
              t[m][h][n % C] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(xv), t[m][h][n % C]);
            }
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
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 256 + 16 * h)));
        // Q4_0's min is -8 d: d * (-8 sum) is the same product (a power of two).
        const __m256 mn = Fmt == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                             reinterpret_cast<const __m128i*>(p + 288 + 16 * h)))
                                       : d;
        for (int m = 0; m < M; ++m) {
          __m256 s = t[m][h][0];
          for (int c = 1; c < C; ++c) s = _mm256_add_ps(s, t[m][h][c]);
          const float sum = xs[(m0 + m) * nb + b];
          acc[m][h] = _mm256_fmadd_ps(s, d, acc[m][h]);
          lin[m][h] =
              _mm256_fmadd_ps(mn, _mm256_set1_ps(Fmt == kQ4_1 ? sum : -8.0f * sum), lin[m][h]);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      alignas(32) float res[kGroup];
      for (int h = 0; h < 2; ++h) _mm256_store_ps(res + 8 * h, _mm256_add_ps(acc[m][h], lin[m][h]));
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
    case 1: return groups_tile<Fmt, 1>;
    case 2: return groups_tile<Fmt, 2>;
    case 3: return groups_tile<Fmt, 3>;
    default: return groups_tile<Fmt, 4>;
  }
}

}  // namespace

// Activation rows as the exact kernels read them: xp [M][nb][32] fp32, block b's weight
// position n of vector j at 8 j + n, pre-scaled by 2^-shift (the top nibble by 1); xs [M][nb]
// the blocks' fp32 sums (in column order, as the file layout's kernels sum them).
void rows16_exact_rows(const uint16_t* x, int M, int64_t K, float* xp, float* xs) {
  // Weight position n (0..7) of a layout vector: its column in the vector's 8, and the
  // activation's factor 2^-shift (the top nibble is shifted down to bit 0 instead).
  constexpr int kCol[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  constexpr float kScale[8] = {1.0f,     0x1p-4f,  0x1p-8f,  0x1p-12f,
                               0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
  const int64_t nb = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const uint16_t* src = x + m * K + 32 * b;
      float* dst = xp + (m * nb + b) * 32;
      for (int j = 0; j < 4; ++j)
        for (int n = 0; n < 8; ++n) dst[8 * j + n] = bf16_to_f32(src[8 * j + kCol[n]]) * kScale[n];
      float sum = 0.0f;
      for (int i = 0; i < 32; ++i) sum += bf16_to_f32(src[i]);
      xs[m * nb + b] = sum;
    }
}

void linear_rows16_bf16_avx2(const uint16_t* x, const uint8_t* w, int fmt, const void* bias,
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
