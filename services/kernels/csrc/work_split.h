// How ferry's CPU kernels share work between threads (paged_decode.cpp, prefill_attention.cpp,
// tiled_linear.cpp).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "pool.h"

struct alignas(64) StealRange {
  std::atomic<uint64_t> front_back;  // front << 32 | back: one word, so an item is taken once
  void set(uint64_t front, uint64_t back) { front_back.store(front << 32 | back, std::memory_order_relaxed); }
  // Up to `count` items (0: half of those left, at least one) from the front (its owner) or
  // the back (another thread): [lo, hi), or false when the range is empty.
  bool take(bool front, int64_t count, int64_t& lo_out, int64_t& hi_out) {
    uint64_t v = front_back.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = v >> 32, hi = v & 0xffffffffu;
      if (lo >= hi) return false;
      const uint64_t c = count > 0 ? std::min<uint64_t>(static_cast<uint64_t>(count), hi - lo)
                                   : std::max<uint64_t>(1, (hi - lo) / 2);
      const uint64_t next = front ? ((lo + c) << 32 | hi) : (lo << 32 | (hi - c));
      if (front_back.compare_exchange_weak(v, next, std::memory_order_acq_rel, std::memory_order_relaxed)) {
        lo_out = static_cast<int64_t>(front ? lo : hi - c);
        hi_out = static_cast<int64_t>(front ? lo + c : hi);
        return true;
      }
    }
  }
};

// [0, n) in `threads` contiguous ranges of about equal count, one per participant.
static inline std::vector<StealRange> even_ranges(int64_t n, int64_t threads) {
  std::vector<StealRange> ranges(threads);
  for (int64_t t = 0; t < threads; ++t) ranges[t].set(n * t / threads, n * (t + 1) / threads);
  return ranges;
}

// Whether parallel_by_cost and parallel_rows take work between threads (work_stealing sets it;
// the linear layers' parallel_stealing always does).
inline bool stealing_on = true;

// One thread's share of a stealing split: its own range `t` from the front, `own` items at a
// time (0: half of what is left), then the other ranges' items from their backs, one at a time,
// each piece run by f(lo, hi).
template <typename F>
static inline void run_and_take(std::vector<StealRange>& ranges, int64_t t, int64_t own, F&& f) {
  const int64_t threads = static_cast<int64_t>(ranges.size());
  int64_t lo, hi;
  while (ranges[t].take(true, own, lo, hi)) f(lo, hi);
  for (int64_t k = 1; k < threads; ++k)
    while (ranges[(t + k) % threads].take(false, 1, lo, hi)) f(lo, hi);
}

// Work items [0, n) in contiguous ranges of about equal cost, one range per thread, run by
// f(begin, end) on pieces of it in order. at::parallel_for splits by count, so a decode step
// whose requests have very different context lengths, or a prompt step with a long cached
// prefix beside fresh prompts, left one thread waiting on the other; an item goes to the range
// its midpoint falls in. Each thread runs its own range front to back, each time half of what
// is left of it (the decode kernel's next-item prefetch follows a piece's items, and breaks
// between pieces: an eighth at a time cost 2-4 % on a quiet machine, halves 0-2 %); a thread
// done with its own takes the others' items from their backs, one at a time, so that a thread
// that lost its core to another process (the gateway, the scheduler, the load's client on a
// 2-core machine) does not leave the other waiting at the end of the kernel, as
// parallel_stealing (below) does for the linear layers (docs/benchmarks.md, "Threads: ferry's
// pool and OpenMP waits"). Which thread runs an item changes nothing in what it computes.
template <typename Cost, typename F>
static void parallel_by_cost(int64_t n, Cost&& cost, F&& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region() || ferry_pool::inside()) {
    if (n > 0) f(0, n);
    return;
  }
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += cost(i);
  std::vector<int64_t> bounds(threads + 1, n);
  bounds[0] = 0;
  double acc = 0;
  for (int64_t i = 0, t = 1; i < n; ++i) {
    const double c = cost(i);
    while (t < threads && acc + c / 2 >= total * t / threads) bounds[t++] = i;
    acc += c;
  }
  if (!stealing_on || n >= (int64_t{1} << 32)) {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        if (bounds[t] < bounds[t + 1]) f(bounds[t], bounds[t + 1]);
    });
    return;
  }
  std::vector<StealRange> ranges(threads);
  for (int64_t t = 0; t < threads; ++t) ranges[t].set(bounds[t], bounds[t + 1]);
  ferry_pool::run(threads, [&](int64_t t) { run_and_take(ranges, t, 0, f); });
}

// Work items [0, n), each run by f(i): one contiguous range per thread, as at::parallel_for
// splits them, each range's front taken by its owner; a thread done with its own range takes
// the others' items from their backs, one at a time. When a thread loses its core for a
// while (the gateway, the scheduler or the load's client on a 2-core machine), the others
// finish its range instead of waiting at the end of the product for it: with a neighbour
// busy 20 % of a core the model's products ran 9-13 % faster than split once, level when
// quiet (docs/benchmarks.md, "Threads: ferry's pool and OpenMP waits"). Which thread
// runs an item changes nothing in what the item computes.
template <typename F>
static void parallel_stealing(int64_t n, F&& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region() || ferry_pool::inside() || n >= (int64_t{1} << 32)) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::vector<StealRange> ranges = even_ranges(n, threads);
  ferry_pool::run(threads, [&](int64_t t) { run_and_take(ranges, t, 1, [&](int64_t i, int64_t) { f(i); }); });
}

// As at::parallel_for(begin, end, grain, f) (f(lo, hi) on pieces of at least `grain` indices,
// inline where the range is one grain or less), on ferry_pool's threads instead of an OpenMP
// team: one contiguous range per thread, each taken half of what is left at a time, then the
// others' grains from their backs. No barrier waits for a thread without a core (pool.h).
template <typename F>
static void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& f) {
  const int64_t n = end - begin, g = std::max<int64_t>(grain, 1), items = (n + g - 1) / g;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  if (n <= 0) return;
  if (threads <= 1 || at::in_parallel_region() || ferry_pool::inside() || items >= (int64_t{1} << 32)) {
    f(begin, end);
    return;
  }
  std::vector<StealRange> ranges = even_ranges(items, threads);
  ferry_pool::run(threads, [&](int64_t t) {
    run_and_take(ranges, t, 0, [&](int64_t lo, int64_t hi) { f(begin + lo * g, std::min(end, begin + hi * g)); });
  });
}

// Rows [0, n), each piece run by f(begin, end), for the row-wise ops (fused_ops.cpp: norms,
// rotary, argmax and sampling rows). A few rows (a decode step's 64 of 576 elements) go as
// at::parallel_for splits them, one piece per thread, at least `grain` rows each; many rows
// (a prompt step's 2,048) go in 2-8 pieces per thread through parallel_stealing, so a thread
// that lost its core does not leave the other waiting at the end of the op. Rows are
// computed independently: the pieces change no bit.
template <typename F>
static void parallel_rows(int64_t n, int64_t grain, F&& f) {
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = std::min<int64_t>(n / std::max<int64_t>(grain, 1), 8 * threads);
  if (!stealing_on) {  // as before the pool, for A/B runs
    at::parallel_for(0, n, grain, f);
    return;
  }
  if (threads <= 1 || wanted < 2 || at::in_parallel_region() || ferry_pool::inside()) {
    parallel_for(0, n, grain, f);
    return;
  }
  const int64_t pieces = wanted < 2 * threads ? wanted : wanted / threads * threads;
  parallel_stealing(pieces, [&](int64_t p) { f(n * p / pieces, n * (p + 1) / pieces); });
}

