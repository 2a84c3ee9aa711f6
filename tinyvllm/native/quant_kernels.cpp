// Weight-only GEMV over raw GGUF blocks for x86 CPUs with AVX2 + FMA + F16C (ctypes, no torch
// headers; built into the same library as cpu_kernels.cpp).
//
// Decode reads every weight once per step, so its speed is the weight bytes: a Q4_1 matrix is
// 0.625 bytes per weight against bf16's 2. The kernels read the file's blocks as they are (no
// repacking at load) and keep activations in fp32: per block of 32,
//   sum_i w_i x_i = d * sum_i q_i x_i  (+ m * sum_i x_i for Q4_1; -8 d * sum_i x_i for Q4_0),
// with the per-block sums of x computed once per call and shared by all output rows.
// Accumulation is fp32 throughout; the output is rounded once to the activation dtype.
//
// Weight format codes (mirrored by tinyvllm/native/quant_ops.py):
//   0 = float32 [N][K], 1 = bfloat16 [N][K]   dense rows, forwarded to tv_linear
//   2 = Q4_0  (18-byte blocks of 32: fp16 d, 16 bytes of nibbles; w = d * (q - 8))
//   3 = Q4_1  (20-byte blocks of 32: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m)
//   4 = Q8_0  (34-byte blocks of 32: fp16 d, 32 int8; w = d * q)
//   5 = Q4_K  (144-byte super-blocks of 256: fp16 d, dmin, 12 bytes of 6-bit scales/mins,
//              128 bytes of nibbles; w = d * sc * q - dmin * mn per 32)
//   6 = Q6_K  (210-byte super-blocks of 256: 128 bytes low nibbles, 64 bytes high 2 bits,
//              16 int8 scales, fp16 d; w = d * sc * (q - 32) per 16)
//   7 = Q5_0  (22-byte blocks of 32: fp16 d, 32 high bits, 16 bytes of nibbles;
//              w = d * (q - 16))
// A GGUF row of K weights is K / block_elems consecutive blocks; rows follow each other.
// Activation / output dtype codes as in cpu_kernels.cpp: 0 = float32, 1 = bfloat16.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

