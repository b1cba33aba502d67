// ferry's bfloat16 linear layer on CPUs with AVX512-BF16 (and no AMX: there oneDNN keeps every
// product past a few rows; packed_linear.py).
//
// The weight is laid out once as tiles of sixteen outputs, each tile every k-pair's sixteen
// (output, k, k+1) words in a row ([N/16][K/2][16] uint32, the operand order of vdpbf16ps).
//
// - One or two rows (a decode step at batch 1-2) are a read of the weight: SmolLM2-135M's 30
//   layers hold 212 MB of bfloat16 weights, ~7 ms at the ~30 GB/s two cores read in order.
//   Each thread walks its tiles front to back, one sequential stream the hardware prefetcher
//   follows (software prefetch on top made it slower), each 64-byte vector taken into the
//   rows' dot products. oneDNN's blocked kernels read the weight at 13.5-20 GB/s there.
// - More rows are blocks of up to 8 rows against 3 tiles (48 outputs): 24 float32
//   accumulators, enough independent sums to keep vdpbf16ps at its throughput (measured ~1 per
//   cycle per core with 12 or more, 0.65 with 4), 3 weight vectors and 8 broadcast k-pairs per
//   24 dot products. Each thread takes a contiguous range of 48-output groups and runs every
//   row block against a group while its tiles are in L1/L2; a thread done early takes the
//   others' last groups (work_split.h, parallel_stealing). On the Zen 4 EPYC this ran the
//   model's products 1.5x as fast as oneDNN's packed kernels at 4-8 rows, 1.13x at 64 and
//   level from 256 to 2,048 rows, at the instruction's throughput (docs/benchmarks.md, "Kernels:
//   linear products (AMX, tiled, oneDNN)").
//
// float32 sums from the bias, k-pairs in order, one rounding to bfloat16 at the end: every
// output is the same sequence of instructions whatever the number of rows, so a row's result
// does not depend on the batch it is computed in (oneDNN's does, at some sizes). The order
// differs from oneDNN's, so results can differ from it in the last bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include "vec512.h"
#endif
#include "work_split.h"
#include "amx.h"

namespace tiled {
inline bool prefetch_next = true;  // the next-group weight prefetch; tiled_prefetch sets it
constexpr int64_t STREAM_ROWS = 2;  // up to here one stream per thread; past it row blocks
constexpr int64_t BLOCK_ROWS = 8;
constexpr int64_t BLOCK_TILES = 3;

// Lines of the weight a thread's next group will read (the tiles right after its current
// group's), prefetched by the current group's row blocks, a share each, at most one line
// per k-step (pf.p + 64 p at step p < pf.lines; pointer and count in registers). At 16-64
// rows a group's tiles come from memory once and serve 2-8 row blocks, and the first block
// waited on memory; with the next group's lines already on their way the products ran 3-6 %
// faster (LM head 5 %), level at 1-2 rows (the streamed path, no blocks) and from 256 rows
// (docs/benchmarks.md, "Kernels: linear products (AMX, tiled, oneDNN)"). tiled_prefetch(false)
// turns it off for A/B runs (bench_tiled_linear --parts prefetch).
struct Prefetch {
  const char* p = nullptr;
  int64_t lines = 0;
};

// The share of [begin, begin + bytes) that row block `block` of `blocks` prefetches.
static inline Prefetch share(const void* begin, int64_t bytes, int64_t block, int64_t blocks) {
  if (bytes <= 0) return {};
  const int64_t lines = (bytes + 63) / 64, per = (lines + blocks - 1) / blocks, first = block * per;
  return {static_cast<const char*>(begin) + 64 * first, std::max<int64_t>(0, std::min(per, lines - first))};
}

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
static void stream(const uint32_t* x, int64_t k2, const uint32_t* tiles, int64_t n, const float* bias,
                   c10::BFloat16* y) {
  // contiguous ranges of tiles per thread: each thread one stream through the weight
  parallel_for(0, n / 16, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      tile_rows<M>(x, k2, tiles + t * k2 * 16, bias ? bias + t * 16 : nullptr, y + t * 16, n);
  });
}

// R rows (row stride k2 words) against T tiles (stride ts words): the same sums as tile_rows
template <int R, int T>
static void block(const uint32_t* x, int64_t k2, const uint32_t* tile, int64_t ts, const float* bias,
                  c10::BFloat16* y, int64_t ldy, Prefetch pf) {
  __m512 acc[R][T];
  for (int t = 0; t < T; ++t) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * t) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][t] = b;
  }
  for (int64_t p = 0; p < k2; ++p) {
    if (p < pf.lines) __builtin_prefetch(pf.p + 64 * p, 0, 2);
    __m512bh w[T];
    for (int t = 0; t < T; ++t) w[t] = (__m512bh)_mm512_load_si512(tile + t * ts + p * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * k2 + p]));
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a, w[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) store16(y + r * ldy + 16 * t, acc[r][t]);
}

using BlockFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, const float*, c10::BFloat16*, int64_t,
                        Prefetch);

template <int T>
struct Blocks {
  static constexpr BlockFn by_rows[BLOCK_ROWS] = {&block<1, T>, &block<2, T>, &block<3, T>, &block<4, T>,
                                                  &block<5, T>, &block<6, T>, &block<7, T>, &block<8, T>};
};

static void blocked(const uint32_t* x, int64_t m, int64_t k2, const uint32_t* tiles, int64_t n, const float* bias,
                    c10::BFloat16* y) {
  static const BlockFn* const by_tiles[BLOCK_TILES] = {Blocks<1>::by_rows, Blocks<2>::by_rows, Blocks<3>::by_rows};
  const int64_t ts = k2 * 16, n16 = n / 16, groups = (n16 + BLOCK_TILES - 1) / BLOCK_TILES;
  parallel_stealing(groups, [&](int64_t g) {
    const int64_t t0 = g * BLOCK_TILES, nt = std::min(BLOCK_TILES, n16 - t0);
    const BlockFn* fns = by_tiles[nt - 1];
    const int64_t blocks = (m + BLOCK_ROWS - 1) / BLOCK_ROWS, next = std::min(BLOCK_TILES, n16 - t0 - nt);
    for (int64_t r = 0, i = 0; r < m; r += BLOCK_ROWS, ++i) {
      const int64_t nr = std::min(BLOCK_ROWS, m - r);
      fns[nr - 1](x + r * k2, k2, tiles + t0 * ts, ts, bias ? bias + 16 * t0 : nullptr, y + r * n + 16 * t0, n,
                  next > 0 && prefetch_next ? share(tiles + (t0 + nt) * ts, 4 * ts * next, i, blocks) : Prefetch{});
    }
  });
}

// The gated MLP's first product, silu(x Wg^T) * (x Wu^T), with [Wg; Wu] as one weight's tiles:
// P gate tiles and their up tiles (n16 / 2 tiles further on) against R rows, then the
// activation on the accumulators before anything is stored. Each of gate and up is rounded
// to bfloat16 first and the activation once more, as the gate/up product followed by
// silu_and_mul rounds them, so the result is the same bits; what is saved is writing the
// [M, 2I] product and reading it back.
template <int R, int P>
static void gated_block(const uint32_t* x, int64_t k2, const uint32_t* gate, const uint32_t* up, int64_t ts,
                        const float* gbias, const float* ubias, c10::BFloat16* y, int64_t ldy, Prefetch pg,
                        Prefetch pu) {
  __m512 g[R][P], u[R][P];
  for (int q = 0; q < P; ++q) {
    const __m512 gb = gbias ? _mm512_loadu_ps(gbias + 16 * q) : _mm512_setzero_ps();
    const __m512 ub = ubias ? _mm512_loadu_ps(ubias + 16 * q) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) g[r][q] = gb, u[r][q] = ub;
  }
  for (int64_t p = 0; p < k2; ++p) {
    if (p < pg.lines) __builtin_prefetch(pg.p + 64 * p, 0, 2);
    if (p < pu.lines) __builtin_prefetch(pu.p + 64 * p, 0, 2);
    __m512bh wg[P], wu[P];
    for (int q = 0; q < P; ++q) {
      wg[q] = (__m512bh)_mm512_load_si512(gate + q * ts + p * 16);
      wu[q] = (__m512bh)_mm512_load_si512(up + q * ts + p * 16);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * k2 + p]));
      for (int q = 0; q < P; ++q) {
        g[r][q] = _mm512_dpbf16_ps(g[r][q], a, wg[q]);
        u[r][q] = _mm512_dpbf16_ps(u[r][q], a, wu[q]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q)
      store16(y + r * ldy + 16 * q, _mm512_mul_ps(round_bf16(silu16(round_bf16(g[r][q]))), round_bf16(u[r][q])));
}

using GatedFn = void (*)(const uint32_t*, int64_t, const uint32_t*, const uint32_t*, int64_t, const float*,
                         const float*, c10::BFloat16*, int64_t, Prefetch, Prefetch);
constexpr int64_t GATED_ROWS = 6;  // 6 rows x 2 pairs of tiles: 24 accumulators, as the plain blocks have

template <int P>
struct GatedBlocks {
  static constexpr GatedFn by_rows[GATED_ROWS] = {&gated_block<1, P>, &gated_block<2, P>, &gated_block<3, P>,
                                                  &gated_block<4, P>, &gated_block<5, P>, &gated_block<6, P>};
};

