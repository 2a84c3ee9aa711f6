// Causal prefill attention in fp32 (prefill_attn_f32.h) on AVX2 / FMA, and the entry point that
// takes the AVX-512 Foundation instantiation (prefill_attn_avx512f.cpp) where the CPU has it.
//
// A micro-tile is 6 query rows by 2 registers: 16 keys per score tile, 16 dims per output
// pass, 12 accumulators (of 16 registers).

#include <immintrin.h>
#include <stdint.h>

#include "common.h"
#include "omp_team.h"
#include "prefill_attn_f32.h"

namespace tv {
namespace {

struct Avx2Lanes {
  using F = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int kTile = 2;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load_bf16(const uint16_t* p) { return load8(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F gather(const float* p, int64_t stride) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_i32gather_ps(p, _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(stride))), 4);
  }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F first(F x, int64_t n, float fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_castsi256_ps(keep));
  }
  static float hmax(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
  static float hsum(F v) { return tv::hsum(v); }
  // x clamped to [-87, 0], so 2^n is a normal float built in its exponent field; below -87
  // (e^-87 ~ 1.6e-38) the result stays at that tiny value instead of reaching 0, which moves
  // no softmax sum that holds the row max's 1. Same reduction and polynomial as
  // avx512_math.h's exp16_in_range.
  static F exp_nonpos(F x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_setzero_ps()), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
};

}  // namespace
}  // namespace tv

// See prefill_attn_f32.h. n prompts, prompt b's step rows [starts[b], starts[b] + lens[b]) of
// q / k / v / out (lens[b] >= 1) after ctx[b] tokens in the paged cache (ctx null: none, and
// the cache arguments are not read); dt 0 float32 or 1 bfloat16 for all of q, k, v, out and
// the cache; D a multiple of 16 up to 256, Hq a multiple of Hkv. `omp_parallel`: as for
// tv_prefill_attn_amx.
extern "C" void tv_prefill_attn_f32(const void* q, const void* k, const void* v, void* out,
                                    int dt, int64_t n, const int64_t* starts,
                                    const int64_t* lens, const int64_t* ctx,
                                    const int32_t* block_table, int64_t bt_stride,
                                    const void* k_cache, const void* v_cache, int64_t block_size,
                                    int64_t Hq, int64_t Hkv, int64_t D, int64_t q_stride,
                                    int64_t kv_stride, int64_t out_stride, float scale,
                                    int nthreads, const void* omp_parallel) {
  tv::prefill_f32::Args a{q,         k,       v,          out,   dt,   starts,  lens,
                          ctx,       block_table, bt_stride, k_cache, v_cache, block_size,
                          Hq,        Hkv,     D,          q_stride, kv_stride, out_stride,
                          scale,     nullptr, nullptr,    nullptr};
  const tv::OmpParallelFn omp = tv::omp_team(omp_parallel);
  if (tv::avx512_foundation() && D % 64 == 0)
    tv::prefill_f32::run_avx512f(a, n, nthreads, omp);
  else
    tv::prefill_f32::run<tv::Avx2Lanes>(a, n, nthreads, omp);
}