namespace {

using namespace tv;

enum Format {
  kF32 = 0, kBF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 4, kQ4_K = 5, kQ6_K = 6, kQ5_0 = 7
};

// Input rows per pass over the weight: all of them share each decoded weight vector.
constexpr int kMaxRows = 8;

inline float fp16(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256 u8x8(const uint8_t* p) {  // 8 unsigned bytes -> 8 int32 lanes
  return _mm256_castsi256_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 i8x8(const void* p) {  // 8 signed bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p))));
}

// Low (shift 0) or high (shift 4) nibbles of 8 widened bytes -> 8 floats.
inline __m256 nib(__m256 bytes, int shift) {
  const __m256i v = _mm256_castps_si256(bytes);
  return _mm256_cvtepi32_ps(shift ? _mm256_srli_epi32(v, 4)
                                  : _mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
}

// Q5_0: (nibble | bit << 4) - 16 for 8 elements whose high bits are the low 8 of `bits`.
inline __m256 nib5(__m256 bytes, int shift, uint32_t bits) {
  const __m256i high = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits & 0xFF)),
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
      _mm256_set1_epi32(1));
  const __m256 hi16 = _mm256_cvtepi32_ps(_mm256_slli_epi32(high, 4));
  return _mm256_sub_ps(_mm256_add_ps(nib(bytes, shift), hi16), _mm256_set1_ps(16.0f));
}

// Two fp16 fields at p (d, then m) -> [d, m, 0, 0].
inline __m128 fp16x2(const uint8_t* p) {
  int32_t bits;
  memcpy(&bits, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

inline __m128 fp16x1(const uint8_t* p) {  // -> [d, 0, 0, 0]
  uint16_t bits;
  memcpy(&bits, p, 2);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

// Decoded super-blocks for Q6_K: 256 int8 values (q - 32) ready for i8x8.
struct Q6Decoded {
  alignas(32) int8_t q[256];
};

// Q6_K: q = (low nibble | high 2 bits << 4) - 32, laid out per 128-element half as
// [ql[0:32] lo | ql[32:64] lo | ql[0:32] hi | ql[32:64] hi] with qh bit pairs 0, 2, 4, 6.
inline void decode_q6k(const uint8_t* blk, Q6Decoded* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i off = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = blk + 64 * h;
    const uint8_t* qh = blk + 128 + 32 * h;
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    // 16-bit shifts move bits across bytes; each mask keeps only bits of the byte itself.
    const __m256i q0 = _mm256_or_si256(_mm256_and_si256(a, m4),
                                       _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
    const __m256i q1 = _mm256_or_si256(_mm256_and_si256(b, m4),
                                       _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
    const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                                       _mm256_and_si256(hb, m30));
    const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
    __m256i* dst = reinterpret_cast<__m256i*>(out->q + 128 * h);
    _mm256_store_si256(dst + 0, _mm256_sub_epi8(q0, off));
    _mm256_store_si256(dst + 1, _mm256_sub_epi8(q1, off));
    _mm256_store_si256(dst + 2, _mm256_sub_epi8(q2, off));
    _mm256_store_si256(dst + 3, _mm256_sub_epi8(q3, off));
  }
}

// Q4_K's 6-bit (scale, min) of sub-block j from its 12 packed bytes.
inline void q4k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ---- per-format groups of 32 weights ------------------------------------------------------
// A format is a cursor over one row: group(g, q) gives the g-th run of 32 weights as
// w = scale * q + min, q being 4 x 8 small integers held exactly in floats, and returns
// [scale, min, 0, 0]. Groups are visited in order: Q6_K decodes each super-block once, when
// its first group is asked for.

struct Q4_0Fmt {
  const uint8_t* row;
  __m128 group(int64_t g, __m256 q[4]) const {
    const uint8_t* blk = row + 18 * g;
    const __m256 lo = u8x8(blk + 2), hi = u8x8(blk + 10);  // byte j: element j | j + 16
    q[0] = nib(lo, 0), q[1] = nib(hi, 0), q[2] = nib(lo, 4), q[3] = nib(hi, 4);
    const __m128 d = fp16x1(blk);
    return _mm_mul_ps(_mm_moveldup_ps(d), _mm_setr_ps(1.0f, -8.0f, 0.0f, 0.0f));
  }
};

struct Q4_1Fmt {
  const uint8_t* row;
  __m128 group(int64_t g, __m256 q[4]) const {
    const uint8_t* blk = row + 20 * g;
    const __m256 lo = u8x8(blk + 4), hi = u8x8(blk + 12);
    q[0] = nib(lo, 0), q[1] = nib(hi, 0), q[2] = nib(lo, 4), q[3] = nib(hi, 4);
    return fp16x2(blk);
  }
};

struct Q5_0Fmt {  // q - 16 in [-16, 15], so w = d * q with no min (dequant.py's order)
  const uint8_t* row;
  __m128 group(int64_t g, __m256 q[4]) const {
    const uint8_t* blk = row + 22 * g;
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m256 lo = u8x8(blk + 6), hi = u8x8(blk + 14);  // byte j: element j | j + 16
    q[0] = nib5(lo, 0, qh), q[1] = nib5(hi, 0, qh >> 8);
    q[2] = nib5(lo, 4, qh >> 16), q[3] = nib5(hi, 4, qh >> 24);
    return fp16x1(blk);
  }
};

struct Q8_0Fmt {
  const uint8_t* row;
  __m128 group(int64_t g, __m256 q[4]) const {
    const uint8_t* blk = row + 34 * g;
    for (int j = 0; j < 4; ++j) q[j] = i8x8(blk + 2 + 8 * j);
    return fp16x1(blk);
  }
};

struct Q4_KFmt {  // group g: sub-block g % 8 of super-block g / 8
  const uint8_t* row;
  __m128 group(int64_t g, __m256 q[4]) const {
    const uint8_t* blk = row + 144 * (g / 8);
    const int sub = static_cast<int>(g % 8);
    uint8_t sc, mn;
    q4k_scale_min(blk + 4, sub, &sc, &mn);
    const uint8_t* qs = blk + 16 + 32 * (sub / 2);  // 32 bytes: sub-block 2i low, 2i + 1 high
    for (int j = 0; j < 4; ++j) q[j] = nib(u8x8(qs + 8 * j), 4 * (sub % 2));
    const __m128 dm = fp16x2(blk);  // d, dmin
    return _mm_mul_ps(dm, _mm_setr_ps(sc, -static_cast<float>(mn), 0.0f, 0.0f));
  }
};

struct Q6_KFmt {  // the int8 scale of each 16 is folded into q (|q * sc| < 2^13, exact)
  const uint8_t* row;
  Q6Decoded dec;
  alignas(32) float scales[16];
  __m128 d;

  __attribute__((noinline)) void start_block(const uint8_t* blk) {
    decode_q6k(blk, &dec);
    for (int j = 0; j < 16; j += 8) _mm256_store_ps(scales + j, i8x8(blk + 192 + j));
    d = fp16x1(blk + 208);
  }

  __m128 group(int64_t g, __m256 q[4]) {
    const uint8_t* blk = row + 210 * (g / 8);
    const int sub = static_cast<int>(g % 8);
    if (sub == 0) start_block(blk);
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_mul_ps(i8x8(dec.q + 32 * sub + 8 * j),
                           _mm256_broadcast_ss(scales + 2 * sub + j / 2));
    return d;
  }
};

// Software prefetch of the weight stream a few KiB ahead, the bytes of the rows about to be
// read: the hardware prefetchers alone leave a core's DRAM stream ~30% short (Q8_0 lm_head),
// and half when two rows are read interleaved.
constexpr int64_t kPrefetchBytes = 4096;
inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes) {
  for (int64_t off = 0; off < row_bytes; off += 64)  // prefetches never fault past the end
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchBytes + off), _MM_HINT_T0);
}

// acc[m] += scale * (q . x[m]) for group g of a row, and lane m of lin += min * sum(x[m]) over
// the group (xs8: the sums of every row, 8 lanes per group).
template <class F, int M>
inline void group_dot(F& f, int64_t g, const float* x, const float* xs8, int64_t K, __m256* acc,
                      __m256* lin) {
  __m256 q[4];
  const __m128 sm = f.group(g, q);
  const __m256 scale = _mm256_broadcastss_ps(sm);
  *lin = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(sm)), _mm256_load_ps(xs8 + 8 * g),
                         *lin);
  for (int m = 0; m < M; ++m) {
    const float* xg = x + m * K + 32 * g;
    __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xg));
    __m256 t = _mm256_mul_ps(q[1], _mm256_loadu_ps(xg + 8));
    s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xg + 16), s);
    t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xg + 24), t);
    acc[m] = _mm256_fmadd_ps(_mm256_add_ps(s, t), scale, acc[m]);
  }
}

