// Decode-step kernels for x86 CPUs with AVX2 + FMA, called through ctypes (no torch headers,
// so the library compiles in about a second on first use).
//
// Decode on a CPU is bound by weight bytes and by per-op dispatch: these kernels read bf16 or
// fp32 weights straight from the model's tensors, accumulate in fp32, and fold the small
// element-wise steps around each matmul into one call. Where eager PyTorch rounds to bf16
// between element-wise ops (residual add, rotary, SiLU * up, the norm's weight multiply), the
// kernels round at the same points so both paths agree bit for bit outside the matmuls.
//
// dtype codes: 0 = float32, 1 = bfloat16.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "paged_decode.h"

namespace {

using namespace tv;

inline float wval(const uint16_t* w, int64_t i) { return bf16_to_f32(w[i]); }
inline float wval(const float* w, int64_t i) { return w[i]; }

// Tiles of prefetch distance. Decode rows are short (576 bf16 = 1152 bytes for a 135M
// model), too short for the hardware prefetchers to ramp up on each: without software
// prefetch a GEMV streams at half the DRAM bandwidth.
constexpr int kPrefetchTiles = 2;

// RB output rows x M input rows per inner step; RB * M accumulators stay in registers.
// Row n's sums land in acc_out[(n - n0) * M + m].
template <typename W, int M, int RB>
void gemv_rows(const W* w, const float* x, int64_t K, int64_t n0, int64_t n1, int64_t N,
               float* acc_out) {
  constexpr int64_t kStep = RB * 8 * static_cast<int64_t>(sizeof(W));  // weight bytes per step
  for (int64_t n = n0; n < n1; n += RB) {
    const int rb = static_cast<int>(n1 - n < RB ? n1 - n : RB);
    __m256 acc[RB][M];
    for (int r = 0; r < RB; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    int64_t k = 0;
    if (rb == RB) {
      // A tile's rows are one contiguous block: stream the block kPrefetchTiles ahead into
      // cache at the rate this one is consumed, past this chunk's end (the next chunk is
      // usually this thread's or the other core's, sharing the L3).
      const char* pf = reinterpret_cast<const char*>(w + (n + kPrefetchTiles * RB) * K);
      const char* pf_end = reinterpret_cast<const char*>(w + N * K);
      for (; k + 8 <= K; k += 8) {
        const int64_t off = k * RB * static_cast<int64_t>(sizeof(W));
        if constexpr (kStep >= 64) {
          for (int64_t b = 0; b < kStep; b += 64)
            if (pf + off + b < pf_end) _mm_prefetch(pf + off + b, _MM_HINT_T0);
        } else if (off % 64 < kStep && pf + off < pf_end) {  // first step into a new line
          _mm_prefetch(pf + off, _MM_HINT_T0);
        }
        for (int r = 0; r < RB; ++r) {
          __m256 wv = load8(w + (n + r) * K + k);
          for (int m = 0; m < M; ++m)
            acc[r][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[r][m]);
        }
      }
    } else {
      for (; k + 8 <= K; k += 8) {
        for (int r = 0; r < rb; ++r) {
          __m256 wv = load8(w + (n + r) * K + k);
          for (int m = 0; m < M; ++m)
            acc[r][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[r][m]);
        }
      }
    }
    for (int r = 0; r < rb; ++r) {
      for (int m = 0; m < M; ++m) {
        float s = hsum(acc[r][m]);
        for (int64_t kk = k; kk < K; ++kk) s += wval(w, (n + r) * K + kk) * x[m * K + kk];
        acc_out[(n - n0 + r) * M + m] = s;
      }
    }
  }
}

template <typename W>
void gemv_dispatch(const W* w, const float* x, int M, int64_t K, int64_t n0, int64_t n1,
                   int64_t N, float* acc) {
  switch (M) {
    case 1: gemv_rows<W, 1, 4>(w, x, K, n0, n1, N, acc); break;
    case 2: gemv_rows<W, 2, 4>(w, x, K, n0, n1, N, acc); break;
    case 3: gemv_rows<W, 3, 3>(w, x, K, n0, n1, N, acc); break;
    case 4: gemv_rows<W, 4, 2>(w, x, K, n0, n1, N, acc); break;
    case 5: gemv_rows<W, 5, 2>(w, x, K, n0, n1, N, acc); break;
    case 6: gemv_rows<W, 6, 2>(w, x, K, n0, n1, N, acc); break;
    case 7: gemv_rows<W, 7, 1>(w, x, K, n0, n1, N, acc); break;
    default: gemv_rows<W, 8, 1>(w, x, K, n0, n1, N, acc); break;
  }
}

// q . k for P cached keys at element offsets off[] (independent FMA chains: one chain per
// key is latency-bound). Each key's sum runs in the same order whatever P is.
template <int P, typename T>
inline void key_dots_t(const T* kv, const int64_t* off, const float* q, int64_t head_dim,
                       float* out) {
  __m256 a[P];
  for (int j = 0; j < P; ++j) a[j] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= head_dim; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < P; ++j) a[j] = _mm256_fmadd_ps(load8(kv + off[j] + d), qv, a[j]);
  }
  for (int j = 0; j < P; ++j) {
    float s = hsum(a[j]);
    for (int64_t e = d; e < head_dim; ++e) s += wval(kv, off[j] + e) * q[e];
    out[j] = s;
  }
}

