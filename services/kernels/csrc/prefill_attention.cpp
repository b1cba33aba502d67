// Causal attention of fresh prompt chunks (no cached prefix) on the CPU, flash style.
//
// A step's multi-token chunks that start at position 0 attend only to their own keys,
// which are in the step's own key/value tensors: no cache read. PyTorch's CPU flash
// kernel did this at ~55 GFLOP/s on 200-token prompts with 64-wide heads (its tiles are
// made for long sequences; docs/benchmarks.md "Kernels: prompt attention").
// Here one work item is (chunk, KV head, 16 query tokens): the item's query rows (16
// tokens x the KV head's query heads, e.g. 48 rows for SmolLM2's 3) are scored against
// 32 keys at a time from a transposed float32 copy of the key tile (4 rows x 32 keys of
// register accumulators, every key load shared by 4 rows), with an online softmax and the
// value tile accumulated the same way. Key tiles past a query tile's last token are never
// read (causal). Items go to threads in a zigzag order of query tiles so each thread gets
// as many late (long) tiles as early (short) ones.
//
// All in float32, any token/head strides (head_dim contiguous); the output is written
// into the step's output tensor at the chunks' rows. bfloat16 on a CPU with AVX512-BF16
// takes prefill_kernel_bf16 instead (bf16 dot products, keys and values laid out once per
// chunk: 2.3x on 10 x 200-token prompts). CPUs without AVX-512 but with AVX2 and FMA take
// prefill_kernel8, the same scheme in eight-lane vectors with 16-key tiles (1.09x PyTorch's
// CPU flash kernel on float32 10 x 200-token prompts on a Zen 3 EPYC). Where the build and the
// CPU have AMX, the bfloat16 kernel's Q.K^T and P.V are AMX tile products (prefill_amx: 0.46x its
// time on ten 200-token prompts, 0.35x on one of 2,000, on a 2-vCPU Xeon).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>
#include "work_split.h"
#include "amx.h"
#define FERRY_PREFILL_AMX FERRY_AMX

// Whether the bfloat16 prompt kernel takes AMX tile products where the build and the CPU have
// them (prefill_amx sets it, for A/B runs and tests).
static bool g_prefill_amx = true;

// query [T, H, D], key/value [T, KH, D] (any token/head strides, D contiguous); out [T, H, D]
// contiguous; spans [S, 2] int64 (start, end) of chunks attending causally to their own keys.
[[maybe_unused]] static void check_prefill_args(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                               const torch::Tensor& out, const torch::Tensor& spans) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.dim() == 3, "[tokens, heads, dim]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1 && out.is_contiguous(),
              "head_dim contiguous, out contiguous");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type() &&
              out.scalar_type() == query.scalar_type(), "one dtype");
  TORCH_CHECK(spans.scalar_type() == torch::kInt64 && spans.is_contiguous() && spans.dim() == 2 && spans.size(1) == 2,
              "spans: [S, 2] int64");
  const int64_t heads = query.size(1), kv_heads = key.size(1), dim = query.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && key.size(2) == dim && value.size(2) == dim, "head shapes");
  TORCH_CHECK(dim == 64 || dim == 128, "head_dim 64 or 128");
}

// The float32 kernels' work items: (chunk, KV head, bq query tokens), each chunk's query
// tiles in zigzag order (0, n-1, 1, n-2, ...) so every thread gets as many late (long)
// tiles as early (short) ones.
// spans: rows of `cols` int64, (start, end) or (start, end, prefix); prefix: context positions
// before the chunk's first query (its keys are in the paged cache).
struct PrefillItem { int64_t start, len, kvh, q0, prefix, span; };
[[maybe_unused]] static std::vector<PrefillItem> prefill_items(const int64_t* spans, int64_t num_spans, int64_t cols,
                                                               int64_t num_kv_heads, int64_t bq) {
  std::vector<PrefillItem> items;
  for (int64_t s = 0; s < num_spans; ++s) {
    const int64_t start = spans[cols * s], len = spans[cols * s + 1] - start, prefix = cols > 2 ? spans[cols * s + 2] : 0;
    const int64_t tiles = (len + bq - 1) / bq;
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
      for (int64_t z = 0; z < tiles; ++z) {
        const int64_t tile = (z % 2 == 0) ? z / 2 : tiles - 1 - z / 2;
        items.push_back({start, len, kvh, tile * bq, prefix, s});
      }
  }
  return items;
}

// Each (chunk, KV head) of a call's spans as a panel of bk-key tiles over its whole context
// (prefix included), the panels in (span, KV head) order, and every (panel, tile) pair: what
// the kernels lay out once per call before their work items run. off: the panel's first
// tile; prefix: context positions before the chunk's first query.
struct Panel { int64_t start, len, kvh, off, prefix, span; };
struct Panels {
  std::vector<Panel> panels;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (panel, tile)
  int64_t num_tiles = 0;
};
[[maybe_unused]] static Panels chunk_panels(const int64_t* spans, int64_t num_spans, int64_t cols, int64_t num_kv_heads,
                                            int64_t bk) {
  Panels p;
  for (int64_t s = 0; s < num_spans; ++s) {
    const int64_t start = spans[cols * s], len = spans[cols * s + 1] - start, prefix = cols > 2 ? spans[cols * s + 2] : 0;
    const int64_t n = (prefix + len + bk - 1) / bk;
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      for (int64_t t = 0; t < n; ++t) p.tiles.emplace_back(static_cast<int64_t>(p.panels.size()), t);
      p.panels.push_back({start, len, kvh, p.num_tiles, prefix, s});
      p.num_tiles += n;
    }
  }
  return p;
}

// A work item's cost for parallel_by_cost: its queries times the keys they attend to, plus a
// little for what every item pays. Items are split by cost, not count: a chunk after a long
// cached prefix costs many times a fresh prompt's chunk per query tile.
[[maybe_unused]] static inline double item_cost(int64_t prefix, int64_t len, int64_t q0, int64_t bq) {
  const int64_t nq = std::min(bq, len - q0);
  return static_cast<double>(nq) * static_cast<double>(prefix + q0 + nq) + 64.0;
}
[[maybe_unused]] static inline double item_cost(const PrefillItem& item, int64_t bq) {
  return item_cost(item.prefix, item.len, item.q0, bq);
}

// Where a chunk's keys and values are. A fresh chunk (no prefix): context position p is row
// start + p of the step's key/value tensors (any token and head strides). Paged (`tables`
// set; k/v the caches [blocks, block_size, kv_heads, dim]): a chunk with a cached prefix,
// every position through its span's block-table row (write_kv has stored the chunk's own).
template <typename T>
struct ContextRows {
  const T *k = nullptr, *v = nullptr;
  int64_t k_st = 0, k_sh = 0, v_st = 0, v_sh = 0;
  const int32_t* tables = nullptr;
  int64_t table_stride = 0, block_size = 1, kv_heads = 1, dim = 0;
  inline int64_t paged(int64_t span, int64_t kvh, int64_t pos) const {
    const int32_t* t = tables + span * table_stride;
    return ((static_cast<int64_t>(t[pos / block_size]) * block_size + pos % block_size) * kv_heads + kvh) * dim;
  }
  inline const T* key(int64_t span, int64_t start, int64_t kvh, int64_t pos) const {
    return tables ? k + paged(span, kvh, pos) : k + (start + pos) * k_st + kvh * k_sh;
  }
  inline const T* value(int64_t span, int64_t start, int64_t kvh, int64_t pos) const {
    return tables ? v + paged(span, kvh, pos) : v + (start + pos) * v_st + kvh * v_sh;
  }
};