static void gated(const uint32_t* x, int64_t m, int64_t k2, const uint32_t* tiles, int64_t n, const float* bias,
                  c10::BFloat16* y) {
  const int64_t ts = k2 * 16, half = n / 32, width = n / 2;  // tiles per half, outputs
  const int64_t groups = (half + 1) / 2;                       // two gate tiles (and their up tiles) a group
  parallel_stealing(groups, [&](int64_t g) {
    const int64_t t = 2 * g;
    const GatedFn* fns = t + 2 <= half ? GatedBlocks<2>::by_rows : GatedBlocks<1>::by_rows;
    const int64_t blocks = (m + GATED_ROWS - 1) / GATED_ROWS, next = std::min<int64_t>(2, half - t - 2);
    for (int64_t r = 0, i = 0; r < m; r += GATED_ROWS, ++i) {
      const int64_t nr = std::min(GATED_ROWS, m - r);
      const bool pf = next > 0 && prefetch_next;
      fns[nr - 1](x + r * k2, k2, tiles + t * ts, tiles + (t + half) * ts, ts, bias ? bias + 16 * t : nullptr,
                  bias ? bias + width + 16 * t : nullptr, y + r * width + 16 * t, width,
                  pf ? share(tiles + (t + 2) * ts, 4 * ts * next, i, blocks) : Prefetch{},
                  pf ? share(tiles + (t + 2 + half) * ts, 4 * ts * next, i, blocks) : Prefetch{});
    }
  });
}
#endif
}  // namespace tiled

bool tiled_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// weight [N, K] bfloat16 (N a multiple of 16, K even) -> the tiles [N/16, K/2, 16] as int32
// words: word (t, p, j) = weight[16 t + j][2 p] | weight[16 t + j][2 p + 1] << 16.
torch::Tensor tiled_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "a [N, K] bfloat16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 2 == 0 && k > 0, "N a multiple of 16, K even and not 0");
  auto w = weight.contiguous();
  auto tiles = torch::empty({n / 16, k / 2, 16}, weight.options().dtype(at::kInt));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(tiles.data_ptr<int32_t>());
  parallel_for(0, n / 16, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t p = 0; p < k / 2; ++p)
        for (int64_t j = 0; j < 16; ++j) {
          const uint16_t* row = src + (16 * t + j) * k;
          dst[(t * (k / 2) + p) * 16 + j] = row[2 * p] | (static_cast<uint32_t>(row[2 * p + 1]) << 16);
        }
  });
  return tiles;
}

// Rows of the weight back out of its tiles: ids [...] int64 -> [..., K] bfloat16, row i =
// weight[ids[i]] bit for bit. A tied embedding (the LM head's weight) reads its rows here, so
// the worker holds that matrix once, as tiles, instead of beside them (runner.py). A row's K/2
// words lie 64 bytes apart (one per k-pair row of its tile): 9 KiB of lines for K = 576.
torch::Tensor tiled_embedding(torch::Tensor tiles, torch::Tensor ids) {
  TORCH_CHECK(tiles.scalar_type() == at::kInt && tiles.dim() == 3 && tiles.size(2) == 16 && tiles.is_contiguous(),
              "tiles from tiled_pack");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "int64 token ids");
  const int64_t k2 = tiles.size(1), n = tiles.size(0) * 16;
  auto flat = ids.contiguous().view(-1);
  const int64_t m = flat.numel();
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "token id ", ip[i], " out of range for an embedding of ", n, " rows");
  auto sizes = ids.sizes().vec();
  sizes.push_back(2 * k2);
  auto out = torch::empty(sizes, tiles.options().dtype(at::kBFloat16));
  const uint32_t* tp = reinterpret_cast<const uint32_t*>(tiles.data_ptr<int32_t>());
  uint32_t* op = reinterpret_cast<uint32_t*>(out.data_ptr<c10::BFloat16>());
  parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint32_t* src = tp + (ip[r] / 16) * k2 * 16 + ip[r] % 16;
      uint32_t* dst = op + r * k2;
      for (int64_t p = 0; p < k2; ++p) dst[p] = src[p * 16];
    }
  });
  return out;
}

namespace {
struct Checked {
  int64_t k2, n, m;
  const float* bias;
};

// The checks both products make: contiguous bfloat16 rows of the weight's input width, tiles
// from tiled_pack, a float32 bias of N or none.
Checked check(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& bias) {
  TORCH_CHECK(tiled_linear_available(), "this build has no AVX512-BF16 tiled linear");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "contiguous bfloat16 rows");
  TORCH_CHECK(tiles.scalar_type() == at::kInt && tiles.dim() == 3 && tiles.size(2) == 16 && tiles.is_contiguous(),
              "tiles from tiled_pack");
  const int64_t k2 = tiles.size(1), n = tiles.size(0) * 16, k = 2 * k2;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "rows of the weight's input width");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n),
              "a float32 bias of N or none");
  return {k2, n, k == 0 ? 0 : x.numel() / k, has_bias ? bias.data_ptr<float>() : nullptr};
}

torch::Tensor rows_of(const torch::Tensor& x, int64_t width) {
  auto sizes = x.sizes().vec();
  sizes.back() = width;
  return torch::empty(sizes, x.options());
}
}  // namespace

