// AVX-512 variant of tv_paged_decode (cpu_kernels.cpp calls it when the CPU has AVX-512
// F/BW/VL/DQ (tv::avx512_foundation(); BF16 not needed), the AMX kernel in attn_amx.cpp
// declined, and the shape fits: head_dim a multiple of 16 up to 256, at most 16 query heads
// per KV head). Same two-pass softmax in fp32 as the AVX2 kernel; only the summation
// order differs (and exp is avx512_math.h's polynomial, within about an ulp of expf).
//
// Why: the AVX2 kernel reduced every (key, query head) dot product across the vector on its
// own and ran expf one score at a time. Here each K row is loaded once for all query heads of
// its group, 16 keys' partial sums are reduced together by one shuffle tree (15 adds for 16
// dot products), exp runs on 16 lanes, and the V rows feed register-resident accumulators of
// up to 4 query heads x 64 dims. Scratch is per thread and reused: nothing is allocated per
// item once a thread has seen the longest context.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx512_math.h"
#include "common.h"
#include "paged_decode.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

#include "attn_value.h"  // after the pragma: its templates compile for AVX-512

namespace tv {

namespace {

constexpr int kMaxGroup = 16;
constexpr int64_t kMaxDim = 256;

// Horizontal sums of v[0..16) into the lanes of one vector: lane 4t + e gets v[4e + t]'s sum
// (a 4x4 transpose, undone by the caller's slot order). Four halving levels of shuffles + adds.
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], u[4], r[2];
  for (int k = 0; k < 8; ++k)  // 256-bit halves: lanes 0-7 v[2k], 8-15 v[2k + 1]
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int m = 0; m < 4; ++m)  // 128-bit lane t of u[m]: v[4m + t]
    u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int q = 0; q < 2; ++q)
    r[q] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * q], u[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * q], u[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Raw scores of the 16 keys at off[0..16) for G query heads (q: [G][D]): lane j of out[g] is
// key j's. Two keys per step, each K chunk loaded once for all G heads.
template <int G, typename T>
inline void score16(const T* kc, const int64_t* off, const float* q, int64_t D, __m512* out) {
  __m512 part[G][16];
  for (int s = 0; s < 16; s += 2) {
    // Slot s holds key 4 (s % 4) + s / 4, so that reduce16's transpose lands key j in lane j.
    const T* k0 = kc + off[(s % 4) * 4 + s / 4];
    const T* k1 = kc + off[((s + 1) % 4) * 4 + (s + 1) / 4];
    __m512 a0[G], a1[G];
    for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x0 = load16(k0 + d), x1 = load16(k1 + d);
      for (int g = 0; g < G; ++g) {
        const __m512 qv = _mm512_loadu_ps(q + g * D + d);
        a0[g] = _mm512_fmadd_ps(x0, qv, a0[g]);
        a1[g] = _mm512_fmadd_ps(x1, qv, a1[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      part[g][s] = a0[g];
      part[g][s + 1] = a1[g];
    }
  }
  for (int g = 0; g < G; ++g) out[g] = reduce16(part[g]);
}

template <typename T>
void score16_any(int G, const T* kc, const int64_t* off, const float* q, int64_t D,
                 __m512* out) {
  switch (G) {
    case 1: score16<1>(kc, off, q, D, out); break;
    case 2: score16<2>(kc, off, q, D, out); break;
    case 3: score16<3>(kc, off, q, D, out); break;
    case 4: score16<4>(kc, off, q, D, out); break;
    case 5: score16<5>(kc, off, q, D, out); break;
    case 6: score16<6>(kc, off, q, D, out); break;
    case 7: score16<7>(kc, off, q, D, out); break;
    default: score16<8>(kc, off, q, D, out); break;
  }
}

struct Item {  // one (query token, KV head): its G query heads over positions [first, L)
  int64_t n, G, D;
  float scale, softcap;
};

// Softmax weights of the item's G heads over its n keys into w ([G][np], padded lanes 0).
// Rows at off[0..16) of `row_bytes` each into cache (hint: _MM_HINT_T0 / _MM_HINT_T1).
template <int Hint, typename T>
inline void prefetch16(const T* base, const int64_t* off, int64_t row_bytes) {
  for (int j = 0; j < 16; ++j) {
    const char* r = reinterpret_cast<const char*>(base + off[j]);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(r + b, static_cast<_mm_hint>(Hint));
  }
}

// The cache sits in L3 (or DRAM) as rows scattered over random blocks, a few hundred bytes per
// (position, KV head): too short and too scattered for the hardware prefetchers, so each
// chunk's score pass fetches the next chunk's K rows into L1 and its own V rows into L2 (the
// value pass reads them after all scores are known).
template <typename T>
void item_weights(const T* kc, const T* vc, const int64_t* off, const float* qf, const Item& it,
                  float* w, int64_t np) {
  const __m512 scale = _mm512_set1_ps(it.scale);
  const int64_t row_bytes = it.D * static_cast<int64_t>(sizeof(T));
  for (int64_t g0 = 0; g0 < it.G; g0 += 8) {
    const int gb = it.G - g0 < 8 ? static_cast<int>(it.G - g0) : 8;
    if (g0 == 0 && np > 0) prefetch16<_MM_HINT_T0>(kc, off, row_bytes);
    for (int64_t c = 0; c < np; c += 16) {
      if (g0 == 0) {
        if (c + 16 < np) prefetch16<_MM_HINT_T0>(kc, off + c + 16, row_bytes);
        prefetch16<_MM_HINT_T1>(vc, off + c, row_bytes);
      }
      __m512 s[8];
      score16_any(gb, kc, off + c, qf + g0 * it.D, it.D, s);
      for (int g = 0; g < gb; ++g)
        _mm512_storeu_ps(w + (g0 + g) * np + c, _mm512_mul_ps(s[g], scale));
    }
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (16 - (np - it.n))) - 1);
  for (int64_t g = 0; g < it.G; ++g) {
    float* sg = w + g * np;
    if (it.softcap > 0.0f)  // no vector tanh: scalar, as the AVX2 kernel does
      for (int64_t p = 0; p < it.n; ++p) sg[p] = tanhf(sg[p] / it.softcap) * it.softcap;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < np; c += 16) {
      const __mmask16 m = c + 16 < np ? 0xFFFF : tail;
      mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(sg + c));
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < np; c += 16) {
      const __mmask16 m = c + 16 < np ? 0xFFFF : tail;
      const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + c), mv)));
      _mm512_storeu_ps(sg + c, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t c = 0; c < np; c += 16)
      _mm512_storeu_ps(sg + c, _mm512_mul_ps(_mm512_loadu_ps(sg + c), inv));
  }
}

