// Causal prefill attention for fresh prompts in bf16 on AMX tiles (Sapphire Rapids and later):
// prompts of any lengths with no cached context, each a run of rows of the step, head_dim 64.
//
// Why: a 4,096-token step of 8 x 512-token prompts on a SmolLM2-135M-shaped model spent ~0.25 s
// of ~0.93 s in torch's flash SDPA (0.3 TFLOP/s), while the step's GEMMs run at ~2.8 TFLOP/s
// on AMX. Here the two matmuls run on AMX tiles (16 x 16 fp32 results per tdpbf16ps pair), key
// tiles past a query block's diagonal are skipped, and softmax is one AVX-512 pass per score
// row in fp32.
//
// Arithmetic as torch's flash kernel for bf16: q.k^T accumulated in fp32, scaled, softmax in
// fp32 with the row max subtracted, the unnormalised probabilities rounded to bf16 for the
// second matmul (fp32 accumulation), multiplied by the reciprocal of the fp32 row sum at the end
// and rounded to bf16. The differences are summation order, no online rescaling (a whole score
// row is kept: 16 rows x L fp32 per block), exp (avx512_math.h's polynomial, within about an
// ulp) and probabilities below 2^-126 rounding to 0 (vcvtneps2bf16 flushes fp32 denormals;
// such terms cannot move a sum that holds the row max's 1).
//
// Layout: q rows [T][q_stride] (head h at column h * 64), k / v rows [T][kv_stride] (KV head g
// at g * 64), out rows [T][out_stride]; a prompt's tokens are consecutive rows; query head h
// reads KV head h / (Hq / Hkv). Two passes on the thread pool: K and V of each (prompt, KV
// head) are repacked into the tiles' pair-interleaved layout, then every (prompt, query head,
// block of 64 queries) is one item, the latest blocks (most keys) of all prompts first.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "amx_tiles.h"
#include "avx512_math.h"
#include "common.h"
#include "omp_team.h"

