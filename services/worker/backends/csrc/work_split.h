// How ferry's CPU kernels share work between threads (paged_decode.cpp, prefill_attention.cpp).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
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
