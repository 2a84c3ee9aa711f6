// bf16 linear layers of decode batches on AMX tiles (Sapphire Rapids and later): tv_linear
// takes this path for bf16 activations and weights from kAmxMinRows (2) rows on.
//
// Why: a decode step of 2-64 sequences runs its linears as GEMMs of that many rows. The
// vdpbf16ps kernels (avx512_kernels.cpp) re-read every weight once per 8 rows and reach
// ~0.1 TFLOP/s per core there (profile of the 64-request mix: a third of the time in them),
// while one tdpbf16ps does 16 x 16 x 32 multiply-adds. Even 2-15 rows (one zero-padded tile)
// stream the weights faster than the vdpbf16ps kernels (~20% at 8 rows, ~1.8x at 12); one row
// stays with them (its own GEMV is as fast and does no wasted work).
//
// The weights stay as they are ([N][K] rows, which is the A tile's layout: 16 output rows x
// 32 columns), and the activations become the B tile: per 32 columns, 16 rows of pairs
// [k pair][m][2], repacked once per call (a 16 x 16 transpose per tile). C tiles hold out^T
// (16 output rows x 16 activation rows) and are transposed on the way out, after the bf16
// rounding (half the shuffles of transposing the fp32 sums).
//
// Where the time goes: weights come from memory once per call, but the tiles of every other
// pass come from L2 (the activations of 64 rows, 72-192 KiB, do not fit L1), and a tile load
// from L2 takes ~3x its tdpbf16ps. Two things keep that down: the passes over pairs of
// activation blocks take turns every kChunkSteps steps, so the second pass finds the item's
// weights in L1 (its C tiles wait in memory meanwhile), and the next step's weight rows are
// prefetched into L1 while this step multiplies (one thread, the 30 layers' four linears with
// the repack below: 32 rows 30 -> 26 ms, 64 rows 40 -> 34 ms; prefetching the activation
// tiles too, or the next item's weights into L2, measured no better).
//
// Arithmetic: every product of two bf16 is exact in fp32 and tdpbf16ps adds them into fp32
// sums (round to nearest even, bf16 denormal inputs as zero), as vdpbf16ps does: the same
// arithmetic as the vdpbf16ps kernels in another summation order. Each sum runs over k in
// order (a C tile parked in memory between chunks is reloaded bit for bit), so a row's result
// does not depend on the other rows or the thread count; a single row sums in the vdpbf16ps
// order instead.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "common.h"

namespace tv {
namespace {

constexpr int64_t kTile = 16;  // rows of a tile; also activation rows per B tile
constexpr int64_t kStep = 32;  // bf16 columns per tile row (64 bytes)

// Steps (32 columns each) one pass runs before the next pair of activation blocks takes over:
// the item's weights for them (32 rows x 6 x 64 bytes) and the activations' (12 KiB per pair)
// stay in L1 together (3, 4 and 9 steps measured the same).
constexpr int64_t kChunkSteps = 6;
// Activation blocks whose C tiles take turns (two per pass, two weight blocks each: 16 C tiles
// of 1 KiB parked on the stack).
constexpr int64_t kGroupBlocks = 8;

// 16 x 16 fp32 transpose in registers: r[i] lane j -> r[j] lane i.
TV_AMX inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: rows 2i, 2i + 1 interleaved
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i+3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  __m512 o[16];
  for (int j = 0; j < 4; ++j) {  // 4 x 4 transpose of 128-bit blocks
    const __m512 ab_lo = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44);
    const __m512 ab_hi = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
    const __m512 cd_lo = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
    const __m512 cd_hi = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
    o[j] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88);
    o[4 + j] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD);
    o[8 + j] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88);
    o[12 + j] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = o[i];
}

// x [M][K] -> xp [M_pad / 16][K / 32][16 pairs][16 rows][2]: one B tile per (m block, k
// step), 1 KiB contiguous; rows past M are zeros. A pair of bf16 is one fp32 lane, so the
// tile is a 16 x 16 transpose of the 16 rows' 64 bytes.
TV_AMX void pack_rows(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp, int64_t mb) {
  const int64_t steps = K / kStep, rows = M - mb * kTile < kTile ? M - mb * kTile : kTile;
  float* blk = reinterpret_cast<float*>(xp + mb * steps * kTile * kTile);
  for (int64_t s = 0; s < steps; ++s) {
    __m512 r[16];
    for (int64_t i = 0; i < kTile; ++i)
      r[i] = i < rows ? _mm512_loadu_ps(x + (mb * kTile + i) * K + s * kStep)
                      : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t p = 0; p < kTile; ++p) _mm512_store_ps(blk + (s * kTile + p) * kTile, r[p]);
  }
}

