// Element-wise kernels for prefill-sized inputs (hundreds to thousands of rows): RMSNorm with
// the residual add, SiLU(gate) * up and neox rotary, with AVX-512 bodies and rows split over
// the thread pool. They round where the eager ops round, like their one-thread counterparts in
// cpu_kernels.cpp (which decode-sized inputs keep using).
//
// Why: a 4,096-token prefill step of a SmolLM2-135M-shaped model spent ~0.9 s of 2.1 s in the
// separate eager ops these replace (each reads and writes the whole activation, several MB,
// past the caches), against 0.55 s in its GEMMs.
//
// The library is built with AVX2 flags only; these functions carry AVX-512 target attributes,
// and Python calls them only where the CPU has avx512f and avx512bw (tv_rows_supported).

#include "avx512_math.h"
#include "common.h"
#include "omp_team.h"

#include <math.h>

namespace tv {
namespace {

// The row kernels' target: AVX-512 with BF16, whose vcvtneps2bf16 instruction is used only
// in the kHw instantiations below, which run only where the CPU has it (tv_rows_bf16_hw).
#define TV_ROWS __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// 16 fp32 -> 16 bf16, rounded as bf16_bits. kHw: one vcvtneps2bf16, which rounds the same way
// (nearest even, NaN quieted by the same bit) except that it reads fp32 denormals as zero, so
// a vector holding one takes the integer path. Why: the integer rounding is ~10 instructions
// per vector, and rope rounds 8 times per element pair, SiLU and RMSNorm 2-3 times; on a
// 4,096-token prefill step of SmolLM2-135M the three kernels spent ~0.23 s of ~1 s.
template <bool kHw>
TV_ROWS inline __m256i bf16_pack(__m512 v) {
  if (kHw && !_mm512_fpclass_ps_mask(v, 0x20))  // 0x20: denormal
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_cvtepi32_epi16(bf16_bits(v));
}

template <bool kHw>
TV_ROWS inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_pack<kHw>(v));
}

template <bool kHw>
TV_ROWS inline void store16(float* p, __m512 v) {
  _mm512_storeu_ps(p, v);
}

// Rounds to the storage type without storing (an eager op's output rounding).
template <bool kHw>
TV_ROWS inline __m512 round16(__m512 v, uint16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack<kHw>(v)), 16));
}

template <bool kHw>
TV_ROWS inline __m512 round16(__m512 v, float*) {
  return v;
}

template <class T>
constexpr int dt_code() {
  return std::is_same<T, uint16_t>::value ? 1 : 0;
}

// Rows per thread-pool item: enough work to amortise claiming an item, small enough that a
// descheduled worker holds up little.
constexpr int64_t kRowsPerItem = 16;

template <class T, bool kHw>
TV_ROWS void rms_norm_row(const T* x, T* res, const T* w, T* out, int64_t H, float eps) {
  // Pass 1: residual add (rounded to the dtype, stored) and the sum of squares in double.
  __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
  double tail = 0.0;
  int64_t h = 0;
  for (; h + 16 <= H; h += 16) {
    __m512 v = load16(x + h);
    if (res) {
      v = round16<kHw>(_mm512_add_ps(v, load16(res + h)), res);
      store16<kHw>(res + h, v);
    }
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
    acc_lo = _mm512_fmadd_pd(lo, lo, acc_lo);  // exact products: fma or not is the same
    acc_hi = _mm512_fmadd_pd(hi, hi, acc_hi);
  }
  for (; h < H; ++h) {
    float v = load(x, h, dt_code<T>());
    if (res) {
      v = as_dtype(v + load(res, h, dt_code<T>()), dt_code<T>());
      store(res, h, v, dt_code<T>());
    }
    tail += static_cast<double>(v) * v;
  }
  const double ss = _mm512_reduce_add_pd(_mm512_add_pd(acc_lo, acc_hi)) + tail;
  const float inv = 1.0f / sqrtf(static_cast<float>(ss / H) + eps);
  // Pass 2: y = w * to_dtype(r * inv), r re-read from wherever pass 1 left it.
  const T* src = res ? res : x;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (h = 0; h + 16 <= H; h += 16) {
    const __m512 normed = round16<kHw>(_mm512_mul_ps(load16(src + h), vinv), out);
    store16<kHw>(out + h, _mm512_mul_ps(load16(w + h), normed));
  }
  for (; h < H; ++h) {
    const float normed = as_dtype(load(src, h, dt_code<T>()) * inv, dt_code<T>());
    store(out, h, load(w, h, dt_code<T>()) * normed, dt_code<T>());
  }
}