template <int P>
inline void key_dots(const void* kv, int dt, const int64_t* off, const float* q,
                     int64_t head_dim, float* out) {
  if (dt)
    key_dots_t<P>(static_cast<const uint16_t*>(kv), off, q, head_dim, out);
  else
    key_dots_t<P>(static_cast<const float*>(kv), off, q, head_dim, out);
}

// sum_p s[p] * v_p[d0 : d0 + 8 V] over positions [first, L), value rows at off[p]: the
// accumulators stay in registers, each lane summing over p in order.
template <int V, typename T>
inline void value_sum_t(const T* kv, const int64_t* off, int64_t first, int64_t L,
                        const float* s, int64_t d0, float* out) {
  __m256 a[V];
  for (int j = 0; j < V; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t p = first; p < L; ++p) {
    const __m256 pw = _mm256_set1_ps(s[p]);
    const T* vp = kv + off[p] + d0;
    for (int j = 0; j < V; ++j) a[j] = _mm256_fmadd_ps(load8(vp + 8 * j), pw, a[j]);
  }
  for (int j = 0; j < V; ++j) _mm256_storeu_ps(out + 8 * j, a[j]);
}

template <int V>
inline void value_sum(const void* kv, int dt, const int64_t* off, int64_t first, int64_t L,
                      const float* s, int64_t d0, float* out) {
  if (dt)
    value_sum_t<V>(static_cast<const uint16_t*>(kv), off, first, L, s, d0, out);
  else
    value_sum_t<V>(static_cast<const float*>(kv), off, first, L, s, d0, out);
}

// tv_linear for bf16 activations and weights on AVX-512 BF16 (vdpbf16ps on the bf16 rows as
// they are: no fp32 copy of x); same items as tv_linear's.
void linear_bf16_avx512(const uint16_t* x, const uint16_t* w, const void* bias, int b_dt,
                        uint16_t* out, int M, int64_t N, int64_t K, int nthreads) {
  if (linear_bf16_amx(x, w, bias, b_dt, out, M, N, K, nthreads)) return;
  constexpr int64_t kChunk = 32;
  const int64_t nchunks = (N + kChunk - 1) / kChunk, ntiles = (M + 7) / 8;
  parallel_for(ntiles * nchunks, nthreads, [&](int64_t item) {
    const int m0 = static_cast<int>(item / nchunks) * 8;
    const int tile = M - m0 < 8 ? M - m0 : 8;
    const int64_t n0 = item % nchunks * kChunk, n1 = n0 + kChunk < N ? n0 + kChunk : N;
    alignas(64) float acc[kChunk * 8];  // [row][tile]
    bf16_gemv_avx512(w, x + static_cast<int64_t>(m0) * K, tile, K, n0, n1, N, acc);
    for (int m = 0; m < tile; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        float v = acc[(n - n0) * tile + m];
        if (bias) v += load(bias, n, b_dt);
        out[(m0 + m) * N + n] = f32_to_bf16(v);
      }
  });
}

