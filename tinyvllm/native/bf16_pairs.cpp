// bf16 matrices interleaved 16 rows at a time in pairs of columns (code kBF16 | kFmtRows16),
// and tv_linear's GEMM on them for CPUs with AVX-512 Foundation but no BF16 dot products
// (Skylake-SP to Ice Lake; CPUs with vdpbf16ps or AMX keep their own kernels).
//
// Why a second layout: in the row layout (gemv_avx512f.cpp, cpu_kernels.cpp) every 16 bf16
// weights cost a widening and a shift on the FMA ports, and every (output row, input row)
// pair ends in a horizontal sum; at 16-64 rows a decode step ran near 57 GFLOP/s a core there
// on an Ice Lake, against a 166 GFLOP/s FMA peak. Here one 32-bit lane of a vector is one
// output row holding two of its weights, k and k + 1: an AND and a shift give the fp32
// weights k (even) and k + 1 (odd) of 16 rows, each used by up to 12 input rows.
// Conversions are 4 of 52 FMA-port instructions, and no sum crosses lanes.
//
// Layout: rows [16 g, 16 g + 16) of an [N][K] matrix (N % 16 == 0, K % 2 == 0) form group g,
// K / 2 vectors of 64 bytes; vector p's lane r holds row 16 g + r's weights 2 p (low half) and
// 2 p + 1 (high half). Same bytes as the matrix.
//
// Order: output (n, m) is one fp32 FMA chain over k = 0, 1, ..., K - 1 from zero, so its bits
// do not depend on the batch, the tiling, the threads or the instruction set.

#include <immintrin.h>
#include <stdint.h>

#include "bf16_pairs_tile.h"
#include "common.h"

namespace tv {

namespace {

using pairs::kGroup;
using pairs::kItemGroups;
constexpr int kMaxTile = 12;  // input rows per tile (the AVX-512 pass)

float* rows_to_f32(const void* x, int x_dt, int64_t n) {
  float* buf = static_cast<float*>(checked_aligned_alloc(n * 4));
  for (int64_t i = 0; i < n; ++i) buf[i] = load(x, i, x_dt);
  return buf;
}

// AVX2 (16 registers), for a repacked matrix where the ISA is forced down (tv_set_isa): a
// group's 16 rows as two 8-lane halves, up to 4 input rows a pass.
struct PairLanes256 {
  using Vec = __m256;
  static constexpr int kLanes = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static void split(const uint32_t* w, Vec& even, Vec& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536)));
  }
};

}  // namespace

// AVX-512 Foundation only: on AVX2 (measured on the same Ice Lake with the ISA forced down)
// the pair tile lost to the row kernels up to 8 rows (M = 1: 33.5 vs 22.4 ms for a
// SmolLM2-135M step's linears) and won only 4-23% past 16, so AVX2 CPUs keep the rows; the
// AVX2 tile reads a repacked matrix where the ISA is forced down.
bool bf16_pairs_supported() { return avx512_foundation() && isa_level() != kIsaAvx512; }

// out [M][N] (x_dt) = x [M][K] w^T (+ bias) for w in the pair layout. Items are 2 groups (32
// output rows). Past one tile of input rows every tile passes over a block of kBlockPairs
// pairs (32 KiB of weights, in L1) before the next block, its sums parked in acc between
// blocks: the weights stream from memory once, while the tiles compute on them.
void linear_bf16_pairs(const void* x, int x_dt, const void* w, const void* bias, int b_dt,
                       void* out, int M, int64_t N, int64_t K, int nthreads) {
  constexpr int64_t kBlockPairs = 256;
  float* xf = rows_to_f32(x, x_dt, static_cast<int64_t>(M) * K);
  const uint32_t* wp = static_cast<const uint32_t*>(w);
  const int64_t groups = N / kGroup, P = K / 2;
  const bool wide = avx512_foundation();
  // Tiles as even as they can be (16 rows: 8 + 8, not 12 + 4, whose 4-row pass converts
  // the weights for a third of the FMAs).
  const int tiles = (M + kMaxTile - 1) / kMaxTile;
  parallel_for((groups + kItemGroups - 1) / kItemGroups, nthreads, [&](int64_t item) {
    const int64_t g0 = item * kItemGroups;
    const int ng = groups - g0 < kItemGroups ? static_cast<int>(groups - g0) : kItemGroups;
    const uint32_t* wg = wp + g0 * P * kGroup;
    float* acc = static_cast<float*>(
        checked_aligned_alloc(static_cast<int64_t>(M) * kItemGroups * kGroup * 4));
    for (int64_t p0 = 0; p0 < P; p0 += kBlockPairs) {
      const int64_t p1 = P - p0 < kBlockPairs ? P : p0 + kBlockPairs;
      for (int t = 0, m0 = 0; t < tiles; ++t) {
        const int mt = (M - m0) / (tiles - t);
        const float* xt = xf + static_cast<int64_t>(m0) * K;
        float* at = acc + static_cast<int64_t>(m0) * kItemGroups * kGroup;
        if (wide)
          bf16_pairs_block_avx512f(wg, K, xt, mt, ng, p0, p1, at);
        else
          pairs::block<PairLanes256, 4>(wg, K, xt, mt, ng, p0, p1, at);
        m0 += mt;
      }
    }
    for (int m = 0; m < M; ++m)
      for (int64_t j = 0; j < ng * kGroup; ++j) {
        const int64_t n = g0 * kGroup + j;
        float v = acc[m * kItemGroups * kGroup + j];
        if (bias) v += load(bias, n, b_dt);
        store(out, m * N + n, v, x_dt);
      }
    free(acc);
  });
  free(xf);
}

}  // namespace tv

extern "C" {

// 1 when tv_linear_any runs bf16 matrices in the pair layout on this CPU's best kernels
// (AVX-512 Foundation without BF16 dot products), so repacking pays.
int tv_bf16_pairs_supported(void) { return tv::bf16_pairs_supported() ? 1 : 0; }

// The bf16 matrix src [N][K] (N % 16 == 0, K % 2 == 0) in the pair layout at dst (as many
// bytes), for code kBF16 | kFmtRows16.
void tv_repack_bf16_pairs(const uint16_t* src, int64_t N, int64_t K, uint16_t* dst,
                          int nthreads) {
  const int64_t P = K / 2;
  tv::parallel_for(N / tv::pairs::kGroup, nthreads, [&](int64_t g) {
    uint16_t* group = dst + g * P * tv::pairs::kGroup * 2;
    for (int r = 0; r < tv::pairs::kGroup; ++r) {
      const uint16_t* row = src + (g * tv::pairs::kGroup + r) * K;
      for (int64_t p = 0; p < P; ++p) {
        group[(p * tv::pairs::kGroup + r) * 2] = row[2 * p];
        group[(p * tv::pairs::kGroup + r) * 2 + 1] = row[2 * p + 1];
      }
    }
  });
}

}  // extern "C"