template <class T, bool kHw>
TV_ROWS void silu_mul_row(const T* x, T* out, int64_t D) {
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    const __m512 g = load16(x + i), u = load16(x + D + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = round16<kHw>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), out);
    store16<kHw>(out + i, _mm512_mul_ps(s, u));
  }
  for (; i < D; ++i) {
    const float g = load(x, i, dt_code<T>()), u = load(x, D + i, dt_code<T>());
    const float s = as_dtype(g / (1.0f + expf(-g)), dt_code<T>());
    store(out, i, s * u, dt_code<T>());
  }
}

// silu_mul_row of fp32 rows [gate | up] rounded to bf16 first (as the GEMM's output rounded to a
// bf16 activation), its bf16 results stored as fp32: the same bits as the GEMM output's
// conversion, silu_mul_row on bf16 and the conversion back to fp32 for the next GEMM. Why: on
// CPUs without bf16 matmul the MLP's GEMMs run in fp32, and those two conversion passes over
// the [T, 2 * D] and [T, D] activations cost a sixth of the MLP (4,096 rows of SmolLM2-135M:
// 113 vs 95 ms a layer on a 2-core Ice Lake).
template <bool kHw>
TV_ROWS void silu_mul_row_bf16_in_f32(const float* x, float* out, int64_t D) {
  uint16_t* const bf16 = nullptr;  // selects round16's bf16 rounding
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    const __m512 g = round16<kHw>(_mm512_loadu_ps(x + i), bf16);
    const __m512 u = round16<kHw>(_mm512_loadu_ps(x + D + i), bf16);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = round16<kHw>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), bf16);
    _mm512_storeu_ps(out + i, round16<kHw>(_mm512_mul_ps(s, u), bf16));
  }
  for (; i < D; ++i) {
    const float g = round_bf16(x[i]), u = round_bf16(x[D + i]);
    out[i] = round_bf16(round_bf16(g / (1.0f + expf(-g))) * u);
  }
}

// One head's neox rotation in place: every product and both sums rounded to the dtype, as the
// eager `rot * cos + cat(-x2, x1) * sin` computes.
template <class T, bool kHw>
TV_ROWS void rope_head(T* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + half + i);
    const __m512 ci = round16<kHw>(_mm512_loadu_ps(c + i), x);
    const __m512 si = round16<kHw>(_mm512_loadu_ps(s + i), x);
    const __m512 a1 = round16<kHw>(_mm512_mul_ps(x1, ci), x);
    const __m512 b1 = round16<kHw>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), si), x);
    const __m512 a2 = round16<kHw>(_mm512_mul_ps(x2, ci), x);
    const __m512 b2 = round16<kHw>(_mm512_mul_ps(x1, si), x);
    store16<kHw>(x + i, _mm512_add_ps(a1, b1));
    store16<kHw>(x + half + i, _mm512_add_ps(a2, b2));
  }
  const int dt = dt_code<T>();
  for (; i < half; ++i) {
    const float x1 = load(x, i, dt), x2 = load(x, half + i, dt);
    const float ci = as_dtype(c[i], dt), si = as_dtype(s[i], dt);
    const float a1 = as_dtype(x1 * ci, dt), b1 = as_dtype(-x2 * si, dt);
    const float a2 = as_dtype(x2 * ci, dt), b2 = as_dtype(x1 * si, dt);
    store(x, i, a1 + b1, dt);
    store(x, half + i, a2 + b2, dt);
  }
}

