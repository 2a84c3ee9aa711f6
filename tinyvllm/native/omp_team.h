// Running a region's items on torch's OpenMP team instead of the library's thread pool, for
// kernels that sit between torch ops (prefill attention, the row kernels of a torch-run step).
//
// Why: after each of torch's parallel ops its OpenMP workers keep spinning (libgomp's default
// wait policy, unless OMP_WAIT_POLICY=PASSIVE was set before torch loaded it) on the cores the
// pool's workers would need; the team's own workers pick the items up instead.
#pragma once

#include <stdint.h>

#include <atomic>

#include "common.h"

namespace tv {

// libgomp's entry for `#pragma omp parallel` (GOMP_parallel): fn(data) on every thread of a
// team of num_threads, the caller among them.
using OmpParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);

// Runs f(i) for i in [0, n): on the OpenMP team of `omp` when given, else on the thread pool.
// Items are claimed as the region goes either way (no static shares).
template <class F>
void run_items(OmpParallelFn omp, int64_t n, int nthreads, F&& f) {
  if (omp == nullptr) {
    parallel_for(n, nthreads, f);
    return;
  }
  struct Ctx {
    std::atomic<int64_t> next{0};
    int64_t n;
    F* f;
  } ctx;
  ctx.n = n;
  ctx.f = &f;
  omp(
      [](void* c) {
        Ctx* x = static_cast<Ctx*>(c);
        for (int64_t i = x->next.fetch_add(1); i < x->n; i = x->next.fetch_add(1)) (*x->f)(i);
      },
      &ctx, static_cast<unsigned>(nthreads), 0);
}

inline OmpParallelFn omp_team(const void* omp_parallel) {
  return reinterpret_cast<OmpParallelFn>(const_cast<void*>(omp_parallel));
}

}  // namespace tv
