// What the AMX kernels (prefill_attn_amx.cpp, amx_linear.cpp) share: the target attribute, the
// run-time check, the one tile configuration they use, and the exact bf16 output rounding.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TV_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace tv {

// Whether the CPU has AMX-BF16 (with AVX-512 BF16 around it) and the OS lets this process use
// its tiles: tile data needs the kernel's permission once per process (Linux 5.16+).
inline bool amx_supported() {
  static const bool ok = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512bf16"))
      return false;
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    if (!((edx >> 22) & 1) || !((edx >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-7 all 16 rows x 64 bytes (per thread: each worker loads it before its tiles).
TV_AMX inline void load_tile_config() {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// fp32 -> bf16 bits in the low half of each lane: round to nearest even, NaN stays NaN (as
// common.h's f32_to_bf16); the output rounding, where denormals must survive.
TV_AMX inline __m512i bf16_round_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(64));
  return _mm512_mask_mov_epi32(r, nan, quiet);
}

}  // namespace tv
