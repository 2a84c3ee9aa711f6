// Shared by the native CPU kernel sources: bf16 <-> fp32 conversion, dtype-coded loads and
// stores (0 = float32, 1 = bfloat16), AVX2 helpers, the thread pool (thread_pool.cpp), and the
// C entry points each file offers the others.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

// The ABI this source tree exports (tinyvllm/native/abi.py declares it for ctypes: signatures,
// struct layouts, codes). Bump both together on any change the Python side must follow.
#define TV_ABI_VERSION 14

namespace tv {

using RangeFn = void (*)(void* ctx, int64_t item);

// Runs fn(ctx, i) for every i in [0, n) on up to nthreads threads, the caller among them, and
// returns when all have run. Items are claimed in increasing order by whoever is free, a claim
// taking a shrinking share of what is left (the last ones one by one), so a thread the OS has
// descheduled delays at most the few items of its last claim (thread_pool.cpp).
void parallel_run(int64_t n, int nthreads, RangeFn fn, void* ctx);

// Instruction sets of the GEMV kernels (avx512_kernels.cpp): the AVX2 ones always build; the
// AVX-512 ones run when the CPU has AVX-512 BW/VL/DQ and BF16 (isa_level(), probed once).
constexpr int kIsaAvx2 = 1;
constexpr int kIsaAvx512 = 2;
int isa_level();
// AVX-512 F/BW/VL/DQ (without BF16 perhaps), unless tv_set_isa asked for AVX2 only.
bool avx512_foundation();
// tv_linear's GEMV on AVX-512 Foundation (gemv_avx512f.cpp), fp32 activations.
void gemv_avx512f(const uint16_t* w, const float* x, int M, int64_t K, int64_t n0, int64_t n1,
                  int64_t N, float* acc);
void gemv_avx512f(const float* w, const float* x, int M, int64_t K, int64_t n0, int64_t n1,
                  int64_t N, float* acc);

// bf16 rows [n0, n1) of w [N][K] against M <= 8 bf16 activation rows x [M][K] (vdpbf16ps):
// row n's sums land in acc[(n - n0) * M + m]. AVX-512 BF16 only.
void bf16_gemv_avx512(const uint16_t* w, const uint16_t* x, int M, int64_t K, int64_t n0,
                      int64_t n1, int64_t N, float* acc);

// bf16 out [M][N] = x [M][K] w^T (+ bias) on AMX tiles (amx_linear.cpp) when M >= kAmxMinRows,
// K % 32 == 0, N % 16 == 0 and the CPU and OS allow AMX; false (nothing written) otherwise.
constexpr int kAmxMinRows = 2;
bool linear_bf16_amx(const uint16_t* x, const uint16_t* w, const void* bias, int b_dt,
                     uint16_t* out, int M, int64_t N, int64_t K, int nthreads);

// A block GEMV over GGUF rows [n0, n1) against M fp32 rows x [M][K] and their group sums xs8
// [K / 32][8]: (w, row_bytes, x, xs8, K, n0, n1, res[(n - n0) * M + m]).
using BlockRowsFn = void (*)(const uint8_t*, int64_t, const float*, const float*, int64_t,
                             int64_t, int64_t, float*);
// The AVX-512 kernel for a format code and M (1..8), or null where only AVX2 has one.
BlockRowsFn block_rows_avx512(int fmt, int M);

// Q4_1 rows against M <= 8 bf16 activation rows in pair layout (avx512_kernels.cpp): x16
// [M][K / 64][64] holds, per pair of blocks (b0, b1), [x_b0[0:16], x_b1[0:16], x_b0[16:32],
// x_b1[16:32]], xsp [K / 64][16] [sum x_b0 of rows 0..7, sum x_b1 of rows 0..7] (0 past M);
// (w, row_bytes, x16, xsp, K, n0, n1, res[(n - n0) * M + m]). K a multiple of 64.
using Bf16BlockRowsFn = void (*)(const uint8_t*, int64_t, const uint16_t*, const float*, int64_t,
                                 int64_t, int64_t, float*);
Bf16BlockRowsFn q4_1_bf16_rows_avx512(int M);

// bf16 matrices in the pair layout (code kBF16 | kFmtRows16, bf16_pairs.cpp): whether this
// CPU's best kernels read it, and out [M][N] (x_dt) = x [M][K] w^T (+ bias) on it.
bool bf16_pairs_supported();
void linear_bf16_pairs(const void* x, int x_dt, const void* w, const void* bias, int b_dt,
                       void* out, int M, int64_t N, int64_t K, int nthreads);

// Opt-in int8-activation GEMVs (int8_kernels.cpp): a GGUF format code with this bit set asks
// tv_linear_any / tv_linear_blocks for them; formats or CPUs they do not cover (no
// AVX512-VNNI, formats other than Q4_0 / Q4_1 / Q8_0) take the exact kernel instead.
constexpr int kFmtInt8Act = 0x100;
bool int8_act_supported(int fmt);
// Same contract as tv_linear_blocks for a format int8_act_supported() accepts.
void linear_blocks_int8(const void* x, int x_dt, const uint8_t* w, int fmt, const void* bias,
                        int b_dt, void* out, int M, int64_t N, int64_t K, int nthreads);
// A Q4_0 / Q4_1 / Q8_0 code with this bit set names a matrix repacked 16 rows at a time
// (rows16_layout.cpp, tv_repack_rows16): its GEMVs with kFmtInt8Act run linear_rows16_int8
// (same contract as tv_linear_blocks; the AVX512-VNNI kernel of int8_rows16.cpp or the AVX2
// one of int8_rows16_avx2.cpp), its rows dequantize through rows16_gguf_row (row r's GGUF
// blocks, K / 32 of them, into row).
constexpr int kFmtRows16 = 0x200;
bool rows16_int8_supported(int fmt);
void linear_rows16_int8(const void* x, int x_dt, const uint8_t* w, int fmt, const void* bias,
                        int b_dt, void* out, int M, int64_t N, int64_t K, int nthreads);
void linear_rows16_int8_avx512(const void* x, int x_dt, const uint8_t* w, int fmt,
                               const void* bias, int b_dt, void* out, int M, int64_t N, int64_t K,
                               int nthreads);
void linear_rows16_int8_avx2(const void* x, int x_dt, const uint8_t* w, int fmt,
                             const void* bias, int b_dt, void* out, int M, int64_t N, int64_t K,
                             int nthreads);
void rows16_gguf_row(const uint8_t* w, int fmt, int64_t K, int64_t r, uint8_t* row);
// The bytes of the layout's blocks to come, before reading `bytes` at p: 8 KiB ahead into L2
// and 1 KiB ahead into L1. The far prefetches keep enough lines in flight for a core to
// stream the weights from L3 or DRAM: without them the real SmolLM2 Q4_1 decoded 215-220
// tok/s with int8 activations, with them 310-330 (1 KiB alone).
inline void rows16_prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) {  // prefetches never fault
    _mm_prefetch(reinterpret_cast<const char*>(p + 1024 + off), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 8192 + off), _MM_HINT_T1);
  }
}
// Without kFmtInt8Act, a Q4_0 / Q4_1 matrix in the layout against bf16 activations runs the
// exact kernel of bf16_rows16.cpp (AVX512-BF16) or bf16_rows16_avx2.cpp (out bf16 [M][N]).
void linear_rows16_bf16(const uint16_t* x, const uint8_t* w, int fmt, const void* bias, int b_dt,
                        uint16_t* out, int M, int64_t N, int64_t K, int nthreads);