// f(t) for every row t, in blocks of rows claimed on the pool or on `omp`'s team (omp_team.h).
template <class F>
void for_row_blocks(int64_t T, int nthreads, OmpParallelFn omp, F&& f) {
  const int64_t items = (T + kRowsPerItem - 1) / kRowsPerItem;
  run_items(omp, items, nthreads, [&](int64_t item) {
    const int64_t t1 = (item + 1) * kRowsPerItem < T ? (item + 1) * kRowsPerItem : T;
    for (int64_t t = item * kRowsPerItem; t < t1; ++t) f(t);
  });
}

template <class T, bool kHw>
void rms_norm_rows(const T* x, T* res, const T* w, T* out, int64_t T_, int64_t H, float eps,
                   int nthreads, OmpParallelFn omp) {
  for_row_blocks(T_, nthreads, omp, [&](int64_t t) {
    rms_norm_row<T, kHw>(x + t * H, res ? res + t * H : nullptr, w, out + t * H, H, eps);
  });
}

template <class T, bool kHw>
void silu_mul_rows(const T* x, T* out, int64_t T_, int64_t D, int nthreads, OmpParallelFn omp) {
  for_row_blocks(T_, nthreads, omp,
                 [&](int64_t t) { silu_mul_row<T, kHw>(x + t * 2 * D, out + t * D, D); });
}

template <class T, bool kHw>
void rope_rows(T* q, int64_t q_stride, int64_t hq, T* k, int64_t k_stride, int64_t hkv,
               int64_t T_, int64_t head_dim, int64_t rot, const int64_t* positions,
               const float* cos_c, const float* sin_c, int nthreads, OmpParallelFn omp) {
  for_row_blocks(T_, nthreads, omp, [&](int64_t t) {
    const float* c = cos_c + positions[t] * rot;  // rows hold [freqs | freqs]
    const float* s = sin_c + positions[t] * rot;
    for (int64_t h = 0; h < hq; ++h)
      rope_head<T, kHw>(q + t * q_stride + h * head_dim, c, s, rot / 2);
    for (int64_t h = 0; h < hkv; ++h)
      rope_head<T, kHw>(k + t * k_stride + h * head_dim, c, s, rot / 2);
  });
}

template <bool kHw>
TV_ROWS void round_rows(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i + 16 <= n; i += 16) store16<kHw>(out + i, _mm512_loadu_ps(x + i));
}

// Whether vcvtneps2bf16 may round bf16 outputs (the CPU has AVX512-BF16), checked once.
bool bf16_hw() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return ok;
}

}  // namespace
}  // namespace tv

using namespace tv;

extern "C" {

// 1 when this CPU can run the tv_rows_* kernels (AVX-512 F + BW), else 0.
int tv_rows_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 1 : 0;
}

// 1 when the row kernels round bf16 outputs with vcvtneps2bf16 (AVX512-BF16), else 0.
int tv_rows_bf16_hw() { return bf16_hw() ? 1 : 0; }

// The row kernels' bf16 rounding of x[0..n) (n a multiple of 16) into out: the vcvtneps2bf16
// path (hw = 1; only where tv_rows_bf16_hw() is 1) or the integer one. For the tests, which
// hold the two to the same bits.
void tv_rows_round_bf16(const float* x, uint16_t* out, int64_t n, int hw) {
  if (hw)
    round_rows<true>(x, out, n);
  else
    round_rows<false>(x, out, n);
}

// The tv_rows_* kernels run on the thread pool, or on the OpenMP team of `omp_parallel` (the
// address of GOMP_parallel in torch's runtime; null: the pool), see omp_team.h.

// tv_rms_norm (cpu_kernels.cpp) over T rows.
void tv_rows_rms_norm(const void* x, void* residual, const void* weight, void* out, int dt,
                      int64_t T, int64_t H, float eps, int nthreads, const void* omp_parallel) {
  const OmpParallelFn omp = omp_team(omp_parallel);
  const auto* xb = static_cast<const uint16_t*>(x);
  auto* rb = static_cast<uint16_t*>(residual);
  const auto* wb = static_cast<const uint16_t*>(weight);
  auto* ob = static_cast<uint16_t*>(out);
  if (dt && bf16_hw())
    rms_norm_rows<uint16_t, true>(xb, rb, wb, ob, T, H, eps, nthreads, omp);
  else if (dt)
    rms_norm_rows<uint16_t, false>(xb, rb, wb, ob, T, H, eps, nthreads, omp);
  else
    rms_norm_rows<float, false>(static_cast<const float*>(x), static_cast<float*>(residual),
                                static_cast<const float*>(weight), static_cast<float*>(out), T,
                                H, eps, nthreads, omp);
}

