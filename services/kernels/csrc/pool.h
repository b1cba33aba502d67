// ferry's own threads for its CPU kernels (work_split.h): the calling thread and helpers that
// join a job if they come in time, so that the caller never waits on a thread that has no core.
//
// at::parallel_for (OpenMP) ends every region at a barrier: each thread of the team must run
// its share, or at least arrive, before the caller goes on. On a 2-core machine shared with the
// gateway, the scheduler, the load's client or another tenant, the second thread is often off
// its core for a scheduler slice (milliseconds) when a region begins, and a decode step's ~250
// regions of 20-500 us each wait for it: with a neighbour busy half of one core the offline
// common load ran 0.57x its quiet speed (norms 4.6x slower, decode products 2.2x), against the
// 0.75x the lost half core explains. Work stolen between threads (work_split.h) could not help
// there: the barrier waits for the absent thread even when it has nothing left to do.
//
// Here a job is items in ranges the participants take from (run_and_take): the caller runs as
// participant 0; each helper that wakes while the job is open takes the next participant
// number and runs too; the caller returns once its own share is done (every item taken) and
// every helper that joined has left. A helper that wakes after that finds the job closed and
// goes back to waiting. A helper that loses its core in the middle of an item still holds the
// caller until that item ends (the caller yields its core meanwhile), so items stay small.
//
// Helpers spin a while after a job (the next one follows within microseconds in a step),
// yielding their core to any other thread that wants it, then sleep on a futex; the caller
// wakes sleepers with one system call. Linux only (as ferry's CPU
// path is); after fork() the child starts its own helpers.
#pragma once
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

namespace ferry_pool {

inline bool& inside() {  // whether this thread is running a job's share (nested jobs run inline)
  thread_local bool in = false;
  return in;
}

// One wait of a spin loop: PAUSE on x86 (the build is portable elsewhere: the kernels fall
// back to plain loops off x86, and a pool that did not build would take them all down).
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// How long a helper spins for the next job before it sleeps: FERRY_CPU_POOL_SPIN_US, default
// 200 us (the gaps between a step's jobs are 1-50 us; between steps, ~1 ms of Python).
inline int64_t spin_ns() {
  static const int64_t ns = [] {
    const char* e = std::getenv("FERRY_CPU_POOL_SPIN_US");
    return e && *e ? std::max<int64_t>(0, std::atoll(e)) * 1000 : int64_t{200000};
  }();
  return ns;
}

class Pool {
 public:
  using Fn = void (*)(void*, int64_t);

  // Runs fn(ctx, p) for p = 0 on this thread and for p = 1.. on the helpers that join while
  // the job is open, at most `threads` participants in all; fn must get every item done
  // whichever participants come (each takes from the others' ranges when its own is empty).
  // False (nothing run) while another thread's job holds the pool: run it inline then.
  bool run(int64_t threads, Fn fn, void* ctx) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    ensure(threads - 1);
    fn_ = fn, ctx_ = ctx, limit_ = threads;
    next_.store(1, std::memory_order_relaxed);
    error_ = nullptr;
    open_.store(true, std::memory_order_seq_cst);
    seq_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) syscall(SYS_futex, &seq_, FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
    std::exception_ptr mine;
    inside() = true;
    try {
      fn(ctx, 0);
    } catch (...) {
      mine = std::current_exception();
    }
    inside() = false;
    open_.store(false, std::memory_order_seq_cst);
    for (int spins = 0; entered_.load(std::memory_order_seq_cst) != 0; ++spins) {
      if (spins < 256) relax();
      else sched_yield();  // a helper off its core mid-item: let it have this one
    }
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  void ensure(int64_t helpers) {
    if (helpers <= started_.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> lock(spawn_);
    while (started_.load(std::memory_order_relaxed) < helpers && started_.load(std::memory_order_relaxed) < 255) {
      std::thread([this] { helper(); }).detach();
      started_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper() {
    inside() = true;  // a kernel called here runs its nested jobs inline
    omp_set_num_threads(1);  // and no OpenMP team of its own
    uint32_t seen = seq_.load(std::memory_order_seq_cst);
    for (;;) {
      const int64_t until = now_ns() + spin_ns();
      for (int i = 0; seq_.load(std::memory_order_acquire) == seen; ++i) {
        // past a few microseconds, let any other thread that wants this core have it (an
        // OpenMP thread of torch's: float32's oneDNN products; the gateway, the scheduler)
        if (i < 64) relax();
        else sched_yield();
        if ((i & 63) == 63 && now_ns() > until) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (seq_.load(std::memory_order_seq_cst) == seen)
            syscall(SYS_futex, &seq_, FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
      seen = seq_.load(std::memory_order_acquire);
      entered_.fetch_add(1, std::memory_order_seq_cst);
      if (open_.load(std::memory_order_seq_cst)) {
        const int64_t p = next_.fetch_add(1, std::memory_order_relaxed);
        if (p < limit_) {
          try {
            fn_(ctx_, p);
          } catch (...) {
            std::lock_guard<std::mutex> lock(spawn_);
            if (!error_) error_ = std::current_exception();
          }
        }
      }
      entered_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex busy_, spawn_;
  std::atomic<int64_t> started_{0};
  alignas(64) std::atomic<uint32_t> seq_{0};  // the futex word: bumped per job
  alignas(64) std::atomic<int32_t> sleepers_{0};
  alignas(64) std::atomic<bool> open_{false};
  alignas(64) std::atomic<int64_t> entered_{0};  // helpers between joining and leaving
  alignas(64) std::atomic<int64_t> next_{1};     // the next helper's participant number
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t limit_ = 0;
  std::exception_ptr error_;
};

// The process's pool, never destroyed (its helpers sleep until the process ends); a child
// after fork() gets a fresh one (the parent's helpers do not exist there).
inline std::atomic<Pool*>& pool_slot() {
  static std::atomic<Pool*> p{nullptr};
  return p;
}
inline Pool& pool() {
  Pool* p = pool_slot().load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  static std::mutex making;
  std::lock_guard<std::mutex> lock(making);
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, [] { pool_slot().store(nullptr); }); });
  p = pool_slot().load(std::memory_order_acquire);
  if (p == nullptr) pool_slot().store(p = new Pool(), std::memory_order_release);
  return *p;
}

// job(p) for each participant p as Pool::run describes; inline (job(0) alone) where one thread
// is asked for or this thread already runs a job's share.
template <typename Job>
inline void run(int64_t threads, Job&& job) {
  if (threads <= 1 || inside()) {
    job(0);
    return;
  }
  using J = std::remove_reference_t<Job>;
  if (!pool().run(threads, [](void* ctx, int64_t p) { (*static_cast<J*>(ctx))(p); },
                  const_cast<void*>(static_cast<const void*>(&job))))
    job(0);
}

}  // namespace ferry_pool
