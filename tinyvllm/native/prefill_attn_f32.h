// Causal prefill attention in fp32 on FMA units, for CPUs without AMX: the prompts and chunks
// of a step (any lengths, with or without cached context) in one call, written once for a
// vector width. `V` is AVX2 (prefill_attn_avx2.cpp) or AVX-512 Foundation
// (prefill_attn_avx512f.cpp). Include it after the file's target pragma: its templates compile
// for that ISA.
//
// Why: without bf16 dot products the torch backend computes prefill attention in fp32, with
// torch's flash SDPA (~90 GFLOP/s on a 2-core Ice Lake, a fifth of a 4,096-token step of a
// SmolLM2-135M-shaped model) after copying q / k / v to fp32, and with one masked SDPA call per
// prompt that has cached context (its context gathered from the paged cache first). Here q / k /
// v are read in place from the fused projection's rows (bf16 or fp32), key tiles past each
// query tile's diagonal are skipped, and the two matmuls are register-tiled FMAs.
//
// Arithmetic: fp32 throughout, as torch's flash kernel for fp32: scores q.k (q scaled first:
// exact for the power-of-two scales of head_dim 64 and 256), online softmax over chunks of
// kChunk keys (running max and sum, earlier output rescaled), the output divided by the sum at
// the end (multiplied by its reciprocal) and rounded to the output dtype. The differences from
// torch are summation order and exp (a polynomial within about an ulp).
//
// V provides: F (float register), kLanes, kTile (registers per micro-tile row: keys kTile *
// kLanes per score tile, dims kTile * kLanes per output pass), zero, set1, load, load_bf16,
// store, gather(p, stride) (lane i: p[i * stride]), fmadd, mul, sub, add, max, first(x, n, fill) (lanes >= n set to fill), hmax, hsum,
// exp_nonpos (exp of x <= 0, about an ulp; lanes past the range give 0).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "omp_team.h"