float* to_f32(const void* x, int64_t n, int dt) {
  float* buf = static_cast<float*>(checked_aligned_alloc(n * 4));
  for (int64_t i = 0; i < n; ++i) buf[i] = load(x, i, dt);
  return buf;
}

}  // namespace

extern "C" {

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); x, out contiguous. Rows go in tiles of
// up to 8 that share each weight load (decode batches: bandwidth-bound up to ~8 rows, then
// FMA-bound; the weight is re-read once per tile). One parallel region for all tiles: items
// are (tile, 32 output rows), handed out in shrinking claims, so on a busy machine one
// descheduled thread does not hold half the matrix.
void tv_linear(const void* x, int x_dt, const void* w, int w_dt, const void* bias, int b_dt,
               void* out, int M, int64_t N, int64_t K, int nthreads) {
  constexpr int64_t kChunk = 32;
  if (x_dt == 1 && w_dt == 1 && isa_level() == kIsaAvx512)
    return linear_bf16_avx512(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                              bias, b_dt, static_cast<uint16_t*>(out), M, N, K, nthreads);
  float* xf = to_f32(x, static_cast<int64_t>(M) * K, x_dt);
  const bool wide = avx512_foundation();  // 16 columns per FMA (gemv_avx512f.cpp)
  const int64_t nchunks = (N + kChunk - 1) / kChunk, ntiles = (M + 7) / 8;
  parallel_for(ntiles * nchunks, nthreads, [&](int64_t item) {
    const int m0 = static_cast<int>(item / nchunks) * 8;
    const int tile = M - m0 < 8 ? M - m0 : 8;
    const float* xt = xf + static_cast<int64_t>(m0) * K;
    const int64_t n0 = item % nchunks * kChunk, n1 = n0 + kChunk < N ? n0 + kChunk : N;
    alignas(32) float acc[kChunk * 8];  // [row][tile]
    if (w_dt && wide)
      gemv_avx512f(static_cast<const uint16_t*>(w), xt, tile, K, n0, n1, N, acc);
    else if (wide)
      gemv_avx512f(static_cast<const float*>(w), xt, tile, K, n0, n1, N, acc);
    else if (w_dt)
      gemv_dispatch(static_cast<const uint16_t*>(w), xt, tile, K, n0, n1, N, acc);
    else
      gemv_dispatch(static_cast<const float*>(w), xt, tile, K, n0, n1, N, acc);
    for (int m = 0; m < tile; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        float v = acc[(n - n0) * tile + m];
        if (bias) v += load(bias, n, b_dt);
        store(out, (m0 + m) * N + n, v, x_dt);
      }
  });
  free(xf);
}

// RMSNorm over rows of width H, as eager: [residual = x + residual (rounded)];
// y = weight * to_dtype(r * rsqrt(mean(r^2) + eps)), statistics in fp32.
void tv_rms_norm(const void* x, void* residual, const void* weight, void* out, int dt,
                 int64_t T, int64_t H, float eps) {
  float* row = static_cast<float*>(checked_malloc(H * 4));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float v = load(x, t * H + h, dt);
      if (residual) {
        v = as_dtype(v + load(residual, t * H + h, dt), dt);
        store(residual, t * H + h, v, dt);
      }
      row[h] = v;
    }
    double ss = 0.0;
    for (int64_t h = 0; h < H; ++h) ss += static_cast<double>(row[h]) * row[h];
    const float inv = 1.0f / sqrtf(static_cast<float>(ss / H) + eps);
    for (int64_t h = 0; h < H; ++h) {
      float normed = as_dtype(row[h] * inv, dt);
      store(out, t * H + h, load(weight, h, dt) * normed, dt);
    }
  }
  free(row);
}