// C tile [16 output rows][16 activation rows] -> out[m0 + r][n0 : n0 + 16] (+ bias), bf16.
// Rounded first, so the transpose moves 16-bit values: u[i] lane m holds output rows i and
// i + 8 of activation row m, and an 8 x 16 transpose of those pairs gives each activation row
// its 16 outputs in 256 bits (then put in order by one vpermw).
TV_AMX void store_tile(const float* c, const float* bias16, uint16_t* out, int64_t N,
                       int64_t n0, int64_t m0, int64_t M) {
  __m512 u[8];
  for (int i = 0; i < 8; ++i) {
    __m512 lo = _mm512_load_ps(c + i * kTile), hi = _mm512_load_ps(c + (i + 8) * kTile);
    if (bias16) {
      lo = _mm512_add_ps(lo, _mm512_set1_ps(bias16[i]));
      hi = _mm512_add_ps(hi, _mm512_set1_ps(bias16[i + 8]));
    }
    u[i] = _mm512_castsi512_ps(_mm512_or_si512(bf16_round_bits(lo),
                                               _mm512_slli_epi32(bf16_round_bits(hi), 16)));
  }
  __m512 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]);
  }
  // v[q] (v[4 + q]) 128-bit lane L: pairs 0-3 (4-7) of activation row 4L + q.
  __m512 v[8];
  for (int h = 0; h < 2; ++h) {
    v[4 * h] = _mm512_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    v[4 * h + 1] = _mm512_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    v[4 * h + 2] = _mm512_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    v[4 * h + 3] = _mm512_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  // 16-bit order of an activation row's 8 pairs: n0 n8 n1 n9 ... -> n0 .. n15 (per half).
  alignas(64) static const uint16_t kOrder[32] = {
      0,  2,  4,  6,  8,  10, 12, 14, 1,  3,  5,  7,  9,  11, 13, 15,
      16, 18, 20, 22, 24, 26, 28, 30, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i order = _mm512_load_si512(kOrder);
  for (int q = 0; q < 4; ++q)
    for (int half = 0; half < 2; ++half) {  // activation rows q, 4 + q; then 8 + q, 12 + q
      // 128-bit lanes (0, 1) or (2, 3) of each, then interleaved: [v[q], v[4 + q]] per row.
      const __m512 x = half ? _mm512_shuffle_f32x4(v[q], v[4 + q], 0xEE)
                            : _mm512_shuffle_f32x4(v[q], v[4 + q], 0x44);
      const __m512i y = _mm512_castps_si512(_mm512_shuffle_f32x4(x, x, 0xD8));
      const __m512i z = _mm512_permutexvar_epi16(order, y);
      const int64_t ma = m0 + 8 * half + q, mb = ma + 4;
      if (ma < M)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ma * N + n0),
                            _mm512_castsi512_si256(z));
      if (mb < M)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + mb * N + n0),
                            _mm512_extracti64x4_epi64(z, 1));
    }
}

// Into L1 for step s + 1: the weight rows' next 64 bytes (after the last step, the next
// rows' first: rows n0.. are contiguous, and the next item usually follows).
TV_AMX inline void prefetch_next(const uint16_t* w, int64_t N, int64_t K, int64_t n0, int rows,
                                 int64_t s, int64_t steps) {
  const int64_t r0 = s + 1 < steps ? n0 : n0 + rows, col = s + 1 < steps ? s + 1 : 0;
  if (r0 + rows > N) return;
  const char* a = reinterpret_cast<const char*>(w + r0 * K + col * kStep);
  for (int r = 0; r < rows; ++r) _mm_prefetch(a + r * K * 2, _MM_HINT_T0);
}