// A buffer of 64-byte aligned lines (tile rows and vectors never straddle two) that grows to
// the largest size asked of it and keeps its contents (none cleared).
template <typename T>
struct Grown {
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T[], Free> data;
  int64_t size = 0;
  T* get(int64_t n) {
    if (n > size) {
      const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
      T* p = static_cast<T*>(std::aligned_alloc(64, bytes));
      TORCH_CHECK(p != nullptr, "prefill scratch: out of memory");
      data.reset(p);
      size = n;
    }
    return data.get();
  }
};
struct PrefillScratch {
  Grown<float> o, s;
  Grown<uint32_t> p, q;
};

// The float32 kernels' panels (chunk_panels) laid out once per call, in parallel: every
// (chunk, KV head)'s keys transposed to [tile][D][BK] at kp and values as [tile][BK][D] at
// vp, zero past the context. widen(src, dst) writes a cache row's D elements to dst as
// float32 (dst 64-byte aligned: each ISA's own vector loads). Each query tile did this for
// itself before (a 200-token prompt's keys ~6.5 times over): 0.80x the AVX-512 kernel's
// time, 0.87-0.90x the AVX2 one's (docs/benchmarks.md, "Kernels: prompt attention").
template <typename cache_t, int64_t D, int64_t BK>
struct FloatPanels {
  static constexpr int64_t TILE = D * BK;  // floats per key (or value) tile
  Panels pl;
  Grown<float> k_tiles, v_tiles;
  float* kp = nullptr;
  float* vp = nullptr;
  template <typename Widen>
  FloatPanels(const int64_t* spans, int64_t num_spans, int64_t cols, int64_t num_kv_heads,
              const ContextRows<cache_t>& rows, Widen widen)
      : pl(chunk_panels(spans, num_spans, cols, num_kv_heads, BK)), kv_heads(num_kv_heads) {
    kp = k_tiles.get(pl.num_tiles * TILE);
    vp = v_tiles.get(pl.num_tiles * TILE);
    parallel_for(0, static_cast<int64_t>(pl.tiles.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const Panel& pn = pl.panels[pl.tiles[i].first];
        const int64_t t = pl.tiles[i].second, k0 = t * BK, kn = std::min(BK, pn.prefix + pn.len - k0);
        float* Kt = kp + (pn.off + t) * TILE;
        float* Vf = vp + (pn.off + t) * TILE;
        std::fill(Kt, Kt + TILE, 0.f);
        for (int64_t c = 0; c < kn; ++c) {
          alignas(64) float tmp[D];
          widen(rows.key(pn.span, pn.start, pn.kvh, k0 + c), tmp);
          widen(rows.value(pn.span, pn.start, pn.kvh, k0 + c), Vf + c * D);
          for (int64_t d = 0; d < D; ++d) Kt[d * BK + c] = tmp[d];
        }
        std::fill(Vf + kn * D, Vf + TILE, 0.f);
      }
    });
  }
  // The key and value tiles an item's chunk and KV head has for context keys [k0, k0 + BK).
  const float* keys(const PrefillItem& item, int64_t k0) const { return kp + tile(item, k0) * TILE; }
  const float* values(const PrefillItem& item, int64_t k0) const { return vp + tile(item, k0) * TILE; }

 private:
  int64_t kv_heads;
  int64_t tile(const PrefillItem& item, int64_t k0) const { return pl.panels[item.span * kv_heads + item.kvh].off + k0 / BK; }
};

#if defined(__AVX512F__)
#include "vec512.h"

namespace {
constexpr int64_t BQ = 16;  // query tokens per work item
constexpr int64_t BK = 32;  // keys per tile (two vectors of scores)
// Keys per softmax pass of the bfloat16 kernel: a work item's scores over them (48 rows x 512
// floats for SmolLM2) stay in L2, and a prompt of up to 512 tokens takes one pass.
constexpr int64_t SPAN = 512;
constexpr int64_t QR = 8;  // query rows per Q.K^T pass of the bfloat16 kernel (16 accumulators)

// The first n of sixteen lanes (none for n <= 0, all for n >= 16).
inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << n) - 1);
}

// Two output rows (nr of them real) of D = NV * 16 floats into registers for P.V, and back.
template <int64_t NV>
inline void load_rows(const float* o, int64_t nr, __m512 (&acc)[2][NV]) {
  for (int64_t rr = 0; rr < 2; ++rr)
    for (int64_t vv = 0; vv < NV; ++vv) acc[rr][vv] = rr < nr ? _mm512_loadu_ps(o + rr * NV * 16 + vv * 16) : _mm512_setzero_ps();
}
template <int64_t NV>
inline void store_rows(float* o, int64_t nr, const __m512 (&acc)[2][NV]) {
  for (int64_t rr = 0; rr < nr; ++rr)
    for (int64_t vv = 0; vv < NV; ++vv) _mm512_storeu_ps(o + rr * NV * 16 + vv * 16, acc[rr][vv]);
}

// One score row of a key tile: keys [last, BK) masked (causal edge, tile end), the online
// softmax's running max m and sum updated, the row's output accumulator rescaled when the
// max moved; p0/p1 get the row's probabilities (zero where masked). The sum stays sixteen
// partial sums (lsum, folded once at the end by row_sum) and the rescale's exp is skipped
// when the max did not move: no horizontal add and no libm call per row and tile.
template <int64_t NV>
inline void softmax_row(const float* sr, int64_t last, float& m, float* lsum, float* orow, __m512& p0, __m512& p1) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __mmask16 v0 = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(last)));
  const __mmask16 v1 = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(last - 16)));
  const __m512 s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), v0, _mm512_loadu_ps(sr));
  const __m512 s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), v1, _mm512_loadu_ps(sr + 16));
  const float mx = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  const float alpha = mx == m ? 1.f : std::exp(m - mx);  // exp(-inf) = 0 on the first tile
  const __m512 mxv = _mm512_set1_ps(mx);
  p0 = _mm512_maskz_mov_ps(v0, exp16(_mm512_sub_ps(s0, mxv)));
  p1 = _mm512_maskz_mov_ps(v1, exp16(_mm512_sub_ps(s1, mxv)));
  _mm512_storeu_ps(lsum, _mm512_fmadd_ps(_mm512_loadu_ps(lsum), _mm512_set1_ps(alpha), _mm512_add_ps(p0, p1)));
  m = mx;
  if (alpha != 1.f) {
    const __m512 av = _mm512_set1_ps(alpha);
    for (int64_t vv = 0; vv < NV; ++vv) _mm512_storeu_ps(orow + vv * 16, _mm512_mul_ps(_mm512_loadu_ps(orow + vv * 16), av));
  }
}

inline float row_sum(const float* lsum) { return _mm512_reduce_add_ps(_mm512_loadu_ps(lsum)); }