template <typename T>
void decode_item(const T* kc, const T* vc, const int64_t* off, const float* qf, const Item& it,
                 float* w, int64_t np, float* acc) {
  item_weights(kc, vc, off, qf, it, w, np);
  for (int64_t g0 = 0; g0 < it.G; g0 += 4) {
    const int gb = it.G - g0 < 4 ? static_cast<int>(it.G - g0) : 4;
    value_any(gb, vc, off, it.n, w + g0 * np, np, 1, acc + g0 * it.D, it.D);
  }
}

}  // namespace

bool paged_decode_avx512_fits(int64_t hq, int64_t hkv, int64_t head_dim) {
  return head_dim % 16 == 0 && head_dim <= kMaxDim && hq / hkv <= kMaxGroup;
}

// tv_paged_decode's contract (cpu_kernels.cpp), for shapes that fit.
void paged_decode_avx512(const PagedDecode& a) {
  const int64_t hkv = a.hkv, head_dim = a.head_dim, block_size = a.block_size;
  const int64_t group = a.hq / hkv, D = head_dim;
  const int64_t cache_half = a.num_blocks * block_size * hkv * head_dim;
  parallel_for(a.n * hkv, a.nthreads, [&](int64_t item) {
    thread_local Scratch scratch;
    const int64_t i = item / hkv, kh = item % hkv;
    const int64_t L = a.length(i), first = a.first(L);
    const int32_t* blocks = a.blocks(i);
    const Item it{L - first, group, D, a.scale, a.softcap};
    const int64_t np = (it.n + 15) / 16 * 16;
    int64_t* off = static_cast<int64_t*>(scratch.get(np * 8 + group * np * 4));
    float* w = reinterpret_cast<float*>(off + np);
    // Block by block (no division per position); padding repeats the last key, whose lanes
    // are dropped.
    const int64_t row_elems = hkv * head_dim;
    for (int64_t pos = first, p = 0; pos < L;) {
      const int64_t in_block = pos % block_size, left = L - pos;
      const int64_t take = block_size - in_block < left ? block_size - in_block : left;
      const int64_t base = (static_cast<int64_t>(blocks[pos / block_size]) * block_size +
                            in_block) * row_elems + kh * head_dim;
      for (int64_t j = 0; j < take; ++j) off[p + j] = base + j * row_elems;
      p += take;
      pos += take;
    }
    for (int64_t p = it.n; p < np; ++p) off[p] = off[it.n - 1];
    alignas(64) float qf[kMaxGroup * kMaxDim];
    alignas(64) float acc[kMaxGroup * kMaxDim];
    const int64_t q0 = a.tok[i] * a.q_stride + kh * group * D;
    for (int64_t e = 0; e < group * D; ++e) qf[e] = load(a.q, q0 + e, a.dt);
    if (a.dt) {
      const uint16_t* kc = static_cast<const uint16_t*>(a.kv);
      decode_item(kc, kc + cache_half, off, qf, it, w, np, acc);
    } else {
      const float* kc = static_cast<const float*>(a.kv);
      decode_item(kc, kc + cache_half, off, qf, it, w, np, acc);
    }
    const int64_t o0 = (a.tok[i] * a.hq + kh * group) * D;
    for (int64_t e = 0; e < group * D; ++e) store(a.out, o0 + e, acc[e], a.dt);
  });
}

}  // namespace tv

#pragma GCC pop_options