namespace tv {
namespace {

constexpr int64_t kDim = 64;         // head_dim the kernel takes
constexpr int64_t kRows = 16;        // query rows per tile block
constexpr int64_t kBlockRows = 64;   // query rows per work item
constexpr int64_t kKeyAlign = 32;    // keys are padded to the P tile's width

struct Shape {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;
  const int64_t* starts;  // first row of each prompt in q / k / v / out
  const int64_t* lens;    // tokens of each prompt in this step
  // Tokens of each prompt in the paged cache before this step (null: none has any), and
  // where they are: block_table[b * bt_stride + i] is the i-th block of prompt b in
  // k_cache / v_cache ([blocks][block_size][Hkv][64]; block_size a multiple of 16).
  const int64_t* ctx;
  const int32_t* block_table;
  int64_t bt_stride;
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  int64_t block_size;
  int64_t Hq, Hkv, q_stride, kv_stride, out_stride;
  float scale;
  bool exact_scale;  // scale is a power of two: products with it are exact
  // Repacked per (prompt, KV head): kt [kDim / 2][L_pad] and vv [L_pad / 2][kDim] of uint32,
  // each entry two bf16 (K: dims 2p, 2p + 1 of one key; V: keys 2p, 2p + 1 of one dim); L_pad
  // is the prompt's keys (context and step) rounded up to kKeyAlign, and a prompt's KV heads
  // follow each other from pack_off[b] (uint32 entries) on.
  const int64_t* pack_off;
  uint32_t* kt;
  uint32_t* vv;
};

inline int64_t padded(int64_t L) { return (L + kKeyAlign - 1) / kKeyAlign * kKeyAlign; }

inline int64_t context(const Shape& s, int64_t b) { return s.ctx ? s.ctx[b] : 0; }

// K / V rows n .. n + 15 (n a multiple of 16) of KV head g of prompt b: the step's own rows
// for a prompt without context, else the paged cache, which holds the step's keys too by now
// (the backend stores them first); 16 keys never straddle a block there.
struct KeyRows {
  const uint16_t* k;
  const uint16_t* v;
  int64_t stride;  // elements from one key's row to the next
};

inline KeyRows key_rows(const Shape& s, int64_t b, int64_t g, int64_t n) {
  if (context(s, b) == 0) {
    const int64_t off = (s.starts[b] + n) * s.kv_stride + g * kDim;
    return {s.k + off, s.v + off, s.kv_stride};
  }
  const int64_t block = s.block_table[b * s.bt_stride + n / s.block_size];
  const int64_t off = ((block * s.block_size + n % s.block_size) * s.Hkv + g) * kDim;
  return {s.k_cache + off, s.v_cache + off, s.Hkv * kDim};
}

// One work item: query rows [blk * kBlockRows, ...) of query head h of prompt b.
struct Item {
  int32_t b, h, blk;
};

// Pass 1: kt / vv of one (prompt, KV head); keys past the last are zero. K: a 32-bit
// transpose by gathers (16 keys of one dim pair each); V: two key rows interleaved by 16-bit
// permutes.
TV_AMX void repack(const Shape& s, int64_t item) {
  const int64_t b = item / s.Hkv, g = item % s.Hkv;
  const int64_t L = context(s, b) + s.lens[b], L_pad = padded(L);
  uint32_t* kt = s.kt + s.pack_off[b] + g * (kDim / 2) * L_pad;
  uint32_t* vv = s.vv + s.pack_off[b] + g * (kDim / 2) * L_pad;
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Gather offsets in 32-bit units: key row i of the 16 at i * stride / 2.
  const __m512i rows = _mm512_mullo_epi32(
      lanes, _mm512_set1_epi32(static_cast<int>(key_rows(s, b, g, 0).stride / 2)));
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t n = 0; n < L_pad; n += 16) {
    const int64_t left = L - n;
    const __mmask16 in =
        left >= 16 ? 0xFFFF : left > 0 ? static_cast<__mmask16>((1u << left) - 1) : 0;
    const KeyRows src = key_rows(s, b, g, left > 0 ? n : 0);
    const int* base = reinterpret_cast<const int*>(src.k);
    for (int64_t p = 0; p < kDim / 2; ++p) {
      const __m512i col =
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in, rows, base + p, 4);
      _mm512_storeu_si512(kt + p * L_pad + n, col);
    }
    for (int64_t j = 0; j < 16; j += 2) {
      uint32_t* dst = vv + (n + j) / 2 * kDim;
      for (int64_t half = 0; half < 2; ++half) {  // dims 0-31, 32-63
        const __m512i r0 = j < left ? _mm512_loadu_si512(src.v + j * src.stride + 32 * half)
                                    : _mm512_setzero_si512();
        const __m512i r1 = j + 1 < left
                               ? _mm512_loadu_si512(src.v + (j + 1) * src.stride + 32 * half)
                               : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 32 * half, _mm512_permutex2var_epi16(r0, lo, r1));
        _mm512_storeu_si512(dst + 32 * half + 16, _mm512_permutex2var_epi16(r0, hi, r1));
      }
    }
  }
}