// x [..., K] bfloat16, contiguous, tiles from tiled_pack, bias [N] float32 or an empty tensor
// -> x @ weight^T (+ bias), [..., N] bfloat16.
torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias) {
  const Checked c = check(x, tiles, bias);
  auto y = rows_of(x, c.n);
  if (c.m == 0) return y;
#if defined(__AVX512BF16__)
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const uint32_t* tp = reinterpret_cast<const uint32_t*>(tiles.data_ptr<int32_t>());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  static_assert(tiled::STREAM_ROWS == 2, "the stream cases below");
  if (c.m == 1)
    tiled::stream<1>(xp, c.k2, tp, c.n, c.bias, yp);
  else if (c.m == 2)
    tiled::stream<2>(xp, c.k2, tp, c.n, c.bias, yp);
  else
    tiled::blocked(xp, c.m, c.k2, tp, c.n, c.bias, yp);
#endif
  return y;
}

// x [..., K] bfloat16, contiguous; tiles from tiled_pack of [Wg; Wu] (2I outputs, I a multiple
// of 16); bias [2I] float32 or empty -> silu(x Wg^T + bg) * (x Wu^T + bu), [..., I] bfloat16:
// the same bits as tiled_linear followed by silu_and_mul.
torch::Tensor tiled_silu_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias) {
  const Checked c = check(x, tiles, bias);
  TORCH_CHECK(tiles.size(0) % 2 == 0, "a gate and an up half of whole tiles (2I outputs, I a multiple of 16)");
  auto y = rows_of(x, c.n / 2);
  if (c.m == 0) return y;
#if defined(__AVX512BF16__)
  tiled::gated(reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>()), c.m, c.k2,
               reinterpret_cast<const uint32_t*>(tiles.data_ptr<int32_t>()), c.n, c.bias, y.data_ptr<c10::BFloat16>());
#endif
  return y;
}
// The next-group weight prefetch on (the default) or off, for A/B measurements.
void tiled_prefetch(bool on) { tiled::prefetch_next = on; }

