// AVX-512 variants of the decode GEMVs, compiled for AVX-512 (BW, VL, DQ, BF16) and called only
// when the CPU has those (checked at run time, tv::isa_level()): the library still loads and
// runs its AVX2 kernels on CPUs without them.
//
// Why: on a CPU whose caches hold the model (Sapphire Rapids: 480 MiB of L3 for a 230 MiB bf16
// or 100 MiB Q4_1 model), single-stream decode is bound by instructions, not DRAM bytes, and
// the AVX2 kernels spend several per weight (widen, shift, convert, FMA on 8 lanes).
//  * bf16 rows x bf16 activations: vdpbf16ps, 32 weights per instruction. Both factors are
//    bf16, so every product is exact in fp32 and each instruction adds two of them into an
//    fp32 lane, rounding like an FMA does: the same arithmetic as the AVX2 kernel in another
//    summation order (and bf16 denormal inputs count as zero).
//  * GGUF blocks: the same fp32 arithmetic as quant_kernels.cpp (q * x in fp32, scale and min
//    per group of 32) on 16 lanes: one widening load gives 16 nibbles twice.
// Either way a row's result does not depend on the batch around it or on the thread count.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <atomic>

#include "common.h"

// Headers first: inline functions they define must not be compiled for AVX-512 here (the
// linker keeps one copy of each, which the AVX2 code calls too).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace tv {

namespace {

// ---- bf16 rows x bf16 activations -----------------------------------------------------

// Rows [n, n + RB) (clamped to n1 - 1: a short last tile reads its last row again and drops
// the copies) against M activation rows; 32 columns per step, the tail through masked loads.
template <int M, int RB>
void bf16_tile(const uint16_t* w, const uint16_t* x, int64_t K, int64_t n, int64_t n1,
               int64_t N, float* out) {
  __m512 acc[RB][M];
  const uint16_t* row[RB];
  for (int r = 0; r < RB; ++r) {
    row[r] = w + (n + r < n1 ? n + r : n1 - 1) * K;
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  }
  // Rows n.. are contiguous: prefetch the block two tiles ahead at the rate this one is read
  // (decode rows are ~1 KiB, too short for the hardware prefetchers to ramp up on each).
  const char* pf = reinterpret_cast<const char*>(w + (n + 2 * RB) * K);
  const char* pf_end = reinterpret_cast<const char*>(w + N * K);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const char* p = pf + k * RB * 2;
    for (int r = 0; r < RB; ++r)
      if (p + 64 * r < pf_end) _mm_prefetch(p + 64 * r, _MM_HINT_T0);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
    for (int r = 0; r < RB; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(row[r] + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
    for (int r = 0; r < RB; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, row[r] + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  const int rb = n1 - n < RB ? static_cast<int>(n1 - n) : RB;
  for (int r = 0; r < rb; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int M, int RB>
void bf16_rows(const uint16_t* w, const uint16_t* x, int64_t K, int64_t n0, int64_t n1,
               int64_t N, float* acc_out) {
  for (int64_t n = n0; n < n1; n += RB) bf16_tile<M, RB>(w, x, K, n, n1, N, acc_out + (n - n0) * M);
}

// ---- GGUF blocks, 16 lanes ----------------------------------------------------------------
// A format gives group g of a row (32 weights) as q_lo (elements 0..15), q_hi (16..31), small
// integers held exactly in floats, and returns [scale, min, 0, 0]: w = scale * q + min, the
// same values and products as quant_kernels.cpp's 8-lane groups.

inline __m128 half2(const uint8_t* p) {  // fp16 d, m at p -> [d, m, 0, 0]
  int32_t bits;
  memcpy(&bits, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

inline __m128 half1(const uint8_t* p) {  // fp16 d at p -> [d, 0, 0, 0]
  uint16_t bits;
  memcpy(&bits, p, 2);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

inline __m512i u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Byte j of 16 holds element j in its low nibble and element j + 16 in its high one.
inline void nibbles(const uint8_t* p, __m512* lo, __m512* hi) {
  const __m512i v = u8x16(p);
  *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
  *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

struct Q4_0 {
  static constexpr bool kHasMin = true;
  const uint8_t* row;
  __m128 group(int64_t g, __m512* lo, __m512* hi) const {
    const uint8_t* blk = row + 18 * g;
    nibbles(blk + 2, lo, hi);
    return _mm_mul_ps(_mm_moveldup_ps(half1(blk)), _mm_setr_ps(1.0f, -8.0f, 0.0f, 0.0f));
  }
};

struct Q4_1 {
  static constexpr bool kHasMin = true;
  const uint8_t* row;
  __m128 group(int64_t g, __m512* lo, __m512* hi) const {
    const uint8_t* blk = row + 20 * g;
    nibbles(blk + 4, lo, hi);
    return half2(blk);
  }
};

struct Q5_0 {  // (nibble | high bit << 4) - 16
  static constexpr bool kHasMin = false;
  const uint8_t* row;
  __m128 group(int64_t g, __m512* lo, __m512* hi) const {
    const uint8_t* blk = row + 22 * g;
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m512i v = u8x16(blk + 6), sixteen = _mm512_set1_epi32(16);
    const __m512i l = _mm512_and_si512(v, _mm512_set1_epi32(0x0F)), h = _mm512_srli_epi32(v, 4);
    *lo = _mm512_cvtepi32_ps(
        _mm512_sub_epi32(_mm512_mask_or_epi32(l, static_cast<__mmask16>(qh), l, sixteen), sixteen));
    *hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_mask_or_epi32(h, static_cast<__mmask16>(qh >> 16), h, sixteen), sixteen));
    return half1(blk);
  }
};

struct Q8_0 {
  static constexpr bool kHasMin = false;
  const uint8_t* row;
  __m128 group(int64_t g, __m512* lo, __m512* hi) const {
    const uint8_t* blk = row + 34 * g;
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2))));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18))));
    return half1(blk);
  }
};