// Rows [n0, n1) against M activation rows -> res[(n - n0) * M + m]; x fp32 [M][K], xs8 [K / 32][8].
// Scale and min stay out of the inner loop (dot = sum_g scale_g * (q_g . x_g) + min_g *
// sum(x_g)), and every input row takes the same operations in the same order whatever M is, so
// a row's result does not depend on the batch around it (decode, K + 1 verify and prefill
// chunks agree). M = 1 reads two output rows per step for independent FMA chains (the software
// prefetch keeps the two interleaved streams at full DRAM speed; without it they reach half).
template <class F, int M>
void rows(const uint8_t* w, int64_t row_bytes, const float* x, const float* xs8, int64_t K,
          int64_t n0, int64_t n1, float* res) {
  constexpr int RB = M == 1 ? 2 : 1;
  const int64_t groups = K / 32;
  alignas(32) float lanes[8];
  int64_t n = n0;
  for (; n < n1; n += RB) {
    const int rb = n1 - n < RB ? static_cast<int>(n1 - n) : RB;
    const uint8_t* row = w + n * row_bytes;
    prefetch_ahead(row, rb * row_bytes);
    __m256 acc[RB][M], lin[RB];
    for (int r = 0; r < RB; ++r) {
      lin[r] = _mm256_setzero_ps();
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    }
    F f[RB];
    for (int r = 0; r < RB; ++r) f[r].row = row + r * row_bytes;
    if (rb == RB) {
      for (int64_t g = 0; g < groups; ++g)
        for (int r = 0; r < RB; ++r) group_dot<F, M>(f[r], g, x, xs8, K, acc[r], &lin[r]);
    } else {  // the odd last row of M = 1
      for (int64_t g = 0; g < groups; ++g) group_dot<F, M>(f[0], g, x, xs8, K, acc[0], &lin[0]);
    }
    for (int r = 0; r < rb; ++r) {
      _mm256_store_ps(lanes, lin[r]);
      for (int m = 0; m < M; ++m) res[(n + r - n0) * M + m] = hsum(acc[r][m]) + lanes[m];
    }
  }
}

