// Paged decode attention for the CPU: one query token per request, read in place.
//
// The reference backend copies every block of every decoding request out of the
// cache in every layer (index_select) and then runs SDPA over the copy: the cache is
// read twice and written once. Here each (request, kv head) pair reads its keys and
// values straight from their blocks, once: two passes over the context (scores, then
// the softmax-weighted values), accumulated in float32 whatever the cache dtype.
//
//   query:        [num_decodes, num_heads, head_dim]        (contiguous)
//   k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim] (contiguous)
//   block_table:  [num_decodes, max_blocks] int32
//   seq_lens:     [num_decodes] int32 (context length including the new token)
//   returns       [num_decodes, num_heads, head_dim] in the query's dtype
//
// Query head h uses kv head h / (num_heads / num_kv_heads), as transformers' repeat_kv.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

// HEAD_DIM > 0: a compile-time head size (the inner loops unroll fully); 0: head_dim at run time.
template <typename scalar_t, int64_t HEAD_DIM>
static void decode_kernel(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int32_t* bt,
                          const int32_t* lens, scalar_t* out, int64_t num_decodes, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                          double scale) {
  const int64_t HD = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of the cache
  at::parallel_for(0, num_decodes * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = lens[n];
      const int32_t* table = bt + n * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = static_cast<float>(q[(n * num_heads + kvh * group + g) * head_dim + d]) * scale;
      scores.assign(group * len, 0.f);
      // Block by block: one table lookup per block, no division per token.
      for (int64_t b = 0, t0 = 0; t0 < len; ++b, t0 += block_size) {
        const scalar_t* base = kc + static_cast<int64_t>(table[b]) * block_size * token_stride + kvh * head_dim;
        const int64_t n_in = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n_in; ++j) {
          const scalar_t* kp = base + j * token_stride;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * HD;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < HD; ++d) dot += qg[d] * static_cast<float>(kp[d]);
            scores[g * len + t0 + j] = dot;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float mx = *std::max_element(s, s + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0, t0 = 0; t0 < len; ++b, t0 += block_size) {
        const scalar_t* base = vc + static_cast<int64_t>(table[b]) * block_size * token_stride + kvh * head_dim;
        const int64_t n_in = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n_in; ++j) {
          const scalar_t* vp = base + j * token_stride;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + t0 + j];
            float* a = acc.data() + g * HD;
#pragma omp simd
            for (int64_t d = 0; d < HD; ++d) a[d] += p * static_cast<float>(vp[d]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out[(n * num_heads + kvh * group + g) * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d]);
    }
  });
}

#if defined(__AVX512F__)
#include "vec512.h"
// AVX-512 path: head_dim a multiple of 16, keys/values widened to float32 sixteen at a time,
// the softmax's exponentials computed sixteen at a time (2^x by a degree-7 polynomial and scalef).
// Softmax in place over one head's scores, padded to a multiple of 16 with -inf (exp gives 0).
static inline void softmax16(float* s, int64_t padded, float max) {
  const __m512 mx = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mx));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t t = 0; t < padded; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
}

// One request's decode attention for its KV heads [kv0, kv1) and their query heads.
// Token by token, the keys of every head in the range (one contiguous stretch of the
// token's row) are read in one pass and scored against all their query heads; then the
// same for the values. Scratch buffers are the caller's, reused across calls.
struct DecodeScratch {
  std::vector<__m512> qv, acc;
  std::vector<float> scores, maxes, tmp;
};