struct Q4_K {  // group g: sub-block g % 8 of super-block g / 8
  static constexpr bool kHasMin = true;
  const uint8_t* row;
  __m128 group(int64_t g, __m512* lo, __m512* hi) const {
    const uint8_t* blk = row + 144 * (g / 8);
    const int sub = static_cast<int>(g % 8);
    const uint8_t* s = blk + 4;
    int sc, mn;
    if (sub < 4) {
      sc = s[sub] & 63, mn = s[sub + 4] & 63;
    } else {
      sc = (s[sub + 4] & 0x0F) | ((s[sub - 4] >> 6) << 4);
      mn = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
    }
    const uint8_t* qs = blk + 16 + 32 * (sub / 2);  // sub-block 2i: low nibbles, 2i + 1: high
    const int shift = 4 * (sub % 2);
    const __m512i mask = _mm512_set1_epi32(0x0F);
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(u8x16(qs), shift), mask));
    *hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(u8x16(qs + 16), shift), mask));
    return _mm_mul_ps(half2(blk),
                      _mm_setr_ps(static_cast<float>(sc), -static_cast<float>(mn), 0.0f, 0.0f));
  }
};

// The bytes of the rows about to be read, twice ahead: 8 KiB into L2 and 1 KiB into L1. A
// single core streaming a model from L3 (or DRAM) reads ~1.5x faster so than with one
// distance alone (4 KiB into L1 before): the far prefetches keep enough lines in flight, the
// near ones are L2 hits by then and leave L1's fill buffers free.
inline void prefetch_rows(const uint8_t* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) {  // prefetches never fault past the end
    _mm_prefetch(reinterpret_cast<const char*>(row + 8192 + off), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(row + 1024 + off), _MM_HINT_T0);
  }
}

// Rows [n0, n1) against M activation rows, as quant_kernels.cpp's rows<F, M> (same arguments,
// same per-row arithmetic whatever M is): acc += scale * (q . x) per group, and lane m of
// lin += min * sum(x[m]) over the group.
template <class F, int M>
void block_rows(const uint8_t* w, int64_t row_bytes, const float* x, const float* xs8,
                int64_t K, int64_t n0, int64_t n1, float* res) {
  constexpr int RB = M == 1 ? 2 : 1;
  const int64_t groups = K / 32;
  alignas(32) float lanes[8];
  for (int64_t n = n0; n < n1; n += RB) {
    const int rb = n1 - n < RB ? static_cast<int>(n1 - n) : RB;
    const uint8_t* row = w + n * row_bytes;
    prefetch_rows(row, rb * row_bytes);
    __m512 acc[RB][M];
    __m256 lin[RB];
    F f[RB];
    for (int r = 0; r < RB; ++r) {
      lin[r] = _mm256_setzero_ps();
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
      f[r].row = row + (r < rb ? r : 0) * row_bytes;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 xs = _mm256_load_ps(xs8 + 8 * g);
      for (int r = 0; r < RB; ++r) {
        __m512 lo, hi;
        const __m128 sm = f[r].group(g, &lo, &hi);
        if constexpr (F::kHasMin)
          lin[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(sm)), xs, lin[r]);
        const __m512 scale = _mm512_broadcastss_ps(sm);
        for (int m = 0; m < M; ++m) {
          const float* xg = x + m * K + 32 * g;
          const __m512 s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16),
                                           _mm512_mul_ps(lo, _mm512_loadu_ps(xg)));
          acc[r][m] = _mm512_fmadd_ps(s, scale, acc[r][m]);
        }
      }
    }
    // Formats without a min (Q8_0, Q5_0) skip the lin lanes: adding their zeros changes no
    // bits but a zero's sign.
    for (int r = 0; r < rb; ++r) {
      _mm256_store_ps(lanes, lin[r]);
      for (int m = 0; m < M; ++m) {
        const float dot = _mm512_reduce_add_ps(acc[r][m]);
        res[(n + r - n0) * M + m] = F::kHasMin ? dot + lanes[m] : dot;
      }
    }
  }
}