// The same tiles as AMX B tiles (CPUs with AMX): a tile's sixteen k-pair rows of sixteen
// outputs are 64-byte rows, the layout TDPBF16PS reads, so the products of a decode step's
// 7-128 rows (past the tiled kernel's 6; oneDNN's before) read them as they are. Each thread
// takes a contiguous range of groups of two output tiles (for the gated product: a gate tile
// and its up tile; then the other's from its back, work_split.h) and runs them against the
// rows 32 at a time: four C tiles (2 x 16 rows x 2
// x 16 outputs), two A tiles of the rows, two B tiles, 32 k a step; up to 32 rows each step's
// B lines are requested into L1 two steps ahead (a tile load waits for its lines, and AMX does
// not run ahead of it: at 32 rows oneDNN's packed product read the weight at 12.8 GB/s, this
// at 21.6).
// Past 32 rows each group runs against every 32 rows in turn, its tiles in L2 after the first
// (see run); past 128 (a prompt step's rows, for the projections packed_linear.py sends them)
// the rows are split between the threads instead (run_rows). Sums in float32 from zero, the
// bias added once, rounded once: a row's result does not depend on the other rows.
namespace tiled_amx_ns {
inline bool enabled = true;  // tiled_amx sets it
// The most rows the decode path (run's group split) takes; amx_linear_rows() reports it, the
// bound decode_layers keeps its AMX products to. Against oneDNN's packed products on the
// model's 30 layers: 0.77-0.78x the time at 7-16 rows, 0.59x at 32, 0.88-0.89x at 33-48, 0.74x
// at 64, 0.84x at 128 (docs/benchmarks.md, "Kernels: linear products"). More rows take run_rows (a prompt step's; the
// projections that send them here are chosen in packed_linear.py).
constexpr int64_t MAX_ROWS = 128;
#if FERRY_AMX
// The previous pair's epilogue, run in slices under the next pair's tile products (side): the
// tile unit works through its products while the vector units add the bias, round and store
// the last pair's sums. After its pair instead, the SiLU epilogue cost a 2,048-row gated product
// ~45 % (two cores: 1.8 TFLOP/s with it, 3.4 with no epilogue at all); spread over the next
// pair's k-steps, 2.3. Stores still slow the tile loads that follow them (q/k/v: 2.4-2.6
// TFLOP/s storing its results, 2.75 storing to an L1 scratch, 3.1 storing nothing); stores in
// bursts of 4-32 rows instead of ~2 a k-step, or the output lines requested for writing ahead,
// were no faster. (docs/benchmarks.md, "Kernels: linear products (AMX, tiled, oneDNN)".)
struct NoSide {
  void operator()(int64_t, int64_t) const {}
};

// What a pair requests ahead of its tile loads. l1 (up to 32 rows, one pair a group): its own
// B tiles' lines two k-steps ahead into L1, then the next group's first steps (n0, n1; null
// after the last group). Otherwise, with n0 set (33-128 rows, 2-4 pairs a group): a share of
// the next group's tiles into L2, lines [from + per s, from + per (s + 1)) of n0 and of n1 at
// k-step s, so that the group's pairs together request all of them. Without it each group's
// first pair waited on its tiles from memory, the gated product's two streams (gate and up,
// 3 MB apart) the worst: gate/up 1.08-1.18x faster at 48-128 rows, the others 1.02-1.10x
// (docs/benchmarks.md, "Kernels: linear products (AMX, tiled, oneDNN)").
struct Ahead {
  const char* n0 = nullptr;
  const char* n1 = nullptr;
  bool l1 = false;
  int64_t from = 0, per = 0;
};

// rows [r0, r0 + 32) of xb (row stride K elements) against B tiles b0, b1 (k2 * 16 words each),
// sums stored to c (four 16 x 16 float32 blocks: rows 0-15 x b0, rows 0-15 x b1, rows 16-31 x
// b0, rows 16-31 x b1); next: what it requests ahead (Ahead).
// side(lo, hi) after each k-step's products: rows [lo, hi) of 32 spread over the k-steps.
// STREAM_A: the rows' tiles loaded with the streaming hint (TILELOADDT1), so the B tiles a thread
// keeps reusing stay in L1 while the rows pass through (run_rows: 2,048 rows of q/k/v 1.25x).
template <bool STREAM_A = false, typename Side = NoSide>
static inline void pair(const c10::BFloat16* x, int64_t K, const char* b0, const char* b1, const Ahead& next,
                        float (*c)[256], Side&& side = Side()) {
  constexpr int64_t AHEAD = 2;  // k-steps (measured: 1-8 alike at 32 rows, none 8 % slower)
  const int64_t ks = K / 32;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < ks; ++s) {
    if (next.l1) {
      const int64_t a = s + AHEAD;
      const char* p0 = a < ks ? b0 + a * 1024 : (next.n0 ? next.n0 + (a - ks) * 1024 : nullptr);
      const char* p1 = a < ks ? b1 + a * 1024 : (next.n1 ? next.n1 + (a - ks) * 1024 : nullptr);
      if (p0 != nullptr)
        for (int l = 0; l < 16; ++l) {
          _mm_prefetch(p0 + 64 * l, _MM_HINT_T0);
          _mm_prefetch(p1 + 64 * l, _MM_HINT_T0);
        }
    } else if (next.n0 != nullptr) {
      const int64_t lo = next.from + s * next.per, hi = std::min(lo + next.per, 16 * ks);
      for (int64_t l = lo; l < hi; ++l) {
        _mm_prefetch(next.n0 + 64 * l, _MM_HINT_T1);
        _mm_prefetch(next.n1 + 64 * l, _MM_HINT_T1);
      }
    }
    // loads and products interleaved, each product issued once its two tiles are in: 4-9 %
    // faster than four loads then four products at 2,048 rows (run_rows), 0-4 % at 8-128
    if constexpr (STREAM_A) _tile_stream_loadd(4, x + s * 32, K * 2);
    else _tile_loadd(4, x + s * 32, K * 2);
    _tile_loadd(6, b0 + s * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + s * 1024, 64);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (STREAM_A) _tile_stream_loadd(5, x + 16 * K + s * 32, K * 2);
    else _tile_loadd(5, x + 16 * K + s * 32, K * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    side(s * 32 / ks, (s + 1) * 32 / ks);
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
}

// Pairs in turn, each one's epilogue under the next one's products: step(...) for each pair
// (its rows from r0, group g's tiles), then finish() for the last pair's epilogue.
template <typename Epilogue>
struct Pipelined {
  explicit Pipelined(Epilogue& e) : epilogue(e) {}  // the sums' buffers left uninitialized
  Epilogue& epilogue;
  alignas(64) float c[2][4][256];
  int cur = 0;
  int64_t pg = -1, pr = 0;  // the previous pair's group and first row; -1: none yet
  template <bool STREAM_A = false>
  void step(const c10::BFloat16* x, int64_t K, const char* b0, const char* b1, const Ahead& next, int64_t g,
            int64_t r0) {
    float (*prev)[256] = c[cur ^ 1];
    pair<STREAM_A>(x, K, b0, b1, next, c[cur], [&](int64_t lo, int64_t hi) {
      if (pg >= 0 && lo < hi) epilogue(pg, pr, prev, lo, hi);
    });
    pg = g, pr = r0, cur ^= 1;
  }
  void finish() {
    if (pg >= 0) epilogue(pg, pr, c[cur ^ 1], 0, 32);
    pg = -1;
  }
};

// More rows than a decode step's (past MAX_ROWS: a prompt step's, or a prompt chunk beside
// decodes): items of up to row_blocks(K) 32-row blocks (590 KB of rows at K = 576, 786 KB at
// K = 1,536: kept in L2 beside the group's tiles) against up to 8 groups, each group against
// every 32 rows of the item in turn: the group's tiles (36 KB at K = 576) stay in L1 while the
// rows pass through with the streaming hint.
// Rows outside and groups inside, or every tile loaded alike, both operands came from L2 at each
// k-step: 2,048 rows of q/k/v ran 2.1 TFLOP/s on two cores against 2.6 (o_proj 2.2 against 2.7;
// down, K = 1,536, whose tiles do not fit L1, level). Nothing requested ahead (the next item's
// tiles or the next rows requested over the current item changed nothing); an item's rows are
// read from memory once, its groups once per row chunk.
// parallel_stealing hands the items out, those of one row chunk next to each other; where the
// rows are few, groups go 2-8 an item so each thread has at least four. Split by groups instead
// (as run is), both threads read every row (2.4 MB at 2,048 x 576) and the products ran 0.6-0.9x
// oneDNN's; at K = 576, 8 row blocks an item ran 2-4 % slower than 16, 24 about 8 %. At K =
// 1,536 (down) 16 blocks are 1.5 MB of rows, which with the group's 96 KB of tiles (from L2:
// they do not fit L1) left the 2 MB L2 thrashing: 2,048 rows 1.12x faster with 8 (the rows
// held in L1 instead, a timing-only build: 1.24x). Each sum is the same products in the same
// order as in run, so a row's result does not depend on the step's rows.
constexpr int64_t ROW_BLOCKS = 16, ITEM_ROW_BYTES = 768 << 10;
static inline int64_t row_blocks(int64_t K) { return std::clamp<int64_t>(ITEM_ROW_BYTES / (64 * K), 1, ROW_BLOCKS); }
template <typename Rows, typename Tile, typename Epilogue>
static void run_rows(Rows rows, int64_t mp, int64_t K, int64_t groups, Tile tile, Epilogue epilogue) {
  const int64_t rb = row_blocks(K), blocks = mp / 32, row_chunks = (blocks + rb - 1) / rb;
  const int64_t want = (4 * at::get_num_threads() + row_chunks - 1) / row_chunks;  // group chunks a row chunk
  const int64_t group_block = std::clamp<int64_t>((groups + want - 1) / want, 2, 8);
  const int64_t group_chunks = (groups + group_block - 1) / group_block;
  parallel_stealing(row_chunks * group_chunks, [&](int64_t item) {
    const int64_t rc = item / group_chunks, gc = item % group_chunks;
    const int64_t g0 = gc * group_block, g1 = std::min(groups, g0 + group_block);
    const int64_t b0 = rc * rb, b1 = std::min(blocks, b0 + rb);
    amx_configure();
    Pipelined<Epilogue> pipe(epilogue);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = b0; b < b1; ++b)
        pipe.template step<true>(rows(32 * b), K, tile(g, 0), tile(g, 1), Ahead{}, g, 32 * b);
    pipe.finish();
    _tile_release();
  });
}

// groups [0, groups): group g's B tiles tile(g, 0) and tile(g, 1); epilogue(g, r0, c, lo, hi)
// stores rows [r0 + lo, r0 + hi) of its four sum blocks (lo, hi within 0-32). Up to 32 rows,
// each group's next steps (and the next group's first) are requested into L1 ahead of their
// tile loads; past 32 rows the rows' A tiles no longer fit L1 beside them and those requests
// cost more than they gave (64 rows: 16.3 ms a step with them, 13.3 without), so the group's
// pairs request the next group's tiles into L2 instead, a share each (Ahead).
//
// x: the rows, m of them; a last block of fewer than 32 is copied into a zero-padded buffer
// (the tile loads read 32 rows), the others read in place: a padded copy of all of x, a tensor
// allocated per call, cost 1-2 ms of a 64-request step at 33-63 rows. More than MAX_ROWS rows
// go to run_rows.
template <typename Tile, typename Epilogue>
static void run(const c10::BFloat16* x, int64_t m, int64_t K, int64_t groups, Tile tile, Epilogue epilogue) {
  const int64_t full = m / 32 * 32, mp = (m + 31) / 32 * 32;
  thread_local std::vector<c10::BFloat16> tail;
  if (mp > full) {
    tail.assign(32 * K, c10::BFloat16(0.f));
    std::memcpy(tail.data(), x + full * K, (m - full) * K * sizeof(c10::BFloat16));
  }
  const c10::BFloat16* tail_rows = tail.data();
  auto rows = [&](int64_t r0) { return r0 < full ? x + r0 * K : tail_rows; };
  if (m > MAX_ROWS) return run_rows(rows, mp, K, groups, tile, epilogue);
  const int64_t pairs = mp / 32, per = (16 + pairs - 1) / pairs;  // L2 lines a k-step (Ahead)
  // each participant its own range of groups front to back, then the others' from their backs
  // one at a time (work_split.h); what it requests ahead is the group after, whoever runs it
  const int64_t threads = at::in_parallel_region() ? 1 : std::clamp<int64_t>(at::get_num_threads(), 1, groups);
  std::vector<StealRange> ranges = even_ranges(groups, threads);
  ferry_pool::run(threads, [&](int64_t t) {
    amx_configure();
    Pipelined<Epilogue> pipe(epilogue);
    run_and_take(ranges, t, 1, [&](int64_t g, int64_t) {
      const bool last = g + 1 == groups;
      for (int64_t j = 0; j < pairs; ++j)
        pipe.step(rows(32 * j), K, tile(g, 0), tile(g, 1),
                  Ahead{last ? nullptr : tile(g + 1, 0), last ? nullptr : tile(g + 1, 1), pairs == 1,
                        j * (K / 32) * per, per},
                  g, 32 * j);
    });
    pipe.finish();
    _tile_release();
  });
}
#endif

}  // namespace tiled_amx_ns