template <typename scalar_t, typename cache_t, int64_t NV>
void prefill_kernel(const scalar_t* q, int64_t q_st, int64_t q_sh, const ContextRows<cache_t>& rows, scalar_t* out,
                    const int64_t* spans, int64_t cols, int64_t num_spans, int64_t num_heads, int64_t num_kv_heads,
                    float scale) {
  constexpr int64_t D = NV * 16;
  const int64_t G = num_heads / num_kv_heads;
  const int64_t rows_max = (BQ * G + 3) / 4 * 4;
  const std::vector<PrefillItem> items = prefill_items(spans, num_spans, cols, num_kv_heads, BQ);
  const FloatPanels<cache_t, D, BK> panels(spans, num_spans, cols, num_kv_heads, rows, [](const cache_t* src, float* dst) {
    for (int64_t vv = 0; vv < NV; ++vv) _mm512_store_ps(dst + vv * 16, load16(src + vv * 16));
  });
  parallel_by_cost(static_cast<int64_t>(items.size()), [&](int64_t i) { return item_cost(items[i], BQ); },
                   [&](int64_t begin, int64_t end) {
    std::vector<float> Qf(rows_max * D), O(rows_max * D), S(rows_max * BK);
    std::vector<float> m(rows_max), l(rows_max * 16);
    for (int64_t it = begin; it < end; ++it) {
      const PrefillItem& item = items[it];
      const int64_t nq = std::min(BQ, item.len - item.q0);
      const int64_t R = nq * G, Rp = (R + 3) / 4 * 4;
      // query rows r = i * G + g (token i of the tile, head g of the KV head's group), pre-scaled
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const scalar_t* src = q + (item.start + item.q0 + i) * q_st + (item.kvh * G + g) * q_sh;
          float* dst = Qf.data() + (i * G + g) * D;
          for (int64_t vv = 0; vv < NV; ++vv)
            _mm512_storeu_ps(dst + vv * 16, _mm512_mul_ps(load16(src + vv * 16), _mm512_set1_ps(scale)));
        }
      std::fill(Qf.begin() + R * D, Qf.begin() + Rp * D, 0.f);
      std::fill(O.begin(), O.begin() + Rp * D, 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t kend = item.prefix + item.q0 + nq;  // keys [0, kend): the tile's last token sees them all
      for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int64_t kn = std::min(BK, kend - k0);
        // the key tile transposed to [D][BK], the value tile as [BK][D] (laid out above): the
        // tile's keys past kn are zeros there, or the context's next keys, which the causal
        // mask below never lets through
        const float* Kt = panels.keys(item, k0);
        const float* Vf = panels.values(item, k0);
        // S = Q K^T: four rows x 32 keys per pass
        for (int64_t r0 = 0; r0 < Rp; r0 += 4) {
          __m512 a[4][2];
          for (auto& row : a) row[0] = row[1] = _mm512_setzero_ps();
          const float* qr = Qf.data() + r0 * D;
          for (int64_t d = 0; d < D; ++d) {
            const __m512 k0v = _mm512_loadu_ps(Kt + d * BK), k1v = _mm512_loadu_ps(Kt + d * BK + 16);
            for (int64_t rr = 0; rr < 4; ++rr) {
              const __m512 qb = _mm512_set1_ps(qr[rr * D + d]);
              a[rr][0] = _mm512_fmadd_ps(qb, k0v, a[rr][0]);
              a[rr][1] = _mm512_fmadd_ps(qb, k1v, a[rr][1]);
            }
          }
          for (int64_t rr = 0; rr < 4; ++rr) {
            _mm512_storeu_ps(S.data() + (r0 + rr) * BK, a[rr][0]);
            _mm512_storeu_ps(S.data() + (r0 + rr) * BK + 16, a[rr][1]);
          }
        }
        // causal mask and online softmax, row by row
        for (int64_t r = 0; r < R; ++r) {
          float* sr = S.data() + r * BK;
          __m512 p0, p1;
          softmax_row<NV>(sr, std::min(kn, item.prefix + item.q0 + r / G - k0 + 1), m[r], l.data() + r * 16, O.data() + r * D,
                          p0, p1);
          _mm512_storeu_ps(sr, p0);
          _mm512_storeu_ps(sr + 16, p1);
        }
        // O += P V: two rows per pass, the value row loaded once for both
        for (int64_t r0 = 0; r0 < R; r0 += 2) {
          const int64_t nr = std::min<int64_t>(2, R - r0);
          __m512 acc[2][NV];
          load_rows<NV>(O.data() + r0 * NV * 16, nr, acc);
          for (int64_t c = 0; c < kn; ++c) {
            __m512 vrow[NV];
            for (int64_t vv = 0; vv < NV; ++vv) vrow[vv] = _mm512_loadu_ps(Vf + c * D + vv * 16);
            for (int64_t rr = 0; rr < 2; ++rr) {
              const __m512 p = _mm512_set1_ps(S[(r0 + rr) * BK + c]);
              for (int64_t vv = 0; vv < NV; ++vv) acc[rr][vv] = _mm512_fmadd_ps(p, vrow[vv], acc[rr][vv]);
            }
          }
          store_rows<NV>(O.data() + r0 * NV * 16, nr, acc);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r / G, g = r % G;
        const __m512 inv = _mm512_set1_ps(1.f / row_sum(l.data() + r * 16));
        alignas(64) float tmp[D];
        for (int64_t vv = 0; vv < NV; ++vv)
          _mm512_store_ps(tmp + vv * 16, _mm512_mul_ps(_mm512_loadu_ps(O.data() + r * D + vv * 16), inv));
        scalar_t* dst = out + ((item.start + item.q0 + i) * num_heads + item.kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(tmp[d]);
      }
    }
  });
}
#if defined(__AVX512BF16__)
// Sixteen rows of sixteen 32-bit words transposed in place: r[j] becomes column j.
inline void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (r_i, r_i+1) elements 4k, 4k+1 / 4k+2, 4k+3
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + e], lane k: rows g..g+3, element 4k + e
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // 128-bit lanes: column 4k + e = lane k of u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// One bfloat16 key/value tile laid out for prefill_kernel_bf16 in whole vectors: keys as
// [D/2][BK] pairs of dimensions (16 x 16 word transposes), values as [BK/2][D] pairs of keys
// (two rows interleaved by vpermt2w); rows at and past kn written as zeros. key(c), value(c):
// the tile's row c. Eight times fewer instructions than element by element.
template <int64_t NV, typename K, typename V>
inline void lay_out_tile_bf16(K&& key, V&& value, int64_t kn, uint32_t* kt, uint16_t* vt) {
  constexpr int64_t D = NV * 16, DP = D / 2;
  for (int64_t c0 = 0; c0 < BK; c0 += 16)
    for (int64_t j = 0; j < DP; j += 16) {
      __m512i r[16];
      for (int64_t c = 0; c < 16; ++c)
        r[c] = c0 + c < kn ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(key(c0 + c)) + j) : _mm512_setzero_si512();
      transpose16x16(r);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(kt + (j + p) * BK + c0, r[p]);
    }
  alignas(64) static constexpr uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t c = 0; c < BK; c += 2) {
    uint16_t* dst = vt + c * D;  // pair c / 2: D word pairs
    for (int64_t i = 0; i < D; i += 32) {
      const __m512i x = c < kn ? _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(value(c)) + i) : _mm512_setzero_si512();
      const __m512i y = c + 1 < kn ? _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(value(c + 1)) + i)
                                   : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * i, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(dst + 2 * i + 32, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// A cache element's value as bfloat16 bits (exact for float8 e4m3).
static inline uint16_t bf16_bits(c10::Float8_e4m3fn x) { return c10::BFloat16(static_cast<float>(x)).x; }


// bfloat16 on CPUs with AVX512-BF16: Q.K^T and P.V as bf16 dot products (vdpbf16ps, two
// products per float32 lane and instruction, half the instructions of float32 FMAs), with
// each chunk's keys and values laid out once per (chunk, KV head) before the work items
// run, instead of once per query tile: keys as [tile][D/2][BK] pairs of dimensions, values
// as [tile][BK/2][D] pairs of keys. P is rounded to bfloat16 for P.V, as GPU flash kernels
// do; the softmax's maximum and sum stay float32. A chunk with a cached prefix (ContextRows
// paged) lays out its whole context, prefix included, from the cache (a float8 cache's values
// widened exactly).
//
// A work item takes its keys SPAN (512) at a time in three passes: every score of the span
// (eight query rows a pass, each row only as far as its causal edge, to the half tile), then
// each row's softmax against a reference kept from span to span (below), then P.V four rows a
// pass, each block only over the keys its last row sees. With AMX tiles the first two are one
// pass: a sixteen-row block's softmax runs one 32-key tile behind its Q.K^T. Against one
// 32-key tile at a time through all three steps (the kernel before): 0.85x
// the time on ten 200-token prompts (docs/benchmarks.md, "Kernels: prompt attention").
template <typename cache_t, int64_t NV, bool AMX>
void prefill_kernel_bf16(const c10::BFloat16* q, int64_t q_st, int64_t q_sh, const ContextRows<cache_t>& rows,
                         c10::BFloat16* out, const int64_t* spans, int64_t cols, int64_t num_spans, int64_t num_heads,
                         int64_t num_kv_heads, float scale) {
  constexpr int64_t D = NV * 16, DP = D / 2, TILE = DP * BK;  // uint32 per key tile = uint16 pairs per value tile
  // rows per P.V pass: 16 accumulators, or one AMX tile's sixteen rows
  constexpr int64_t PR = AMX ? 16 : NV <= 4 ? 4 : 2;
  constexpr int64_t RB = AMX ? 16 : QR;  // rows per Q.K^T pass
  const int64_t G = num_heads / num_kv_heads;
  const int64_t rows_max = (BQ * G + RB - 1) / RB * RB;
  // each (chunk, KV head)'s tiles in the laid-out key and value tiles (kp, vp) from its off
  const Panels pl = chunk_panels(spans, num_spans, cols, num_kv_heads, BK);
  const std::vector<Panel>& panels = pl.panels;
  const std::vector<std::pair<int64_t, int64_t>>& tiles = pl.tiles;
  const int64_t num_tiles = pl.num_tiles;
  // not zeroed: the layout below writes every word of every tile (zeros past the context)
  // (64-byte aligned: every tile row one line)
  Grown<uint32_t> k_tiles, v_tiles;
  uint32_t* const kp = k_tiles.get(num_tiles * TILE);
  uint32_t* const vp = v_tiles.get(num_tiles * TILE);
  parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Panel& pn = panels[tiles[i].first];
      const int64_t t = tiles[i].second, k0 = t * BK, kn = std::min(BK, pn.prefix + pn.len - k0);
      uint32_t* kt = kp + (pn.off + t) * TILE;
      uint16_t* vt = reinterpret_cast<uint16_t*>(vp + (pn.off + t) * TILE);
      if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {  // whole vectors, zeros past kn
        lay_out_tile_bf16<NV>([&](int64_t c) { return rows.key(pn.span, pn.start, pn.kvh, k0 + c); },
                              [&](int64_t c) { return rows.value(pn.span, pn.start, pn.kvh, k0 + c); }, kn, kt, vt);
      } else {
        std::fill(kt, kt + TILE, 0u);
        std::fill(vt, vt + 2 * TILE, uint16_t{0});
        for (int64_t c = 0; c < kn; ++c) {  // a float8 cache: every e4m3 value is a bfloat16 too
          uint16_t* dst = vt + (c / 2) * 2 * D + (c % 2);
          const cache_t* kr = rows.key(pn.span, pn.start, pn.kvh, k0 + c);
          const cache_t* vr = rows.value(pn.span, pn.start, pn.kvh, k0 + c);
          for (int64_t p = 0; p < DP; ++p)
            kt[p * BK + c] = bf16_bits(kr[2 * p]) | (static_cast<uint32_t>(bf16_bits(kr[2 * p + 1])) << 16);
          for (int64_t d = 0; d < D; ++d) dst[2 * d] = bf16_bits(vr[d]);
        }
      }
    }
  });
  struct Item { int64_t panel, q0; };
  std::vector<Item> items;
  for (int64_t pi = 0; pi < static_cast<int64_t>(panels.size()); ++pi) {
    const int64_t n = (panels[pi].len + BQ - 1) / BQ;
    for (int64_t z = 0; z < n; ++z) items.push_back({pi, ((z % 2 == 0) ? z / 2 : n - 1 - z / 2) * BQ});
  }
  parallel_by_cost(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Panel& pn = panels[items[i].panel];
    return item_cost(pn.prefix, pn.len, items[i].q0, BQ);
  }, [&](int64_t begin, int64_t end) {
    // A thread's buffers, kept from call to call (growing only) and never cleared: every word
    // is written before it is read. As vectors made per piece of work (several a call, each
    // thread, with stealing) their zero-filling and the Q rows' copies through memmove came to
    // ~14 % of this kernel's time on ten 200-token prompts.
    thread_local PrefillScratch scratch;
    float* const O = scratch.o.get(rows_max * D);
    float* const S = scratch.s.get(rows_max * SPAN);
    uint32_t* const P = scratch.p.get(rows_max * SPAN / 2);
    std::vector<float> m(rows_max), l(rows_max);
    std::vector<int64_t> vis(rows_max);
    std::vector<const uint32_t*> qrow(rows_max);
    alignas(64) static const uint32_t zero_row[64] = {};  // DP <= 64
    const __m512 ninf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
    // AMX: the item's query rows side by side (an A tile's rows are one stride apart)
    uint32_t* const Qt = AMX ? scratch.q.get(rows_max * DP) : nullptr;
#if FERRY_PREFILL_AMX
    if constexpr (AMX) amx_configure();
#endif
    // item it's query row for token i, head g of its KV head's group
    const auto query_row = [&](int64_t it, int64_t i, int64_t g) {
      const Panel& pn = panels[items[it].panel];
      return reinterpret_cast<const uint32_t*>(q + (pn.start + items[it].q0 + i) * q_st + (pn.kvh * G + g) * q_sh);
    };
    for (int64_t it = begin; it < end; ++it) {
      const Panel& pn = panels[items[it].panel];
      const int64_t q0 = items[it].q0, nq = std::min(BQ, pn.len - q0);
      const int64_t R = nq * G, Rp = (R + RB - 1) / RB * RB;
      for (int64_t i = 0, r = 0; i < nq; ++i)  // row r = i * G + g: token i of the tile, head g of the KV head's group
        for (int64_t g = 0; g < G; ++g, ++r) {
          qrow[r] = query_row(it, i, g);
          vis[r] = pn.prefix + q0 + i + 1;  // row r sees context keys [0, vis[r])
        }
      for (int64_t r = R; r < Rp; ++r) qrow[r] = zero_row;
      // The next item's query rows requested now, so that its copy below does not wait on them
      // (a step's queries, 2.4 MB at 2,048 tokens, are read a tile of tokens and a KV head at a
      // time: the copy's loads missed the caches, ~12 % of this pass's samples).
      if (it + 1 < end) {
        const int64_t nq1 = std::min(BQ, panels[items[it + 1].panel].len - items[it + 1].q0);
        for (int64_t i = 0; i < nq1; ++i)
          for (int64_t g = 0; g < G; ++g)
            for (int64_t b = 0; b < DP * 4; b += 64) _mm_prefetch(reinterpret_cast<const char*>(query_row(it + 1, i, g)) + b, _MM_HINT_T0);
      }
      if constexpr (AMX)  // a row is NV / 2 vectors
        for (int64_t r = 0; r < Rp; ++r)
          for (int64_t v = 0; v < NV / 2; ++v)
            _mm512_store_si512(Qt + r * DP + 16 * v, _mm512_loadu_si512(qrow[r] + 16 * v));
      else  // the AMX products start O from zero tiles in the first span
        std::fill(O, O + Rp * D, 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t kend = pn.prefix + q0 + nq;  // the tile's last query sees every key before it
      for (int64_t K0 = 0; K0 < kend; K0 += SPAN) {
        const int64_t kspan = std::min(SPAN, kend - K0);
        // row r's visible keys in this span: [0, lim(r))
        const auto lim = [&](int64_t r) { return std::clamp<int64_t>(vis[r] - K0, 0, kspan); };
        // Each probability is 2^(s c - ref c), c the scale times log2(e) (S is unscaled;
        // scale > 0): one FMA into exp2_16's base-2 units, a polynomial of degree 4 since P is
        // rounded to bfloat16 next. ref need not be the max: P, the sum l and O all hold
        // float32's (and bfloat16's) exponent range, so a row keeps the reference it has (its
        // first span: the max of its first 32 keys) as long as its span's sum stays under 2^64,
        // which any score more than 2^64 past the reference breaks (a row of many scores just
        // under that is caught too: correct, and rare); a row past it is done again against its
        // true max. So a span needs no pass over its scores for their max nor O a rescale. The
        // softmax was half of this kernel's time on 2,000-token prompts, its max pass a fifth of
        // that (perf; docs/benchmarks.md, "Kernels: prompt attention").
        const float c = scale * 1.4426950408889634f;
        const __m512 cv = _mm512_set1_ps(c);
        constexpr float HEADROOM = 0x1p64f;  // a span's row sum past which the row is redone
        // row r's probabilities for keys [k, k + BK) of the span against mc = ref c, as
        // bfloat16 pairs of keys (zeros at and past its n visible keys), into sum
        const auto prob_tile = [&](int64_t r, int64_t n, int64_t k, __m512 mc, __m512& sum) {
          const float* sr = S + r * SPAN;
          __m512 p0 = zero, p1 = zero;
          if (k < n) {
            const __mmask16 v0 = lanes_below(n - k), v1 = lanes_below(n - k - 16);
            p0 = exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(v0, sr + k), cv, mc), v0);
            if (v1) p1 = exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(v1, sr + k + 16), cv, mc), v1);
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
          }
          _mm512_storeu_si512(P + r * (SPAN / 2) + k / 2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        };
        // the max of row r's first visible keys in its first tile (its first span's reference)
        const auto first_ref = [&](int64_t r, int64_t n) {
          const float* sr = S + r * SPAN;
          return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_loadu_ps(ninf, lanes_below(n), sr),
                                                    _mm512_mask_loadu_ps(ninf, lanes_below(n - 16), sr + 16)));
        };
        // row r's span done against ref (P, its sum): a row whose sum passed HEADROOM (or
        // overflowed) is done again against its true max. Then l, m and O take the span (O
        // rescaled when ref moved).
        const auto finish_row = [&](int64_t r, int64_t n, int64_t fill, float ref, __m512 sum) {
          float total = _mm512_reduce_add_ps(sum);
          if (!(total <= HEADROOM)) {
            const float* sr = S + r * SPAN;
            __m512 mx = ninf;
            for (int64_t k = 0; k < n; k += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, lanes_below(n - k), sr + k));
            ref = std::max(ref, _mm512_reduce_max_ps(mx));
            const __m512 mc = _mm512_set1_ps(ref * c);
            sum = zero;
            for (int64_t k = 0; k < fill; k += BK) prob_tile(r, n, k, mc, sum);
            total = _mm512_reduce_add_ps(sum);
          }
          // exp(-inf) = 0 on the first span (no libm call for it)
          const float alpha = ref == m[r] ? 1.f : m[r] == -INFINITY ? 0.f : std::exp2((m[r] - ref) * c);
          m[r] = ref;
          l[r] = l[r] * alpha + total;
          if (alpha != 1.f && !(AMX && K0 == 0)) {  // AMX: the first span's P.V starts from zero tiles
            const __m512 av = _mm512_set1_ps(alpha);
            for (int64_t vv = 0; vv < NV; ++vv)
              _mm512_storeu_ps(O + r * D + vv * 16, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + vv * 16), av));
          }
        };
        // S = Q K^T (unscaled: the softmax scales it as it loads it), then P.