template <typename scalar_t, int64_t NV>
static inline void decode_one(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int32_t* table,
                              int64_t len, scalar_t* out, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                              int64_t kv0, int64_t kv1, int64_t block_size, __m512 sc, DecodeScratch& s) {
  constexpr int64_t HD = NV * 16;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * HD;
  const int64_t h0 = kv0 * group, heads = (kv1 - kv0) * group;  // query heads [h0, h0 + heads)
  const int64_t padded = (len + 15) / 16 * 16;
  s.qv.resize(heads * NV);
  s.acc.assign(heads * NV, _mm512_setzero_ps());
  s.maxes.assign(heads, -INFINITY);
  s.scores.assign(heads * padded, -INFINITY);
  s.tmp.resize(HD);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t v = 0; v < NV; ++v) s.qv[h * NV + v] = _mm512_mul_ps(load16(q + (n * num_heads + h0 + h) * HD + v * 16), sc);
  // fn(row, t, kvh, vectors): every token t of the context, for each KV head in range, its
  // HD elements of `cache` widened to float32, block by block through the table.
  auto walk = [&](const scalar_t* cache, auto&& fn) {
    for (int64_t b = 0, t0 = 0; t0 < len; ++b, t0 += block_size) {
      const scalar_t* base = cache + static_cast<int64_t>(table[b]) * block_size * token_stride;
      const int64_t n_in = std::min(block_size, len - t0);
      for (int64_t j = 0; j < n_in; ++j)
        for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
          __m512 x[NV];
          for (int64_t v = 0; v < NV; ++v) x[v] = load16(base + j * token_stride + kvh * HD + v * 16);
          fn(t0 + j, (kvh - kv0) * group, x);
        }
    }
  };
  walk(kc, [&](int64_t t, int64_t first, const __m512* kv) {
    for (int64_t h = first; h < first + group; ++h) {
      __m512 d = _mm512_mul_ps(s.qv[h * NV], kv[0]);
      for (int64_t v = 1; v < NV; ++v) d = _mm512_fmadd_ps(s.qv[h * NV + v], kv[v], d);
      const float score = _mm512_reduce_add_ps(d);
      s.scores[h * padded + t] = score;
      s.maxes[h] = std::max(s.maxes[h], score);
    }
  });
  for (int64_t h = 0; h < heads; ++h) softmax16(s.scores.data() + h * padded, padded, s.maxes[h]);
  walk(vc, [&](int64_t t, int64_t first, const __m512* vv) {
    for (int64_t h = first; h < first + group; ++h) {
      const __m512 p = _mm512_set1_ps(s.scores[h * padded + t]);
      for (int64_t v = 0; v < NV; ++v) s.acc[h * NV + v] = _mm512_fmadd_ps(p, vv[v], s.acc[h * NV + v]);
    }
  });
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t v = 0; v < NV; ++v) _mm512_storeu_ps(s.tmp.data() + v * 16, s.acc[h * NV + v]);
    scalar_t* o = out + (n * num_heads + h0 + h) * HD;
    for (int64_t d = 0; d < HD; ++d) o[d] = static_cast<scalar_t>(s.tmp[d]);
  }
}

// AVX-512 path: head_dim a multiple of 16. Few requests: one work item per (request, KV
// head), so both threads have work; at least four requests per thread: one item per
// request (`rows`), each token's whole row read once for all its KV heads.
template <typename scalar_t, int64_t NV>
static void decode_kernel_avx512(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int32_t* bt,
                                 const int32_t* lens, scalar_t* out, int64_t num_decodes, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, double scale, bool rows) {
  const int64_t per = rows ? 1 : num_kv_heads;  // work items per request
  at::parallel_for(0, num_decodes * per, 1, [&](int64_t begin, int64_t end) {
    DecodeScratch scratch;
    const __m512 sc = _mm512_set1_ps(static_cast<float>(scale));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / per;
      const int64_t kv0 = rows ? 0 : item % per, kv1 = rows ? num_kv_heads : kv0 + 1;
      decode_one<scalar_t, NV>(q, kc, vc, bt + n * max_blocks, lens[n], out, n, num_heads, num_kv_heads, kv0, kv1,
                               block_size, sc, scratch);
    }
  });
}
#endif

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "contiguous tables");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache share a dtype");
  const int64_t num_decodes = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes");
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto kernel) {
      kernel(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_decodes,
             num_heads, num_kv_heads, head_dim, block_size, block_table.size(1), scale);
    };
#if defined(__AVX512F__)
    if constexpr (!std::is_same_v<scalar_t, double>) {
    // Enough requests to keep every thread busy: one item per request.
    const bool rows = num_decodes >= 4 * at::get_num_threads() && head_dim <= 128;
    auto run_vec = [&](auto kernel) {
      kernel(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_decodes,
             num_heads, num_kv_heads, block_size, block_table.size(1), scale, rows);
    };
    if (head_dim == 64) return run_vec(decode_kernel_avx512<scalar_t, 4>);
    if (head_dim == 128) return run_vec(decode_kernel_avx512<scalar_t, 8>);
    if (head_dim == 256) return run_vec(decode_kernel_avx512<scalar_t, 16>);
    }
#endif
    if (head_dim == 64) run(decode_kernel<scalar_t, 64>);
    else if (head_dim == 128) run(decode_kernel<scalar_t, 128>);
    else run(decode_kernel<scalar_t, 0>);
  });
  return out;
}
