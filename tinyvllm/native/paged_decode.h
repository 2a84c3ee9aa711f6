// tv_paged_decode's arguments (cpu_kernels.cpp states the contract) as one value, and the
// AVX-512 and AMX variants (attn_avx512.cpp, attn_amx.cpp) it hands them to: one parameter
// list instead of one per variant, and the positions each query token attends in one place.
#pragma once

#include <stdint.h>

namespace tv {

struct PagedDecode {
  const void* q;
  int64_t q_stride;
  void* out;
  int dt;
  int64_t n;
  const int64_t* tok;
  const int64_t* row;
  const int32_t* tok_lens;
  const int32_t* seq_lens;
  const int32_t* block_table;
  int64_t bt_stride;
  const void* kv;
  int64_t num_blocks;
  int64_t block_size;
  int64_t hq;
  int64_t hkv;
  int64_t head_dim;
  float scale;
  int64_t window;
  float softcap;
  int nthreads;

  // Query token i attends positions [first(L), L) of its request, L = length(i).
  int64_t length(int64_t i) const { return tok_lens ? tok_lens[i] : seq_lens[row[i]]; }
  int64_t first(int64_t L) const { return window > 0 && L - window > 0 ? L - window : 0; }
  const int32_t* blocks(int64_t i) const { return block_table + row[i] * bt_stride; }
};

bool paged_decode_avx512_fits(int64_t hq, int64_t hkv, int64_t head_dim);
void paged_decode_avx512(const PagedDecode& a);
// False (nothing written) where the AMX kernel does not take the call.
bool paged_decode_amx(const PagedDecode& a);

}  // namespace tv
