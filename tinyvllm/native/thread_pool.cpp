// The native library's one thread runtime: persistent workers that spin briefly between
// parallel regions, then sleep on a futex (no OpenMP, so no second runtime next to torch's).
//
// Why not OpenMP: a decode step is ~150 short parallel regions. With static shares, a worker
// the OS has descheduled (another program wants the core) holds up the whole region until its
// next time slice, and an OpenMP team's idle threads spin for a long time, taking the core from
// whoever is running there (often our own straggler). Here items are claimed one at a time, the
// calling thread claims too, so a worker that is not running holds nothing but the item it is
// on; and every wait ends in a futex sleep, which leaves the core idle so the kernel can move a
// runnable thread (our straggler) onto it.

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <immintrin.h>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

namespace {

// Spin this long before sleeping. A worker waiting for the next region: the gaps inside a
// decode step (norms, rotary, a few microseconds) stay well below it, the gaps between steps
// (Python, sampling: a millisecond and more) well above. The caller waiting for a worker's last
// item: items take microseconds, so a longer wait means the worker is not running.
constexpr int64_t kWorkerSpinNs = 200000;
constexpr int64_t kCallerSpinNs = 30000;
constexpr int kMaxWorkers = 255;
// Contention check: over each window of regions, the time the caller slept waiting for an
// item a descheduled worker held. When other programs keep the cores busy, such stalls
// (each a wait for the worker's next time slice, then for the caller's own) cost more than
// the second thread brings: past kStallShare of the window's time the caller runs regions
// alone for kSoloWindows windows, then tries the workers again.
constexpr int kWindowRegions = 256;
constexpr int kSoloWindows = 8;
constexpr double kStallShare = 0.05;

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, count, nullptr,
          nullptr, 0);
}

// Spins until pred() holds or `budget_ns` passes; returns pred()'s last value.
template <class Pred>
bool spin_until(Pred pred, int64_t budget_ns) {
  const int64_t deadline = now_ns() + budget_ns;
  for (;;) {
    for (int i = 0; i < 32; ++i) {
      if (pred()) return true;
      _mm_pause();
    }
    if (now_ns() > deadline) return pred();
  }
}

// The ticket packs a region's id, its item count and the next unclaimed item into one word,
// so a claim (one compare-and-swap) can never take an item of a region other than the one it
// read: a region is not retired, and its function not replaced, until all of its items have
// been claimed and run.
constexpr int kIdxBits = 24, kCountBits = 24;
constexpr uint64_t kIdxMask = (1ull << kIdxBits) - 1;
constexpr int64_t kMaxItems = static_cast<int64_t>(kIdxMask);

