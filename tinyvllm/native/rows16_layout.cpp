// GGUF Q4_0 / Q4_1 / Q8_0 matrices interleaved 16 rows at a time (code flag kFmtRows16): the
// layout, its repacking at load, reading a row back in the file's layout, and which GEMV
// reads it with int8 activations. Plain AVX2 code: it runs on every CPU the library builds
// for (the AVX-512 kernels are in files compiled with their own target).
//
// Why a second layout: in the file's layout a row's blocks follow each other, so a GEMV ends
// every block of every row with its own scale arithmetic and, per row, a horizontal sum: ~15
// instructions per 64 weights, which holds single-stream decode near 16 GB/s per core while
// the weights come from L3 at 40+. Here the blocks of 16 rows are interleaved so that one
// 32-bit lane of a vector is one output row and a block's scales are one vector for all 16
// rows (int8_rows16.cpp, int8_rows16_avx2.cpp, bf16_rows16.cpp read it).
//
// Layout: rows [16 g, 16 g + 16) of an [N][K] matrix (N % 16 == 0) form group g; the group's
// blocks b (32 columns each) follow each other, each stored as
//  * Q4_0 / Q4_1: 4 vectors of 64 bytes, vector j's byte 4 r + i holding row r's weights
//    8 j + i (low nibble) and 8 j + 4 + i (high nibble), i < 4; then the 16 rows' d (fp16),
//    then Q4_1's 16 m (fp16): 288 / 320 bytes, as many as the 16 GGUF blocks;
//  * Q8_0: 8 vectors, vector j's byte 4 r + i holding row r's weight 4 j + i plus 128 (an
//    unsigned byte for vpdpbusd), then the 16 d (fp16): 544 bytes.
// A 64-byte vector's first 32 bytes are rows 0-7, the next 32 rows 8-15 (AVX2 reads halves).

#include <stdint.h>
#include <string.h>

#include "common.h"

namespace tv {

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 4;
constexpr int kGroup = 16;

int64_t gguf_block_bytes(int fmt) { return fmt == kQ4_1 ? 20 : fmt == kQ4_0 ? 18 : 34; }
int64_t group_block_bytes(int fmt) { return kGroup * gguf_block_bytes(fmt); }

// Where row r's weight k of a block lies in the group's block at base: (byte, shift).
inline int64_t q4_byte(int r, int k) { return 64 * (k / 8) + 4 * r + (k % 4); }
inline int q4_shift(int k) { return k % 8 < 4 ? 0 : 4; }
inline int64_t q8_byte(int r, int k) { return 64 * (k / 4) + 4 * r + (k % 4); }

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

inline void store_u32(uint8_t* p, uint32_t v) { memcpy(p, &v, 4); }

// One GGUF block of row r (at blk) into the group's block at base: whole 32-bit words (row r's
// 4 bytes of each vector) from the block's quants, 4 at a time, as q4_byte / q8_byte place
// them (a loop over single nibbles took ~150 ms of a SmolLM2-135M Q4_1 load).
void pack_block(int fmt, const uint8_t* blk, int r, uint8_t* base) {
  if (fmt == kQ8_0) {
    for (int j = 0; j < 8; ++j)
      store_u32(base + 64 * j + 4 * r, load_u32(blk + 2 + 4 * j) ^ 0x80808080u);
    memcpy(base + 512 + 2 * r, blk, 2);
    return;
  }
  const uint8_t* qs = blk + (fmt == kQ4_1 ? 4 : 2);
  // qs[i] holds weight i (low nibble) and i + 16 (high); vector j's byte i of row r holds
  // weights 8 j + i (low) and 8 j + 4 + i (high).
  const uint32_t a0 = load_u32(qs), a1 = load_u32(qs + 4), a2 = load_u32(qs + 8),
                 a3 = load_u32(qs + 12);
  constexpr uint32_t lo = 0x0F0F0F0Fu, hi = 0xF0F0F0F0u;
  store_u32(base + 4 * r, (a0 & lo) | (a1 & lo) << 4);
  store_u32(base + 64 + 4 * r, (a2 & lo) | (a3 & lo) << 4);
  store_u32(base + 128 + 4 * r, (a0 >> 4 & lo) | (a1 & hi));
  store_u32(base + 192 + 4 * r, (a2 >> 4 & lo) | (a3 & hi));
  memcpy(base + 256 + 2 * r, blk, 2);
  if (fmt == kQ4_1) memcpy(base + 288 + 2 * r, blk + 2, 2);
}

// The inverse: row r's GGUF block from the group's block at base.
void unpack_block(int fmt, const uint8_t* base, int r, uint8_t* blk) {
  if (fmt == kQ8_0) {
    memcpy(blk, base + 512 + 2 * r, 2);
    for (int k = 0; k < 32; ++k) blk[2 + k] = static_cast<uint8_t>(base[q8_byte(r, k)] ^ 0x80);
    return;
  }
  memcpy(blk, base + 256 + 2 * r, 2);
  if (fmt == kQ4_1) memcpy(blk + 2, base + 288 + 2 * r, 2);
  uint8_t* qs = blk + (fmt == kQ4_1 ? 4 : 2);
  for (int i = 0; i < 16; ++i) {
    const int lo = base[q4_byte(r, i)] >> q4_shift(i) & 15;
    const int hi = base[q4_byte(r, i + 16)] >> q4_shift(i + 16) & 15;
    qs[i] = static_cast<uint8_t>(lo | hi << 4);
  }
}

}  // namespace

