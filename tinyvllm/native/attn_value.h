// What the AVX-512 and AMX paged decode kernels (attn_avx512.cpp, attn_amx.cpp) share: the
// value pass (softmax weights times V rows, fp32 accumulators in registers) and per-thread
// scratch. Include inside a region compiled for AVX-512 (#pragma GCC target).
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx512_math.h"
#include "common.h"

namespace tv {
// Internal linkage: each includer compiles these under its own target options, and one
// shared instantiation would carry only one file's.
namespace {

// out[g][d0 : d0 + 16 NV] = sum_p w[g][p] v_p[d0 : ...] for GB query heads over n positions
// (value rows at off[p]), accumulators in registers, each lane summing over p in order.
template <int GB, int NV, typename T>
inline void value_tile(const T* vc, const int64_t* off, int64_t n, const float* w,
                       int64_t gs, int64_t ps, int64_t d0, float* out, int64_t D) {
  __m512 acc[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    const T* v = vc + off[p] + d0;
    __m512 x[NV];
    for (int c = 0; c < NV; ++c) x[c] = load16(v + 16 * c);
    for (int g = 0; g < GB; ++g) {
      const __m512 s = _mm512_set1_ps(w[g * gs + p * ps]);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(s, x[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + g * D + d0 + 16 * c, acc[g][c]);
}

template <int GB, typename T>
void value_heads(const T* vc, const int64_t* off, int64_t n, const float* w, int64_t gs,
                 int64_t ps, float* out, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) value_tile<GB, 4>(vc, off, n, w, gs, ps, d, out, D);
  for (; d < D; d += 16) value_tile<GB, 1>(vc, off, n, w, gs, ps, d, out, D);
}

template <typename T>
void value_any(int GB, const T* vc, const int64_t* off, int64_t n, const float* w, int64_t gs,
               int64_t ps, float* out, int64_t D) {
  switch (GB) {
    case 1: value_heads<1>(vc, off, n, w, gs, ps, out, D); break;
    case 2: value_heads<2>(vc, off, n, w, gs, ps, out, D); break;
    case 3: value_heads<3>(vc, off, n, w, gs, ps, out, D); break;
    default: value_heads<4>(vc, off, n, w, gs, ps, out, D); break;
  }
}

// Per-thread scratch, grown to the longest context seen and kept for the thread's life.
struct Scratch {
  void* p = nullptr;
  int64_t bytes = 0;
  ~Scratch() { free(p); }
  void* get(int64_t need) {
    if (need > bytes) {
      free(p);
      p = checked_aligned_alloc(need);
      bytes = need;
    }
    return p;
  }
};

}  // namespace
}  // namespace tv