// The step's rows [r0, r0 + rows) of query head h of prompt b (rows <= kRows), at positions
// c + r0 ... after the prompt's c cached tokens: keys [0, c + r0 + rows).
TV_AMX void attend_rows(const Shape& s, int64_t b, int64_t h, int64_t r0, int64_t rows,
                        float* scores, uint16_t* probs) {
  const int64_t g = h / (s.Hq / s.Hkv);
  const int64_t c = context(s, b);
  const int64_t ld = padded(c + s.lens[b]);  // row stride of kt, scores and probs
  const uint32_t* kt = s.kt + s.pack_off[b] + g * (kDim / 2) * ld;
  const uint32_t* vv = s.vv + s.pack_off[b] + g * (kDim / 2) * ld;
  const int64_t keys = c + r0 + rows;  // causal: up to the last row
  const int64_t keys_pad = padded(keys);

  // Q rows, zero past the prompt, as two A tiles (dims 0-31, 32-63).
  alignas(64) uint16_t qbuf[kRows * kDim];
  memset(qbuf, 0, sizeof(qbuf));
  for (int64_t i = 0; i < rows; ++i)
    memcpy(qbuf + i * kDim, s.q + (s.starts[b] + r0 + i) * s.q_stride + h * kDim, kDim * 2);
  // Two key tiles per step on separate registers (tiles are not renamed: reusing one
  // register would wait for the previous product): C in 0 / 1, K^T halves in 2 / 3 and 6 / 7.
  _tile_loadd(4, qbuf, kDim * 2);
  _tile_loadd(5, qbuf + 32, kDim * 2);
  for (int64_t j = 0; j < keys_pad; j += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, kt + j, ld * 4);
    _tile_loadd(3, kt + 16 * ld + j, ld * 4);
    _tile_loadd(6, kt + j + 16, ld * 4);
    _tile_loadd(7, kt + 16 * ld + j + 16, ld * 4);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(0, 5, 3);
    _tile_dpbf16ps(1, 5, 7);
    _tile_stored(0, scores + j, ld * 4);
    _tile_stored(1, scores + j + 16, ld * 4);
  }

  // Softmax numerators per row; probabilities past the row's own position are 0 (stored as
  // zeros up to keys_pad without computing them: the P V steps read whole 32-key steps).
  // The row max is taken over the raw scores and scaled once: scaling by a positive number
  // rounds monotonically, so it equals the max of the scaled scores bit for bit. Four
  // accumulators, as one would wait on each max's latency.
  float inv_sum[kRows];
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t i = 0; i < kRows; ++i) {
    float* srow = scores + i * ld;
    uint16_t* prow = probs + i * ld;
    const int64_t valid = i < rows ? c + r0 + i + 1 : 0;
    __m512 mx[4];
    for (int a = 0; a < 4; ++a) mx[a] = _mm512_set1_ps(-INFINITY);
    int64_t n = 0;
    for (; n + 64 <= valid; n += 64)
      for (int a = 0; a < 4; ++a) mx[a] = _mm512_max_ps(mx[a], _mm512_loadu_ps(srow + n + 16 * a));
    for (; n + 16 <= valid; n += 16) mx[0] = _mm512_max_ps(mx[0], _mm512_loadu_ps(srow + n));
    const __mmask16 tail = static_cast<__mmask16>((1u << (valid - n)) - 1);
    if (valid > n) mx[1] = _mm512_mask_max_ps(mx[1], tail, mx[1], _mm512_loadu_ps(srow + n));
    const __m512 mm = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
    const __m512 m = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(mm)), scale);
    __m512 sum = _mm512_setzero_ps();
    for (n = 0; n < valid; n += 16) {
      const int64_t left = valid - n;
      const __mmask16 keep = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      // (s * scale) - m: with a power-of-two scale (head_dim 64) the product is exact (short
      // of fp32's denormal range), so one fused rounding is the same as two.
      const __m512 sv = _mm512_loadu_ps(srow + n);
      const __m512 x = s.exact_scale ? _mm512_fmsub_ps(sv, scale, m)
                                     : _mm512_sub_ps(_mm512_mul_ps(sv, scale), m);
      // x <= 0 in the kept lanes: only the lower clamp applies, and the mask is folded into
      // exp's final scaling (the same bits as masking exp16's result, two instructions fewer
      // in a loop of ~20 that is half of the kernel's time).
      const __m512 e = exp16_in_range(keep, _mm512_max_ps(x, _mm512_set1_ps(-110.0f)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + n),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    }
    for (; n < keys_pad; n += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + n), _mm256_setzero_si256());
    const float total = _mm512_reduce_add_ps(sum);
    inv_sum[i] = total > 0.0f ? 1.0f / total : 0.0f;
  }

  // O = P V over 32-key steps into four 16 x 16 tiles (dims 0-15 ... 48-63).
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t j = 0; j < keys_pad; j += 32) {
    _tile_loadd(4, probs + j, ld * 2);
    const uint32_t* vrow = vv + (j / 2) * kDim;
    _tile_loadd(5, vrow, kDim * 4);
    _tile_loadd(6, vrow + 16, kDim * 4);
    _tile_loadd(7, vrow + 32, kDim * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, vrow + 48, kDim * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) float obuf[kRows * kDim];
  _tile_stored(0, obuf, kDim * 4);
  _tile_stored(1, obuf + 16, kDim * 4);
  _tile_stored(2, obuf + 32, kDim * 4);
  _tile_stored(3, obuf + 48, kDim * 4);
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* dst = s.out + (s.starts[b] + r0 + i) * s.out_stride + h * kDim;
    const __m512 inv = _mm512_set1_ps(inv_sum[i]);
    for (int64_t d = 0; d < kDim; d += 16) {
      // The division as torch's kernel does it: multiply by the reciprocal of the sum.
      const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(obuf + i * kDim + d), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          _mm512_cvtepi32_epi16(bf16_round_bits(o)));
    }
  }
}