#if FERRY_PREFILL_AMX
        if constexpr (AMX) {
          // Sixteen rows (one A tile per 32 dimensions) against 32 keys a pass: two C tiles,
          // a key tile's laid-out pairs of dimensions being B tiles as they are (a scaling pass
          // of its own here read each tile store straight back, ~9 % of the kernel's time).
          // The softmax follows one key tile behind: the block's rows over tile k - 32 are
          // computed in the vector units while the tile unit multiplies tile k (independent
          // instructions, close enough in program order for the core to overlap them), where
          // a pass of products and then a pass of softmax left each unit idle half the time.
          for (int64_t r0 = 0; r0 < Rp; r0 += 16) {
            const int64_t re = std::min(r0 + 16, R);  // the block's rows that exist
            const int64_t qend = lim(re - 1);  // the keys the block's last row sees
            const uint32_t* qa = Qt + r0 * DP;
            if (qend == 0) continue;  // none of its rows sees a key of this span
            if constexpr (NV == 4) {
              _tile_loadd(2, qa, DP * 4);
              _tile_loadd(5, qa + 16, DP * 4);
            }
            __m512 sums[16];
            float refs[16];
            int64_t ns[16];
            for (int64_t r = r0; r < re; ++r) {
              sums[r - r0] = zero;
              refs[r - r0] = m[r];
              ns[r - r0] = lim(r);
            }
            for (int64_t k = 0; k < qend + BK; k += BK) {
              if (k < qend) {
                const uint32_t* kt = kp + (pn.off + (K0 + k) / BK) * TILE;
                _tile_zero(0);
                _tile_zero(1);
                if constexpr (NV == 4) {
                  _tile_loadd(3, kt, BK * 4);
                  _tile_loadd(4, kt + 16, BK * 4);
                  _tile_loadd(6, kt + 16 * BK, BK * 4);
                  _tile_loadd(7, kt + 16 * BK + 16, BK * 4);
                  _tile_dpbf16ps(0, 2, 3);
                  _tile_dpbf16ps(1, 2, 4);
                  _tile_dpbf16ps(0, 5, 6);
                  _tile_dpbf16ps(1, 5, 7);
                } else {
                  for (int64_t ks = 0; ks < DP / 16; ++ks) {
                    _tile_loadd(2, qa + ks * 16, DP * 4);
                    _tile_loadd(3, kt + ks * 16 * BK, BK * 4);
                    _tile_loadd(4, kt + ks * 16 * BK + 16, BK * 4);
                    _tile_dpbf16ps(0, 2, 3);
                    _tile_dpbf16ps(1, 2, 4);
                  }
                }
                float* s = S + r0 * SPAN + k;
                _tile_stored(0, s, SPAN * 4);
                _tile_stored(1, s + 16, SPAN * 4);
              }
              if (k == 0) continue;
              const int64_t kk = k - BK;  // the tile the softmax takes now
              for (int64_t r = r0; r < re; ++r) {
                const int64_t j = r - r0;
                if (kk == 0 && refs[j] == -INFINITY) refs[j] = first_ref(r, ns[j]);  // first span: n >= 1
                prob_tile(r, ns[j], kk, _mm512_set1_ps(refs[j] * c), sums[j]);
              }
            }
            const int64_t fill = (qend + BK - 1) / BK * BK;
            for (int64_t r = r0; r < re; ++r) {
              const int64_t j = r - r0;
              finish_row(r, ns[j], fill, refs[j], sums[j]);
            }
          }
        } else