// ---- Q4_1 rows x bf16 activations: vdpbf16ps ---------------------------------------------
// With bf16 activations every product q * x (q a 4-bit integer) is exact in bf16 x bf16 -> fp32,
// so vdpbf16ps can take both factors: a nibble becomes the bf16 of its value through one
// vpermw table lookup, and each instruction adds two exact products into an fp32 lane. Per
// pair of blocks (b0, b1) one zmm holds [q_b0[0:16], q_b1[0:16]] (the low nibbles) and one
// [q_b0[16:32], q_b1[16:32]] (the high ones), against x in the same order (x16 below), so a
// lane's sum belongs to one block and meets that block's scale in one FMA: the arithmetic of
// block_rows (scale * (q . x) + min * sum(x) per block, fp32 sums) in another summation order,
// with about half the instructions per weight. The mins meet all M rows' block sums in one
// FMA per pair: lane m sums the first blocks' min * sum(x[m]), lane 8 + m the second ones'.

inline __m128 half2x2(const uint8_t* p0, const uint8_t* p1) {  // -> [d0, m0, d1, m1]
  int32_t a, b;
  memcpy(&a, p0, 4);
  memcpy(&b, p1, 4);
  return _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(a), b, 1));
}

template <int M, int RB>
void q4_1_bf16_rows(const uint8_t* w, int64_t row_bytes, const uint16_t* x16, const float* xsp,
                    int64_t K, int64_t n0, int64_t n1, float* res) {
  const int64_t pairs = K / 64;
  // Entry i: bf16 of i & 15 (vpermw reads bits 4:0 of each word; a byte's low nibble and
  // the lowest bit of its high one).
  const __m512i table = _mm512_set_epi16(
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
      0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
      0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
  const __m512i didx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i midx = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  for (int64_t n = n0; n < n1; n += RB) {
    const int rb = n1 - n < RB ? static_cast<int>(n1 - n) : RB;
    const uint8_t* row[RB];
    __m512 acc[RB][M], lin[RB];
    for (int r = 0; r < RB; ++r) {
      row[r] = w + (n + (r < rb ? r : 0)) * row_bytes;
      lin[r] = _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    }
    prefetch_rows(row[0], rb * row_bytes);
    for (int64_t p = 0; p < pairs; ++p) {
      for (int r = 0; r < RB; ++r) {
        const uint8_t* b0 = row[r] + 40 * p;
        const __m256i v = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 4))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 24)), 1);
        const __m512i bytes = _mm512_cvtepu8_epi16(v);
        const __m512bh qa = (__m512bh)_mm512_permutexvar_epi16(bytes, table);
        const __m512bh qb = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
        const __m128 dm = half2x2(b0, b0 + 20);
        const __m512 dw = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(dm));
        const __m512 mw = _mm512_permutexvar_ps(midx, _mm512_castps128_ps512(dm));
        lin[r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(xsp + 16 * p), lin[r]);
        for (int m = 0; m < M; ++m) {
          const uint16_t* xp = x16 + (m * pairs + p) * 64;
          __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), qa,
                                      (__m512bh)_mm512_loadu_si512(xp));
          t = _mm512_dpbf16_ps(t, qb, (__m512bh)_mm512_loadu_si512(xp + 32));
          acc[r][m] = _mm512_fmadd_ps(t, dw, acc[r][m]);
        }
      }
    }
    for (int r = 0; r < rb; ++r) {
      alignas(64) float mins[16];
      _mm512_store_ps(mins, lin[r]);
      for (int m = 0; m < M; ++m)
        res[(n + r - n0) * M + m] = _mm512_reduce_add_ps(acc[r][m]) + (mins[m] + mins[8 + m]);
    }
  }
}

