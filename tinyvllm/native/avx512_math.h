// AVX-512 helpers shared by the kernels that carry AVX-512 target attributes (row_kernels.cpp,
// attn_avx512.cpp, the 16-row layout's GEMVs): the library is built with AVX2 flags, so each function names its target.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#define TV_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

namespace tv {

TV_AVX512 inline __m512 load16(const uint16_t* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

TV_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// fp32 -> bf16 bits in the low half of each lane: round to nearest even, NaN stays NaN
// (as common.h's f32_to_bf16).
TV_AVX512 inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(64));
  return _mm512_mask_mov_epi32(r, nan, quiet);
}

// exp(x) to ~1 ulp for x in [-110, 100], in the lanes of `keep` (zero elsewhere): x = n ln2 + r
// (ln2 split in two so n ln2 is exact), a degree-7 polynomial for e^r on |r| <= ln2 / 2, then
// scalef by 2^n, which overflows to inf and underflows to 0 where expf does.
TV_AVX512 inline __m512 exp16_in_range(__mmask16 keep, __m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// exp16_in_range of every lane, after clamping x to its range.
TV_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(100.0f)), _mm512_set1_ps(-110.0f));
  return exp16_in_range(0xFFFF, x);
}

}  // namespace tv