using RowsFn = BlockRowsFn;

template <class F>
RowsFn rows_for_m(int M) {
  switch (M) {
    case 1: return rows<F, 1>;
    case 2: return rows<F, 2>;
    case 3: return rows<F, 3>;
    case 4: return rows<F, 4>;
    case 5: return rows<F, 5>;
    case 6: return rows<F, 6>;
    case 7: return rows<F, 7>;
    default: return rows<F, 8>;
  }
}

RowsFn rows_for(int fmt, int M) {
  switch (fmt) {
    case kQ4_0: return rows_for_m<Q4_0Fmt>(M);
    case kQ4_1: return rows_for_m<Q4_1Fmt>(M);
    case kQ8_0: return rows_for_m<Q8_0Fmt>(M);
    case kQ4_K: return rows_for_m<Q4_KFmt>(M);
    case kQ5_0: return rows_for_m<Q5_0Fmt>(M);
    default: return rows_for_m<Q6_KFmt>(M);
  }
}

// (elements, bytes) per block; 0 elements for codes that are not GGUF blocks.
void block_layout(int fmt, int64_t* elems, int64_t* bytes) {
  static const int64_t table[][2] = {{0, 0},     {0, 0},     {32, 18},   {32, 20},
                                     {32, 34},   {256, 144}, {256, 210}, {32, 22}};
  const bool ok = fmt >= kQ4_0 && fmt <= kQ5_0;
  *elems = ok ? table[fmt][0] : 0;
  *bytes = ok ? table[fmt][1] : 0;
}

// A row of a block matrix as fp32, computed exactly as tinyvllm/gguf/dequant.py does (same
// products and sums in the same order, no fused multiply-adds), so both give the same bits.
template <class F, bool kHasMin>
void dequant_groups(const uint8_t* row, int64_t K, float* out) {
  __m256 q[4];
  F f;
  f.row = row;
  for (int64_t g = 0; g < K / 32; ++g) {
    const __m128 sm = f.group(g, q);
    const __m256 scale = _mm256_broadcastss_ps(sm);
    const __m256 min = _mm256_broadcastss_ps(_mm_movehdup_ps(sm));
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_mul_ps(q[j], scale);
      _mm256_storeu_ps(out + 32 * g + 8 * j, kHasMin ? _mm256_add_ps(v, min) : v);
    }
  }
}

// Row r's GGUF blocks: in place, or gathered into tmp from a 16-row layout (kFmtRows16).
const uint8_t* gguf_row(const uint8_t* w, int fmt, bool rows16, int64_t row_bytes, int64_t K,
                        int64_t r, uint8_t* tmp) {
  if (!rows16) return w + r * row_bytes;
  rows16_gguf_row(w, fmt, K, r, tmp);
  return tmp;
}

void dequant_row(int fmt, const uint8_t* row, int64_t K, float* out) {
  switch (fmt) {
    case kQ4_0: return dequant_groups<Q4_0Fmt, true>(row, K, out);
    case kQ4_1: return dequant_groups<Q4_1Fmt, true>(row, K, out);
    case kQ8_0: return dequant_groups<Q8_0Fmt, false>(row, K, out);
    case kQ5_0: return dequant_groups<Q5_0Fmt, false>(row, K, out);
    case kQ4_K: return dequant_groups<Q4_KFmt, true>(row, K, out);
    case kQ6_K:  // (d * scale) * q per 16, the reference's order (Q6_KFmt folds differently)
      for (int64_t b = 0; b < K / 256; ++b) {
        const uint8_t* blk = row + 210 * b;
        Q6Decoded dec;
        decode_q6k(blk, &dec);
        const float d = fp16(blk + 208);
        const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
        for (int i = 0; i < 16; ++i) {
          const __m256 scale = _mm256_set1_ps(d * static_cast<float>(scales[i]));
          for (int j = 0; j < 2; ++j)
            _mm256_storeu_ps(out + 256 * b + 16 * i + 8 * j,
                             _mm256_mul_ps(scale, i8x8(dec.q + 16 * i + 8 * j)));
        }
      }
      return;
  }
}

