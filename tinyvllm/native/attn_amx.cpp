// AMX variant of tv_paged_decode for bf16 caches with head_dim 64 and 16-position chunks
// (cpu_kernels.cpp tries it first on AVX-512 CPUs; it declines what does not fit, see
// paged_decode_amx below, and the AVX-512 kernel in attn_avx512.cpp runs instead).
//
// Why: at batch 64 x a few hundred positions (SmolLM2-135M: 9 query heads on 3 KV heads) the
// decode attention was the largest part of a step, and most of the AVX-512 kernel's
// instructions went to the scores: per key a bf16 -> fp32 convert and one FMA per 16 dims and
// query head, then a shuffle tree. Here the scores of 16 positions x the item's G query heads
// are two tdpbf16ps: the K rows straight from the cache are the A tiles (16 positions x 32
// dims, row stride Hkv * 64 elements, no repack) and the G query heads, repacked once per item
// into dim pairs, the B tiles. Items, softmax and value pass are the AVX-512 kernel's: one item
// per (query token, KV head), weights in fp32, V rows into register accumulators.
//
// Arithmetic: scores are fp32 sums of exact bf16 products as before, in another order (and
// tdpbf16ps takes denormal inputs as zero and flushes denormal sums: terms below 2^-126). The
// softmax is the same sequence of fp32 steps (scale, soft-cap, max, exp, reciprocal of the
// sum), on scores laid out [position][head] (the tile's) instead of [head][position], so only
// the order of the max and sum reductions differs.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <atomic>

#include "amx_tiles.h"
#include "common.h"
#include "paged_decode.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

#include "attn_value.h"  // after the pragma: its templates compile for this target

namespace tv {
namespace {

constexpr int64_t kDim = 64;       // head_dim the kernel takes: two 32-dim A tiles
constexpr int64_t kChunk = 16;     // positions per score tile (one tile's rows)
constexpr int64_t kMaxGroup = 16;  // query heads per KV head: the columns of a score tile
// Fewest positions per query token, on average over a call, for which this kernel beats the
// AVX-512 one. Batch 64 on the SmolLM2-135M shape, 30 layers' caches, interleaved (AVX-512 ->
// AMX ms per step): mean 64 positions 6.0 -> 7.8, mean 128 12.7 -> 12.7, mean 224 22.9 ->
// 20.5, mean 350 41 -> 35. Per item the tile configuration, the query repack and two partial
// chunks cost the same at any length; the scores save per position.
constexpr int64_t kMinMeanPositions = 160;

// Whether fitting shapes take this kernel (tv_set_decode_amx), and how many calls it took
// (tv_decode_amx_calls): tests compare both kernels and check which one ran.
std::atomic<bool> g_allowed{true};
std::atomic<int64_t> g_calls{0};

struct Shape {
  const uint16_t* kc;  // K half of the layer's cache
  const uint16_t* vc;  // V half
  int64_t block_size, group, row_elems;  // row_elems: Hkv * kDim, one position's row
  float scale, softcap;
};

// Tiles 0, 1: scores of two chunks (16 positions x G fp32); 2, 3 and 6, 7: their K rows (16
// positions x 32 dims, dims 0-31 and 32-63); 4, 5: the query heads (16 dim pairs x G).
TV_AMX void load_config(int64_t G) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>(t == 0 || t == 1 || t == 4 || t == 5 ? 4 * G : 64);
  }
  _tile_loadconfig(&cfg);
}

// One line into cache. Inline assembly: GCC 12 folds a counted loop of _mm_prefetch calls
// on affine addresses into its first call (the others are dropped as side-effect free).
template <int Hint>
inline void prefetch_line(const char* p) {
  if (Hint == _MM_HINT_T0) asm volatile("prefetcht0 %0" : : "m"(*p));
  else if (Hint == _MM_HINT_T1) asm volatile("prefetcht1 %0" : : "m"(*p));
  else if (Hint == _MM_HINT_T2) asm volatile("prefetcht2 %0" : : "m"(*p));
  else asm volatile("prefetchnta %0" : : "m"(*p));
}

// The 16 rows of kDim bf16 at p, `stride` bytes apart (two lines each).
template <int Hint>
inline void prefetch_rows(const uint16_t* p, int64_t stride) {
  const char* r = reinterpret_cast<const char*>(p);
  for (int j = 0; j < 16; ++j) {
    prefetch_line<Hint>(r + j * stride);
    prefetch_line<Hint>(r + j * stride + 64);
  }
}