void linear_rows16_bf16_avx512(const uint16_t* x, const uint8_t* w, int fmt, const void* bias,
                               int b_dt, uint16_t* out, int M, int64_t N, int64_t K,
                               int nthreads);
void linear_rows16_bf16_avx512f(const uint16_t* x, const uint8_t* w, int fmt, const void* bias,
                                int b_dt, uint16_t* out, int M, int64_t N, int64_t K,
                                int nthreads);
void linear_rows16_bf16_avx2(const uint16_t* x, const uint8_t* w, int fmt, const void* bias,
                             int b_dt, uint16_t* out, int M, int64_t N, int64_t K,
                             int nthreads);

template <class F>
void parallel_for(int64_t n, int nthreads, F&& f) {
  using Fn = std::remove_reference_t<F>;
  parallel_run(n, nthreads, [](void* c, int64_t i) { (*static_cast<Fn*>(c))(i); }, &f);
}


// Scratch memory for a kernel (release with free): 64-byte aligned, or plain malloc where
// alignment does not matter. The kernels have no error channel, so running out of memory stops
// the process with a message naming the size rather than writing through a null pointer.
inline void* checked(void* p, int64_t bytes) {
  if (p == nullptr) {
    fprintf(stderr, "tinyvllm native kernels: out of memory allocating %lld bytes\n",
            static_cast<long long>(bytes));
    abort();
  }
  return p;
}

