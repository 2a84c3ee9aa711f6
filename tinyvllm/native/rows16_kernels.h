// What the GEMV kernels of the 16-row layout share (int8_rows16.cpp, int8_rows16_avx2.cpp,
// bf16_rows16.cpp, bf16_rows16_exact.h): how a call's work is split into items, and the int8
// activation rows. Header-only: each kernel file compiles it for its own instruction set.
#pragma once

#include <stdint.h>
#include <stdlib.h>

#include "common.h"

namespace tv {

constexpr int kRows16Group = 16;  // rows per group of the layout
constexpr int kRows16Tile = 4;    // input rows per pass over a group's weights

// fn(g0, g1, m0, tile) for the groups [g0, g1) of an [N][.] matrix against the input rows
// [m0, m0 + tile), over items of 2 groups (32 rows: their weight bytes stay in L1 while every
// tile of input rows passes over them) on up to nthreads threads.
template <class F>
void rows16_parallel(int64_t N, int M, int nthreads, F&& fn) {
  constexpr int64_t kGroupsPerItem = 2;
  const int64_t groups = N / kRows16Group;
  parallel_for((groups + kGroupsPerItem - 1) / kGroupsPerItem, nthreads, [&](int64_t item) {
    const int64_t g0 = item * kGroupsPerItem;
    const int64_t g1 = g0 + kGroupsPerItem < groups ? g0 + kGroupsPerItem : groups;
    for (int64_t m0 = 0; m0 < M; m0 += kRows16Tile)
      fn(g0, g1, m0, M - m0 < kRows16Tile ? static_cast<int>(M - m0) : kRows16Tile);
  });
}

// The exact kernels' activation rows (bf16_rows16_avx2.cpp): xp [M][K] reordered to the
// layout's weight positions and pre-scaled, xs [M][K / 32] the blocks' sums.
void rows16_exact_rows(const uint16_t* x, int M, int64_t K, float* xp, float* xs);

// Input rows rounded to int8 for the int8 kernels: q [M][K] in order; per block dx, Q4_1's
// factor sx = dx S and the integer sum's start s0, each [M][K / 32]. One allocation, freed with
// the object.
struct Int8Rows {
  int8_t* q;
  float* dx;
  float* sx;
  int32_t* s0;
  int64_t K, nb;

  Int8Rows(int M, int64_t k) : K(k), nb(k / 32) {
    const int64_t scales = M * nb;
    char* buf = static_cast<char*>(checked_aligned_alloc(M * K + 12 * scales));
    q = reinterpret_cast<int8_t*>(buf);
    dx = reinterpret_cast<float*>(buf + M * K);  // K % 32 == 0: 4-byte aligned
    sx = dx + scales;
    s0 = reinterpret_cast<int32_t*>(sx + scales);
  }
  ~Int8Rows() { free(q); }
  Int8Rows(const Int8Rows&) = delete;
  Int8Rows& operator=(const Int8Rows&) = delete;
};

}  // namespace tv