#endif
        {
          for (int64_t r0 = 0; r0 < Rp; r0 += QR) {
            const int64_t qend = lim(std::min(r0 + QR - 1, R - 1));
            const uint32_t* const* qr = qrow.data() + r0;
            for (int64_t k = 0; k < qend; k += BK) {
              const uint32_t* kt = kp + (pn.off + (K0 + k) / BK) * TILE;
              float* s = S + r0 * SPAN + k;
              if (qend - k > 16) {
                __m512 a[QR][2];
                for (auto& row : a) row[0] = row[1] = _mm512_setzero_ps();
                for (int64_t p = 0; p < DP; ++p) {
                  const __m512bh k0v = (__m512bh)_mm512_loadu_si512(kt + p * BK);
                  const __m512bh k1v = (__m512bh)_mm512_loadu_si512(kt + p * BK + 16);
                  for (int64_t rr = 0; rr < QR; ++rr) {
                    const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[rr][p]));
                    a[rr][0] = _mm512_dpbf16_ps(a[rr][0], qb, k0v);
                    a[rr][1] = _mm512_dpbf16_ps(a[rr][1], qb, k1v);
                  }
                }
                for (int64_t rr = 0; rr < QR; ++rr) {
                  _mm512_storeu_ps(s + rr * SPAN, a[rr][0]);
                  _mm512_storeu_ps(s + rr * SPAN + 16, a[rr][1]);
                }
              } else {
                __m512 a[QR];
                for (auto& row : a) row = _mm512_setzero_ps();
                for (int64_t p = 0; p < DP; ++p) {
                  const __m512bh k0v = (__m512bh)_mm512_loadu_si512(kt + p * BK);
                  for (int64_t rr = 0; rr < QR; ++rr)
                    a[rr] = _mm512_dpbf16_ps(a[rr], (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[rr][p])), k0v);
                }
                for (int64_t rr = 0; rr < QR; ++rr) _mm512_storeu_ps(s + rr * SPAN, a[rr]);
              }
            }
          }
          // softmax row by row over the keys it sees, P zero past them up to what its P.V pass
          // reads
          for (int64_t r = 0; r < R; ++r) {
            const int64_t n = lim(r), fill = (lim(std::min(r - r % PR + PR - 1, R - 1)) + BK - 1) / BK * BK;
            float ref = m[r];
            if (ref == -INFINITY && n > 0) ref = first_ref(r, n);
            const __m512 mc = _mm512_set1_ps(ref * c);
            __m512 sum = zero;
            for (int64_t k = 0; k < fill; k += BK) prob_tile(r, n, k, mc, sum);
            finish_row(r, n, fill, ref, sum);
          }
        }
        // O += P V: PR rows at a time over the keys the last of them sees, two keys per
        // instruction; a panel's value tiles are contiguous, so its key pairs run on across tiles
        const uint32_t* vspan = vp + (pn.off + K0 / BK) * TILE;
