// A bfloat16 linear layer for a few rows at a time (decode steps at low concurrency).
//
// At one to eight rows a linear layer is a read of its weight: SmolLM2-135M's 30 layers hold
// 212 MB of bfloat16 weights, ~7 ms at the ~30 GB/s two cores read in order, and no arithmetic
// to speak of. oneDNN's packed kernels took 12-13.5 ms for them at M = 1-8 on the Zen 4 EPYC
// (16-17.6 GB/s): blocked for larger M, they do not stream the weight at the memory's rate.
// Here the weight is laid out once as tiles of sixteen outputs, each tile every k-pair's
// sixteen (output, k, k+1) words in a row ([N/16][K/2][16] uint32, the operand order of
// vdpbf16ps), so a thread walks its tiles front to back: one sequential stream per thread that
// the hardware prefetcher follows (software prefetch on top made it slower), each 64-byte
// vector taken into M dot products against the rows' broadcast k-pairs. float32 sums, the
// bias added, one rounding to bfloat16 at the end, as oneDNN does; the order of the sums
// differs from oneDNN's, so results can differ from it in the last bit (bfloat16 outputs are
// not batch-invariant on the CPU anyway: docs/benchmarks.md).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include "vec512.h"
#endif

namespace small_batch {
constexpr int64_t MAX_ROWS = 8;  // past this oneDNN's kernels are as fast or faster (docs/worker.md)

#if defined(__AVX512BF16__)
template <int64_t M>
static inline void tile_rows(const uint32_t* x, int64_t k2, const uint32_t* tile, const float* bias, c10::BFloat16* y,
                             int64_t ldy) {
  __m512 acc[M];
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t m = 0; m < M; ++m) acc[m] = b;
  for (int64_t p = 0; p < k2; ++p) {
    const __m512bh w = (__m512bh)_mm512_load_si512(tile + p * 16);
    for (int64_t m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * k2 + p])), w);
  }
  for (int64_t m = 0; m < M; ++m) store16(y + m * ldy, acc[m]);
}

template <int64_t M>
static void rows(const uint32_t* x, int64_t k2, const uint32_t* tiles, int64_t n, const float* bias, c10::BFloat16* y) {
  // contiguous ranges of tiles per thread: each thread one stream through the weight
  at::parallel_for(0, n / 16, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      tile_rows<M>(x, k2, tiles + t * k2 * 16, bias ? bias + t * 16 : nullptr, y + t * 16, n);
  });
}
#endif
}  // namespace small_batch

bool small_batch_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// weight [N, K] bfloat16 (N a multiple of 16, K even) -> the tiles [N/16, K/2, 16] as int32
// words: word (t, p, j) = weight[16 t + j][2 p] | weight[16 t + j][2 p + 1] << 16.
torch::Tensor small_batch_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "a [N, K] bfloat16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 2 == 0, "N a multiple of 16, K even");
  auto w = weight.contiguous();
  auto tiles = torch::empty({n / 16, k / 2, 16}, weight.options().dtype(at::kInt));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(tiles.data_ptr<int32_t>());
  at::parallel_for(0, n / 16, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t p = 0; p < k / 2; ++p)
        for (int64_t j = 0; j < 16; ++j) {
          const uint16_t* row = src + (16 * t + j) * k;
          dst[(t * (k / 2) + p) * 16 + j] = row[2 * p] | (static_cast<uint32_t>(row[2 * p + 1]) << 16);
        }
  });
  return tiles;
}

// x [..., K] bfloat16 with at most MAX_ROWS rows, tiles from small_batch_pack, bias [N]
// float32 or an empty tensor -> x @ weight^T (+ bias), [..., N] bfloat16.
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias) {
  TORCH_CHECK(small_batch_linear_available(), "this build has no AVX512-BF16 small-batch linear");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "contiguous bfloat16 rows");
  TORCH_CHECK(tiles.scalar_type() == at::kInt && tiles.dim() == 3 && tiles.size(2) == 16 && tiles.is_contiguous(),
              "tiles from small_batch_pack");
  const int64_t k2 = tiles.size(1), n = tiles.size(0) * 16, k = 2 * k2;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "rows of the weight's input width");
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  TORCH_CHECK(m >= 1 && m <= small_batch::MAX_ROWS, "1 to 8 rows");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n),
              "a float32 bias of N or none");
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
#if defined(__AVX512BF16__)
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const uint32_t* tp = reinterpret_cast<const uint32_t*>(tiles.data_ptr<int32_t>());
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  switch (m) {
    case 1: small_batch::rows<1>(xp, k2, tp, n, bp, yp); break;
    case 2: small_batch::rows<2>(xp, k2, tp, n, bp, yp); break;
    case 3: small_batch::rows<3>(xp, k2, tp, n, bp, yp); break;
    case 4: small_batch::rows<4>(xp, k2, tp, n, bp, yp); break;
    case 5: small_batch::rows<5>(xp, k2, tp, n, bp, yp); break;
    case 6: small_batch::rows<6>(xp, k2, tp, n, bp, yp); break;
    case 7: small_batch::rows<7>(xp, k2, tp, n, bp, yp); break;
    default: small_batch::rows<8>(xp, k2, tp, n, bp, yp); break;
  }
#endif
  return y;
}
