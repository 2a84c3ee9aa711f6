// The GEMM tile of the bf16 pair layout (bf16_pairs.cpp) for a Lanes type of L fp32 lanes:
// bf16_pairs.cpp compiles it for AVX2 (L = 8), bf16_pairs_avx512f.cpp for AVX-512 (L = 16),
// each including this header under its own target.
//
// A pass takes NV vectors of L output rows: AVX-512 one vector from each of an item's two
// 16-row groups, AVX2 the two halves of one group. For each pair p an AND and a shift give the
// fp32 weights 2 p and 2 p + 1 of every vector's rows, and each of MT input rows adds
// x[2 p] * even, then x[2 p + 1] * odd, to its accumulator: every output is one FMA chain over
// k in order whatever L, MT or NV, so both instruction sets give the same bits.
//
// Lanes provides Vec, kLanes, zero / load / store / broadcast / fmadd, and split(w, even, odd)
// (the L lanes at w: their low halves shifted up, and their high halves masked).
#pragma once

#include <stdint.h>

namespace tv {
namespace pairs {

constexpr int kGroup = 16;      // output rows per group of the layout
constexpr int kItemGroups = 2;  // groups per item: an accumulator row is 32 floats

// MT input rows x NV vectors over the pairs [p0, p1) of the group(s) at w, continuing the
// sums in acc [MT][kItemGroups * kGroup] (from zero when p0 == 0).
template <class Lanes, int MT, int NV>
void tile(const uint32_t* w, int64_t K, const float* x, int64_t p0, int64_t p1, float* acc) {
  using Vec = typename Lanes::Vec;
  constexpr int L = Lanes::kLanes, per_group = kGroup / L, stride = kItemGroups * kGroup;
  const int64_t P = K / 2;
  Vec sums[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j)
      sums[m][j] = p0 ? Lanes::load(acc + m * stride + j * L) : Lanes::zero();
  for (int64_t p = p0; p < p1; ++p) {
    Vec even[NV], odd[NV];
    for (int j = 0; j < NV; ++j)
      Lanes::split(w + (j / per_group * P + p) * kGroup + j % per_group * L, even[j], odd[j]);
    for (int m = 0; m < MT; ++m) {
      const Vec xe = Lanes::broadcast(x + m * K + 2 * p);
      const Vec xo = Lanes::broadcast(x + m * K + 2 * p + 1);
      for (int j = 0; j < NV; ++j) sums[m][j] = Lanes::fmadd(even[j], xe, sums[m][j]);
      for (int j = 0; j < NV; ++j) sums[m][j] = Lanes::fmadd(odd[j], xo, sums[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j) Lanes::store(acc + m * stride + j * L, sums[m][j]);
}

// tile<Lanes, rows, NV> for a run-time rows in [1, MaxRows].
template <class Lanes, int NV, int MaxRows>
void tile_rows(int rows, const uint32_t* w, int64_t K, const float* x, int64_t p0, int64_t p1,
               float* acc) {
  if constexpr (MaxRows > 1)
    if (rows < MaxRows) return tile_rows<Lanes, NV, MaxRows - 1>(rows, w, K, x, p0, p1, acc);
  tile<Lanes, MaxRows, NV>(w, K, x, p0, p1, acc);
}

// The pairs [p0, p1) of an item's ng groups (at w) against mt input rows (at x), passes of up
// to MaxRows rows and two vectors: acc as `tile`'s.
template <class Lanes, int MaxRows>
void block(const uint32_t* w, int64_t K, const float* x, int mt, int ng, int64_t p0,
           int64_t p1, float* acc) {
  constexpr int per_group = kGroup / Lanes::kLanes;
  constexpr int groups_per_pass = per_group == 1 ? kItemGroups : 1;
  for (int g = 0; g < ng; g += groups_per_pass) {
    const int nv = (ng - g < groups_per_pass ? ng - g : groups_per_pass) * per_group;
    const uint32_t* wg = w + g * (K / 2) * kGroup;
    for (int m0 = 0; m0 < mt; m0 += MaxRows) {
      const int rows = mt - m0 < MaxRows ? mt - m0 : MaxRows;
      float* a = acc + m0 * kItemGroups * kGroup + g * kGroup;
      if (nv == 2)
        tile_rows<Lanes, 2, MaxRows>(rows, wg, K, x + m0 * K, p0, p1, a);
      else
        tile_rows<Lanes, 1, MaxRows>(rows, wg, K, x + m0 * K, p0, p1, a);
    }
  }
}

}  // namespace pairs

// pairs::block on AVX-512 F, up to 12 rows a pass (bf16_pairs_avx512f.cpp).
void bf16_pairs_block_avx512f(const uint32_t* w, int64_t K, const float* x, int mt, int ng,
                              int64_t p0, int64_t p1, float* acc);

}  // namespace tv
