// Opt-in int8-activation GEMVs over GGUF Q4_0 / Q4_1 / Q8_0 rows with AVX512-VNNI (vpdpbusd):
// llama.cpp's arithmetic, NOT the exact default (see quant_kernels.cpp for that one).
//
// Why: single-stream decode of a model that fits in L3 is bound by instructions per weight.
// The exact kernels widen every 4-bit weight to an fp32 lane and multiply it with an fp32
// activation; here the activations are rounded once per GEMV input to int8 per block of 32,
// and one vpdpbusd multiplies 64 weight bytes with 64 activation bytes, adding four products
// per int32 lane exactly. Per block b of a row (w = dw * q + mw; Q4_0: mw = -8 dw; Q8_0: mw = 0)
//   sum_i w_i x_i ~ (dw * dx) * sum_i q_i qx_i + mw * sx,
// with qx = round(x / dx) in [-127, 127], dx = max|x| / 127 (0 for an all-zero block) and
// sx = dx * sum_i qx_i. Only the rounding of x to int8 differs from the exact sum (~0.5% per
// output); everything after the integer dot products is fp32.
//
// Layouts, made once per input so the weight side does as little as possible:
//  * Q4_x: a pair of blocks (b0, b1) holds [x_b0[0:16], x_b1[0:16], x_b0[16:32], x_b1[16:32]],
//    the order in which the two blocks' nibbles unpack into one zmm ([qs0 & 15, qs1 & 15,
//    qs0 >> 4, qs1 >> 4]); Q8_0 keeps x in order. An odd last block stays in order.
//  * per pair: dx for each of the 16 int32 lanes of the dot product, and [0, sx_b0, 0, sx_b1]
//    to meet the weight's [dw0, mw0, dw1, mw1].
// Q8_0's signed weights: vpdpbusd multiplies unsigned by signed bytes, so |w| meets x with
// w's sign (qx never is -128).

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

// After the target pragma: its inline AVX-512 functions compile for that target.
#include "int8_act.h"

namespace tv {

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 4;

// One GEMV input quantized: rows m of q [M][G * 32], dxp [M][pairs + 1][16], sxp likewise
// [4] (the extra slot: an odd last block, dx in lanes 0..7, [0, sx, 0, 0]).
struct ActQ8 {
  int8_t* q;
  float* dxp;
  float* sxp;
  int64_t groups, pairs, q_stride, dx_stride, sx_stride;
};

void quantize_row(const void* x, int x_dt, int64_t K, bool q4_layout, const ActQ8& a,
                  int64_t m) {
  int8_t* q = a.q + m * a.q_stride;
  float* dxp = a.dxp + m * a.dx_stride;
  float* sxp = a.sxp + m * a.sx_stride;
  alignas(64) int8_t blk[2][32];
  for (int64_t p = 0; p < a.pairs; ++p) {
    float dx[2];
    int32_t sum[2];
    for (int j = 0; j < 2; ++j)
      int8_act_block(x, x_dt, m * K + 32 * (2 * p + j), blk[j], dx + j, sum + j);
    int8_t* dst = q + 64 * p;
    if (q4_layout) {
      for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 2; ++j) memcpy(dst + 32 * half + 16 * j, blk[j] + 16 * half, 16);
      for (int lane = 0; lane < 16; ++lane) dxp[16 * p + lane] = dx[(lane / 4) % 2];
    } else {
      memcpy(dst, blk[0], 32);
      memcpy(dst + 32, blk[1], 32);
      for (int lane = 0; lane < 16; ++lane) dxp[16 * p + lane] = dx[lane / 8];
    }
    const float s[4] = {0.0f, dx[0] * static_cast<float>(sum[0]), 0.0f,
                        dx[1] * static_cast<float>(sum[1])};
    memcpy(sxp + 4 * p, s, sizeof(s));
  }
  if (a.groups % 2) {
    float dx;
    int32_t sum;
    int8_act_block(x, x_dt, m * K + 32 * (a.groups - 1), q + 64 * a.pairs, &dx, &sum);
    for (int lane = 0; lane < 16; ++lane) dxp[16 * a.pairs + lane] = lane < 8 ? dx : 0.0f;
    const float s[4] = {0.0f, dx * static_cast<float>(sum), 0.0f, 0.0f};
    memcpy(sxp + 4 * a.pairs, s, sizeof(s));
  }
}

