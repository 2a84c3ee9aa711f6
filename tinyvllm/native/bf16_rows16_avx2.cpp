// The exact GEMV over Q4_0 / Q4_1 matrices in the 16-row layout (rows16_layout.cpp) against
// bf16 activations on AVX2: the arithmetic of the file layout's kernels (scale * (q . x) +
// min * sum(x) per block, every product exact, fp32 sums) in another summation order, as
// bf16_rows16.cpp does with AVX512-BF16. The kernel itself is bf16_rows16_exact.h, here with
// a group's 16 rows in two 8-lane halves.
//
// Why: the file layout's AVX2 kernel widens every 8 weights of a row from bytes, splits the
// nibbles, converts and multiplies, then ends every block of every row with scale arithmetic
// and every row with a horizontal sum; a core runs it at ~4.5 GB/s, less than half of what
// DRAM gives it. Here one 32-bit lane is one output row, so each weight position of a block is
// one mask and one int -> float conversion for 8 rows, and one FMA against its activation
// broadcast to all lanes; a block's scales are one vector for 8 rows.

#include <immintrin.h>
#include <stdint.h>

#include "bf16_rows16_exact.h"
#include "common.h"
#include "rows16_kernels.h"

namespace tv {

namespace {

struct Avx2Lanes {
  using F = __m256;
  using I = __m256i;
  static constexpr int kHalves = 2;
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static I load_bits(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  template <int N>
  static F weights(I v) {
    if (N == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * N))));
  }
  static F scales(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
};

}  // namespace

// Activation rows as the exact kernels read them: xp [M][nb][32] fp32, block b's weight
// position n of vector j at 8 j + n, pre-scaled by 2^-(4 n) (the top nibble by 1); xs [M][nb]
// the blocks' fp32 sums (in column order, as the file layout's kernels sum them). Activations
// below 2^-100 in magnitude would lose bits as fp32 subnormals when pre-scaled; they are far
// below any sum's last bit.
void rows16_exact_rows(const uint16_t* x, int M, int64_t K, float* xp, float* xs) {
  // Weight position n (0..7) of a layout vector: its column in the vector's 8, and the
  // activation's factor 2^-(4 n) (the top nibble is shifted down to bit 0 instead).
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
  rows16_exact::linear<Avx2Lanes>(x, w, fmt, bias, b_dt, out, M, N, K, nthreads);
}

}  // namespace tv