namespace tv {
namespace prefill_f32 {

constexpr int64_t kMaxDim = 256;                 // head_dim up to this, a multiple of the pass
constexpr int64_t kRows = 6;                     // query rows per micro-tile
constexpr int64_t kTiles = 8;                    // micro-tiles per work item
constexpr int64_t kBlockRows = kRows * kTiles;   // query rows per work item
constexpr int64_t kChunk = 256;                  // keys per online-softmax step
constexpr int64_t kKeyAlign = 64;                // packed keys per prompt: a multiple of this

struct Args {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int dt;  // of q, k, v, out and the cache: 0 float32, 1 bfloat16
  const int64_t* starts;  // first row of each prompt in q / k / v / out
  const int64_t* lens;    // tokens of each prompt in this step
  // Tokens of each prompt in the paged cache before this step (null: none has any), and
  // where: block_table[b * bt_stride + i] is the i-th block of prompt b in k_cache / v_cache
  // ([blocks][block_size][Hkv][D]), which hold the step's own keys too.
  const int64_t* ctx;
  const int32_t* block_table;
  int64_t bt_stride;
  const void* k_cache;
  const void* v_cache;
  int64_t block_size;
  int64_t Hq, Hkv, D, q_stride, kv_stride, out_stride;
  float scale;
  // Packed per (prompt, KV head), from pack_off[b] + g * D * L_pad floats on (L_pad: the
  // prompt's keys rounded up to kKeyAlign; keys past the last are zero): kt holds K tile by
  // tile, [L_pad / tile][D][tile] for score tiles of `tile` keys; vv holds V as [L_pad][D].
  const int64_t* pack_off;
  float* kt;
  float* vv;
};

// The AVX-512 Foundation instantiation of `run` (prefill_attn_avx512f.cpp).
void run_avx512f(Args a, int64_t n, int nthreads, OmpParallelFn omp);

// Everything below is internal to the file that includes it: each file compiles it for its
// own ISA, so no copy may be shared at link time.
namespace {

inline int64_t padded(int64_t L) { return (L + kKeyAlign - 1) / kKeyAlign * kKeyAlign; }

inline int64_t context(const Args& a, int64_t b) { return a.ctx ? a.ctx[b] : 0; }

// Key / value row n of KV head g of prompt b (element offset into k / v or the cache).
struct KeyRow {
  const void* k;
  const void* v;
  int64_t off;
};

inline KeyRow key_row(const Args& a, int64_t b, int64_t g, int64_t n) {
  if (context(a, b) == 0) return {a.k, a.v, (a.starts[b] + n) * a.kv_stride + g * a.D};
  const int64_t block = a.block_table[b * a.bt_stride + n / a.block_size];
  return {a.k_cache, a.v_cache, ((block * a.block_size + n % a.block_size) * a.Hkv + g) * a.D};
}

template <class V>
inline typename V::F load_any(const void* p, int dt, int64_t i) {
  return dt ? V::load_bf16(static_cast<const uint16_t*>(p) + i)
            : V::load(static_cast<const float*>(p) + i);
}

// Pass 1, one (prompt, KV head): K and V to fp32 in their packed layouts. K goes through
// kLanes rows at a time, transposed by gathers from a small row-major copy (scalar stores
// into the tiles took a quarter of the call on 64-token prompts).
template <class V>
void pack(const Args& a, int64_t item) {
  constexpr int64_t W = V::kLanes, KT = V::kTile * V::kLanes;
  const int64_t b = item / a.Hkv, g = item % a.Hkv, D = a.D;
  const int64_t L = context(a, b) + a.lens[b], L_pad = padded(L);
  float* kt = a.kt + a.pack_off[b] + g * D * L_pad;
  float* vv = a.vv + a.pack_off[b] + g * D * L_pad;
  alignas(64) float rows[W * kMaxDim];
  for (int64_t n0 = 0; n0 < L_pad; n0 += W) {
    for (int64_t i = 0; i < W; ++i) {
      const int64_t n = n0 + i;
      if (n >= L) {
        memset(rows + i * D, 0, D * sizeof(float));
        memset(vv + n * D, 0, D * sizeof(float));
        continue;
      }
      const KeyRow src = key_row(a, b, g, n);
      for (int64_t d = 0; d < D; d += W) {
        V::store(rows + i * D + d, load_any<V>(src.k, a.dt, src.off + d));
        V::store(vv + n * D + d, load_any<V>(src.v, a.dt, src.off + d));
      }
    }
    float* tile = kt + (n0 / KT) * D * KT + n0 % KT;
    for (int64_t d = 0; d < D; ++d) V::store(tile + d * KT, V::gather(rows + d, D));
  }
}

// Scores of the micro-tile's kRows query rows q [kRows][D] (scaled) against keys [k0, k0 +
// count) (count a multiple of the score tile) into s [kRows][kChunk] from column 0.
template <class V>
void scores(const float* q, const float* kt, int64_t D, int64_t k0, int64_t count, float* s) {
  using F = typename V::F;
  constexpr int NR = V::kTile;
  constexpr int64_t W = V::kLanes, KT = NR * W;
  for (int64_t n = 0; n < count; n += KT) {
    const float* tile = kt + (k0 + n) / KT * D * KT;
    F acc[kRows][NR];
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = V::zero();
    for (int64_t d = 0; d < D; ++d) {
      F kv[NR];
      for (int j = 0; j < NR; ++j) kv[j] = V::load(tile + d * KT + j * W);
      for (int r = 0; r < kRows; ++r) {
        const F qv = V::set1(q[r * D + d]);
        for (int j = 0; j < NR; ++j) acc[r][j] = V::fmadd(qv, kv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < NR; ++j) V::store(s + r * kChunk + n + j * W, acc[r][j]);
  }
}

// o [kRows][D] += p [kRows][kChunk] (columns [0, count)) times V rows [k0, k0 + count).
template <class V>
void accumulate(const float* p, const float* vv, int64_t D, int64_t k0, int64_t count,
                float* o) {
  using F = typename V::F;
  constexpr int NR = V::kTile;
  constexpr int64_t W = V::kLanes, DT = NR * W;
  for (int64_t d0 = 0; d0 < D; d0 += DT) {
    F acc[kRows][NR];
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = V::load(o + r * D + d0 + j * W);
    const float* vrow = vv + k0 * D + d0;
    for (int64_t n = 0; n < count; ++n, vrow += D) {
      F vx[NR];
      for (int j = 0; j < NR; ++j) vx[j] = V::load(vrow + j * W);
      for (int r = 0; r < kRows; ++r) {
        const F pv = V::set1(p[r * kChunk + n]);
        for (int j = 0; j < NR; ++j) acc[r][j] = V::fmadd(pv, vx[j], acc[r][j]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < NR; ++j) V::store(o + r * D + d0 + j * W, acc[r][j]);
  }
}

// Online softmax of one score row over its `valid` keys of this chunk (0 < valid <= width):
// probabilities in place, zero over [valid, width); returns the factor earlier terms take.
template <class V>
float softmax_step(float* s, int64_t valid, int64_t width, float& m, float& l) {
  using F = typename V::F;
  constexpr int64_t W = V::kLanes;
  F mx = V::set1(-INFINITY);
  int64_t n = 0;
  for (; n + W <= valid; n += W) mx = V::max(mx, V::load(s + n));
  if (n < valid) mx = V::max(mx, V::first(V::load(s + n), valid - n, -INFINITY));
  const float m_new = std::max(m, V::hmax(mx));
  const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
  const F mv = V::set1(m_new);
  F sum = V::zero();
  for (n = 0; n < width; n += W) {
    F e = V::exp_nonpos(V::sub(V::load(s + n), mv));
    if (n + W > valid) e = V::first(e, std::max<int64_t>(valid - n, 0), 0.0f);
    sum = V::add(sum, e);
    V::store(s + n, e);
  }
  m = m_new;
  l = l * alpha + V::hsum(sum);
  return alpha;
}

struct Item {
  int32_t b, h, blk;
};

// Pass 2, one item: query rows [blk * kBlockRows, ...) of query head h of prompt b, at
// positions c + r after the prompt's c cached tokens (keys [0, c + r] for row r).
template <class V>
void attend_block(const Args& a, const Item& it) {
  using F = typename V::F;
  constexpr int64_t W = V::kLanes, KT = V::kTile * V::kLanes;
  thread_local std::vector<float> buf;
  const int64_t D = a.D, b = it.b, h = it.h;
  const size_t need = static_cast<size_t>(2 * kBlockRows * D + kRows * kChunk + 2 * kBlockRows);
  if (buf.size() < need) buf.resize(need);
  float* qb = buf.data();           // [kBlockRows][D], scaled
  float* ob = qb + kBlockRows * D;  // [kBlockRows][D], unnormalised output
  float* sb = ob + kBlockRows * D;  // [kRows][kChunk] scores, then probabilities
  float* mrow = sb + kRows * kChunk;
  float* lrow = mrow + kBlockRows;

  const int64_t g = h / (a.Hq / a.Hkv), c = context(a, b);
  const int64_t r0 = it.blk * kBlockRows, rows = std::min(kBlockRows, a.lens[b] - r0);
  const int64_t L_pad = padded(c + a.lens[b]);
  const float* kt = a.kt + a.pack_off[b] + g * D * L_pad;
  const float* vv = a.vv + a.pack_off[b] + g * D * L_pad;
  const F scale = V::set1(a.scale);
  for (int64_t i = 0; i < kBlockRows; ++i) {
    mrow[i] = -INFINITY;
    lrow[i] = 0.0f;
    for (int64_t d = 0; d < D; d += W) {
      V::store(ob + i * D + d, V::zero());
      const F x = i < rows ? V::mul(load_any<V>(a.q, a.dt, (a.starts[b] + r0 + i) * a.q_stride +
                                                               h * D + d),
                                    scale)
                           : V::zero();
      V::store(qb + i * D + d, x);
    }
  }
  const int64_t tiles = (rows + kRows - 1) / kRows;
  for (int64_t k0 = 0; k0 < c + r0 + rows; k0 += kChunk) {
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t tr = t * kRows, trows = std::min(kRows, rows - tr);
      const int64_t keys = c + r0 + tr + trows;  // of the tile's last row
      if (k0 >= keys) continue;  // a later tile (more keys) may still reach this chunk
      const int64_t width = std::min(kChunk, keys - k0);
      scores<V>(qb + tr * D, kt, D, k0, (width + KT - 1) / KT * KT, sb);
      for (int64_t i = 0; i < kRows; ++i) {
        float* s = sb + i * kChunk;
        const int64_t valid = i < trows ? std::min(width, c + r0 + tr + i + 1 - k0) : 0;
        if (valid <= 0) {
          memset(s, 0, width * sizeof(float));
          continue;
        }
        const float alpha = softmax_step<V>(s, valid, width, mrow[tr + i], lrow[tr + i]);
        if (alpha != 1.0f) {
          const F av = V::set1(alpha);
          float* o = ob + (tr + i) * D;
          for (int64_t d = 0; d < D; d += W) V::store(o + d, V::mul(V::load(o + d), av));
        }
      }
      accumulate<V>(sb, vv, D, k0, width, ob + tr * D);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = 1.0f / lrow[i];
    const int64_t row = (a.starts[b] + r0 + i) * a.out_stride + h * D;
    for (int64_t d = 0; d < D; ++d) store(a.out, row + d, ob[i * D + d] * inv, a.dt);
  }
}

// The items, those with the most keys first, so that the short ones even out the threads at
// the end of the region; a KV head's query heads next to each other (they read the same
// packed K / V).
inline std::vector<Item> items_by_keys(const Args& a, int64_t n) {
  std::vector<Item> items;
  for (int64_t b = 0; b < n; ++b)
    for (int64_t blk = 0; blk * kBlockRows < a.lens[b]; ++blk)
      for (int64_t h = 0; h < a.Hq; ++h)
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h),
                         static_cast<int32_t>(blk)});
  auto keys = [&](const Item& it) {
    return context(a, it.b) + std::min(a.lens[it.b], (it.blk + 1) * kBlockRows);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& x, const Item& y) { return keys(x) > keys(y); });
  return items;
}

// The whole call: packs, then attends, on `omp`'s team or the thread pool.
template <class V>
void run(Args a, int64_t n, int nthreads, OmpParallelFn omp) {
  std::vector<int64_t> pack_off(static_cast<size_t>(n) + 1, 0);
  for (int64_t b = 0; b < n; ++b)
    pack_off[b + 1] = pack_off[b] + a.Hkv * a.D * padded(context(a, b) + a.lens[b]);
  const int64_t packed = pack_off[n];
  float* buf = static_cast<float*>(checked_aligned_alloc(2 * packed * 4));
  a.pack_off = pack_off.data();
  a.kt = buf;
  a.vv = buf + packed;
  run_items(omp, n * a.Hkv, nthreads, [&](int64_t i) { pack<V>(a, i); });
  const std::vector<Item> items = items_by_keys(a, n);
  run_items(omp, static_cast<int64_t>(items.size()), nthreads,
            [&](int64_t i) { attend_block<V>(a, items[i]); });
  free(buf);
}

}  // namespace
}  // namespace prefill_f32
}  // namespace tv