inline __m128i load32x2(const uint8_t* p0, const uint8_t* p1) {  // [p0[0:4], p1[0:4], 0, 0]
  int32_t b;
  memcpy(&b, p1, 4);
  return _mm_insert_epi32(_mm_loadu_si32(p0), b, 1);
}

// [d, m] of a Q4_x block at p as fp32 (Q4_0: m = -8 d).
template <int Fmt>
inline __m128 q4_dm(const uint8_t* p0, const uint8_t* p1) {
  if (Fmt == kQ4_1) return _mm_cvtph_ps(load32x2(p0, p1));
  uint16_t a, b;
  memcpy(&a, p0, 2);
  memcpy(&b, p1, 2);
  const __m128 d = _mm_cvtph_ps(_mm_setr_epi16(a, 0, b, 0, 0, 0, 0, 0));  // [d0, 0, d1, 0]
  return _mm_mul_ps(_mm_moveldup_ps(d), _mm_setr_ps(1.0f, -8.0f, 1.0f, -8.0f));
}

// The rows after [row, row + rb * row_bytes): two rows ahead into L1 and 8 KiB ahead into L2
// (as avx512_kernels.cpp's prefetch_rows: enough lines in flight for one core to stream from
// L3 near its bandwidth).
inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes, int rb) {
  for (int64_t off = 0; off < rb * row_bytes; off += 64) {  // prefetches never fault
    _mm_prefetch(reinterpret_cast<const char*>(row + 8192 + off), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(row + 2 * row_bytes + off), _MM_HINT_T0);
  }
}

// Rows [n0, n1) of a Q4_0 / Q4_1 matrix against input rows m0 .. m0 + M of `a`; two rows per
// step share each activation load.
template <int Fmt, int M>
void q4_rows(const uint8_t* w, int64_t row_bytes, const ActQ8& a, int64_t m0, int64_t n0,
             int64_t n1, float* res) {
  constexpr int RB = 2;
  constexpr int64_t kBlock = Fmt == kQ4_1 ? 20 : 18, kQs = Fmt == kQ4_1 ? 4 : 2;
  const __m512i m4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);
  for (int64_t n = n0; n < n1; n += RB) {
    const int rb = n1 - n < RB ? static_cast<int>(n1 - n) : RB;
    const uint8_t* row[RB];
    __m512 acc[RB][M];
    __m128 lin[RB][M];
    for (int r = 0; r < RB; ++r) {
      row[r] = w + (n + (r < rb ? r : 0)) * row_bytes;
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps(), lin[r][m] = _mm_setzero_ps();
    }
    prefetch_ahead(row[0], row_bytes, rb);
    for (int64_t p = 0; p < a.pairs; ++p) {
      for (int r = 0; r < RB; ++r) {
        const uint8_t* b0 = row[r] + 2 * p * kBlock;
        const __m256i v = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + kQs))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + kBlock + kQs)), 1);
        const __m512i wq = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), m4);
        const __m128 dm = q4_dm<Fmt>(b0, b0 + kBlock);  // [d0, m0, d1, m1]
        const __m512 dw = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(dm));
        for (int m = 0; m < M; ++m) {
          const int64_t mm = m0 + m;
          const __m512i xq = _mm512_loadu_si512(a.q + mm * a.q_stride + 64 * p);
          const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, wq, xq)),
                                           _mm512_loadu_ps(a.dxp + mm * a.dx_stride + 16 * p));
          acc[r][m] = _mm512_fmadd_ps(dot, dw, acc[r][m]);
          lin[r][m] = _mm_fmadd_ps(dm, _mm_loadu_ps(a.sxp + mm * a.sx_stride + 4 * p), lin[r][m]);
        }
      }
    }
    if (a.groups % 2) {  // the odd last block, elements in order
      for (int r = 0; r < RB; ++r) {
        const uint8_t* b0 = row[r] + (a.groups - 1) * kBlock;
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + kQs));
        const __m256i wq = _mm256_and_si256(
            _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
            _mm256_set1_epi8(0x0F));
        const __m128 dm = q4_dm<Fmt>(b0, b0);
        const __m512 dw = _mm512_set1_ps(_mm_cvtss_f32(dm));
        for (int m = 0; m < M; ++m) {
          const int64_t mm = m0 + m;
          const __m256i xq = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(a.q + mm * a.q_stride + 64 * a.pairs));
          const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq);
          const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(d)),
                                           _mm512_loadu_ps(a.dxp + mm * a.dx_stride + 16 * a.pairs));
          acc[r][m] = _mm512_fmadd_ps(dot, dw, acc[r][m]);
          lin[r][m] = _mm_fmadd_ps(dm, _mm_loadu_ps(a.sxp + mm * a.sx_stride + 4 * a.pairs),
                                   lin[r][m]);
        }
      }
    }
    for (int r = 0; r < rb; ++r)
      for (int m = 0; m < M; ++m) {
        const __m128 l = lin[r][m];
        const float mins = _mm_cvtss_f32(_mm_add_ss(_mm_movehdup_ps(l),
                                                    _mm_movehdup_ps(_mm_movehl_ps(l, l))));
        res[(n + r - n0) * M + m] = _mm512_reduce_add_ps(acc[r][m]) + mins;
      }
  }
}