inline void* checked_aligned_alloc(int64_t bytes) {
  const int64_t size = bytes > 0 ? (bytes + 63) / 64 * 64 : 64;
  return checked(aligned_alloc(64, static_cast<size_t>(size)), size);
}

inline void* checked_malloc(int64_t bytes) {
  return checked(malloc(static_cast<size_t>(bytes > 0 ? bytes : 1)), bytes);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 64);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

inline float load(const void* p, int64_t i, int dt) {
  return dt ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store(void* p, int64_t i, float v, int dt) {
  if (dt)
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else
    static_cast<float*>(p)[i] = v;
}

// Rounds to the storage dtype without storing (emulates an eager op's output rounding).
inline float as_dtype(float v, int dt) { return dt ? round_bf16(v) : v; }

inline __m256 load8(const uint16_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

}  // namespace tv

extern "C" {
void tv_linear(const void* x, int x_dt, const void* w, int w_dt, const void* bias, int b_dt,
               void* out, int M, int64_t N, int64_t K, int nthreads);
void tv_linear_any(const void* x, int x_dt, const void* w, int w_fmt, const void* bias,
                   int b_dt, void* out, int M, int64_t N, int64_t K, int nthreads);
void tv_linear_blocks(const void* x, int x_dt, const void* w, int w_fmt, const void* bias,
                      int b_dt, void* out, int M, int64_t N, int64_t K, int nthreads);
void tv_embedding_any(const void* w, int w_fmt, const int64_t* ids, int64_t T, int64_t K,
                      void* out, int out_dt);
void tv_rms_norm(const void* x, void* residual, const void* weight, void* out, int dt,
                 int64_t T, int64_t H, float eps);
void tv_silu_mul(const void* x, void* out, int dt, int64_t T, int64_t D);
void tv_gelu_tanh_mul(const void* x, void* out, int dt, int64_t T, int64_t D);
void tv_rope(void* q, int64_t q_stride, int64_t hq, void* k, int64_t k_stride, int64_t hkv,
             int dt, int64_t T, int64_t head_dim, int64_t rot, const int64_t* positions,
             const float* cos_c, const float* sin_c);
// row_kernels.cpp: the same three with AVX-512 bodies, where they run, on the thread pool or
// on torch's OpenMP team (omp_parallel: GOMP_parallel's address, or null for the pool).
int tv_rows_supported();
void tv_rows_rms_norm(const void* x, void* residual, const void* weight, void* out, int dt,
                      int64_t T, int64_t H, float eps, int nthreads, const void* omp_parallel);
void tv_rows_silu_mul(const void* x, void* out, int dt, int64_t T, int64_t D, int nthreads,
                      const void* omp_parallel);
void tv_rows_rope(void* q, int64_t q_stride, int64_t hq, void* k, int64_t k_stride, int64_t hkv,
                  int dt, int64_t T, int64_t head_dim, int64_t rot, const int64_t* positions,
                  const float* cos_c, const float* sin_c, int nthreads,
                  const void* omp_parallel);
void tv_store_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, int64_t T,
                 int64_t width, int elem, void* k_cache, void* v_cache, const int64_t* slots);
void tv_rows_store_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride,
                      int64_t T, int64_t width, int elem, void* k_cache, void* v_cache,
                      const int64_t* slots, int nthreads, const void* omp_parallel);
void tv_paged_decode(const void* q, int64_t q_stride, void* out, int dt, int64_t n,
                     const int64_t* tok, const int64_t* row, const int32_t* tok_lens,
                     const int32_t* seq_lens, const int32_t* block_table, int64_t bt_stride,
                     const void* kv, int64_t num_blocks, int64_t block_size, int64_t hq,
                     int64_t hkv, int64_t head_dim, float scale, int64_t window, float softcap,
                     int nthreads);
}