// Adds bias and stores res (rows [n0, n1) of a tile of `tile` input rows from m0) into out.
inline void store_tile(const float* res, const void* bias, int b_dt, void* out, int x_dt,
                       int64_t m0, int tile, int64_t n0, int64_t n1, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const float b = bias ? load(bias, n, b_dt) : 0.0f;
    for (int m = 0; m < tile; ++m) store(out, (m0 + m) * N + n, res[(n - n0) * tile + m] + b, x_dt);
  }
}

// Q4_1 against bf16 activations through vdpbf16ps (avx512_kernels.cpp, same arithmetic as
// the fp32 kernel up to summation order): x is laid out per pair of blocks once per call.
void linear_q4_1_bf16(const uint16_t* x, const uint8_t* w, const void* bias, int b_dt,
                      void* out, int M, int64_t N, int64_t K, int nthreads) {
  const int64_t pairs = K / 64, row_bytes = K / 32 * 20;
  const int64_t ntiles = (M + kMaxRows - 1) / kMaxRows;
  // x16 [M][pairs][64] bf16, then per tile of 8 rows xsp [pairs][16] fp32 (zeros past M).
  const int64_t x16_bytes = M * pairs * 128, xsp_floats = ntiles * pairs * 16;
  char* buf = static_cast<char*>(checked_aligned_alloc(x16_bytes + 4 * xsp_floats));
  uint16_t* x16 = reinterpret_cast<uint16_t*>(buf);
  float* xsp = reinterpret_cast<float*>(buf + x16_bytes);
  memset(xsp, 0, 4 * xsp_floats);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < pairs; ++p) {
      uint16_t* dst = x16 + (m * pairs + p) * 64;
      float* sums = xsp + (m / kMaxRows * pairs + p) * 16 + m % kMaxRows;
      for (int j = 0; j < 2; ++j) {
        const uint16_t* src = x + m * K + 64 * p + 32 * j;
        memcpy(dst + 16 * j, src, 32);
        memcpy(dst + 32 + 16 * j, src + 16, 32);
        float sum = 0.0f;
        for (int i = 0; i < 32; ++i) sum += bf16_to_f32(src[i]);
        sums[8 * j] = sum;
      }
    }
  constexpr int64_t kChunk = 32;
  const int64_t nchunks = (N + kChunk - 1) / kChunk;
  parallel_for(ntiles * nchunks, nthreads, [&](int64_t item) {
    const int64_t m0 = item / nchunks * kMaxRows;
    const int tile = static_cast<int>(M - m0 < kMaxRows ? M - m0 : kMaxRows);
    const int64_t n0 = item % nchunks * kChunk, n1 = n0 + kChunk < N ? n0 + kChunk : N;
    float res[kChunk * kMaxRows];
    q4_1_bf16_rows_avx512(tile)(w, row_bytes, x16 + m0 * pairs * 64, xsp + m0 / kMaxRows *
                                pairs * 16, K, n0, n1, res);
    store_tile(res, bias, b_dt, out, 1, m0, tile, n0, n1, N);
  });
  free(buf);
}