// out[t, i] = silu(x[t, i]) * x[t, D + i], rounding after the silu as eager does.
void tv_silu_mul(const void* x, void* out, int dt, int64_t T, int64_t D) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < D; ++i) {
      float g = load(x, t * 2 * D + i, dt);
      float u = load(x, t * 2 * D + D + i, dt);
      float s = as_dtype(g / (1.0f + expf(-g)), dt);
      store(out, t * D + i, s * u, dt);
    }
}

// out[t, i] = gelu_tanh(x[t, i]) * x[t, D + i] (Gemma's gelu_pytorch_tanh), rounding after
// the gelu as eager does.
void tv_gelu_tanh_mul(const void* x, void* out, int dt, int64_t T, int64_t D) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < D; ++i) {
      float g = load(x, t * 2 * D + i, dt);
      float u = load(x, t * 2 * D + D + i, dt);
      float s = as_dtype(0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g))), dt);
      store(out, t * D + i, s * u, dt);
    }
}

// In-place neox rotary on the first `rot` dims of every head of q and k (rows of stride
// q_stride / k_stride elements). cos/sin: fp32 [max_pos, rot], rounded to the dtype first
// and every product rounded, exactly as the eager rotation computes in bf16.
void tv_rope(void* q, int64_t q_stride, int64_t hq, void* k, int64_t k_stride, int64_t hkv,
             int dt, int64_t T, int64_t head_dim, int64_t rot, const int64_t* positions,
             const float* cos_c, const float* sin_c) {
  const int64_t half = rot / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos_c + positions[t] * rot;  // rows hold [freqs | freqs]
    const float* s = sin_c + positions[t] * rot;
    for (int which = 0; which < 2; ++which) {
      void* base = which ? k : q;
      const int64_t heads = which ? hkv : hq, stride = which ? k_stride : q_stride;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t o = t * stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          float x1 = load(base, o + i, dt), x2 = load(base, o + half + i, dt);
          float ci = as_dtype(c[i], dt), si = as_dtype(s[i], dt);
          float a1 = as_dtype(x1 * ci, dt), b1 = as_dtype(-x2 * si, dt);
          float a2 = as_dtype(x2 * ci, dt), b2 = as_dtype(x1 * si, dt);
          store(base, o + i, a1 + b1, dt);
          store(base, o + half + i, a2 + b2, dt);
        }
      }
    }
  }
}

// K and V rows ([T, width] with row strides) into the paged cache at slots (< 0 skipped).
void tv_store_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, int64_t T,
                 int64_t width, int elem, void* k_cache, void* v_cache, const int64_t* slots) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    memcpy(static_cast<char*>(k_cache) + slot * width * elem,
           static_cast<const char*>(k) + t * k_stride * elem, width * elem);
    memcpy(static_cast<char*>(v_cache) + slot * width * elem,
           static_cast<const char*>(v) + t * v_stride * elem, width * elem);
  }
}

}  // extern "C"