// Raw scores of chunks [0, nc) (chunk c's 16 rows start at element kb[c] of each cache half)
// into s [nc * 16][G]; the query tiles are loaded. Two chunks per step on separate tiles
// (tiles are not renamed: reusing one would wait for the product before). The cache is too
// scattered for the hardware prefetchers: each step fetches the next step's K rows into L1
// and its own V rows into L2 for the value pass.
TV_AMX void scores(const Shape& sh, const int64_t* kb, int64_t nc, float* s) {
  const int64_t stride = sh.row_elems * 2, G = sh.group;
  const uint16_t* kc = sh.kc;
  for (int64_t c = 0; c < 2 && c < nc; ++c) prefetch_rows<_MM_HINT_T0>(kc + kb[c], stride);
  for (int64_t c = 0; c < nc; c += 2) {
    const bool two = c + 1 < nc;
    for (int64_t j = c; j < c + 2 && j < nc; ++j) {
      if (j + 2 < nc) prefetch_rows<_MM_HINT_T0>(kc + kb[j + 2], stride);
      prefetch_rows<_MM_HINT_T1>(sh.vc + kb[j], stride);
    }
    const uint16_t* k0 = kc + kb[c];
    const uint16_t* k1 = kc + kb[two ? c + 1 : c];
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, k0, stride);
    _tile_loadd(3, k0 + 32, stride);
    _tile_loadd(6, k1, stride);
    _tile_loadd(7, k1 + 32, stride);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 6, 4);
    _tile_dpbf16ps(0, 3, 5);
    _tile_dpbf16ps(1, 7, 5);
    _tile_stored(0, s + c * kChunk * G, 4 * G);
    if (two) _tile_stored(1, s + (c + 1) * kChunk * G, 4 * G);
  }
}

// Softmax weights in place over s [e / G position][e % G head], elements [0, E); those before
// `lead` and from `valid_end` on are positions outside the item, set to -inf after the
// soft-cap so that exp makes them exactly 0 (and whatever the cache holds there drops out).
TV_AMX void softmax(const Shape& sh, float* s, int64_t E, int64_t lead, int64_t valid_end) {
  const int64_t G = sh.group;
  if (sh.softcap > 0.0f)  // no vector tanh: scalar, as the other kernels do
    for (int64_t e = 0; e < E; ++e) s[e] = tanhf(s[e] * sh.scale / sh.softcap) * sh.softcap;
  for (int64_t e = 0; e < lead; ++e) s[e] = -INFINITY;
  for (int64_t e = valid_end; e < E; ++e) s[e] = -INFINITY;
  // Lane l of vector k is head (16 k + l) % G: the pattern repeats every P vectors.
  const int64_t low = G & -G, P = G / (low < 16 ? low : 16);
  __m512 acc[kMaxGroup], pat[kMaxGroup];
  alignas(64) float buf[16 * kMaxGroup];
  float per_head[kMaxGroup];
  for (int64_t v = 0; v < P; ++v) acc[v] = _mm512_set1_ps(-INFINITY);
  const __m512 scale = _mm512_set1_ps(sh.softcap > 0.0f ? 1.0f : sh.scale);
  for (int64_t k = 0, v = 0; k < E / 16; ++k, v = v + 1 == P ? 0 : v + 1) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * k), scale);
    _mm512_storeu_ps(s + 16 * k, x);
    acc[v] = _mm512_max_ps(acc[v], x);
  }
  for (int64_t v = 0; v < P; ++v) _mm512_storeu_ps(buf + 16 * v, acc[v]);
  for (int64_t h = 0; h < G; ++h) per_head[h] = -INFINITY;
  for (int64_t e = 0; e < 16 * P; ++e) per_head[e % G] = fmaxf(per_head[e % G], buf[e]);
  for (int64_t e = 0; e < 16 * P; ++e) buf[e] = per_head[e % G];
  for (int64_t v = 0; v < P; ++v) {
    pat[v] = _mm512_loadu_ps(buf + 16 * v);
    acc[v] = _mm512_setzero_ps();
  }
  for (int64_t k = 0, v = 0; k < E / 16; ++k, v = v + 1 == P ? 0 : v + 1) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * k), pat[v]));
    _mm512_storeu_ps(s + 16 * k, e);
    acc[v] = _mm512_add_ps(acc[v], e);
  }
  for (int64_t v = 0; v < P; ++v) _mm512_storeu_ps(buf + 16 * v, acc[v]);
  for (int64_t h = 0; h < G; ++h) per_head[h] = 0.0f;
  for (int64_t e = 0; e < 16 * P; ++e) per_head[e % G] += buf[e];
  for (int64_t e = 0; e < 16 * P; ++e) buf[e] = 1.0f / per_head[e % G];
  for (int64_t v = 0; v < P; ++v) pat[v] = _mm512_loadu_ps(buf + 16 * v);
  for (int64_t k = 0, v = 0; k < E / 16; ++k, v = v + 1 == P ? 0 : v + 1)
    _mm512_storeu_ps(s + 16 * k, _mm512_mul_ps(_mm512_loadu_ps(s + 16 * k), pat[v]));
}