bool amx_linear_ready() {
#if FERRY_AMX
  return tiled_amx_ns::enabled && amx_permitted();
#else
  return false;
#endif
}

// 0: AMX products off, 1: on (where the build and the CPU have AMX); anything else: only
// asks. Returns the most rows they take (0: they do not run). For A/B runs and tests.
int64_t amx_linear_rows() { return amx_linear_ready() ? tiled_amx_ns::MAX_ROWS : 0; }
int64_t tiled_amx(int64_t mode) {
  if (mode == 0 || mode == 1) tiled_amx_ns::enabled = mode == 1;
  return amx_linear_rows();
}

// As tiled_linear (the same tiles, bias and result shape; N a multiple of 32, K of 32), by
// AMX tile products; the sums' order differs from tiled_linear's, so the last bit can.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias) {
  const Checked c = check(x, tiles, bias);
  TORCH_CHECK(amx_linear_ready(), "no AMX here (or tiled_amx(0))");
  TORCH_CHECK(c.n % 32 == 0 && (2 * c.k2) % 32 == 0, "N and K multiples of 32");
  auto y = rows_of(x, c.n);
  if (c.m == 0) return y;
#if FERRY_AMX
  const int64_t K = 2 * c.k2, n = c.n, m = c.m;
  const char* tp = reinterpret_cast<const char*>(tiles.data_ptr<int32_t>());
  const int64_t tile_bytes = c.k2 * 64;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const float* bias_p = c.bias;
  tiled_amx_ns::run(x.data_ptr<c10::BFloat16>(), m, K, n / 32,
      [&](int64_t g, int q) { return tp + (2 * g + q) * tile_bytes; },
      [&](int64_t g, int64_t r0, float (*s)[256], int64_t lo, int64_t hi) {
        const int64_t o = 32 * g;
        const __m512 b0 = bias_p ? _mm512_loadu_ps(bias_p + o) : _mm512_setzero_ps();
        const __m512 b1 = bias_p ? _mm512_loadu_ps(bias_p + o + 16) : _mm512_setzero_ps();
        for (int64_t i = lo; i < std::min(hi, m - r0); ++i) {
          const int64_t h = i >> 4, r = i & 15;
          store16(yp + (r0 + i) * n + o, _mm512_add_ps(_mm512_load_ps(s[2 * h] + 16 * r), b0));
          store16(yp + (r0 + i) * n + o + 16, _mm512_add_ps(_mm512_load_ps(s[2 * h + 1] + 16 * r), b1));
        }
      });
