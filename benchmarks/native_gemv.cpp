// The native GGUF GEMVs alone, no Python in the loop (built and run by native_gemv.py): per
// GEMV of SmolLM2-135M's shapes (hot: one weight copy, cold: a copy per layer, 30 layers) and
// per token (every layer's four GEMVs, then the Q8_0 lm_head), single-stream (M = 1).
//
//   native_gemv FLAGS REPS MODE      FLAGS 0 exact, 256 int8 activations;
//                                    MODE 0 all, 1 token at 2 threads, 2 hot GEMVs at 1 thread
// One thread is timed in thread CPU time (a busy box deschedules it), two in wall time; the
// pool is governed (tv_pool_govern) so that it never switches itself to running alone.

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>

extern "C" void tv_linear_blocks(const void* x, int x_dt, const void* w, int w_fmt,
                                 const void* bias, int b_dt, void* out, int M, int64_t N,
                                 int64_t K, int nthreads);
extern "C" void tv_pool_govern(int threads);

namespace {

struct Shape {
  const char* name;
  int64_t N, K;
  int fmt;  // 3 Q4_1, 4 Q8_0
};
constexpr Shape kShapes[5] = {{"qkv", 960, 576, 3},
                              {"o_proj", 576, 576, 3},
                              {"gate_up", 3072, 576, 3},
                              {"down", 576, 1536, 3},
                              {"lm_head", 49152, 576, 4}};
constexpr int kLayers = 30;

double now(bool cpu) {
  timespec ts;
  clock_gettime(cpu ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int64_t block_bytes(int fmt) { return fmt == 3 ? 20 : 34; }

// Random blocks with small fp16 scales (random bytes there could be NaN or Inf).
uint8_t* make_weight(const Shape& s, unsigned seed) {
  const int64_t bb = block_bytes(s.fmt), row = s.K / 32 * bb, bytes = s.N * row;
  uint8_t* w = static_cast<uint8_t*>(aligned_alloc(64, (bytes + 63) / 64 * 64));
  srand(seed);
  for (int64_t i = 0; i < bytes; ++i) w[i] = static_cast<uint8_t>(rand());
  const uint16_t h = _cvtss_sh(0.01f, 0);
  for (int64_t b = 0; b < bytes / bb; ++b) {
    memcpy(w + b * bb, &h, 2);
    if (s.fmt == 3) memcpy(w + b * bb + 2, &h, 2);
  }
  return w;
}

double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double minimum(const std::vector<double>& t) { return *std::min_element(t.begin(), t.end()); }

}  // namespace

int main(int argc, char** argv) {
  const int flags = argc > 1 ? atoi(argv[1]) : 0;
  const int reps = argc > 2 ? atoi(argv[2]) : 200;
  const int mode = argc > 3 ? atoi(argv[3]) : 0;
  std::vector<uint8_t*> w[5];
  for (int s = 0; s < 4; ++s)
    for (int l = 0; l < kLayers; ++l) w[s].push_back(make_weight(kShapes[s], 100 * s + l));
  w[4].push_back(make_weight(kShapes[4], 7));
  std::vector<uint16_t> x(1536), out(49152);
  for (int i = 0; i < 1536; ++i) x[i] = static_cast<uint16_t>(0x3f00 + (rand() & 0xff));
  auto gemv = [&](int s, const uint8_t* wt, int nt) {
    const Shape& sh = kShapes[s];
    tv_linear_blocks(x.data(), 1, wt, sh.fmt | flags, nullptr, 1, out.data(), 1, sh.N, sh.K, nt);
  };
  for (int nt = mode == 1 ? 2 : 1; nt <= (mode == 2 ? 1 : 2); ++nt) {
    const bool cpu = nt == 1;
    tv_pool_govern(nt);
    printf("%d thread(s), %s, %s\n", nt, flags ? "int8 activations" : "exact",
           cpu ? "thread CPU time" : "wall time");
    for (int s = 0; s < (mode == 1 ? 0 : 5); ++s)
      for (int cold = 0; cold < (mode == 2 || s == 4 ? 1 : 2); ++cold) {
        std::vector<double> t;
        for (int r = 0; r < reps; ++r) {
          const double t0 = now(cpu);
          gemv(s, w[s][cold ? r % w[s].size() : 0], nt);
          t.push_back(now(cpu) - t0);
        }
        const double bytes = kShapes[s].N * kShapes[s].K / 32.0 * block_bytes(kShapes[s].fmt);
        printf("  %-8s %s median %8.1f us  min %8.1f us  %5.1f GB/s\n", kShapes[s].name,
               cold ? "cold" : "hot ", median(t) * 1e6, minimum(t) * 1e6, bytes / median(t) / 1e9);
      }
    if (mode == 2) continue;
    std::vector<double> layers, head;
    for (int r = 0; r < reps / 10 + 5; ++r) {
      const double t0 = now(cpu);
      for (int l = 0; l < kLayers; ++l)
        for (int s = 0; s < 4; ++s) gemv(s, w[s][l], nt);
      const double t1 = now(cpu);
      gemv(4, w[4][0], nt);
      layers.push_back(t1 - t0);
      head.push_back(now(cpu) - t1);
    }
    printf("  token: layers median %.3f ms (min %.3f), lm_head median %.3f ms (min %.3f)\n",
           median(layers) * 1e3, minimum(layers) * 1e3, median(head) * 1e3, minimum(head) * 1e3);
  }
  tv_pool_govern(0);
  return 0;
}