extern "C" {

// Attention straight from the paged cache (no gather): query token tok[i] of request row[i]
// attends over the first seq_lens[row[i]] cached positions (decode), or over the first
// tok_lens[i] when tok_lens is given (any query token: its own position + 1, so several tokens
// of one request, e.g. K + 1 verify tokens, attend causally). q rows are q_stride elements
// apart (views into the fused qkv output); out is contiguous [T, hq, head_dim]. kv layout per
// layer: [2][num_blocks][block_size][hkv][head_dim]. Scores and softmax in fp32.
void tv_paged_decode(const void* q, int64_t q_stride, void* out, int dt, int64_t n,
                     const int64_t* tok, const int64_t* row, const int32_t* tok_lens,
                     const int32_t* seq_lens, const int32_t* block_table,
                     int64_t bt_stride, const void* kv, int64_t num_blocks, int64_t block_size,
                     int64_t hq, int64_t hkv, int64_t head_dim, float scale, int64_t window,
                     float softcap, int nthreads) {
  const PagedDecode a{q, q_stride, out, dt, n, tok, row, tok_lens, seq_lens, block_table,
                      bt_stride, kv, num_blocks, block_size, hq, hkv, head_dim, scale, window,
                      softcap, nthreads};
  if (isa_level() == kIsaAvx512 && paged_decode_amx(a)) return;
  // No BF16 instruction in it: every CPU with AVX-512 F/BW/VL/DQ takes it.
  if (avx512_foundation() && paged_decode_avx512_fits(hq, hkv, head_dim)) {
    paged_decode_avx512(a);
    return;
  }
  const int64_t group = hq / hkv;
  const int64_t cache_half = num_blocks * block_size * hkv * head_dim;
  // One item per (query token, KV head): its query heads share every K and V row read.
  parallel_for(n * hkv, nthreads, [&](int64_t item) {
    const int64_t i = item / hkv, kh = item % hkv;
    const int64_t L = a.length(i), first = a.first(L);
    const int32_t* blocks = a.blocks(i);
    // Per position: the element offset of its K row; its V row is cache_half further on.
    int64_t* off = static_cast<int64_t*>(
        checked_malloc(L * 8 + (L + 1) * group * 4 + head_dim * group * 8));
    float* scores = reinterpret_cast<float*>(off + L);
    float* qf = scores + (L + 1) * group;
    float* acc = qf + head_dim * group;
    for (int64_t p = first; p < L; ++p) {
      const int64_t slot = static_cast<int64_t>(blocks[p / block_size]) * block_size +
                           p % block_size;
      off[p] = (slot * hkv + kh) * head_dim;
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < head_dim; ++d)
        qf[g * head_dim + d] = load(q, tok[i] * q_stride + (kh * group + g) * head_dim + d, dt);
    float mx[64];
    for (int64_t g = 0; g < group; ++g) mx[g] = -INFINITY;
    for (int64_t p = first; p < L;) {
      const int np = L - p >= 4 ? 4 : 1;  // four keys at a time, then one by one
      for (int64_t g = 0; g < group; ++g) {
        float sc[4];
        if (np == 4)
          key_dots<4>(kv, dt, off + p, qf + g * head_dim, head_dim, sc);
        else
          key_dots<1>(kv, dt, off + p, qf + g * head_dim, head_dim, sc);
        for (int j = 0; j < np; ++j) {
          float v = sc[j] * scale;
          if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
          scores[g * (L + 1) + p + j] = v;
          if (v > mx[g]) mx[g] = v;
        }
      }
      p += np;
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores + g * (L + 1);
      float sum = 0.0f;
      for (int64_t p = first; p < L; ++p) {
        sg[p] = expf(sg[p] - mx[g]);
        sum += sg[p];
      }
      const float inv = 1.0f / sum;
      for (int64_t p = first; p < L; ++p) sg[p] *= inv;
    }
    const void* vcache = static_cast<const char*>(kv) + cache_half * (dt ? 2 : 4);
    for (int64_t g = 0; g < group; ++g) {
      const float* sg = scores + g * (L + 1);
      float* ag = acc + g * head_dim;
      int64_t d = 0;
      for (; d + 64 <= head_dim; d += 64) value_sum<8>(vcache, dt, off, first, L, sg, d, ag + d);
      for (; d + 8 <= head_dim; d += 8) value_sum<1>(vcache, dt, off, first, L, sg, d, ag + d);
      for (; d < head_dim; ++d) {
        float a = 0.0f;
        for (int64_t p = first; p < L; ++p) a += sg[p] * load(vcache, off[p] + d, dt);
        ag[d] = a;
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < head_dim; ++d)
        store(out, (tok[i] * hq + kh * group + g) * head_dim + d, acc[g * head_dim + d], dt);
    free(off);
  });
}

}  // extern "C"