#if FERRY_PREFILL_AMX
        if constexpr (AMX) {
          // sixteen rows of P (an A tile: 32 keys) against value pairs (B tiles: 16 dimensions
          // each), four C tiles of O at a time, over the keys the block's last row sees
          for (int64_t r0 = 0; r0 < R; r0 += 16) {
            const int64_t nr = std::min<int64_t>(16, R - r0), kn = (lim(r0 + nr - 1) + BK - 1) / BK * BK;
            if (kn == 0) continue;
            float* o = O + r0 * D;
            const uint32_t* pa = P + r0 * (SPAN / 2);
            for (int64_t dg = 0; dg < NV; dg += 4) {
              if (K0 == 0) {  // every row of the block sees key 0: the whole block is written below
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
              } else {
                _tile_loadd(0, o + dg * 16, D * 4);
                _tile_loadd(1, o + dg * 16 + 16, D * 4);
                _tile_loadd(2, o + dg * 16 + 32, D * 4);
                _tile_loadd(3, o + dg * 16 + 48, D * 4);
              }
              for (int64_t kc = 0; kc < kn; kc += BK) {
                const uint32_t* vb = vspan + (kc / 2) * D + dg * 16;
                _tile_loadd(4, pa + kc / 2, SPAN * 2);
                _tile_loadd(5, vb, D * 4);
                _tile_loadd(6, vb + 16, D * 4);
                _tile_loadd(7, vb + 32, D * 4);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(5, vb + 48, D * 4);
                _tile_dpbf16ps(1, 4, 6);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 4, 5);
              }
              _tile_stored(0, o + dg * 16, D * 4);
              _tile_stored(1, o + dg * 16 + 16, D * 4);
              _tile_stored(2, o + dg * 16 + 32, D * 4);
              _tile_stored(3, o + dg * 16 + 48, D * 4);
            }
          }
        } else
#endif
        for (int64_t r0 = 0; r0 < R; r0 += PR) {
          const int64_t nr = std::min<int64_t>(PR, R - r0), pairs = (lim(r0 + nr - 1) + 1) / 2;
          if (pairs == 0) continue;
          __m512 acc[PR][NV];
          for (int64_t rr = 0; rr < PR; ++rr)
            for (int64_t vv = 0; vv < NV; ++vv) acc[rr][vv] = _mm512_loadu_ps(O + (r0 + rr) * D + vv * 16);
          const uint32_t* pr = P + r0 * (SPAN / 2);
          for (int64_t cp = 0; cp < pairs; ++cp) {
            __m512bh vrow[NV];
            for (int64_t vv = 0; vv < NV; ++vv) vrow[vv] = (__m512bh)_mm512_loadu_si512(vspan + cp * D + vv * 16);
            for (int64_t rr = 0; rr < PR; ++rr) {
              const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[rr * (SPAN / 2) + cp]));
              for (int64_t vv = 0; vv < NV; ++vv) acc[rr][vv] = _mm512_dpbf16_ps(acc[rr][vv], pb, vrow[vv]);
            }
          }
          for (int64_t rr = 0; rr < nr; ++rr)
            for (int64_t vv = 0; vv < NV; ++vv) _mm512_storeu_ps(O + (r0 + rr) * D + vv * 16, acc[rr][vv]);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r / G, g = r % G;
        const __m512 inv = _mm512_set1_ps(1.f / l[r]);
        c10::BFloat16* dst = out + ((pn.start + q0 + i) * num_heads + pn.kvh * G + g) * D;
        for (int64_t vv = 0; vv < NV; ++vv) store16(dst + vv * 16, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + vv * 16), inv));
      }
    }