// tv_silu_mul over T rows.
void tv_rows_silu_mul(const void* x, void* out, int dt, int64_t T, int64_t D, int nthreads,
                      const void* omp_parallel) {
  const OmpParallelFn omp = omp_team(omp_parallel);
  const auto* xb = static_cast<const uint16_t*>(x);
  auto* ob = static_cast<uint16_t*>(out);
  if (dt && bf16_hw())
    silu_mul_rows<uint16_t, true>(xb, ob, T, D, nthreads, omp);
  else if (dt)
    silu_mul_rows<uint16_t, false>(xb, ob, T, D, nthreads, omp);
  else
    silu_mul_rows<float, false>(static_cast<const float*>(x), static_cast<float*>(out), T, D,
                                nthreads, omp);
}

// SiLU(gate) * up of T fp32 rows [gate | up] rounded to bf16, into fp32 rows holding the bf16
// results (silu_mul_row_bf16_in_f32). AVX-512 F + BW (tv_rows_supported).
void tv_rows_silu_mul_bf16_in_f32(const float* x, float* out, int64_t T, int64_t D, int nthreads,
                                  const void* omp_parallel) {
  const OmpParallelFn omp = omp_team(omp_parallel);
  for_row_blocks(T, nthreads, omp, [&](int64_t t) {
    if (bf16_hw())
      silu_mul_row_bf16_in_f32<true>(x + t * 2 * D, out + t * D, D);
    else
      silu_mul_row_bf16_in_f32<false>(x + t * 2 * D, out + t * D, D);
  });
}

// tv_rope over T rows.
void tv_rows_rope(void* q, int64_t q_stride, int64_t hq, void* k, int64_t k_stride, int64_t hkv,
                  int dt, int64_t T, int64_t head_dim, int64_t rot, const int64_t* positions,
                  const float* cos_c, const float* sin_c, int nthreads, const void* omp_parallel) {
  const OmpParallelFn omp = omp_team(omp_parallel);
  auto* qb = static_cast<uint16_t*>(q);
  auto* kb = static_cast<uint16_t*>(k);
  if (dt && bf16_hw())
    rope_rows<uint16_t, true>(qb, q_stride, hq, kb, k_stride, hkv, T, head_dim, rot, positions,
                              cos_c, sin_c, nthreads, omp);
  else if (dt)
    rope_rows<uint16_t, false>(qb, q_stride, hq, kb, k_stride, hkv, T, head_dim, rot, positions,
                               cos_c, sin_c, nthreads, omp);
  else
    rope_rows<float, false>(static_cast<float*>(q), q_stride, hq, static_cast<float*>(k), k_stride,
                            hkv, T, head_dim, rot, positions, cos_c, sin_c, nthreads, omp);
}

// tv_store_kv (cpu_kernels.cpp) over blocks of rows. Why: a prefill step's K / V rows land
// in cache pages often touched for the first time (the cache is mapped lazily), and one
// thread faulting and copying them took 2-3 ms a layer for 4,096 rows of SmolLM2-135M.
void tv_rows_store_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride,
                      int64_t T, int64_t width, int elem, void* k_cache, void* v_cache,
                      const int64_t* slots, int nthreads, const void* omp_parallel) {
  const int64_t items = (T + kRowsPerItem - 1) / kRowsPerItem;
  run_items(omp_team(omp_parallel), items, nthreads, [&](int64_t item) {
    const int64_t t0 = item * kRowsPerItem;
    const int64_t n = T - t0 < kRowsPerItem ? T - t0 : kRowsPerItem;
    tv_store_kv(static_cast<const char*>(k) + t0 * k_stride * elem, k_stride,
                static_cast<const char*>(v) + t0 * v_stride * elem, v_stride, n, width, elem,
                k_cache, v_cache, slots + t0);
  });
}

}  // extern "C"