inline uint64_t ticket_idx(uint64_t t) { return t & kIdxMask; }
inline uint64_t ticket_count(uint64_t t) { return (t >> kIdxBits) & ((1ull << kCountBits) - 1); }

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }

  // governed: the caller chose the thread count for this step (tv_pool_govern), so the
  // pool's own switch to running alone stays out of it.
  void run(int64_t n, int nthreads, tv::RangeFn fn, void* ctx, bool governed) {
    // One region at a time: callers from several threads (LLM and AsyncLLM engines in one
    // process) take turns.
    std::lock_guard<std::mutex> guard(run_lock_);
    if (governed) {
      ++stats_[0];
      stats_[3] += run_parallel(n, nthreads, fn, ctx);
      return;
    }
    if (solo_regions_ > 0) {
      --solo_regions_;
      ++stats_[1];
      for (int64_t i = 0; i < n; ++i) fn(ctx, i);
      return;
    }
    const int64_t start = now_ns();
    const int64_t stalled = run_parallel(n, nthreads, fn, ctx);
    window_ns_ += now_ns() - start;
    window_stall_ns_ += stalled;
    ++stats_[0];
    stats_[3] += stalled;
    if (++window_count_ == kWindowRegions) {
      if (window_stall_ns_ > kStallShare * window_ns_) {
        solo_regions_ = kSoloWindows * kWindowRegions;
        ++stats_[2];
      }
      window_count_ = 0;
      window_ns_ = window_stall_ns_ = 0;
    }
  }

 private:
  Pool() = default;

  // Returns the nanoseconds the caller slept waiting for held items.
  int64_t run_parallel(int64_t n, int nthreads, tv::RangeFn fn, void* ctx) {
    ensure_workers(nthreads - 1);
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    slots_.store(nthreads - 1, std::memory_order_relaxed);
    serial_ = (serial_ + 1) & ((1ull << (64 - kIdxBits - kCountBits)) - 1);
    const uint64_t base = (serial_ << (kIdxBits + kCountBits)) |
                          (static_cast<uint64_t>(n) << kIdxBits);
    ticket_.store(base, std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(&epoch_, nthreads - 1);
    work();
    const uint32_t total = static_cast<uint32_t>(n);
    int64_t stalled = 0;
    if (!spin_until([&] { return done_.load(std::memory_order_acquire) == total; },
                    kCallerSpinNs)) {
      const int64_t sleep_start = now_ns();
      for (;;) {
        caller_sleeping_.store(1, std::memory_order_seq_cst);
        const uint32_t seen = done_.load(std::memory_order_seq_cst);
        if (seen == total) break;
        futex_wait(&done_, seen);
      }
      caller_sleeping_.store(0, std::memory_order_relaxed);
      stalled = now_ns() - sleep_start;
    }
    slots_.store(0, std::memory_order_relaxed);
    return stalled;
  }

  void ensure_workers(int wanted) {
    wanted = wanted < kMaxWorkers ? wanted : kMaxWorkers;
    while (static_cast<int>(workers_.size()) < wanted) {
      workers_.emplace_back([this] { worker_loop(); });
      workers_.back().detach();
    }
  }

  // Claims and runs items of the current region until none is left; true if it ran any.
  bool work() {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    bool ran = false;
    while (ticket_idx(t) < ticket_count(t)) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      // The claim holds this region open: fn_ and ctx_ are its own until done_ reaches n.
      fn_(ctx_, static_cast<int64_t>(ticket_idx(t)));
      const uint32_t finished = done_.fetch_add(1, std::memory_order_seq_cst) + 1;
      if (finished == ticket_count(t) && caller_sleeping_.load(std::memory_order_seq_cst))
        futex_wake(&done_, 1);
      ran = true;
      t = ticket_.load(std::memory_order_acquire);
    }
    return ran;
  }

  bool claimable() const {
    const uint64_t t = ticket_.load(std::memory_order_acquire);
    return ticket_idx(t) < ticket_count(t) && slots_.load(std::memory_order_relaxed) > 0;
  }

  void worker_loop() {
    for (;;) {
      if (!spin_until([&] { return claimable(); }, kWorkerSpinNs)) {
        const uint32_t seen = epoch_.load(std::memory_order_seq_cst);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (!claimable()) futex_wait(&epoch_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        continue;
      }
      // A slot per region caps the threads at the caller's count (best effort: the region
      // may already be over, and the slot then goes unused).
      int free = slots_.load(std::memory_order_relaxed);
      while (free > 0 && !slots_.compare_exchange_weak(free, free - 1)) {
      }
      if (free <= 0) continue;
      work();
    }
  }

  std::mutex run_lock_;
  // Contention window (guarded by run_lock_).
  int window_count_ = 0;
  int64_t window_ns_ = 0, window_stall_ns_ = 0;
  int solo_regions_ = 0;

 public:
  // Regions run by the pool, regions run alone, switches to running alone, ns slept on
  // stalls (tv_pool_stats).
  int64_t stats_[4] = {0, 0, 0, 0};
  // tv_pool_govern's thread count (0: not governed).
  std::atomic<int> governed_{0};
  std::vector<std::thread> workers_;
  tv::RangeFn fn_ = nullptr;
  void* ctx_ = nullptr;
  uint64_t serial_ = 0;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<uint32_t> epoch_{0};
  std::atomic<uint32_t> done_{0};
  std::atomic<uint32_t> caller_sleeping_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> slots_{0};
};

}  // namespace

namespace tv {

void parallel_run(int64_t n, int nthreads, RangeFn fn, void* ctx) {
  if (n <= 0) return;
  Pool& pool = Pool::get();
  const int governed = pool.governed_.load(std::memory_order_relaxed);
  if (governed > 0 && governed < nthreads) nthreads = governed;
  if (nthreads <= 1 || n == 1 || n > kMaxItems) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
  pool.run(n, nthreads, fn, ctx, governed > 0);
}

}  // namespace tv

extern "C" void tv_pool_stats(int64_t* out) {
  for (int i = 0; i < 4; ++i) out[i] = Pool::get().stats_[i];
}

// Every region from now on runs on at most `threads` threads, and the pool does not switch to
// running alone by itself (> 0: the engine chose this decode step's thread count by measuring
// both, tinyvllm/native/step_threads.py); 0 hands the choice back to the pool.
extern "C" void tv_pool_govern(int threads) {
  Pool::get().governed_.store(threads > 0 ? threads : 0, std::memory_order_relaxed);
}
