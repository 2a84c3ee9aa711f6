// The exact GEMV over Q4_0 / Q4_1 matrices in the 16-row layout against bf16 activations,
// written once for a vector width: `V` is AVX2 (a group's 16 rows in two 8-lane halves,
// bf16_rows16_avx2.cpp) or AVX-512 Foundation (one 16-lane register, bf16_rows16_avx512f.cpp).
// Every lane runs the same operations in the same order at either width, so both give the
// same bits. Include it after the file's target pragma: its templates compile for that ISA.
//
// Lane r of a layout vector j holds row r's weights 8 j + i (bits 8 i .. 8 i + 4) and
// 8 j + 4 + i (bits 8 i + 4 .. 8 i + 8), i < 4. Masking weight position n at bit 4 n leaves
// q * 2^(4 n), exact as an int32 and as its float; the activations come pre-scaled by
// 2^-(4 n) (rows16_exact_rows), so each product is q * x again. The top nibble (past an
// int32's sign) is shifted down instead.
//
// V provides: F (float register), I (int register), kHalves (registers per 16 rows), zero,
// add, fmadd, set1, load_bits (a register's 64 / kHalves layout bytes), weights<n> (position
// n of a bits register as floats), scales (16 / kHalves fp16 scales as floats), store.
#pragma once

#include <stdint.h>
#include <stdlib.h>

#include <type_traits>

#include "common.h"
#include "rows16_kernels.h"

namespace tv {
namespace rows16_exact {

constexpr int kQ4_0 = 2, kQ4_1 = 3;

// Groups [g0, g1) against input rows m0 .. m0 + M; out [.][N] bf16.
template <class V, int Fmt, int M>
void groups_tile(const uint8_t* w, const float* xp, const float* xs, int64_t nb, int64_t m0,
                 int64_t g0, int64_t g1, const void* bias, int b_dt, uint16_t* out, int64_t N) {
  using F = typename V::F;
  constexpr int H = V::kHalves, kLanes = kRows16Group / H;
  constexpr int64_t kBlock = kRows16Group * (Fmt == kQ4_1 ? 20 : 18);
  // Independent FMA chains per input row and half: enough in flight for the FMA latency.
  constexpr int C = M == 1 ? 4 : M == 2 ? 2 : 1;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* base = w + g * nb * kBlock;
    F acc[M][H], lin[M][H];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h) acc[m][h] = lin[m][h] = V::zero();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = base + b * kBlock;
      rows16_prefetch(p, kBlock);
      F t[M][H][C];
      for (int m = 0; m < M; ++m)
        for (int h = 0; h < H; ++h)
          for (int c = 0; c < C; ++c) t[m][h][c] = V::zero();
      for (int j = 0; j < 4; ++j) {
        typename V::I v[H];
        for (int h = 0; h < H; ++h) v[h] = V::load_bits(p + 64 * j + 4 * kLanes * h);
        const auto step = [&](auto n_const) {
          constexpr int n = decltype(n_const)::value;
          for (int h = 0; h < H; ++h) {
            const F q = V::template weights<n>(v[h]);
            for (int m = 0; m < M; ++m) {
              const float xv = xp[((m0 + m) * nb + b) * 32 + 8 * j + n];
              t[m][h][n % C] = V::fmadd(q, V::set1(xv), t[m][h][n % C]);
            }
          }
        };
        step(std::integral_constant<int, 0>{});
        step(std::integral_constant<int, 1>{});
        step(std::integral_constant<int, 2>{});
        step(std::integral_constant<int, 3>{});
        step(std::integral_constant<int, 4>{});
        step(std::integral_constant<int, 5>{});
        step(std::integral_constant<int, 6>{});
        step(std::integral_constant<int, 7>{});
      }
      for (int h = 0; h < H; ++h) {
        const F d = V::scales(p + 256 + 2 * kLanes * h);
        // Q4_0's min is -8 d: d * (-8 sum) is the same product (a power of two).
        const F mn = Fmt == kQ4_1 ? V::scales(p + 288 + 2 * kLanes * h) : d;
        for (int m = 0; m < M; ++m) {
          F s = t[m][h][0];
          for (int c = 1; c < C; ++c) s = V::add(s, t[m][h][c]);
          const float sum = xs[(m0 + m) * nb + b];
          acc[m][h] = V::fmadd(s, d, acc[m][h]);
          lin[m][h] = V::fmadd(mn, V::set1(Fmt == kQ4_1 ? sum : -8.0f * sum), lin[m][h]);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      alignas(64) float res[kRows16Group];
      for (int h = 0; h < H; ++h) V::store(res + kLanes * h, V::add(acc[m][h], lin[m][h]));
      for (int r = 0; r < kRows16Group; ++r) {
        const int64_t n = kRows16Group * g + r;
        const float bv = bias ? load(bias, n, b_dt) : 0.0f;
        out[(m0 + m) * N + n] = f32_to_bf16(res[r] + bv);
      }
    }
  }
}

template <class V, int Fmt>
void run_tile(int tile, const uint8_t* w, const float* xp, const float* xs, int64_t nb,
              int64_t m0, int64_t g0, int64_t g1, const void* bias, int b_dt, uint16_t* out,
              int64_t N) {
  switch (tile) {
    case 1: return groups_tile<V, Fmt, 1>(w, xp, xs, nb, m0, g0, g1, bias, b_dt, out, N);
    case 2: return groups_tile<V, Fmt, 2>(w, xp, xs, nb, m0, g0, g1, bias, b_dt, out, N);
    case 3: return groups_tile<V, Fmt, 3>(w, xp, xs, nb, m0, g0, g1, bias, b_dt, out, N);
    default: return groups_tile<V, Fmt, 4>(w, xp, xs, nb, m0, g0, g1, bias, b_dt, out, N);
  }
}

// The whole call: activations prepared once, items of groups x tiles of input rows.
template <class V>
void linear(const uint16_t* x, const uint8_t* w, int fmt, const void* bias, int b_dt,
            uint16_t* out, int M, int64_t N, int64_t K, int nthreads) {
  const int64_t nb = K / 32;
  float* xp = static_cast<float*>(checked_aligned_alloc((M * K + M * nb) * 4));
  float* xs = xp + M * K;
  rows16_exact_rows(x, M, K, xp, xs);
  rows16_parallel(N, M, nthreads, [&](int64_t g0, int64_t g1, int64_t m0, int tile) {
    if (fmt == kQ4_1)
      run_tile<V, kQ4_1>(tile, w, xp, xs, nb, m0, g0, g1, bias, b_dt, out, N);
    else
      run_tile<V, kQ4_0>(tile, w, xp, xs, nb, m0, g0, g1, bias, b_dt, out, N);
  });
  free(xp);
}

}  // namespace rows16_exact
}  // namespace tv