// Q8_0 rows: |w| against x carrying w's sign.
template <int M>
void q8_rows(const uint8_t* w, int64_t row_bytes, const ActQ8& a, int64_t m0, int64_t n0,
             int64_t n1, float* res) {
  constexpr int RB = 2;
  const __m512i zero = _mm512_setzero_si512();
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t n = n0; n < n1; n += RB) {
    const int rb = n1 - n < RB ? static_cast<int>(n1 - n) : RB;
    const uint8_t* row[RB];
    __m512 acc[RB][M];
    for (int r = 0; r < RB; ++r) {
      row[r] = w + (n + (r < rb ? r : 0)) * row_bytes;
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    }
    prefetch_ahead(row[0], row_bytes, rb);
    for (int64_t p = 0; p <= a.pairs; ++p) {
      const bool tail = p == a.pairs;
      if (tail && a.groups % 2 == 0) break;
      for (int r = 0; r < RB; ++r) {
        const uint8_t* b0 = row[r] + 2 * p * 34;
        // The odd last block: the upper half reads zeros (its dx lanes are 0 as well).
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
        const __m256i hi = tail ? _mm256_setzero_si256()
                                : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 36));
        const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        const __m512i aw = _mm512_abs_epi8(wq);
        const __mmask64 neg = _mm512_movepi8_mask(wq);
        uint16_t h0, h1 = 0;
        memcpy(&h0, b0, 2);
        if (!tail) memcpy(&h1, b0 + 34, 2);
        const __m128 d = _mm_cvtph_ps(_mm_setr_epi16(h0, h1, 0, 0, 0, 0, 0, 0));
        const __m512 dw = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d));
        for (int m = 0; m < M; ++m) {
          const int64_t mm = m0 + m;
          const __m512i xq = _mm512_loadu_si512(a.q + mm * a.q_stride + 64 * p);
          const __m512i xs = _mm512_mask_sub_epi8(xq, neg, zero, xq);
          const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, aw, xs)),
                                           _mm512_loadu_ps(a.dxp + mm * a.dx_stride + 16 * p));
          acc[r][m] = _mm512_fmadd_ps(dot, dw, acc[r][m]);
        }
      }
    }
    for (int r = 0; r < rb; ++r)
      for (int m = 0; m < M; ++m) res[(n + r - n0) * M + m] = _mm512_reduce_add_ps(acc[r][m]);
  }
}

using Int8RowsFn = void (*)(const uint8_t*, int64_t, const ActQ8&, int64_t, int64_t, int64_t,
                            float*);

template <int M>
Int8RowsFn rows_fn(int fmt) {
  switch (fmt) {
    case kQ4_0: return q4_rows<kQ4_0, M>;
    case kQ4_1: return q4_rows<kQ4_1, M>;
    default: return q8_rows<M>;
  }
}

