// tv_linear's GEMV on AVX-512 Foundation (F/BW/VL/DQ), for CPUs that have it without BF16
// dot products (Skylake-SP to Ice Lake, Zen 4 runs the vdpbf16ps kernels instead): bf16 or
// fp32 weight rows against fp32 activations, 16 columns per FMA.
//
// Why: the AVX2 kernel (cpu_kernels.cpp) does 8 columns per FMA and one activation load per
// FMA. Past a few rows a decode step is FMA- and load-bound, not bandwidth-bound: on a 2-vCPU
// Ice Lake a 64-row step of a SmolLM2-135M-shaped bf16 model took ~178 ms on it against ~13.6
// GFLOP of work. Twice the columns per instruction and more output rows per activation load
// (32 vector registers) halve that instruction count.
//
// Same structure as the AVX2 kernel: each (output row, input row) pair sums over k in order
// in its own accumulator, so a row's bits do not depend on the batch or the threads; the
// 16-lane partial sums reduce in another order than the AVX2 kernel's 8, so bits may differ
// from it (values within fp32 rounding).

#include <immintrin.h>
#include <stdint.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

namespace tv {
namespace {

inline __m512 load16w(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512 load16w(const float* p) { return _mm512_loadu_ps(p); }

inline float wval16(const uint16_t* w, int64_t i) { return bf16_to_f32(w[i]); }
inline float wval16(const float* w, int64_t i) { return w[i]; }

// Tiles of prefetch distance (as the AVX2 kernel: short rows need software prefetch).
constexpr int kPrefetchTiles = 2;

// RB output rows x M input rows per inner step; row n's sums land in acc_out[(n - n0) * M + m].
template <typename W, int M, int RB>
void gemv_rows16(const W* w, const float* x, int64_t K, int64_t n0, int64_t n1, int64_t N,
                 float* acc_out) {
  constexpr int64_t kStep = RB * 16 * static_cast<int64_t>(sizeof(W));  // weight bytes a step
  const char* pf_end = reinterpret_cast<const char*>(w + N * K);
  for (int64_t n = n0; n < n1; n += RB) {
    const int rb = static_cast<int>(n1 - n < RB ? n1 - n : RB);
    __m512 acc[RB][M];
    for (int r = 0; r < RB; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    int64_t k = 0;
    if (rb == RB) {
      const char* pf = reinterpret_cast<const char*>(w + (n + kPrefetchTiles * RB) * K);
      for (; k + 16 <= K; k += 16) {
        const int64_t off = k * RB * static_cast<int64_t>(sizeof(W));
        for (int64_t b = 0; b < kStep; b += 64)
          if (pf + off + b < pf_end) _mm_prefetch(pf + off + b, _MM_HINT_T0);
        __m512 wv[RB];
        for (int r = 0; r < RB; ++r) wv[r] = load16w(w + (n + r) * K + k);
        for (int m = 0; m < M; ++m) {
          const __m512 xv = _mm512_loadu_ps(x + m * K + k);
          for (int r = 0; r < RB; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
        }
      }
    } else {
      for (; k + 16 <= K; k += 16)
        for (int r = 0; r < rb; ++r) {
          const __m512 wv = load16w(w + (n + r) * K + k);
          for (int m = 0; m < M; ++m)
            acc[r][m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[r][m]);
        }
    }
    for (int r = 0; r < rb; ++r)
      for (int m = 0; m < M; ++m) {
        float s = _mm512_reduce_add_ps(acc[r][m]);
        for (int64_t kk = k; kk < K; ++kk) s += wval16(w, (n + r) * K + kk) * x[m * K + kk];
        acc_out[(n - n0 + r) * M + m] = s;
      }
  }
}

template <typename W>
void gemv_avx512f_t(const W* w, const float* x, int M, int64_t K, int64_t n0, int64_t n1,
                    int64_t N, float* acc) {
  // RB x M accumulators + RB weight vectors + one activation vector within 32 registers.
  switch (M) {
    case 1: return gemv_rows16<W, 1, 4>(w, x, K, n0, n1, N, acc);
    case 2: return gemv_rows16<W, 2, 4>(w, x, K, n0, n1, N, acc);
    case 3: return gemv_rows16<W, 3, 4>(w, x, K, n0, n1, N, acc);
    case 4: return gemv_rows16<W, 4, 4>(w, x, K, n0, n1, N, acc);
    case 5: return gemv_rows16<W, 5, 4>(w, x, K, n0, n1, N, acc);
    case 6: return gemv_rows16<W, 6, 4>(w, x, K, n0, n1, N, acc);
    case 7: return gemv_rows16<W, 7, 2>(w, x, K, n0, n1, N, acc);
    default: return gemv_rows16<W, 8, 2>(w, x, K, n0, n1, N, acc);
  }
}

}  // namespace

void gemv_avx512f(const uint16_t* w, const float* x, int M, int64_t K, int64_t n0, int64_t n1,
                  int64_t N, float* acc) {
  gemv_avx512f_t(w, x, M, K, n0, n1, N, acc);
}

void gemv_avx512f(const float* w, const float* x, int M, int64_t K, int64_t n0, int64_t n1,
                  int64_t N, float* acc) {
  gemv_avx512f_t(w, x, M, K, n0, n1, N, acc);
}

}  // namespace tv

#pragma GCC pop_options