template <class F>
BlockRowsFn block_rows_for_m(int M) {
  switch (M) {
    case 1: return block_rows<F, 1>;
    case 2: return block_rows<F, 2>;
    case 3: return block_rows<F, 3>;
    case 4: return block_rows<F, 4>;
    case 5: return block_rows<F, 5>;
    case 6: return block_rows<F, 6>;
    case 7: return block_rows<F, 7>;
    default: return block_rows<F, 8>;
  }
}

}  // namespace

void bf16_gemv_avx512(const uint16_t* w, const uint16_t* x, int M, int64_t K, int64_t n0,
                      int64_t n1, int64_t N, float* acc) {
  switch (M) {
    case 1: return bf16_rows<1, 4>(w, x, K, n0, n1, N, acc);
    case 2: return bf16_rows<2, 8>(w, x, K, n0, n1, N, acc);
    case 3: return bf16_rows<3, 4>(w, x, K, n0, n1, N, acc);
    case 4: return bf16_rows<4, 4>(w, x, K, n0, n1, N, acc);
    case 5: return bf16_rows<5, 2>(w, x, K, n0, n1, N, acc);
    case 6: return bf16_rows<6, 2>(w, x, K, n0, n1, N, acc);
    case 7: return bf16_rows<7, 2>(w, x, K, n0, n1, N, acc);
    default: return bf16_rows<8, 2>(w, x, K, n0, n1, N, acc);
  }
}

Bf16BlockRowsFn q4_1_bf16_rows_avx512(int M) {
  switch (M) {
    case 1: return q4_1_bf16_rows<1, 2>;
    case 2: return q4_1_bf16_rows<2, 1>;
    case 3: return q4_1_bf16_rows<3, 1>;
    case 4: return q4_1_bf16_rows<4, 1>;
    case 5: return q4_1_bf16_rows<5, 1>;
    case 6: return q4_1_bf16_rows<6, 1>;
    case 7: return q4_1_bf16_rows<7, 1>;
    default: return q4_1_bf16_rows<8, 1>;
  }
}

BlockRowsFn block_rows_avx512(int fmt, int M) {
  switch (fmt) {
    case 2: return block_rows_for_m<Q4_0>(M);
    case 3: return block_rows_for_m<Q4_1>(M);
    case 4: return block_rows_for_m<Q8_0>(M);
    case 5: return block_rows_for_m<Q4_K>(M);
    case 7: return block_rows_for_m<Q5_0>(M);
    default: return nullptr;  // Q6_K: the AVX2 kernel
  }
}

}  // namespace tv

#pragma GCC pop_options

namespace tv {

namespace {

// 0: not probed yet; else the level in use (kIsaAvx2 / kIsaAvx512). Set by the first call,
// or by tv_set_isa (tests compare the two paths on one machine).
std::atomic<int> g_isa{0};
// Set by tv_set_isa(kIsaAvx2): the AVX-512 Foundation kernels stay off too.
std::atomic<bool> g_avx2_only{false};

bool cpu_has_avx512_foundation() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

int best_isa() {
  const bool ok = cpu_has_avx512_foundation() && __builtin_cpu_supports("avx512bf16");
  return ok ? kIsaAvx512 : kIsaAvx2;
}

}  // namespace

bool avx512_foundation() {
  static const bool has = cpu_has_avx512_foundation();
  return has && !g_avx2_only.load(std::memory_order_relaxed);
}

int isa_level() {
  int level = g_isa.load(std::memory_order_relaxed);
  if (level == 0) {
    level = best_isa();
    g_isa.store(level, std::memory_order_relaxed);
  }
  return level;
}

}  // namespace tv

// Which kernels run: 0 = the best this CPU has, 1 = AVX2 only; returns the level now in use
// (kIsaAvx2 = 1, kIsaAvx512 = 2). For tests and benchmarks that compare the two paths.
extern "C" int tv_set_isa(int level) {
  const int best = tv::best_isa();
  const int use = level == tv::kIsaAvx2 ? tv::kIsaAvx2 : best;
  tv::g_isa.store(use, std::memory_order_relaxed);
  tv::g_avx2_only.store(level == tv::kIsaAvx2, std::memory_order_relaxed);
  return use;
}