#if FERRY_PREFILL_AMX
    if constexpr (AMX) _tile_release();
#endif
  });
}
#endif
}  // namespace

// One call of the kernel this build has for scalar_t: bfloat16 through AVX512-BF16 dot
// products where the CPU has them and bf16_dot (else float32 FMAs).
template <typename scalar_t, typename cache_t>
void run_prefill(const scalar_t* q, int64_t q_st, int64_t q_sh, const ContextRows<cache_t>& rows, scalar_t* out,
                 const int64_t* spans, int64_t cols, int64_t num_spans, int64_t heads, int64_t kv_heads, int64_t dim,
                 float scale, bool bf16_dot) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (bf16_dot) {
#if FERRY_PREFILL_AMX
      if (g_prefill_amx && amx_permitted()) {
        auto kernel = dim == 64 ? prefill_kernel_bf16<cache_t, 4, true> : prefill_kernel_bf16<cache_t, 8, true>;
        return kernel(q, q_st, q_sh, rows, out, spans, cols, num_spans, heads, kv_heads, scale);
      }
#endif
      auto kernel = dim == 64 ? prefill_kernel_bf16<cache_t, 4, false> : prefill_kernel_bf16<cache_t, 8, false>;
      return kernel(q, q_st, q_sh, rows, out, spans, cols, num_spans, heads, kv_heads, scale);
    }
  }
#endif
  auto kernel = dim == 64 ? prefill_kernel<scalar_t, cache_t, 4> : prefill_kernel<scalar_t, cache_t, 8>;
  kernel(q, q_st, q_sh, rows, out, spans, cols, num_spans, heads, kv_heads, scale);
}
bool prefill_attention_available() { return true; }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "vec256.h"

namespace {
constexpr int64_t BQ = 16;  // query tokens per work item
constexpr int64_t BK = 16;  // keys per tile (two vectors of scores)

// The AVX-512 kernel's scheme (above) in eight-lane vectors, for CPUs without AVX-512: every
// dtype in float32 FMAs. S = Q K^T four rows x 16 keys per pass (8 accumulators); O += P V
// two rows x 32 output elements per pass (8 accumulators), the value tile from L1; keys and
// values laid out once per call (FloatPanels).
template <typename scalar_t, typename cache_t, int64_t NV>
void prefill_kernel8(const scalar_t* q, int64_t q_st, int64_t q_sh, const ContextRows<cache_t>& rows, scalar_t* out,
                     const int64_t* spans, int64_t cols, int64_t num_spans, int64_t num_heads, int64_t num_kv_heads,
                     float scale) {
  constexpr int64_t D = NV * 8, CH = 4;
  static_assert(NV % CH == 0, "head size a multiple of 32");
  const int64_t G = num_heads / num_kv_heads;
  const int64_t rows_max = (BQ * G + 3) / 4 * 4;
  const std::vector<PrefillItem> items = prefill_items(spans, num_spans, cols, num_kv_heads, BQ);
  const FloatPanels<cache_t, D, BK> panels(spans, num_spans, cols, num_kv_heads, rows, [](const cache_t* src, float* dst) {
    for (int64_t vv = 0; vv < NV; ++vv) _mm256_store_ps(dst + vv * 8, load8(src + vv * 8));
  });
  parallel_by_cost(static_cast<int64_t>(items.size()), [&](int64_t i) { return item_cost(items[i], BQ); },
                   [&](int64_t begin, int64_t end) {
    std::vector<float> Qf(rows_max * D), O(rows_max * D), S(rows_max * BK);
    std::vector<float> m(rows_max), l(rows_max);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t it = begin; it < end; ++it) {
      const PrefillItem& item = items[it];
      const int64_t nq = std::min(BQ, item.len - item.q0);
      const int64_t R = nq * G, Rp = (R + 3) / 4 * 4;
      // query rows r = i * G + g (token i of the tile, head g of the KV head's group), pre-scaled
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const scalar_t* src = q + (item.start + item.q0 + i) * q_st + (item.kvh * G + g) * q_sh;
          float* dst = Qf.data() + (i * G + g) * D;
          for (int64_t vv = 0; vv < NV; ++vv) _mm256_storeu_ps(dst + vv * 8, _mm256_mul_ps(load8(src + vv * 8), sc));
        }
      std::fill(Qf.begin() + R * D, Qf.begin() + Rp * D, 0.f);
      std::fill(O.begin(), O.begin() + Rp * D, 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t kend = item.prefix + item.q0 + nq;  // keys [0, kend) of the context
      for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        const int64_t kn = std::min(BK, kend - k0);
        // the key tile transposed to [D][BK], the value tile as [BK][D] (laid out above): keys
        // past kn are zeros or the context's next keys, which the causal mask never lets through
        const float* Kt = panels.keys(item, k0);
        const float* Vf = panels.values(item, k0);
        for (int64_t r0 = 0; r0 < Rp; r0 += 4) {
          __m256 a[4][2];
          for (auto& row : a) row[0] = row[1] = _mm256_setzero_ps();
          const float* qr = Qf.data() + r0 * D;
          for (int64_t d = 0; d < D; ++d) {
            const __m256 k0v = _mm256_load_ps(Kt + d * BK), k1v = _mm256_load_ps(Kt + d * BK + 8);
            for (int64_t rr = 0; rr < 4; ++rr) {
              const __m256 qb = _mm256_broadcast_ss(qr + rr * D + d);
              a[rr][0] = _mm256_fmadd_ps(qb, k0v, a[rr][0]);
              a[rr][1] = _mm256_fmadd_ps(qb, k1v, a[rr][1]);
            }
          }
          for (int64_t rr = 0; rr < 4; ++rr) {
            _mm256_storeu_ps(S.data() + (r0 + rr) * BK, a[rr][0]);
            _mm256_storeu_ps(S.data() + (r0 + rr) * BK + 8, a[rr][1]);
          }
        }
        // causal mask and online softmax, row by row: keys [last, BK) masked
        for (int64_t r = 0; r < R; ++r) {
          float* sr = S.data() + r * BK;
          const int64_t last = std::min(kn, item.prefix + item.q0 + r / G - k0 + 1);
          const __m256i lastv = _mm256_set1_epi32(static_cast<int>(last));
          const __m256 v0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lastv, lane));
          const __m256 v1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lastv, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
          const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr), v0);
          const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr + 8), v1);
          const float mx = std::max(m[r], hmax8(_mm256_max_ps(s0, s1)));
          const float alpha = std::exp(m[r] - mx);  // exp(-inf) = 0 on the first tile
          const __m256 mxv = _mm256_set1_ps(mx);
          const __m256 p0 = exp8(_mm256_sub_ps(s0, mxv)), p1 = exp8(_mm256_sub_ps(s1, mxv));  // masked: 0
          l[r] = l[r] * alpha + hadd8(_mm256_add_ps(p0, p1));
          m[r] = mx;
          if (alpha != 1.f) {
            const __m256 av = _mm256_set1_ps(alpha);
            float* orow = O.data() + r * D;
            for (int64_t vv = 0; vv < NV; ++vv) _mm256_storeu_ps(orow + vv * 8, _mm256_mul_ps(_mm256_loadu_ps(orow + vv * 8), av));
          }
          _mm256_storeu_ps(sr, p0);
          _mm256_storeu_ps(sr + 8, p1);
        }
        // O += P V: two rows x CH vectors per pass, each value vector loaded once for both rows
        for (int64_t r0 = 0; r0 < R; r0 += 2) {
          const int64_t nr = std::min<int64_t>(2, R - r0);
          for (int64_t c = 0; c < NV; c += CH) {
            __m256 acc[2][CH];
            for (int64_t rr = 0; rr < 2; ++rr)
              for (int64_t vv = 0; vv < CH; ++vv)
                acc[rr][vv] = rr < nr ? _mm256_loadu_ps(O.data() + (r0 + rr) * D + (c + vv) * 8) : _mm256_setzero_ps();
            for (int64_t key = 0; key < kn; ++key) {
              const __m256 p0 = _mm256_broadcast_ss(S.data() + r0 * BK + key);
              const __m256 p1 = _mm256_broadcast_ss(S.data() + (r0 + nr - 1) * BK + key);  // nr = 1: row r0 again
              for (int64_t vv = 0; vv < CH; ++vv) {
                const __m256 x = _mm256_load_ps(Vf + key * D + (c + vv) * 8);
                acc[0][vv] = _mm256_fmadd_ps(p0, x, acc[0][vv]);
                acc[1][vv] = _mm256_fmadd_ps(p1, x, acc[1][vv]);
              }
            }
            for (int64_t rr = 0; rr < nr; ++rr)
              for (int64_t vv = 0; vv < CH; ++vv) _mm256_storeu_ps(O.data() + (r0 + rr) * D + (c + vv) * 8, acc[rr][vv]);
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r / G, g = r % G;
        const __m256 inv = _mm256_set1_ps(1.f / l[r]);
        scalar_t* dst = out + ((item.start + item.q0 + i) * num_heads + item.kvh * G + g) * D;
        for (int64_t vv = 0; vv < NV; ++vv) store8(dst + vv * 8, _mm256_mul_ps(_mm256_loadu_ps(O.data() + r * D + vv * 8), inv));
      }
    }
  });
}
}  // namespace

