// Causal prefill attention in fp32 (prefill_attn_f32.h) on AVX-512 Foundation (Skylake-SP and
// later; no BF16 instruction is used).
//
// A micro-tile is 6 query rows by 4 registers: 64 keys per score tile, 64 dims per output pass,
// 24 accumulators (of 32 registers), twice the AVX2 kernel's work per instruction.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>  // before the target pragma: the library's shared copies stay AVX2
#include <vector>

#include "avx512_math.h"
#include "common.h"
#include "omp_team.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

#include "prefill_attn_f32.h"  // after the pragma: its templates compile for AVX-512

namespace tv {
namespace {

struct Avx512Lanes {
  using F = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr int kTile = 4;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load_bf16(const uint16_t* p) { return load16(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F gather(const float* p, int64_t stride) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_i32gather_ps(_mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(stride))), p, 4);
  }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F first(F x, int64_t n, float fill) {
    const __mmask16 keep = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    return _mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), x);
  }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static F exp_nonpos(F x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_setzero_ps()), _mm512_set1_ps(-110.0f));
    return exp16_in_range(0xFFFF, x);
  }
};

}  // namespace

namespace prefill_f32 {

void run_avx512f(Args a, int64_t n, int nthreads, OmpParallelFn omp) {
  run<Avx512Lanes>(a, n, nthreads, omp);
}

}  // namespace prefill_f32
}  // namespace tv

#pragma GCC pop_options
