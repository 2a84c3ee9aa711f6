// The pair layout's GEMM tile (bf16_pairs_tile.h) on AVX-512 Foundation: one 16-lane vector
// per 16-row group, 12 input rows x 2 groups = 24 accumulators of the 32 registers.

#include <immintrin.h>
#include <stdint.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")

#include "bf16_pairs_tile.h"  // after the pragma: its templates compile for AVX-512

namespace tv {

namespace {

struct PairLanes512 {
  using Vec = __m512;
  static constexpr int kLanes = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static void split(const uint32_t* w, Vec& even, Vec& odd) {
    const __m512i v = _mm512_loadu_si512(w);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
  }
};

}  // namespace

void bf16_pairs_block_avx512f(const uint32_t* w, int64_t K, const float* x, int mt, int ng,
                              int64_t p0, int64_t p1, float* acc) {
  pairs::block<PairLanes512, 12>(w, K, x, mt, ng, p0, p1, acc);
}

}  // namespace tv

#pragma GCC pop_options