template <typename scalar_t, typename cache_t>
void run_prefill(const scalar_t* q, int64_t q_st, int64_t q_sh, const ContextRows<cache_t>& rows, scalar_t* out,
                 const int64_t* spans, int64_t cols, int64_t num_spans, int64_t heads, int64_t kv_heads, int64_t dim,
                 float scale, bool /*bf16_dot: no AVX512-BF16 here*/) {
  auto kernel = dim == 64 ? prefill_kernel8<scalar_t, cache_t, 8> : prefill_kernel8<scalar_t, cache_t, 16>;
  kernel(q, q_st, q_sh, rows, out, spans, cols, num_spans, heads, kv_heads, scale);
}
bool prefill_attention_available() { return true; }
#else
template <typename scalar_t, typename cache_t>
void run_prefill(const scalar_t*, int64_t, int64_t, const ContextRows<cache_t>&, scalar_t*, const int64_t*, int64_t,
                 int64_t, int64_t, int64_t, int64_t, float, bool) {
  TORCH_CHECK(false, "built without AVX-512 or AVX2");
}
bool prefill_attention_available() { return false; }
#endif

template <typename F>
static void with_prefill_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "float32, bfloat16 or float16");
  }
}

// Fresh chunks (no cached prefix): keys and values from the step's own tensors.
void prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor out,
                       torch::Tensor spans, double scale, bool bf16_dot) {
  check_prefill_args(query, key, value, out, spans);
  TORCH_CHECK(scale > 0, "scale > 0");
  const int64_t heads = query.size(1), kv_heads = key.size(1), dim = query.size(2);
  with_prefill_dtype(query.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    ContextRows<scalar_t> rows;
    rows.k = key.data_ptr<scalar_t>();
    rows.v = value.data_ptr<scalar_t>();
    rows.k_st = key.stride(0), rows.k_sh = key.stride(1), rows.v_st = value.stride(0), rows.v_sh = value.stride(1);
    run_prefill<scalar_t>(query.data_ptr<scalar_t>(), query.stride(0), query.stride(1), rows, out.data_ptr<scalar_t>(),
                          spans.data_ptr<int64_t>(), 2, spans.size(0), heads, kv_heads, dim, static_cast<float>(scale),
                          bf16_dot);
  });
}

// Chunks with a cached prefix (chunked prefill's later chunks, prefix-cache hits): every key
// and value read from the paged cache (the chunk's own already stored by write_kv). query and
// out as in prefill_attention; caches [blocks, block_size, kv_heads, dim] in the query's
// dtype or float8 e4m3fn (--kv-cache-dtype fp8: widened exactly as they are read); spans [S, 3] int64 (start, end, prefix); block_table [S, max_blocks] int32, span s's row.
void prefill_attention_paged(torch::Tensor query, torch::Tensor out, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor spans, torch::Tensor block_table, double scale, bool bf16_dot) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && out.is_contiguous() && out.sizes() == query.sizes(),
              "query [tokens, heads, dim], head_dim contiguous; out contiguous, its shape");
  TORCH_CHECK(scale > 0, "scale > 0");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
              (fp8 || k_cache.scalar_type() == query.scalar_type()),
              "query, out and caches in one dtype (or float8 caches)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "caches [blocks, block_size, kv_heads, dim], contiguous");
  TORCH_CHECK(spans.scalar_type() == torch::kInt64 && spans.is_contiguous() && spans.dim() == 2 && spans.size(1) == 3,
              "spans: [S, 3] int64 (start, end, prefix)");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.is_contiguous() && block_table.dim() == 2 &&
              block_table.size(0) == spans.size(0), "block_table: [S, max_blocks] int32");
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), dim = query.size(2), bs = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim && (dim == 64 || dim == 128), "head shapes");
  const int64_t* sp = spans.data_ptr<int64_t>();
  for (int64_t s = 0; s < spans.size(0); ++s) {
    const int64_t start = sp[3 * s], end = sp[3 * s + 1], prefix = sp[3 * s + 2];
    TORCH_CHECK(0 <= start && start < end && end <= query.size(0) && prefix >= 0 &&
                (prefix + end - start + bs - 1) / bs <= block_table.size(1), "span ", s, " out of range");
  }
  with_prefill_dtype(query.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    auto go = [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      ContextRows<cache_t> rows;
      rows.k = k_cache.data_ptr<cache_t>();
      rows.v = v_cache.data_ptr<cache_t>();
      rows.tables = block_table.data_ptr<int32_t>();
      rows.table_stride = block_table.size(1), rows.block_size = bs, rows.kv_heads = kv_heads, rows.dim = dim;
      run_prefill<scalar_t>(query.data_ptr<scalar_t>(), query.stride(0), query.stride(1), rows,
                            out.data_ptr<scalar_t>(), sp, 3, spans.size(0), heads, kv_heads, dim,
                            static_cast<float>(scale), bf16_dot);
    };
    if (fp8) {
      go(c10::Float8_e4m3fn{});
    } else {
      go(scalar_t{});
    }
  });
}

// The bfloat16 prompt kernel's AMX tile products: mode 0 off, 1 on (where this build and CPU
// have them), anything else leaves it as it is; returns whether they are used from now on.
bool prefill_amx(int64_t mode) {
  if (mode == 0 || mode == 1) g_prefill_amx = mode == 1;
#if FERRY_PREFILL_AMX
  return g_prefill_amx && amx_permitted();
#else
  return false;
#endif
}

// Which of the kernels' instruction-set paths this build compiled: "avx512", "avx2" or "portable".
std::string kernel_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "portable";
#endif
}