#endif
  return y;
}

// As tiled_silu_linear (tiles of [Wg; Wu], I a multiple of 16), by AMX tile products: a gate
// tile and its up tile a group, the activation rounded as silu_and_mul rounds it.
torch::Tensor amx_silu_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias) {
  const Checked c = check(x, tiles, bias);
  TORCH_CHECK(amx_linear_ready(), "no AMX here (or tiled_amx(0))");
  TORCH_CHECK(tiles.size(0) % 2 == 0 && (2 * c.k2) % 32 == 0, "a gate and an up half of whole tiles, K a multiple of 32");
  auto y = rows_of(x, c.n / 2);
  if (c.m == 0) return y;
#if FERRY_AMX
  const int64_t K = 2 * c.k2, width = c.n / 2, half = c.n / 32, m = c.m;
  const char* tp = reinterpret_cast<const char*>(tiles.data_ptr<int32_t>());
  const int64_t tile_bytes = c.k2 * 64;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const float* bias_p = c.bias;
  tiled_amx_ns::run(x.data_ptr<c10::BFloat16>(), m, K, half,
      [&](int64_t g, int q) { return tp + (g + q * half) * tile_bytes; },
      [&](int64_t g, int64_t r0, float (*s)[256], int64_t lo, int64_t hi) {
        const int64_t o = g * 16;
        const __m512 gb = bias_p ? _mm512_loadu_ps(bias_p + o) : _mm512_setzero_ps();
        const __m512 ub = bias_p ? _mm512_loadu_ps(bias_p + width + o) : _mm512_setzero_ps();
        for (int64_t i = lo; i < std::min(hi, m - r0); ++i) {
          const int64_t h = i >> 4, r = i & 15;
          const __m512 gv = _mm512_add_ps(_mm512_load_ps(s[2 * h] + 16 * r), gb);
          const __m512 uv = _mm512_add_ps(_mm512_load_ps(s[2 * h + 1] + 16 * r), ub);
          store16(yp + (r0 + i) * width + o, _mm512_mul_ps(round_bf16(silu16(round_bf16(gv))), round_bf16(uv)));
        }
      });
#endif
  return y;
}