bool rows16_int8_supported(int fmt) { return fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ8_0; }

void linear_rows16_int8(const void* x, int x_dt, const uint8_t* w, int fmt, const void* bias,
                        int b_dt, void* out, int M, int64_t N, int64_t K, int nthreads) {
  if (int8_act_supported(fmt))  // AVX512-VNNI
    return linear_rows16_int8_avx512(x, x_dt, w, fmt, bias, b_dt, out, M, N, K, nthreads);
  linear_rows16_int8_avx2(x, x_dt, w, fmt, bias, b_dt, out, M, N, K, nthreads);
}

void linear_rows16_bf16(const uint16_t* x, const uint8_t* w, int fmt, const void* bias, int b_dt,
                        uint16_t* out, int M, int64_t N, int64_t K, int nthreads) {
  if (isa_level() == kIsaAvx512)
    return linear_rows16_bf16_avx512(x, w, fmt, bias, b_dt, out, M, N, K, nthreads);
  if (avx512_foundation())  // AVX-512 without BF16: the AVX2 kernel's bits, 16 lanes
    return linear_rows16_bf16_avx512f(x, w, fmt, bias, b_dt, out, M, N, K, nthreads);
  linear_rows16_bf16_avx2(x, w, fmt, bias, b_dt, out, M, N, K, nthreads);
}

void rows16_gguf_row(const uint8_t* w, int fmt, int64_t K, int64_t r, uint8_t* row) {
  const int64_t nb = K / 32, bb = gguf_block_bytes(fmt), gb = group_block_bytes(fmt);
  const uint8_t* group = w + r / kGroup * nb * gb;
  for (int64_t b = 0; b < nb; ++b)
    unpack_block(fmt, group + b * gb, static_cast<int>(r % kGroup), row + b * bb);
}

}  // namespace tv

extern "C" {

// 1 when a Q4_0 / Q4_1 / Q8_0 matrix (code fmt) can be repacked 16 rows at a time for the
// int8-activation GEMVs (AVX512-VNNI or AVX2 kernels): the caller also needs N % 16 == 0.
int tv_rows16_supported(int fmt) { return tv::rows16_int8_supported(fmt) ? 1 : 0; }

// 1 when the exact kernel takes a Q4_0 / Q4_1 matrix (code fmt) in the 16-row layout against
// bf16 activations (bf16_rows16.cpp with AVX512-BF16, bf16_rows16_avx2.cpp elsewhere).
int tv_rows16_exact_supported(int fmt) { return fmt == tv::kQ4_0 || fmt == tv::kQ4_1 ? 1 : 0; }

// The GGUF block matrix src [N][K / 32 blocks] of format fmt (N % 16 == 0, K % 32 == 0) in
// the 16-row layout at dst (as many bytes), for codes with kFmtRows16.
void tv_repack_rows16(const void* src, int fmt, int64_t N, int64_t K, void* dst, int nthreads) {
  const int64_t nb = K / 32, bb = tv::gguf_block_bytes(fmt), gb = tv::group_block_bytes(fmt);
  const uint8_t* s = static_cast<const uint8_t*>(src);
  uint8_t* d = static_cast<uint8_t*>(dst);
  tv::parallel_for(N / tv::kGroup, nthreads, [&](int64_t g) {
    uint8_t* group = d + g * nb * gb;  // pack_block writes every byte of it
    for (int r = 0; r < tv::kGroup; ++r) {
      const uint8_t* row = s + (g * tv::kGroup + r) * nb * bb;
      for (int64_t b = 0; b < nb; ++b) tv::pack_block(fmt, row + b * bb, r, group + b * gb);
    }
  });
}

}  // extern "C"
