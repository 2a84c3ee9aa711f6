// Activations rounded to int8 per block of 32 for the opt-in int8-activation GEMVs
// (int8_kernels.cpp, int8_rows16.cpp): qx = round(x / dx) in [-127, 127], dx = max|x| / 127
// (0 for an all-zero block). Include only from code compiled for AVX-512.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "avx512_math.h"

namespace tv {

// 16 values of x (dtype code x_dt: fp32 or bf16) from element i, as fp32.
inline __m512 int8_act_load16(const void* x, int x_dt, int64_t i) {
  return x_dt == 0 ? load16(static_cast<const float*>(x) + i)
                   : load16(static_cast<const uint16_t*>(x) + i);
}

// Block at x + off (32 values) -> 32 int8 at q (in order), its dx, the sum of its int8 values.
inline void int8_act_block(const void* x, int x_dt, int64_t off, int8_t* q, float* dx,
                           int32_t* sum) {
  const __m512 a = int8_act_load16(x, x_dt, off), b = int8_act_load16(x, x_dt, off + 16);
  const __m512 mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, mask),
                                                        _mm512_and_ps(b, mask)));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  // Round to nearest even (the default MXCSR mode), as torch.round.
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *dx = d;
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

}  // namespace tv