// As amx_linear, with the rotary embedding applied to the first rope_cols outputs (the query
// and key heads of a fused q/k/v projection, head_dim each) in the epilogue: out[i] for a
// head's first half = T(T(x_i cos_i) + T(-x_{i+half} sin_i)), its second half = T(T(x_{i+half}
// cos_{i+half}) + T(x_i sin_{i+half})), each x the product rounded to bfloat16 first, as
// amx_linear followed by rotary (fused_ops.cpp) compute it: the same bits, without storing
// the query and key and reading them back, nor a rotary call (its own parallel region).
// Within the rope columns a group pairs the 16-output tile of a head's first half with the
// tile half a head further on (not two neighbouring tiles), so each element's partner is in
// the same lane of the other sum block. cos/sin: [rows, head_dim] bfloat16, row r token r's.
torch::Tensor amx_rope_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias, torch::Tensor cos,
                              torch::Tensor sin, int64_t rope_cols, int64_t head_dim) {
  const Checked c = check(x, tiles, bias);
  TORCH_CHECK(amx_linear_ready(), "no AMX here (or tiled_amx(0))");
  TORCH_CHECK(c.n % 32 == 0 && (2 * c.k2) % 32 == 0, "N and K multiples of 32");
  TORCH_CHECK(head_dim > 0 && head_dim % 32 == 0 && rope_cols >= 0 && rope_cols % head_dim == 0 && rope_cols <= c.n,
              "head_dim a multiple of 32; rope_cols whole heads within N");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == c.m * head_dim && sin.numel() == cos.numel(),
              "cos/sin: contiguous bfloat16 [rows, head_dim]");
  auto y = rows_of(x, c.n);
  if (c.m == 0) return y;
#if FERRY_AMX
  const int64_t K = 2 * c.k2, n = c.n, m = c.m, half = head_dim / 2;
  const int64_t half_tiles = half / 16, rope_groups = rope_cols / 32;
  const char* tp = reinterpret_cast<const char*>(tiles.data_ptr<int32_t>());
  const int64_t tile_bytes = c.k2 * 64;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const c10::BFloat16* cp = cos.data_ptr<c10::BFloat16>();
  const c10::BFloat16* sp = sin.data_ptr<c10::BFloat16>();
  const float* bias_p = c.bias;
  // group g's tile q (its sum block q): a rope group's first-half tile and its partner, else two neighbours
  auto tile_of = [&](int64_t g, int q) -> int64_t {
    if (g >= rope_groups) return 2 * g + q;
    const int64_t head = g / half_tiles, j = g % half_tiles;
    return head * 2 * half_tiles + j + q * half_tiles;
  };
  tiled_amx_ns::run(x.data_ptr<c10::BFloat16>(), m, K, n / 32,
      [&](int64_t g, int q) { return tp + tile_of(g, q) * tile_bytes; },
      [&](int64_t g, int64_t r0, float (*s)[256], int64_t lo, int64_t hi) {
        const int64_t o0 = 16 * tile_of(g, 0), o1 = 16 * tile_of(g, 1);
        const __m512 b0 = bias_p ? _mm512_loadu_ps(bias_p + o0) : _mm512_setzero_ps();
        const __m512 b1 = bias_p ? _mm512_loadu_ps(bias_p + o1) : _mm512_setzero_ps();
        const bool rope = g < rope_groups;
        const int64_t d = o0 % head_dim;  // a rope group's first-half dimension
        for (int64_t i = lo; i < std::min(hi, m - r0); ++i) {
          const int64_t h = i >> 4, r = i & 15, row = r0 + i;
          const __m512 v0 = _mm512_add_ps(_mm512_load_ps(s[2 * h] + 16 * r), b0);
          const __m512 v1 = _mm512_add_ps(_mm512_load_ps(s[2 * h + 1] + 16 * r), b1);
          if (!rope) {
            store16(yp + row * n + o0, v0);
            store16(yp + row * n + o1, v1);
            continue;
          }
          // the product as stored in bfloat16, then rotary's arithmetic (fused_ops.cpp, rope16)
          rope16<c10::BFloat16>(round_bf16(v0), round_bf16(v1), cp + row * head_dim, sp + row * head_dim, d, half,
                                yp + row * n + o0, yp + row * n + o1);
        }
      });
#endif
  return y;
}
