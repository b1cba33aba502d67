// How ferry's CPU kernels share work between threads (paged_decode.cpp, prefill_attention.cpp,
// tiled_linear.cpp).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

// Work items [0, n) in contiguous ranges of about equal cost, one range per thread, each
// run by f(begin, end). at::parallel_for splits by count, so a decode step whose requests
// have very different context lengths, or a prompt step with a long cached prefix beside
// fresh prompts, left one thread waiting on the other; the ranges stay contiguous and in
// order (the decode kernel's next-item prefetch follows each thread's own items). An item
// goes to the range its midpoint falls in.
template <typename Cost, typename F>
static void parallel_by_cost(int64_t n, Cost&& cost, F&& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
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
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (bounds[t] < bounds[t + 1]) f(bounds[t], bounds[t + 1]);
  });
}

// Work items [0, n), each run by f(i): one contiguous range per thread, as at::parallel_for
// splits them, each range's front taken by its owner; a thread done with its own range takes
// the others' items from their backs, one at a time. When a thread loses its core for a
// while (the gateway, the scheduler or the load's client on a 2-core machine), the others
// finish its range instead of waiting at the end of the product for it: with a neighbour
// busy 20 % of a core the model's products ran 9-13 % faster than split once, level when
// quiet (docs/benchmarks.md, "Work taken from a thread that lost its core"). Which thread
// runs an item changes nothing in what the item computes.
struct alignas(64) StealRange {
  std::atomic<uint64_t> front_back;  // front << 32 | back: one word, so an item is taken once
};

template <typename F>
static void parallel_stealing(int64_t n, F&& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region() || n >= (int64_t{1} << 32)) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::vector<StealRange> ranges(threads);
  for (int64_t t = 0; t < threads; ++t)
    ranges[t].front_back.store(static_cast<uint64_t>(n * t / threads) << 32 | static_cast<uint64_t>(n * (t + 1) / threads),
                               std::memory_order_relaxed);
  // take one item from the front (own range) or the back (another's); -1 when it is empty
  auto take = [](StealRange& r, bool front) -> int64_t {
    uint64_t v = r.front_back.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = v >> 32, hi = v & 0xffffffffu;
      if (lo >= hi) return -1;
      const uint64_t next = front ? ((lo + 1) << 32 | hi) : (lo << 32 | (hi - 1));
      if (r.front_back.compare_exchange_weak(v, next, std::memory_order_acq_rel, std::memory_order_relaxed))
        return static_cast<int64_t>(front ? lo : hi - 1);
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i; (i = take(ranges[t], true)) >= 0;) f(i);
      for (int64_t k = 1; k < threads; ++k)
        for (int64_t i; (i = take(ranges[(t + k) % threads], false)) >= 0;) f(i);
    }
  });
}