Int8RowsFn rows_for(int fmt, int M) {
  switch (M) {
    case 1: return rows_fn<1>(fmt);
    case 2: return rows_fn<2>(fmt);
    case 3: return rows_fn<3>(fmt);
    case 4: return rows_fn<4>(fmt);
    default: return rows_fn<8>(fmt);  // only full tiles of 8 get here (see tiles below)
  }
}

}  // namespace

void linear_blocks_int8(const void* x, int x_dt, const uint8_t* w, int fmt, const void* bias,
                        int b_dt, void* out, int M, int64_t N, int64_t K, int nthreads) {
  const int64_t groups = K / 32, pairs = groups / 2;
  const int64_t bytes = fmt == kQ4_1 ? 20 : fmt == kQ4_0 ? 18 : 34;
  const int64_t row_bytes = groups * bytes;
  ActQ8 a{nullptr, nullptr, nullptr, groups, pairs, 64 * (pairs + 1), 16 * (pairs + 1),
          4 * (pairs + 1)};
  const int64_t q_bytes = M * a.q_stride, dx_bytes = 4 * M * a.dx_stride;
  char* buf = static_cast<char*>(checked_aligned_alloc(q_bytes + dx_bytes + 4 * M * a.sx_stride));
  a.q = reinterpret_cast<int8_t*>(buf);
  a.dxp = reinterpret_cast<float*>(buf + q_bytes);
  a.sxp = reinterpret_cast<float*>(buf + q_bytes + dx_bytes);
  for (int64_t m = 0; m < M; ++m) quantize_row(x, x_dt, K, fmt != kQ8_0, a, m);
  // Input tiles: 8 rows while at least 8 remain, then 4, 2, 1 (the kernels unroll M).
  int64_t tile_start[16], ntiles = 0;
  int tile_rows[16];
  constexpr int kChunk = 32;  // output rows per item: contiguous weight bytes
  const int64_t nchunks = (N + kChunk - 1) / kChunk;
  auto run_tiles = [&](int64_t first, int64_t count) {
    parallel_for(count * nchunks, nthreads, [&](int64_t item) {
      const int64_t t = first + item / nchunks;
      const int tile = tile_rows[t];
      const int64_t m0 = tile_start[t];
      const int64_t n0 = item % nchunks * kChunk, n1 = n0 + kChunk < N ? n0 + kChunk : N;
      float res[kChunk * 8];
      rows_for(fmt, tile)(w, row_bytes, a, m0, n0, n1, res);
      for (int64_t n = n0; n < n1; ++n) {
        const float b = bias ? load(bias, n, b_dt) : 0.0f;
        for (int m = 0; m < tile; ++m)
          store(out, (m0 + m) * N + n, res[(n - n0) * tile + m] + b, x_dt);
      }
    });
  };
  // At most 16 tiles (128 rows) per parallel region; the GEMV path takes up to 64.
  for (int64_t done = 0; done < M;) {
    ntiles = 0;
    for (int64_t t0 = done; t0 < M && ntiles < 16;) {
      const int64_t left = M - t0;
      const int rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      tile_start[ntiles] = t0, tile_rows[ntiles++] = rows;
      t0 += rows;
    }
    run_tiles(0, ntiles);
    done = tile_start[ntiles - 1] + tile_rows[ntiles - 1];
  }
  free(buf);
}

}  // namespace tv

#pragma GCC pop_options

namespace tv {

bool int8_act_supported(int fmt) {
  if (fmt != kQ4_0 && fmt != kQ4_1 && fmt != kQ8_0) return false;
  if (isa_level() != kIsaAvx512) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}

}  // namespace tv

// 1 when GEMVs over weights of format `fmt` with kFmtInt8Act run the int8-activation kernel
// on this CPU (AVX512-VNNI, Q4_0 / Q4_1 / Q8_0, AVX-512 kernels in use), 0 when they fall
// back to the exact kernel.
extern "C" int tv_int8_act_supported(int fmt) { return tv::int8_act_supported(fmt) ? 1 : 0; }
