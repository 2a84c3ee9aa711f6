// The exact GEMV over Q4_0 / Q4_1 matrices in the 16-row layout (int8_rows16.cpp describes
// it) against bf16 activations: the arithmetic of the file layout's kernels (scale * (q . x)
// + min * sum(x) per block, every product exact, fp32 sums) in another summation order.
//
// Why: one int32 lane per output row serves vdpbf16ps as well as vpdpbusd. A 32-bit lane of a
// weight vector holds row r's 4 bytes of 8 weights; vpermw maps the 5 low bits of each 16-bit
// word to the bf16 of a nibble (the table repeats, so the fifth bit does not matter), so the
// vector shifted by 0, 4, 8 and 12 bits gives four vectors of (2 weights x 16 rows) in bf16,
// each against a pair of activations broadcast to all lanes: 16 vdpbf16ps per block of 16
// rows, no per-row scale arithmetic and no horizontal sums (the file layout's kernel spends
// about twice the instructions per weight).
//
// The pairs: lane r of vector j (block columns 8 j .. 8 j + 8) shifted by s holds weights
//   s = 0: (8j, 8j+2)   s = 4: (8j+4, 8j+6)   s = 8: (8j+1, 8j+3)   s = 12: (8j+5, 8j+7),
// so each block's 32 activations are reordered into those pairs once per GEMV input.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "rows16_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace tv {

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3;
constexpr int kGroup = kRows16Group;

// Column of pair p (0..15) of a block, first and second element: p = 4 j + t, t the shift.
inline int pair_col(int p, int second) {
  static const int base[4] = {0, 4, 1, 5};
  return 8 * (p / 4) + base[p % 4] + 2 * second;
}

// Activation rows as the kernel reads them: x16 [M][nb][32] bf16 in pair order, xs [M][nb] the
// blocks' fp32 sums (in column order, as the file layout's kernels sum them).
void reorder_rows(const uint16_t* x, int M, int64_t K, uint16_t* x16, float* xs) {
  const int64_t nb = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const uint16_t* src = x + m * K + 32 * b;
      uint16_t* dst = x16 + (m * nb + b) * 32;
      for (int p = 0; p < 16; ++p) {
        dst[2 * p] = src[pair_col(p, 0)];
        dst[2 * p + 1] = src[pair_col(p, 1)];
      }
      float sum = 0.0f;
      for (int i = 0; i < 32; ++i) sum += bf16_to_f32(src[i]);
      xs[m * nb + b] = sum;
    }
}

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// Groups [g0, g1) against input rows m0 .. m0 + M; out [.][N] bf16.
template <int Fmt, int M>
void groups_tile(const uint8_t* w, const uint16_t* x16, const float* xs, int64_t nb, int64_t m0,
                 int64_t g0, int64_t g1, const void* bias, int b_dt, uint16_t* out, int64_t N) {
  constexpr int64_t kBlock = kGroup * (Fmt == kQ4_1 ? 20 : 18);
  // Entry i: bf16 of i & 15.
  const __m512i table = _mm512_set_epi16(
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
      0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
      0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* base = w + g * nb * kBlock;
    __m512 acc[M], lin[M];
    for (int m = 0; m < M; ++m) acc[m] = lin[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = base + b * kBlock;
      rows16_prefetch(p, kBlock);
      __m512 t0[M], t1[M];  // two chains of the block's products per input row
      for (int m = 0; m < M; ++m) t0[m] = t1[m] = _mm512_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);
        const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(v, table);
        const __m512bh w4 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
        const __m512bh w8 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table);
        const __m512bh w12 =
            (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table);
        for (int m = 0; m < M; ++m) {
          const uint16_t* xp = x16 + ((m0 + m) * nb + b) * 32 + 8 * j;
          t0[m] = _mm512_dpbf16_ps(t0[m], w0, bcast_pair(xp));
          t1[m] = _mm512_dpbf16_ps(t1[m], w4, bcast_pair(xp + 2));
          t0[m] = _mm512_dpbf16_ps(t0[m], w8, bcast_pair(xp + 4));
          t1[m] = _mm512_dpbf16_ps(t1[m], w12, bcast_pair(xp + 6));
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          p + 256)));
      // Q4_0's min is -8 d: d * (-8 sum) is the same product (a power of two).
      const __m512 mn = Fmt == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(p + 288)))
                                     : d;
      for (int m = 0; m < M; ++m) {
        const float sum = xs[(m0 + m) * nb + b];
        acc[m] = _mm512_fmadd_ps(_mm512_add_ps(t0[m], t1[m]), d, acc[m]);
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

using TileFn = void (*)(const uint8_t*, const uint16_t*, const float*, int64_t, int64_t, int64_t,
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

void linear_rows16_bf16_avx512(const uint16_t* x, const uint8_t* w, int fmt, const void* bias,
                               int b_dt, uint16_t* out, int M, int64_t N, int64_t K,
                               int nthreads) {
  const int64_t nb = K / 32;
  char* buf = static_cast<char*>(checked_aligned_alloc(M * K * 2 + M * nb * 4));
  uint16_t* x16 = reinterpret_cast<uint16_t*>(buf);
  float* xs = reinterpret_cast<float*>(buf + M * K * 2);
  reorder_rows(x, M, K, x16, xs);
  rows16_parallel(N, M, nthreads, [&](int64_t g0, int64_t g1, int64_t m0, int tile) {
    (fmt == kQ4_1 ? tile_for<kQ4_1>(tile) : tile_for<kQ4_0>(tile))(
        w, x16, xs, nb, m0, g0, g1, bias, b_dt, out, N);
  });
  free(buf);
}

}  // namespace tv

#pragma GCC pop_options