// A matrix in the 16-row layout (made only where its kernels run: tv_rows16_supported):
// int8 activations, or bf16 ones on the exact kernel; other activations (fp32, which the
// engine never pairs with the layout) on the file layout, rebuilt for the call.
void linear_rows16(const void* x, int x_dt, const void* w, int w_fmt, const void* bias, int b_dt,
                   void* out, int M, int64_t N, int64_t K, int nthreads) {
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  const int fmt = w_fmt & ~(kFmtRows16 | kFmtInt8Act);
  if (w_fmt & kFmtInt8Act)
    return linear_rows16_int8(x, x_dt, wb, fmt, bias, b_dt, out, M, N, K, nthreads);
  if (x_dt == 1)
    return linear_rows16_bf16(static_cast<const uint16_t*>(x), wb, fmt, bias, b_dt,
                              static_cast<uint16_t*>(out), M, N, K, nthreads);
  int64_t elems, bytes;
  block_layout(fmt, &elems, &bytes);
  const int64_t row_bytes = K / elems * bytes;
  uint8_t* rows = static_cast<uint8_t*>(checked_malloc(N * row_bytes));
  for (int64_t r = 0; r < N; ++r) rows16_gguf_row(wb, fmt, K, r, rows + r * row_bytes);
  tv_linear_blocks(x, x_dt, rows, fmt, bias, b_dt, out, M, N, K, nthreads);
  free(rows);
}

}  // namespace