TV_AMX void attend_block(const Shape& s, const Item& it, int64_t max_pad) {
  // Scores and probabilities of one 16-row block, kept per thread across calls.
  thread_local std::vector<float> scores;
  thread_local std::vector<uint16_t> probs;
  const size_t need = static_cast<size_t>(kRows * max_pad);
  if (scores.size() < need) {
    scores.resize(need);
    probs.resize(need);
  }
  load_tile_config();
  const int64_t end = std::min(s.lens[it.b], (it.blk + 1) * kBlockRows);
  for (int64_t r0 = it.blk * kBlockRows; r0 < end; r0 += kRows)
    attend_rows(s, it.b, it.h, r0, std::min(kRows, end - r0), scores.data(), probs.data());
  _tile_release();
}

// The items, those with the most keys first, so that the short ones even out the threads at
// the end of the region.
std::vector<Item> items_by_keys(const Shape& s, int64_t n) {
  std::vector<Item> items;
  for (int64_t b = 0; b < n; ++b)
    for (int64_t blk = 0; blk * kBlockRows < s.lens[b]; ++blk)
      for (int64_t h = 0; h < s.Hq; ++h)
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h),
                         static_cast<int32_t>(blk)});
  auto keys = [&](const Item& it) {
    return context(s, it.b) + std::min(s.lens[it.b], (it.blk + 1) * kBlockRows);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& x, const Item& y) { return keys(x) > keys(y); });
  return items;
}

}  // namespace
}  // namespace tv

// See the top of the file; call only where tv_amx_supported() (amx_linear.cpp) returned 1.
// n prompts, prompt b's step rows [starts[b], starts[b] + lens[b]) of q / k / v / out
// (lens[b] >= 1) after ctx[b] tokens in the paged cache (see Shape; ctx null: no context, and
// the cache arguments are not read).
// `omp_parallel`: the address of GOMP_parallel in the OpenMP runtime torch runs its ops on, or
// null for the library's thread pool. Why torch's team: this call sits between torch GEMMs,
// after which torch's OpenMP workers spin (by default for milliseconds) on the cores the
// pool's workers would need; its own team picks the work up instead.
extern "C" void tv_prefill_attn_amx(const void* q, const void* k, const void* v, void* out,
                                    int64_t n, const int64_t* starts, const int64_t* lens,
                                    const int64_t* ctx, const int32_t* block_table,
                                    int64_t bt_stride, const void* k_cache, const void* v_cache,
                                    int64_t block_size, int64_t Hq, int64_t Hkv,
                                    int64_t q_stride, int64_t kv_stride, int64_t out_stride,
                                    float scale, int nthreads, const void* omp_parallel) {
  const tv::OmpParallelFn omp = tv::omp_team(omp_parallel);
  std::vector<int64_t> pack_off(static_cast<size_t>(n) + 1, 0);
  int64_t max_pad = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t L_pad = tv::padded((ctx ? ctx[b] : 0) + lens[b]);
    pack_off[b + 1] = pack_off[b] + Hkv * (tv::kDim / 2) * L_pad;
    max_pad = std::max(max_pad, L_pad);
  }
  int exponent = 0;
  const bool exact_scale = scale > 0.0f && frexpf(scale, &exponent) == 0.5f;
  const int64_t packed = pack_off[n];  // uint32 entries each of kt, vv
  uint32_t* buf = static_cast<uint32_t*>(tv::checked_aligned_alloc(2 * packed * 4));
  const tv::Shape s{static_cast<const uint16_t*>(q),
                    static_cast<const uint16_t*>(k),
                    static_cast<const uint16_t*>(v),
                    static_cast<uint16_t*>(out),
                    starts,
                    lens,
                    ctx,
                    block_table,
                    bt_stride,
                    static_cast<const uint16_t*>(k_cache),
                    static_cast<const uint16_t*>(v_cache),
                    block_size,
                    Hq,
                    Hkv,
                    q_stride,
                    kv_stride,
                    out_stride,
                    scale,
                    exact_scale,
                    pack_off.data(),
                    buf,
                    buf + packed};
  tv::run_items(omp, n * Hkv, nthreads, [&](int64_t i) { tv::repack(s, i); });
  const std::vector<tv::Item> items = tv::items_by_keys(s, n);
  tv::run_items(omp, static_cast<int64_t>(items.size()), nthreads,
                [&](int64_t i) { tv::attend_block(s, items[i], max_pad); });
  free(buf);
}