// One (query token, KV head): its group's query heads (q, kDim each) over positions
// [first, L) of its block list; out: [group][kDim] fp32.
TV_AMX void item(const Shape& sh, const int32_t* blocks, int64_t kh, int64_t first, int64_t L,
                 const uint16_t* q, Scratch& scratch, float* out) {
  const int64_t G = sh.group, a0 = first / kChunk * kChunk, n = L - first;
  const int64_t nc = (L - a0 + kChunk - 1) / kChunk, E = nc * kChunk * G;
  int64_t* kb = static_cast<int64_t*>(scratch.get((nc + n) * 8 + E * 4));
  int64_t* off = kb + nc;
  float* s = reinterpret_cast<float*>(off + n);
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t pos = a0 + c * kChunk;
    kb[c] = (static_cast<int64_t>(blocks[pos / sh.block_size]) * sh.block_size +
             pos % sh.block_size) * sh.row_elems + kh * kDim;
  }
  for (int64_t p = 0; p < n; ++p) {
    const int64_t r = first - a0 + p;
    off[p] = kb[r / kChunk] + r % kChunk * sh.row_elems;
  }
  // Query tiles: row pr % 16 of tile pr / 16 holds dims 2 pr, 2 pr + 1 of each head.
  alignas(64) uint32_t qb[2 * 16 * kMaxGroup];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t pr = 0; pr < kDim / 2; ++pr) memcpy(qb + pr * G + g, q + g * kDim + 2 * pr, 4);
  load_config(G);
  _tile_loadd(4, qb, 4 * G);
  _tile_loadd(5, qb + 16 * G, 4 * G);
  scores(sh, kb, nc, s);
  _tile_release();
  const int64_t lead = (first - a0) * G;
  softmax(sh, s, E, lead, (L - a0) * G);
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int gb = G - g0 < 4 ? static_cast<int>(G - g0) : 4;
    value_any(gb, sh.vc, off, n, s + lead + g0, 1, G, out + g0 * kDim, kDim);
  }
}

}  // namespace

// tv_paged_decode's arguments and contract (cpu_kernels.cpp) where the cache is bf16,
// head_dim 64, blocks whole 16-position chunks, at most 16 query heads per KV head, the query
// tokens attend over kMinMeanPositions or more on average, and the CPU and OS allow AMX;
// false (nothing written) otherwise.
bool paged_decode_amx(const PagedDecode& a) {
  const int64_t hkv = a.hkv, block_size = a.block_size;
  if (a.dt != 1 || a.head_dim != kDim || block_size % kChunk != 0 || a.hq % hkv != 0 ||
      a.hq / hkv > kMaxGroup || !g_allowed.load(std::memory_order_relaxed) || !amx_supported())
    return false;
  int64_t positions = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t L = a.length(i);
    positions += L - a.first(L);
  }
  if (positions < kMinMeanPositions * a.n) return false;
  g_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t G = a.hq / hkv;
  const uint16_t* kc = static_cast<const uint16_t*>(a.kv);
  const Shape sh{kc, kc + a.num_blocks * block_size * hkv * kDim, block_size, G, hkv * kDim,
                 a.scale, a.softcap};
  parallel_for(a.n * hkv, a.nthreads, [&](int64_t it) {
    thread_local Scratch scratch;
    const int64_t i = it / hkv, h0 = it % hkv * G;
    const int64_t L = a.length(i);
    alignas(64) float acc[kMaxGroup * kDim];
    item(sh, a.blocks(i), it % hkv, a.first(L), L,
         static_cast<const uint16_t*>(a.q) + a.tok[i] * a.q_stride + h0 * kDim, scratch, acc);
    uint16_t* o = static_cast<uint16_t*>(a.out) + (a.tok[i] * a.hq + h0) * kDim;
    for (int64_t e = 0; e < G * kDim; e += 16)  // rounded as common.h's f32_to_bf16
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + e),
                          _mm512_cvtepi32_epi16(bf16_round_bits(_mm512_loadu_ps(acc + e))));
  });
  return true;
}

}  // namespace tv

// Whether bf16 decode attention of fitting shapes may run on AMX tiles (1, the default) or
// must take the AVX-512 kernel (0); returns whether it now runs on AMX where it fits (0 on
// CPUs without AMX). For tests and benchmarks that compare the two kernels.
extern "C" int tv_set_decode_amx(int allow) {
  tv::g_allowed.store(allow != 0, std::memory_order_relaxed);
  return allow != 0 && tv::amx_supported() ? 1 : 0;
}

// How many tv_paged_decode calls the AMX kernel has run in this process.
extern "C" int64_t tv_decode_amx_calls(void) {
  return tv::g_calls.load(std::memory_order_relaxed);
}

#pragma GCC pop_options