// Steps [s0, s1) of output rows [n0, n0 + 16 NB) x activation blocks b0 (and b0 + btile when
// two) in C tiles 0-3, continuing the sums parked in c (zero at s0 = 0) and parking them there.
template <int NB>
TV_AMX void pair_steps(const uint16_t* w, const uint32_t* b0, bool two, int64_t N, int64_t K,
                       int64_t n0, int64_t btile, int64_t s0, int64_t s1,
                       float (*c)[kTile * kTile]) {
  const int64_t steps = K / kStep;
  if (s0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c[0], 64);
    if (two) _tile_loadd(1, c[1], 64);
    if (NB == 2) _tile_loadd(2, c[2], 64);
    if (NB == 2 && two) _tile_loadd(3, c[3], 64);
  }
  for (int64_t s = s0; s < s1; ++s) {
    prefetch_next(w, N, K, n0, NB * kTile, s, steps);
    const uint16_t* a = w + n0 * K + s * kStep;
    _tile_loadd(4, a, K * 2);
    if (NB == 2) _tile_loadd(5, a + kTile * K, K * 2);
    _tile_loadd(6, b0 + s * kTile * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) _tile_dpbf16ps(2, 5, 6);
    if (two) {
      _tile_loadd(7, b0 + btile + s * kTile * kTile, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  if (two) _tile_stored(1, c[1], 64);
  if (NB == 2) _tile_stored(2, c[2], 64);
  if (NB == 2 && two) _tile_stored(3, c[3], 64);
}

// Output rows [n0, n0 + 16 NB) for all M rows: per group of activation blocks, the pairs of
// blocks take turns every kChunkSteps steps (one pair runs all steps at once).
template <int NB>
TV_AMX void rows_item(const uint16_t* w, const uint32_t* xp, const void* bias, int b_dt,
                      uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t n0) {
  alignas(64) float c[2 * kGroupBlocks][kTile * kTile];  // pair p: c[4p .. 4p + 3]
  alignas(64) float bias16[NB][kTile];
  for (int nb = 0; nb < NB; ++nb)
    for (int64_t i = 0; i < kTile; ++i)
      bias16[nb][i] = bias ? load(bias, n0 + nb * kTile + i, b_dt) : 0.0f;
  const int64_t steps = K / kStep, mblocks = (M + kTile - 1) / kTile;
  const int64_t btile = steps * kTile * kTile;  // uint32 per m block
  for (int64_t g0 = 0; g0 < mblocks; g0 += kGroupBlocks) {
    const int64_t g1 = g0 + kGroupBlocks < mblocks ? g0 + kGroupBlocks : mblocks;
    const int64_t chunk = g1 - g0 > 2 ? kChunkSteps : steps;
    for (int64_t s0 = 0; s0 < steps; s0 += chunk)
      for (int64_t mb = g0; mb < g1; mb += 2)
        pair_steps<NB>(w, xp + mb * btile, mb + 1 < g1, N, K, n0, btile, s0,
                       s0 + chunk < steps ? s0 + chunk : steps, c + 2 * (mb - g0));
    for (int64_t mb = g0; mb < g1; ++mb)
      for (int nb = 0; nb < NB; ++nb)
        store_tile(c[2 * (mb - g0 - (mb - g0) % 2) + 2 * nb + (mb - g0) % 2],
                   bias ? bias16[nb] : nullptr, out, N, n0 + nb * kTile, mb * kTile, M);
  }
}

TV_AMX void run_item(const uint16_t* w, const uint32_t* xp, const void* bias, int b_dt,
                     uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t n0) {
  load_tile_config();
  if (n0 + 2 * kTile <= N)
    rows_item<2>(w, xp, bias, b_dt, out, M, N, K, n0);
  else
    rows_item<1>(w, xp, bias, b_dt, out, M, N, K, n0);
  _tile_release();
}

}  // namespace

bool linear_bf16_amx(const uint16_t* x, const uint16_t* w, const void* bias, int b_dt,
                     uint16_t* out, int M, int64_t N, int64_t K, int nthreads) {
  if (M < kAmxMinRows || K % kStep != 0 || N % kTile != 0 || !amx_supported()) return false;
  const int64_t mblocks = (M + kTile - 1) / kTile;
  uint32_t* xp = static_cast<uint32_t*>(
      checked_aligned_alloc(mblocks * (K / kStep) * kTile * kTile * 4));
  parallel_for(mblocks, nthreads, [&](int64_t mb) { pack_rows(x, M, K, xp, mb); });
  // Items of 32 output rows: enough of them to balance two threads on the smallest linear
  // here (192 rows), each reading its weights from memory once (the passes after the first
  // find them in L1).
  const int64_t items = (N + 2 * kTile - 1) / (2 * kTile);
  parallel_for(items, nthreads, [&](int64_t item) {
    run_item(w, xp, bias, b_dt, out, M, N, K, item * 2 * kTile);
  });
  free(xp);
  return true;
}

}  // namespace tv

// 1 when the CPU has AMX-BF16 and the OS lets this process use its tiles: the AMX linears
// above and the AMX prefill attention (prefill_attn_amx.cpp) run.
extern "C" int tv_amx_supported() { return tv::amx_supported() ? 1 : 0; }