extern "C" {

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a GGUF block matrix w (codes 2..7), any
// M (passes of up to 8 rows); x, out contiguous [M][K] / [M][N] in x_dt. K must be a whole
// number of blocks. A code with kFmtInt8Act (0x100) set opts into the int8-activation kernels
// where this CPU and format have them (int8_kernels.cpp; not exact), else runs this one.
void tv_linear_blocks(const void* x, int x_dt, const void* w, int w_fmt, const void* bias,
                      int b_dt, void* out, int M, int64_t N, int64_t K, int nthreads) {
  if (w_fmt & kFmtRows16) return linear_rows16(x, x_dt, w, w_fmt, bias, b_dt, out, M, N, K,
                                               nthreads);
  if (w_fmt & kFmtInt8Act) {
    w_fmt &= ~kFmtInt8Act;
    if (int8_act_supported(w_fmt))
      return linear_blocks_int8(x, x_dt, static_cast<const uint8_t*>(w), w_fmt, bias, b_dt, out,
                                M, N, K, nthreads);
  }
  if (w_fmt == kQ4_1 && x_dt == 1 && K % 64 == 0 && isa_level() == kIsaAvx512)
    return linear_q4_1_bf16(static_cast<const uint16_t*>(x), static_cast<const uint8_t*>(w), bias,
                            b_dt, out, M, N, K, nthreads);
  int64_t elems, bytes;
  block_layout(w_fmt, &elems, &bytes);
  const int64_t row_bytes = K / elems * bytes, groups = K / 32;
  const int64_t ntiles = (M + kMaxRows - 1) / kMaxRows;
  // Per tile of up to kMaxRows input rows: fp32 rows, then the group sums [groups][8]
  // (32-byte aligned: K is a multiple of 32).
  const int64_t tile_floats = kMaxRows * K + 8 * groups;
  const int64_t buf_bytes = ntiles * tile_floats * 4;
  float* buf = static_cast<float*>(checked_aligned_alloc(buf_bytes));
  for (int64_t t = 0; t < ntiles; ++t) {
    const int64_t m0 = t * kMaxRows;
    const int tile = static_cast<int>(M - m0 < kMaxRows ? M - m0 : kMaxRows);
    float* xf = buf + t * tile_floats;
    float* xs8 = xf + kMaxRows * K;
    memset(xs8, 0, 8 * groups * 4);
    for (int m = 0; m < tile; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.0f;
        for (int64_t i = 32 * g; i < 32 * g + 32; ++i) {
          const float v = load(x, (m0 + m) * K + i, x_dt);
          xf[m * K + i] = v;
          s += v;
        }
        xs8[8 * g + m] = s;
      }
  }
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  // AVX-512 where the CPU and the format have it (same arithmetic on 16 lanes), else AVX2.
  const bool wide = isa_level() == kIsaAvx512 && block_rows_avx512(w_fmt, 1) != nullptr;
  auto kernel = [&](int tile) {
    return wide ? block_rows_avx512(w_fmt, tile) : rows_for(w_fmt, tile);
  };
  // One parallel region for all tiles; items are (tile, 32 output rows), contiguous weight
  // bytes each, so every thread's stream stays sequential for the prefetchers.
  constexpr int64_t kChunk = 32;
  const int64_t nchunks = (N + kChunk - 1) / kChunk;
  parallel_for(ntiles * nchunks, nthreads, [&](int64_t item) {
    const int64_t m0 = item / nchunks * kMaxRows;
    const int tile = static_cast<int>(M - m0 < kMaxRows ? M - m0 : kMaxRows);
    const float* xf = buf + item / nchunks * tile_floats;
    const int64_t n0 = item % nchunks * kChunk, n1 = n0 + kChunk < N ? n0 + kChunk : N;
    float res[kChunk * kMaxRows];
    kernel(tile)(wb, row_bytes, xf, xf + kMaxRows * K, K, n0, n1, res);
    store_tile(res, bias, b_dt, out, x_dt, m0, tile, n0, n1, N);
  });
  free(buf);
}

// The one entry the decode program calls for any weight: dense rows (codes 0, 1) go to
// tv_linear, GGUF blocks (codes 2..7) to tv_linear_blocks. Same contract as tv_linear.
void tv_linear_any(const void* x, int x_dt, const void* w, int w_fmt, const void* bias,
                   int b_dt, void* out, int M, int64_t N, int64_t K, int nthreads) {
  if (w_fmt == kF32 || w_fmt == kBF16)
    tv_linear(x, x_dt, w, w_fmt, bias, b_dt, out, M, N, K, nthreads);
  else if (w_fmt == (kBF16 | kFmtRows16))
    linear_bf16_pairs(x, x_dt, w, bias, b_dt, out, M, N, K, nthreads);
  else
    tv_linear_blocks(x, x_dt, w, w_fmt, bias, b_dt, out, M, N, K, nthreads);
}

// Rows [row0, row1) of a GGUF block matrix as fp32 [row1 - row0][K] (the large-batch path
// dequantizes slabs of rows and runs a GEMM on them).
void tv_dequant_rows(const void* w, int w_fmt, int64_t K, int64_t row0, int64_t row1,
                     float* out, int nthreads) {
  const bool rows16 = w_fmt & kFmtRows16;
  w_fmt &= ~(kFmtInt8Act | kFmtRows16);  // the flag asks for other GEMVs only
  int64_t elems, bytes;
  block_layout(w_fmt, &elems, &bytes);
  const int64_t row_bytes = K / elems * bytes;
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  constexpr int64_t kRows = 8;  // per item: enough work to amortise the claim
  parallel_for((row1 - row0 + kRows - 1) / kRows, nthreads, [&](int64_t item) {
    const int64_t r0 = row0 + item * kRows, r1 = r0 + kRows < row1 ? r0 + kRows : row1;
    uint8_t* tmp = rows16 ? static_cast<uint8_t*>(checked_malloc(row_bytes)) : nullptr;
    for (int64_t r = r0; r < r1; ++r)
      dequant_row(w_fmt, gguf_row(wb, w_fmt, rows16, row_bytes, K, r, tmp), K,
                  out + (r - row0) * K);
    free(tmp);
  });
}

// Embedding lookup: out[t] = row ids[t] of w (any format code), dequantized to fp32 and stored
// in out_dt (one rounding, as casting the fp32 dequantized table would give).
void tv_embedding_any(const void* w, int w_fmt, const int64_t* ids, int64_t T, int64_t K,
                      void* out, int out_dt) {
  const bool rows16 = w_fmt & kFmtRows16;
  w_fmt &= ~(kFmtInt8Act | kFmtRows16);
  int64_t elems, bytes;
  block_layout(w_fmt, &elems, &bytes);
  const int64_t row_bytes = elems ? K / elems * bytes : 0;
  float* row = static_cast<float*>(checked_aligned_alloc(K * 4));
  uint8_t* tmp = rows16 ? static_cast<uint8_t*>(checked_malloc(row_bytes)) : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    if (w_fmt == kF32 || w_fmt == kBF16) {
      for (int64_t k = 0; k < K; ++k) row[k] = load(w, ids[t] * K + k, w_fmt);
    } else {
      const uint8_t* blocks = gguf_row(static_cast<const uint8_t*>(w), w_fmt, rows16, row_bytes,
                                       K, ids[t], tmp);
      dequant_row(w_fmt, blocks, K, row);
    }
    for (int64_t k = 0; k < K; ++k) store(out, t * K + k, row[k], out_dt);
  }
  free(tmp);
  free(row);
}

}  // extern "C"
