// bf16 linear layers of decode batches on AMX tiles (Sapphire Rapids and later): tv_linear
// takes this path for bf16 activations and weights from kAmxMinRows rows on.
//
// Why: a decode step of 16-64 sequences runs its linears as GEMMs of that many rows. The
// vdpbf16ps kernels (avx512_kernels.cpp) re-read every weight once per 8 rows and reach
// ~0.1 TFLOP/s per core there (profile of the 64-request mix: a third of the time in them),
// while one tdpbf16ps does 16 x 16 x 32 multiply-adds.
//
// The weights stay as they are ([N][K] rows, which is the A tile's layout: 16 output rows x
// 32 columns), and the activations become the B tile: per 32 columns, 16 rows of pairs
// [k pair][m][2], repacked once per call (M x K bf16, a few microseconds). C tiles hold
// out^T (16 output rows x 16 activation rows) and are transposed on the way out.
//
// Arithmetic: every product of two bf16 is exact in fp32 and tdpbf16ps adds them into fp32
// sums (round to nearest even, bf16 denormal inputs as zero), as vdpbf16ps does: the same
// arithmetic as the vdpbf16ps kernels in another summation order. A row's result does not
// depend on the other rows or the thread count (each sum runs over k in order), but a batch
// below kAmxMinRows sums in the vdpbf16ps order instead.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "common.h"

namespace tv {
namespace {

constexpr int64_t kTile = 16;  // rows of a tile; also activation rows per B tile
constexpr int64_t kStep = 32;  // bf16 columns per tile row (64 bytes)

// x [M][K] -> xp [M_pad / 16][K / 32][16 pairs][16 rows][2]: one B tile per (m block, k
// step), 1 KiB contiguous; rows past M are zeros.
void pack_rows(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp, int64_t mb) {
  const int64_t steps = K / kStep;
  uint32_t* blk = xp + mb * steps * kTile * kTile;
  for (int64_t s = 0; s < steps; ++s)
    for (int64_t p = 0; p < kTile; ++p)
      for (int64_t r = 0; r < kTile; ++r) {
        const int64_t m = mb * kTile + r;
        uint32_t v = 0;
        if (m < M) memcpy(&v, x + m * K + s * kStep + 2 * p, 4);
        blk[(s * kTile + p) * kTile + r] = v;
      }
}

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

// C tile [16 output rows][16 activation rows] -> out[m0 + r][n0 : n0 + 16] (+ bias), bf16.
TV_AMX void store_tile(const float* c, const float* bias16, uint16_t* out, int64_t N,
                       int64_t n0, int64_t m0, int64_t M) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + i * kTile);
  transpose16(r);
  const __m512 b = bias16 ? _mm512_loadu_ps(bias16) : _mm512_setzero_ps();
  for (int64_t j = 0; j < kTile && m0 + j < M; ++j) {
    const __m512 v = bias16 ? _mm512_add_ps(r[j], b) : r[j];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + j) * N + n0),
                        _mm512_cvtepi32_epi16(bf16_round_bits(v)));
  }
}

// Output rows [n0, n0 + 16 NB) for all M rows, two activation blocks at a time.
template <int NB>
TV_AMX void rows_item(const uint16_t* w, const uint32_t* xp, const void* bias, int b_dt,
                      uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t n0) {
  alignas(64) float c[4][kTile * kTile];
  alignas(64) float bias16[NB][kTile];
  for (int nb = 0; nb < NB; ++nb)
    for (int64_t i = 0; i < kTile; ++i)
      bias16[nb][i] = bias ? load(bias, n0 + nb * kTile + i, b_dt) : 0.0f;
  const int64_t steps = K / kStep, mblocks = (M + kTile - 1) / kTile;
  const int64_t btile = steps * kTile * kTile;  // uint32 per m block
  for (int64_t mb = 0; mb < mblocks; mb += 2) {
    const bool two = mb + 1 < mblocks;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint32_t* b0 = xp + mb * btile;
    for (int64_t s = 0; s < steps; ++s) {
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
    for (int nb = 0; nb < NB; ++nb)
      for (int j = 0; j < (two ? 2 : 1); ++j)
        store_tile(c[2 * nb + j], bias ? bias16[nb] : nullptr, out, N, n0 + nb * kTile,
                   (mb + j) * kTile, M);
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
  uint32_t* xp = static_cast<uint32_t*>(checked_aligned_alloc(mblocks * (K / kStep) * kTile * kTile * 4));
  parallel_for(mblocks, nthreads, [&](int64_t mb) { pack_rows(x, M, K, xp, mb); });
  // Items of 32 output rows: enough of them to balance two threads on the smallest linear
  // here (192 rows), each reading its weights once per two activation blocks.
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
