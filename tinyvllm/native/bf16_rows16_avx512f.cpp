// The exact GEMV over Q4_0 / Q4_1 matrices in the 16-row layout against bf16 activations on
// AVX-512 Foundation, for CPUs without AVX512-BF16 (Skylake-SP to Ice Lake): the kernel of
// bf16_rows16_exact.h with a group's 16 rows in one register instead of two AVX2 halves.
//
// Why: a layout vector is 64 bytes, one 32-bit lane per output row, so AVX-512 takes each
// weight position of a block for all 16 rows in one mask, one int -> float conversion and one
// FMA against the broadcast activation: half the instructions of the AVX2 kernel. Every lane
// runs the AVX2 kernel's operations in the same order, so the outputs are the same bits.

#include <immintrin.h>
#include <stdint.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

#include "bf16_rows16_exact.h"  // after the pragma: its templates compile for AVX-512

namespace tv {

namespace {

struct Avx512Lanes {
  using F = __m512;
  using I = __m512i;
  static constexpr int kHalves = 1;
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static I load_bits(const uint8_t* p) { return _mm512_loadu_si512(p); }
  template <int N>
  static F weights(I v) {
    if (N == 7) return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 28));
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15 << (4 * N))));
  }
  static F scales(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
};

}  // namespace

void linear_rows16_bf16_avx512f(const uint16_t* x, const uint8_t* w, int fmt, const void* bias,
                                int b_dt, uint16_t* out, int M, int64_t N, int64_t K,
                                int nthreads) {
  rows16_exact::linear<Avx512Lanes>(x, w, fmt, bias, b_dt, out, M, N, K, nthreads);
}

}  // namespace tv

#pragma GCC pop_options
