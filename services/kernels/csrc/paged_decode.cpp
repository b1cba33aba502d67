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
#include <cstring>
#include <type_traits>
#include <vector>
#include <c10/util/Float8_e4m3fn.h>
#include "work_split.h"

template <typename T>
struct CacheType { using type = T; };

// HEAD_DIM > 0: a compile-time head size (the inner loops unroll fully); 0: head_dim at run time.
template <typename scalar_t, typename cache_t, int64_t HEAD_DIM>
static void decode_kernel(const scalar_t* q, const cache_t* kc, const cache_t* vc, const int32_t* bt,
                          const int32_t* lens, scalar_t* out, int64_t num_decodes, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                          double scale) {
  const int64_t HD = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of the cache
  parallel_for(0, num_decodes * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
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
        const cache_t* base = kc + static_cast<int64_t>(table[b]) * block_size * token_stride + kvh * head_dim;
        const int64_t n_in = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n_in; ++j) {
          const cache_t* kp = base + j * token_stride;
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
        const cache_t* base = vc + static_cast<int64_t>(table[b]) * block_size * token_stride + kvh * head_dim;
        const int64_t n_in = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n_in; ++j) {
          const cache_t* vp = base + j * token_stride;
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

// The element offset of each of a request's `len` context tokens' rows in the cache (plus
// `first`: its first KV head in range), through its block table; `padded` entries, those
// past the context repeating the first row (a valid address whose scores are masked).
static inline void row_offsets(std::vector<int64_t>& off, const int32_t* table, int64_t len, int64_t padded,
                               int64_t block_size, int64_t token_stride, int64_t first) {
  off.resize(std::max(padded, len));
  for (int64_t b = 0, t = 0; t < len; ++b)
    for (int64_t j = 0; j < block_size && t < len; ++j, ++t)
      off[t] = (static_cast<int64_t>(table[b]) * block_size + j) * token_stride + first;
  std::fill(off.begin() + len, off.end(), off[0]);
}

// The next work item's K and V rows requested into L2 a few tokens at a time, spread over the
// current item's pass over its keys (see decode_group for why and what it measured).
struct NextRows {
  const char *k = nullptr, *v = nullptr;  // the caches
  const int64_t* off = nullptr;           // the next item's row offsets, in cache elements
  int64_t len = 0, pos = 0, elem = 0, bytes = 0;  // its tokens, requested so far; element size; bytes per row span
  template <typename cache_t>
  NextRows(const cache_t* kc, const cache_t* vc, const int64_t* next, int64_t next_len, int64_t span_elems)
      : k(reinterpret_cast<const char*>(kc)), v(reinterpret_cast<const char*>(vc)), off(next), len(next ? next_len : 0),
        elem(sizeof(cache_t)), bytes(span_elems * static_cast<int64_t>(sizeof(cache_t))) {}
  inline void ahead(int64_t tokens) {
    for (const int64_t e = std::min(len, pos + tokens); pos < e; ++pos) {
      const char* kr = k + off[pos] * elem;
      const char* vr = v + off[pos] * elem;
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(kr + b, 0, 2);
        __builtin_prefetch(vr + b, 0, 2);
      }
    }
  }
};

// The rows a grouped-decode work item touches first, in the order it touches them (its keys,
// its values, then the next item's keys), requested into L2 a fixed distance ahead of use:
// each row whole, front to back. The kernel's own loads walk a sixteen-token chunk one KV
// head at a time (a stride of one row) and the value pass sweeps the context once per KV
// head, orders the hardware prefetcher does not follow; the same bytes read row by row in
// order come from memory in about two thirds of the time (docs/benchmarks.md, "Kernels:
// decode attention"). Used for 16-bit caches; a float8 cache's kernel is bound by its
// conversions, and the NextRows above is the cheaper there.
struct RowStream {
  const char *k, *v;
  const int64_t *off, *next;  // this item's row offsets and the next item's, in cache elements
  int64_t len, next_len, pos, elem, bytes;  // pos: rows requested so far, of 2 * len + next_len
  template <typename cache_t>
  RowStream(const cache_t* kc, const cache_t* vc, const int64_t* off_, int64_t len_, const int64_t* next_,
            int64_t next_len_, int64_t span_elems, int64_t already)
      : k(reinterpret_cast<const char*>(kc)), v(reinterpret_cast<const char*>(vc)), off(off_), next(next_), len(len_),
        next_len(next_ ? next_len_ : 0), pos(std::min(already, len_)), elem(sizeof(cache_t)),
        bytes(span_elems * static_cast<int64_t>(sizeof(cache_t))) {}
  // Request every row before position i of the sequence (keys, values, next keys).
  inline void upto(int64_t i) {
    for (const int64_t e = std::min(i, 2 * len + next_len); pos < e; ++pos) {
      const char* r = pos < len ? k + off[pos] * elem : pos < 2 * len ? v + off[pos - len] * elem
                                                                      : k + next[pos - 2 * len] * elem;
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(r + b, 0, 2);
    }
  }
  // The next item's key rows already requested: where its own stream starts.
  inline int64_t carried() const { return std::max<int64_t>(0, pos - 2 * len); }
};

// A work item's cost for parallel_by_cost: its context, plus a little for what every item pays.
static inline double item_cost(const int32_t* lens, int64_t item, int64_t per) { return lens[item / per] + 16.0; }

// A thread's grouped-decode work items [begin, end) in order: item = request n's KV heads
// from kv0 (all of them when `rows`, else one: `per` items per request). Each item's row
// offsets (padded to 32) are computed one item ahead into s.next, so `run(n, kv0, next_len)`
// finds this item's rows in s.off and can request the next item's (s.next) while it works.
template <typename Scratch, typename F>
static inline void for_items_with_next(Scratch& s, int64_t begin, int64_t end, const int32_t* bt, const int32_t* lens,
                                       int64_t max_blocks, int64_t block_size, int64_t token_stride, int64_t head_dim,
                                       int64_t per, bool rows, F&& run) {
  auto offsets = [&](std::vector<int64_t>& off, int64_t item) {
    const int64_t n = item / per, kv0 = rows ? 0 : item % per;
    row_offsets(off, bt + n * max_blocks, lens[n], (lens[n] + 31) / 32 * 32, block_size, token_stride, kv0 * head_dim);
  };
  if (begin < end) offsets(s.next, begin);
  for (int64_t item = begin; item < end; ++item) {
    std::swap(s.off, s.next);  // this item's rows were the next item's of the last one
    const bool more = item + 1 < end;
    if (more) offsets(s.next, item + 1);
    run(item / per, rows ? 0 : item % per, more ? lens[(item + 1) / per] : 0);
  }
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

// A vector of sixteen bfloat16 pairs widened to float32: the even elements (each pair's low
// half shifted up), the odd ones (the high half, the low masked off). Exact, one instruction each.
static inline __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline __m512 bf16_odd(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Eight vectors, each two sums of eight lanes (its 256-bit halves), to one: lane t holds
// token t's score when v[p] holds tokens (p, p + 4) for p < 4 and (p + 4, p + 8) for p >= 4
// (low half, high half). hsum16's first three stages: 21 shuffles and adds.
static inline __m512 hsum8x2(const __m512* v) {
  __m512 w[4], x[2];
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}
// The rows paired in pair accumulator p of a sixteen-token chunk (hsum8x2's order).
static inline int64_t pair_row_a(int64_t p) { return p < 4 ? p : p + 4; }
static inline int64_t pair_row_b(int64_t p) { return p < 4 ? p + 4 : p + 8; }

// Sixteen vectors to one: lane j holds the sum of v[j]'s sixteen lanes. A transpose-and-add
// tree: 45 shuffles and adds where sixteen separate horizontal sums take about 130. Its first
// three stages are hsum8x2 on each half; the last adds the halves' 256-bit sums.
static inline __m512 hsum16(const __m512* v) {
  const __m512 z0 = hsum8x2(v), z1 = hsum8x2(v + 8);
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

static inline void store_out(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void store_out(c10::BFloat16* p, __m512 x) { store16(p, x); }
static inline void store_out(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The float8 scalings of the bf16-dot path (load32bf below).
constexpr float FP8_UP = 1267650600228229401496703205376.f;  // 2^100
constexpr float FP8_BACK = 1048576.f;                         // 2^20 = 2^120 / 2^100
#if defined(__AVX512BF16__)
// Thirty-two cache elements as bfloat16 operands of vdpbf16ps. A bfloat16 cache: as stored.
// A float8 (e4m3) cache: each byte's seven magnitude bits moved under a bfloat16's exponent
// field give the value times 2^-120, exactly, subnormals included (bf16 and e4m3 exponent
// biases differ by 120); the other operand carries 2^100 (FP8_UP) so the products land at
// 2^-20 of their value, far above float32's smallest normal, and the result is scaled back.
static inline __m512i load32bf(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }
#if defined(__AVX512VBMI__)
// Bytes of `src` picked by `idx` into the high halves of 32 words (vpermb; the low halves get
// the same bytes), then load32bf's operands in two more instructions: an arithmetic shift right
// by four puts the seven magnitude bits under the exponent field and copies the sign into bits
// 11-15, and a mask keeps bit 15 and the magnitude (the low four bits were the low byte's).
static inline __m512i fp8_words(__m512i src, __m512i idx) {
  return _mm512_and_si512(_mm512_srai_epi16(_mm512_permutexvar_epi8(idx, src), 4),
                          _mm512_set1_epi16(static_cast<int16_t>(0x87F0)));
}
// vpermb's indices. in_order: word w <- byte w (one row's thirty-two elements in order). lo,
// hi: two rows (a in bytes 0-31 of the source, b in 32-63) interleaved as _mm512_unpacklo_epi16
// / _mm512_unpackhi_epi16 of their load32bf operands interleave them: in each 128-bit lane,
// words 2m and 2m + 1 are a's and b's element 8 * lane + m (+ 4 for hi).
struct Fp8Index {
  alignas(64) int8_t in_order[64] = {}, lo[64] = {}, hi[64] = {};
};
static constexpr Fp8Index make_fp8_index() {
  Fp8Index r;
  for (int w = 0; w < 32; ++w) r.in_order[2 * w] = r.in_order[2 * w + 1] = static_cast<int8_t>(w);
  for (int lane = 0; lane < 4; ++lane)
    for (int m = 0; m < 4; ++m) {
      const int w = 8 * lane + 2 * m;
      for (int half = 0; half < 2; ++half) {
        int8_t* idx = half ? r.hi : r.lo;
        const int e = 8 * lane + m + 4 * half;
        idx[2 * w] = idx[2 * w + 1] = static_cast<int8_t>(e);
        idx[2 * w + 2] = idx[2 * w + 3] = static_cast<int8_t>(32 + e);
      }
    }
  return r;
}
static constexpr Fp8Index FP8_INDEX = make_fp8_index();
static inline __m512i load32bf(const c10::Float8_e4m3fn* p) {
  return fp8_words(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                   _mm512_load_si512(FP8_INDEX.in_order));
}
// vpermb's indices for two rows side by side (a's bytes 32h..32h+31 in bytes 0-31 of the
// source, b's in 32-63): words 0-15 <- a's elements 32h + 16u.., words 16-31 <- b's (u = 0, 1).
struct Fp8PairIndex {
  alignas(64) int8_t half[2][64] = {};
};
static constexpr Fp8PairIndex make_fp8_pair_index() {
  Fp8PairIndex r;
  for (int u = 0; u < 2; ++u)
    for (int w = 0; w < 32; ++w) r.half[u][2 * w] = r.half[u][2 * w + 1] = static_cast<int8_t>(w < 16 ? 16 * u + w : 16 + 16 * u + w);
  return r;
}
static constexpr Fp8PairIndex FP8_PAIR_INDEX = make_fp8_pair_index();
// Elements [32h, 32h + 32) of float8 rows a and b as the pair layout's two operands (steps
// 2h and 2h + 1): each 16 of a's elements then the same 16 of b's, as load32bf converts them.
static inline void fp8_pair_words(const c10::Float8_e4m3fn* a, const c10::Float8_e4m3fn* b, __m512i& s0, __m512i& s1) {
  const __m512i src = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
  s0 = fp8_words(src, _mm512_load_si512(FP8_PAIR_INDEX.half[0]));
  s1 = fp8_words(src, _mm512_load_si512(FP8_PAIR_INDEX.half[1]));
}
#else
static inline __m512i fp8_bytes_to_words(__m256i bytes) {
  const __m512i b = _mm512_cvtepu8_epi16(bytes);
  return _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)), 4),
                         _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
}
static inline __m512i load32bf(const c10::Float8_e4m3fn* p) {
  return fp8_bytes_to_words(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline void fp8_pair_words(const c10::Float8_e4m3fn* a, const c10::Float8_e4m3fn* b, __m512i& s0, __m512i& s1) {
  const __m128i* pa = reinterpret_cast<const __m128i*>(a);
  const __m128i* pb = reinterpret_cast<const __m128i*>(b);
  s0 = fp8_bytes_to_words(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(pa)), _mm_loadu_si128(pb), 1));
  s1 = fp8_bytes_to_words(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(pa + 1)), _mm_loadu_si128(pb + 1), 1));
}
#endif
// bfloat16 pairs of thirty-two query elements times `up` (a power of two: exact in range).
template <typename scalar_t>
static inline __m512i query32bf(const scalar_t* p, float up) {
  const __m512 u = _mm512_set1_ps(up);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(load16(p + 16), u), _mm512_mul_ps(load16(p), u));
}
#endif

// LINES cache lines from p requested into L2. (As a lambda over a row pointer that may be null,
// GCC 12 at -O3 dropped these prefetches from decode_group altogether.)
template <int64_t LINES>
static inline void request_lines(const void* p) {
  for (int64_t l = 0; l < LINES; ++l) _mm_prefetch(static_cast<const char*>(p) + 64 * l, _MM_HINT_T1);
}

struct HeadScratch {
  std::vector<int64_t> off, next;  // each context token's row in the cache (element offset): this item's, the next's
  std::vector<float> scores;
  std::vector<uint32_t> qpairs;  // float8: the query's pair-layout operands (decode_group)
  std::vector<float> qsplit;      // bfloat16 through FMAs: the query's even and odd elements (decode_group)
  std::vector<float> vacc;        // bfloat16 through FMAs: the values' sums between chunks (decode_group)
  int64_t carried = 0;  // this item's key rows the last item's RowStream already requested
};


// One request's KV heads [kv0, kv1) and the G query heads of each (G and the head size
// compile-time). Keys sixteen tokens at a time, every KV head of the range from the same
// rows (whole rows of the cache when the range is all heads: one contiguous stretch per
// block): one partial-product vector per token, folded into sixteen scores by hsum16.
// Values one KV head at a time, the group's accumulators in registers. BF16DOT (a bfloat16
// or float8 cache, AVX512-BF16): Q.K^T and P.V as bf16 dot products (vdpbf16ps), P rounded
// to bfloat16 as the prompt kernel and GPU flash kernels do; otherwise keys and values are
// widened to float32 and multiplied with FMAs.
//
// `off`: the rows of this item's context (row_offsets, padded to 32: past the context the
// first token's row, whose scores are masked to -inf, so every sixteen-token pass has a fixed
// length). `next`, `next_len`: the next work item's rows. A step's KV is read from memory
// request by request, and without software prefetch each request's first lines wait on memory
// while nothing else is in flight. A 16-bit cache requests its rows in the order they are first
// touched, a little ahead (RowStream: this item's keys, its values, then the next item's first
// keys; 12-18 % less time per step than NextRows on a fresh server's layout, a few percent
// on scattered blocks). A float8 or float32 cache requests the next item's rows a few tokens
// per scoring pass (NextRows: 17-27 % less than no prefetch for float8; RowStream was slower
// there). A bfloat16 cache
// through FMAs (SPLIT) has each KV head's pass request its own slice of the rows further on
// (see SLICE_AHEAD). A burst of the whole next item at once stalled the core on its miss
// buffers and gained nothing.
template <typename scalar_t, typename cache_t, int64_t NV, int64_t G, bool BF16DOT>
static inline void decode_group(const scalar_t* q, const cache_t* kc, const cache_t* vc, const int64_t* off,
                                int64_t len, scalar_t* out, int64_t nkv, float scale, HeadScratch& s,
                                const int64_t* next, int64_t next_len) {
  constexpr int64_t HD = NV * 16;
  const int64_t padded = (len + 31) / 32 * 32;
  s.scores.assign(nkv * G * padded, -INFINITY);
  // float8 through bf16 dot products: operands and results scaled as load32bf explains (the
  // FMA path widens the bytes to their true values and needs no scaling)
  constexpr bool SCALED = BF16DOT && std::is_same_v<cache_t, c10::Float8_e4m3fn>;
  const float up = SCALED ? FP8_UP : 1.f, back = SCALED ? FP8_BACK : 1.f;
  const __m512 sc = _mm512_set1_ps(scale * back), ninf = _mm512_set1_ps(-INFINITY);
  // bfloat16 through FMAs (below)
  constexpr bool SPLIT = !BF16DOT && std::is_same_v<cache_t, c10::BFloat16> && NV % 2 == 0;
  // 16-bit caches through dot products: rows requested in order, ROWS_AHEAD rows before their
  // first use (RowStream); float8: the next item's rows, a few per scoring pass (NextRows);
  // SPLIT: each KV head's slice of the rows SLICE_AHEAD tokens ahead, by that head's own pass
  // (below)
  constexpr bool IN_ORDER = sizeof(cache_t) == 2 && !SPLIT;
  constexpr int64_t ROWS_AHEAD = 16;
  NextRows pf(kc, vc, IN_ORDER || SPLIT ? nullptr : next, next_len, nkv * HD);
  RowStream rs(kc, vc, off, IN_ORDER ? len : 0, next, IN_ORDER ? next_len : 0, nkv * HD, s.carried);
  // float8: the next item's rows requested at about this item's own pace (18 rows per sixteen
  // tokens for SmolLM2's 3 x 3 heads). Same-process A/B on a fresh layout: 27 rows (the next
  // item all requested by two thirds of this one) took 6-12 % longer per step; 54 or 9 rows
  // took 28-34 % longer than 27
  const int64_t per_pass = (16 + nkv * G - 1) / (nkv * G);
  // float8: each query head's sixteen-element steps as bf16 pairs (times FP8_UP), repeated in
  // both 256-bit halves: the pair layout's other operand, made once per item
  [[maybe_unused]] const __m512i* qpairs = nullptr;
  if constexpr (SCALED) {
#if defined(__AVX512BF16__)
    s.qpairs.resize(nkv * G * NV * 16);
    __m512i* qp = reinterpret_cast<__m512i*>(s.qpairs.data());
    for (int64_t h = 0; h < nkv * G; ++h)
      for (int64_t i = 0; i < NV / 2; ++i) {
        const __m512i qb = query32bf(q + h * HD + i * 32, up);
        _mm512_storeu_si512(qp + h * NV + 2 * i, _mm512_shuffle_i64x2(qb, qb, 0x44));
        _mm512_storeu_si512(qp + h * NV + 2 * i + 1, _mm512_shuffle_i64x2(qb, qb, 0xEE));
      }
    qpairs = qp;
#endif
  }
  // bfloat16 through FMAs (SPLIT): a bfloat16 pair widens to float32 in one instruction per
  // element (the even element shifted up, the odd one masked), so keys and values are read as
  // their even and odd elements. Each query head's sixteen-element steps as those two halves,
  // each repeated in both 256-bit halves for the pair layout of the keys: [head][step][even,
  // odd][16], made once per item.
  [[maybe_unused]] const float* qsplit = nullptr;
  if constexpr (SPLIT) {
    s.qsplit.resize(nkv * G * NV * 32);
    float* qs = s.qsplit.data();
    for (int64_t h = 0; h < nkv * G; ++h)
      for (int64_t i = 0; i < NV / 2; ++i) {
        const __m512i x = _mm512_loadu_si512(q + h * HD + i * 32);
        const __m512 e = bf16_even(x), o = bf16_odd(x);
        float* d = qs + (h * NV + 2 * i) * 32;
        _mm512_storeu_ps(d, _mm512_shuffle_f32x4(e, e, 0x44));
        _mm512_storeu_ps(d + 16, _mm512_shuffle_f32x4(o, o, 0x44));
        _mm512_storeu_ps(d + 32, _mm512_shuffle_f32x4(e, e, 0xEE));
        _mm512_storeu_ps(d + 48, _mm512_shuffle_f32x4(o, o, 0xEE));
      }
    qsplit = qs;
  }
  // SPLIT's prefetch. A pass reads one KV head's slice of each row (keys: a sixteen-token
  // chunk per head; values: a VCHUNK-token chunk per head), and each head's pass requests its
  // own slice of the row SLICE_AHEAD tokens further on (request_lines): the keys' pass runs on
  // into the values' first rows, the values' into the next item's first keys. On the common load's
  // decode shape (bench_kernels_ab --parts decode --dot rule, fresh layout) this took 15 %
  // less time per step than RowStream's whole rows in order a chunk ahead, 5 % less with
  // every row in cache (docs/benchmarks.md, "Kernels: decode attention").
  constexpr int64_t SLICE_AHEAD = 32;
  for (int64_t c0 = 0; c0 < len; c0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, len - c0);
    const __mmask16 valid = static_cast<__mmask16>((1u << cnt) - 1u);
    for (int64_t k = 0; k < nkv; ++k) {
      if constexpr (IN_ORDER) rs.upto(c0 + ROWS_AHEAD + 16 * (k + 1) / nkv);  // the chunk's share, spread over its heads
      const scalar_t* qk = q + k * G * HD;
      [[maybe_unused]] alignas(64) uint16_t kbf[SCALED ? 16 * HD : 32];
      if constexpr (SCALED) {
#if defined(__AVX512BF16__)
        // float8: the chunk's keys converted once, not once per query head, in the pair
        // layout: operand (p, st) holds elements [16 st, 16 st + 16) of rows pair_row_a(p)
        // then pair_row_b(p), so each dot product's lanes sum within one token and eight
        // accumulators fold into sixteen scores in 21 operations (hsum16 over per-token
        // vectors took 45 per query head)
        for (int64_t p = 0; p < 8; ++p) {
          const cache_t* ra = kc + off[c0 + pair_row_a(p)] + k * HD;
          const cache_t* rb = kc + off[c0 + pair_row_b(p)] + k * HD;
          for (int64_t h = 0; h < NV / 2; ++h) {
            __m512i s0, s1;
            fp8_pair_words(ra + 32 * h, rb + 32 * h, s0, s1);
            _mm512_store_si512(kbf + (p * NV + 2 * h) * 32, s0);
            _mm512_store_si512(kbf + (p * NV + 2 * h + 1) * 32, s1);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          if constexpr (!IN_ORDER) pf.ahead(per_pass);
          const __m512i* qa = qpairs + (k * G + g) * NV;
          __m512 acc[8];
          for (auto& a : acc) a = _mm512_setzero_ps();
          for (int64_t st = 0; st < NV; ++st)
            for (int64_t p = 0; p < 8; ++p)
              acc[p] = _mm512_dpbf16_ps(acc[p], (__m512bh)_mm512_loadu_si512(qa + st),
                                       (__m512bh)_mm512_load_si512(kbf + (p * NV + st) * 32));
          const __m512 r = _mm512_mask_blend_ps(valid, ninf, _mm512_mul_ps(hsum8x2(acc), sc));
          _mm512_storeu_ps(s.scores.data() + (k * G + g) * padded + c0, r);
        }
        continue;
#endif
      }
      if constexpr (SPLIT) {
        // Two tokens per vector (rows pair_row_a(p) and pair_row_b(p), sixteen elements of
        // each in the two 256-bit halves), widened once for the group's G query heads; the
        // eight pair sums fold into sixteen scores in hsum8x2's 21 operations. On a Xeon
        // (AMX, AVX512-BF16) vdpbf16ps issues one per two cycles where FMAs issue two per
        // cycle: this pass took half the time of the dot products' (docs/benchmarks.md, "Kernels: decode attention").
        __m512 acc[G][8];
        for (int64_t g = 0; g < G; ++g)
          for (int64_t p = 0; p < 8; ++p) acc[g][p] = _mm512_setzero_ps();
        const float* qk2 = qsplit + k * G * NV * 32;
#pragma GCC unroll 8
        for (int64_t p = 0; p < 8; ++p) {
          for (int64_t ta = c0 + 2 * p + SLICE_AHEAD; ta < c0 + 2 * p + 2 + SLICE_AHEAD; ++ta) {
            if (ta < len) request_lines<NV / 2>(kc + off[ta] + k * HD);  // this item's keys
            else if (ta - len < len) request_lines<NV / 2>(vc + off[ta - len] + k * HD);  // then its values
          }
          const cache_t* ra = kc + off[c0 + pair_row_a(p)] + k * HD;
          const cache_t* rb = kc + off[c0 + pair_row_b(p)] + k * HD;
#pragma GCC unroll 16
          for (int64_t st = 0; st < NV; ++st) {
            const __m512i x = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + 16 * st))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + 16 * st)), 1);
            const __m512 e = bf16_even(x), o = bf16_odd(x);
            for (int64_t g = 0; g < G; ++g) {
              const float* qg = qk2 + (g * NV + st) * 32;
              acc[g][p] = _mm512_fmadd_ps(_mm512_loadu_ps(qg), e, acc[g][p]);
              acc[g][p] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), o, acc[g][p]);
            }
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const __m512 r = _mm512_mask_blend_ps(valid, ninf, _mm512_mul_ps(hsum8x2(acc[g]), sc));
          _mm512_storeu_ps(s.scores.data() + (k * G + g) * padded + c0, r);
        }
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        [[maybe_unused]] __m512i qb[NV / 2 > 0 ? NV / 2 : 1];
        if constexpr (BF16DOT) {
#if defined(__AVX512BF16__)
          for (int64_t i = 0; i < NV / 2; ++i) qb[i] = query32bf(qk + g * HD + i * 32, up);
#endif
        }
        if constexpr (!IN_ORDER) pf.ahead(per_pass);
        __m512 part[16];
        for (int64_t j = 0; j < 16; ++j) {
          part[j] = _mm512_setzero_ps();
          const cache_t* kp = kc + off[c0 + j] + k * HD;
          if constexpr (BF16DOT) {
#if defined(__AVX512BF16__)
            for (int64_t i = 0; i < NV / 2; ++i)
              part[j] = _mm512_dpbf16_ps(part[j], (__m512bh)qb[i],
                                         SCALED ? (__m512bh)_mm512_load_si512(kbf + j * HD + i * 32)
                                                : (__m512bh)load32bf(kp + i * 32));
#endif
          } else {
            for (int64_t v = 0; v < NV; ++v)
              part[j] = _mm512_fmadd_ps(load16(qk + g * HD + v * 16), load16(kp + v * 16), part[j]);
          }
        }
        const __m512 r = _mm512_mask_blend_ps(valid, ninf, _mm512_mul_ps(hsum16(part), sc));
        _mm512_storeu_ps(s.scores.data() + (k * G + g) * padded + c0, r);
      }
    }
  }
  for (int64_t h = 0; h < nkv * G; ++h) {
    float* sh = s.scores.data() + h * padded;
    __m512 mx = ninf;
    for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sh + t));
    softmax16(sh, padded, _mm512_reduce_max_ps(mx));
  }
  if constexpr (SPLIT) {
    // Values VCHUNK tokens at a time, every KV head of the range per chunk, each head's
    // accumulators carried from chunk to chunk in s.vacc (a head's sums still run over its
    // tokens in order); each head's pass requests its slice of the rows SLICE_AHEAD further on.
    constexpr int64_t VCHUNK = 32;
    s.vacc.assign(nkv * G * NV * 16, 0.f);
    float* va = s.vacc.data();
    for (int64_t c0 = 0; c0 < len; c0 += VCHUNK) {
      const int64_t c1 = std::min<int64_t>(len, c0 + VCHUNK);
      for (int64_t k = 0; k < nkv; ++k) {
        // acc[g][2i] holds the even elements of dimensions [32i, 32i + 32), acc[g][2i + 1] the odd
        __m512 acc[G][NV];
        for (int64_t g = 0; g < G; ++g)
          for (int64_t v = 0; v < NV; ++v) acc[g][v] = _mm512_loadu_ps(va + ((k * G + g) * NV + v) * 16);
        const float* sk = s.scores.data() + k * G * padded;
        for (int64_t t = c0; t < c1; ++t) {
          const int64_t ta = t + SLICE_AHEAD;
          if (ta < len) request_lines<NV / 2>(vc + off[ta] + k * HD);  // this item's values
          else if (ta - len < next_len) request_lines<NV / 2>(kc + next[ta - len] + k * HD);  // then the next item's keys
          const cache_t* vr = vc + off[t] + k * HD;
          for (int64_t i = 0; i < NV / 2; ++i) {
            const __m512i x = _mm512_loadu_si512(vr + i * 32);
            const __m512 e = bf16_even(x), o = bf16_odd(x);
            for (int64_t g = 0; g < G; ++g) {
              const __m512 p = _mm512_set1_ps(sk[g * padded + t]);
              acc[g][2 * i] = _mm512_fmadd_ps(p, e, acc[g][2 * i]);
              acc[g][2 * i + 1] = _mm512_fmadd_ps(p, o, acc[g][2 * i + 1]);
            }
          }
        }
        for (int64_t g = 0; g < G; ++g)
          for (int64_t v = 0; v < NV; ++v) _mm512_storeu_ps(va + ((k * G + g) * NV + v) * 16, acc[g][v]);
      }
    }
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t h = 0; h < nkv * G; ++h)
      for (int64_t i = 0; i < NV / 2; ++i) {
        const __m512 ev = _mm512_loadu_ps(va + (h * NV + 2 * i) * 16), od = _mm512_loadu_ps(va + (h * NV + 2 * i + 1) * 16);
        store_out(out + h * HD + i * 32, _mm512_permutex2var_ps(ev, first, od));
        store_out(out + h * HD + i * 32 + 16, _mm512_permutex2var_ps(ev, second, od));
      }
    s.carried = 0;
    return;
  }
  // Values one KV head at a time, the group's accumulators in registers.
  for (int64_t k = 0; k < nkv; ++k) {
    scalar_t* ok = out + k * G * HD;
    if constexpr (BF16DOT) {
#if defined(__AVX512BF16__)
      // Two tokens at a time, interleaved element by element (unpack within 128-bit lanes):
      // accumulator lo holds dims 8k..8k+3 and hi dims 8k+4..8k+7 of each 32.
      constexpr int64_t NP = NV / 2;
      __m512 lo[G][NP], hi[G][NP];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < NP; ++i) lo[g][i] = hi[g][i] = _mm512_setzero_ps();
      const uint32_t* pb[G];
      for (int64_t g = 0; g < G; ++g) {  // P to bf16 pairs, in place over the scores
        float* sg = s.scores.data() + (k * G + g) * padded;
        uint32_t* dst = reinterpret_cast<uint32_t*>(sg);
        const __m512 pu = _mm512_set1_ps(up);
        for (int64_t t = 0; t < padded; t += 32) {
          const __m512i pr = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sg + t + 16), pu),
                                                          _mm512_mul_ps(_mm512_loadu_ps(sg + t), pu));
          _mm512_storeu_si512(dst + t / 2, pr);
        }
        pb[g] = dst;
      }
#if defined(__AVX512VBMI__)
      [[maybe_unused]] const __m512i pairs_lo = _mm512_load_si512(FP8_INDEX.lo), pairs_hi = _mm512_load_si512(FP8_INDEX.hi);
#endif
      for (int64_t t = 0; t < len; t += 2) {
        // the first head's sweep is the values' first touch: keep ROWS_AHEAD rows ahead of it,
        // running on into the next item's keys near its end
        if (IN_ORDER && k == 0 && (t & 7) == 0) rs.upto(len + t + 8 + ROWS_AHEAD);
        const cache_t* va = vc + off[t] + k * HD;
        const cache_t* vb = vc + off[t + 1] + k * HD;  // past the context: p = 0 for a valid row
        for (int64_t i = 0; i < NP; ++i) {
          __m512bh l, h;
#if defined(__AVX512VBMI__)
          if constexpr (SCALED) {  // both rows' bytes in one register, interleaved as they convert
            const __m512i src = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + i * 32))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + i * 32)), 1);
            l = (__m512bh)fp8_words(src, pairs_lo);
            h = (__m512bh)fp8_words(src, pairs_hi);
          } else
#endif
          {
            const __m512i x = load32bf(va + i * 32), y = load32bf(vb + i * 32);
            l = (__m512bh)_mm512_unpacklo_epi16(x, y), h = (__m512bh)_mm512_unpackhi_epi16(x, y);
          }
          for (int64_t g = 0; g < G; ++g) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[g][t / 2]));
            lo[g][i] = _mm512_dpbf16_ps(lo[g][i], p, l);
            hi[g][i] = _mm512_dpbf16_ps(hi[g][i], p, h);
          }
        }
      }
      const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
      const __m512 ob = _mm512_set1_ps(back);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < NP; ++i) {
          store_out(ok + g * HD + i * 32, _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][i], first, hi[g][i]), ob));
          store_out(ok + g * HD + i * 32 + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo[g][i], second, hi[g][i]), ob));
        }
#endif
    } else {
      __m512 acc[G][NV];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t v = 0; v < NV; ++v) acc[g][v] = _mm512_setzero_ps();
      const float* sk = s.scores.data() + k * G * padded;
      for (int64_t t = 0; t < len; ++t) {
        if (IN_ORDER && k == 0 && (t & 7) == 0) rs.upto(len + t + 8 + ROWS_AHEAD);  // as above
        __m512 vv[NV];
        for (int64_t v = 0; v < NV; ++v) vv[v] = load16(vc + off[t] + k * HD + v * 16);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(sk[g * padded + t]);
          for (int64_t v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t v = 0; v < NV; ++v) store_out(ok + g * HD + v * 16, acc[g][v]);
    }
  }
  s.carried = rs.carried();
}

// Few requests: one work item per (request, KV head), so every thread has work; at least
// four requests per thread: one item per request (`rows`), each token's whole row read at once.
template <typename scalar_t, typename cache_t, int64_t NV, int64_t G, bool BF16DOT>
static void decode_kernel_grouped(const scalar_t* q, int64_t q_st, const cache_t* kc, const cache_t* vc, const int32_t* bt,
                                  const int32_t* lens, scalar_t* out, int64_t num_decodes, int64_t num_kv_heads,
                                  int64_t block_size, int64_t max_blocks, double scale, bool rows) {
  constexpr int64_t HD = NV * 16;
  const int64_t per = rows ? 1 : num_kv_heads;  // work items per request
  parallel_by_cost(num_decodes * per, [&](int64_t i) { return item_cost(lens, i, per); }, [&](int64_t begin, int64_t end) {
    HeadScratch s;
    const int64_t nkv = rows ? num_kv_heads : 1;
    for_items_with_next(s, begin, end, bt, lens, max_blocks, block_size, num_kv_heads * HD, HD, per, rows,
                        [&](int64_t n, int64_t kv0, int64_t next_len) {
      const int64_t head = (n * num_kv_heads + kv0) * G * HD;  // the range's first query head (out)
      decode_group<scalar_t, cache_t, NV, G, BF16DOT>(q + n * q_st + kv0 * G * HD, kc, vc, s.off.data(), lens[n], out + head, nkv,
                                                      static_cast<float>(scale), s, s.next.data(), next_len);
    });
  });
}

// AVX-512 path: head_dim a multiple of 16. Few requests: one work item per (request, KV
// head), so both threads have work; at least four requests per thread: one item per
// request (`rows`), each token's whole row read once for all its KV heads. (The grouped
// kernels' next-item prefetch, NextRows, was tried here for float32 caches: 25 % faster on
// scattered blocks but 15-20 % slower on a fresh server's layout and in cache, so not kept.)
template <typename scalar_t, int64_t NV>
static void decode_kernel_avx512(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int32_t* bt,
                                 const int32_t* lens, scalar_t* out, int64_t num_decodes, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, double scale, bool rows) {
  const int64_t per = rows ? 1 : num_kv_heads;  // work items per request
  parallel_for(0, num_decodes * per, 1, [&](int64_t begin, int64_t end) {
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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include "vec256.h"
// AVX2/FMA path (CPUs without AVX-512): every cache dtype widened to float32 and multiplied
// with FMAs, eight lanes at a time. One pass over the context, C tokens at a time, with an
// online softmax (as flash decoding): the chunk's keys scored, then its values accumulated.
// Each token's row (its KV heads' keys or values, one contiguous stretch) is read front to
// back once: measured on the common load's decode shape (docs/benchmarks.md, "Kernels: decode attention"), walking the
// rows head by head with the accumulators in registers took 1.5x as long from memory, though
// less compute, because the strided walk kept the hardware prefetcher from streaming.
struct Scratch8 {
  std::vector<int64_t> off, next;  // each context token's row in the cache (element offset): this item's, the next's
  std::vector<float> scores, qf, pv;
};

// `off`: this item's rows (row_offsets, padded to a multiple of C: past the context the first
// token's row, its scores masked to -inf); `next`: the next item's, prefetched (NextRows).
template <typename scalar_t, typename cache_t, int64_t NV, int64_t G>
static inline void decode_group8(const scalar_t* q, const cache_t* kc, const cache_t* vc, const int64_t* off,
                                 int64_t len, scalar_t* out, int64_t nkv, float scale, Scratch8& s,
                                 const int64_t* next, int64_t next_len) {
  constexpr int64_t HD = NV * 8;
  constexpr int64_t C = 32;  // context tokens per chunk
  const int64_t heads = nkv * G;
  NextRows pf(kc, vc, next, next_len, nkv * HD);
  s.scores.resize(heads * C + 2 * heads);
  s.qf.resize(2 * heads * HD);
  s.pv.resize(heads * 64);
  float* sc_ = s.scores.data();  // [heads][C] this chunk's scores, then probabilities
  float* mrun = sc_ + heads * C;  // running max per head
  float* lrun = mrun + heads;     // running sum per head
  float* qf = s.qf.data();        // [heads][HD] the query, pre-scaled
  float* acc = qf + heads * HD;   // [heads][HD] the unnormalized output
  float* pv = s.pv.data();        // [heads][8 tokens][8 lanes] partial products
  const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t h = 0; h < heads; ++h) {
    mrun[h] = -INFINITY;
    lrun[h] = 0.f;
    for (int64_t v = 0; v < NV; ++v) {
      _mm256_storeu_ps(qf + h * HD + v * 8, _mm256_mul_ps(load8(q + h * HD + v * 8), sc));
      _mm256_storeu_ps(acc + h * HD + v * 8, _mm256_setzero_ps());
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t c0 = 0; c0 < len; c0 += C) {
    const int64_t cn = std::min<int64_t>(C, len - c0);
    // Q.K^T, eight tokens at a time: one partial-product vector per (head, token), each key
    // vector loaded once for the G query heads that share it, folded by hsum8
    for (int64_t t8 = 0; t8 < cn; t8 += 8) {
      const int64_t cnt = std::min<int64_t>(8, cn - t8);
      pf.ahead(1);  // with one per token below: a little ahead of this item's pace
      for (int64_t j = 0; j < 8; ++j) {
        pf.ahead(1);
        const cache_t* row = kc + off[c0 + t8 + j];
        for (int64_t k = 0; k < nkv; ++k) {
          __m256 a[G];
          for (int64_t g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
          for (int64_t v = 0; v < NV; ++v) {
            const __m256 kv = load8(row + k * HD + v * 8);
            for (int64_t g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (k * G + g) * HD + v * 8), kv, a[g]);
          }
          for (int64_t g = 0; g < G; ++g) _mm256_storeu_ps(pv + ((k * G + g) * 8 + j) * 8, a[g]);
        }
      }
      const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cnt)), lane));
      for (int64_t h = 0; h < heads; ++h) {
        __m256 part[8];
        for (int64_t j = 0; j < 8; ++j) part[j] = _mm256_loadu_ps(pv + (h * 8 + j) * 8);
        _mm256_storeu_ps(sc_ + h * C + t8, _mm256_blendv_ps(ninf, hsum8(part), valid));
      }
    }
    // online softmax: the running max moves, the sum and output so far are rescaled
    const int64_t cp = (cn + 7) / 8 * 8;  // scores in [cn, cp) are -inf
    for (int64_t h = 0; h < heads; ++h) {
      float* sh = sc_ + h * C;
      __m256 mx = ninf;
      for (int64_t t = 0; t < cp; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sh + t));
      const float m_new = std::max(mrun[h], hmax8(mx));
      const float alpha = std::exp(mrun[h] - m_new);  // exp(-inf) = 0 on the first chunk
      const __m256 m = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t t = 0; t < cp; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), m));
        _mm256_storeu_ps(sh + t, e);
        sum = _mm256_add_ps(sum, e);
      }
      lrun[h] = lrun[h] * alpha + hadd8(sum);
      mrun[h] = m_new;
      if (alpha != 1.f) {
        const __m256 al = _mm256_set1_ps(alpha);
        for (int64_t v = 0; v < NV; ++v) _mm256_storeu_ps(acc + h * HD + v * 8, _mm256_mul_ps(_mm256_loadu_ps(acc + h * HD + v * 8), al));
      }
    }
    // P.V two tokens at a time (each accumulator loaded and stored once per pair), each value
    // vector loaded once for the G query heads that share it. Tokens in [cn, cp) have p = 0
    // and valid rows (see off), so pairs never need a remainder.
    for (int64_t t = 0; t < cp; t += 2) {
      const cache_t* row0 = vc + off[c0 + t];
      const cache_t* row1 = vc + off[c0 + t + 1];
      for (int64_t k = 0; k < nkv; ++k) {
        __m256 p0[G], p1[G];
        for (int64_t g = 0; g < G; ++g) {
          p0[g] = _mm256_broadcast_ss(sc_ + (k * G + g) * C + t);
          p1[g] = _mm256_broadcast_ss(sc_ + (k * G + g) * C + t + 1);
        }
        for (int64_t v = 0; v < NV; ++v) {
          const __m256 v0 = load8(row0 + k * HD + v * 8), v1 = load8(row1 + k * HD + v * 8);
          for (int64_t g = 0; g < G; ++g) {
            float* a = acc + (k * G + g) * HD + v * 8;
            _mm256_storeu_ps(a, _mm256_fmadd_ps(p1[g], v1, _mm256_fmadd_ps(p0[g], v0, _mm256_loadu_ps(a))));
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const __m256 inv = _mm256_set1_ps(1.f / lrun[h]);
    for (int64_t v = 0; v < NV; ++v) store8(out + h * HD + v * 8, _mm256_mul_ps(_mm256_loadu_ps(acc + h * HD + v * 8), inv));
  }
}

// Few requests: one work item per (request, KV head), so every thread has work; at least
// four requests per thread: one item per request (`rows`), each token's whole row read at once.
template <typename scalar_t, typename cache_t, int64_t NV, int64_t G>
static void decode_kernel_grouped8(const scalar_t* q, int64_t q_st, const cache_t* kc, const cache_t* vc, const int32_t* bt,
                                   const int32_t* lens, scalar_t* out, int64_t num_decodes, int64_t num_kv_heads,
                                   int64_t block_size, int64_t max_blocks, double scale, bool rows) {
  constexpr int64_t HD = NV * 8;
  const int64_t per = rows ? 1 : num_kv_heads;
  parallel_by_cost(num_decodes * per, [&](int64_t i) { return item_cost(lens, i, per); }, [&](int64_t begin, int64_t end) {
    Scratch8 s;
    const int64_t nkv = rows ? num_kv_heads : 1;
    for_items_with_next(s, begin, end, bt, lens, max_blocks, block_size, num_kv_heads * HD, HD, per, rows,
                        [&](int64_t n, int64_t kv0, int64_t next_len) {
      const int64_t head = (n * num_kv_heads + kv0) * G * HD;
      decode_group8<scalar_t, cache_t, NV, G>(q + n * q_st + kv0 * G * HD, kc, vc, s.off.data(), lens[n], out + head, nkv,
                                              static_cast<float>(scale), s, s.next.data(), next_len);
    });
  });
}
#endif

// One work item per request (each token's whole row, every KV head, read at once) when there
// are at least four requests per thread and no request's context is more than a thread's
// share of the step's (parallel_by_cost cannot split one item); else one per (request, KV head).
static bool whole_rows(const torch::Tensor& seq_lens, int64_t head_dim) {
  const int64_t n = seq_lens.size(0), threads = at::get_num_threads();
  if (n < 4 * threads || head_dim > 128) return false;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t total = 0, longest = 0;
  for (int64_t i = 0; i < n; ++i) total += lens[i], longest = std::max<int64_t>(longest, lens[i]);
  return longest * threads <= total;
}

// bf16_dot: a bfloat16 or float8 cache through AVX512-BF16 dot products where the CPU has them.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale, bool bf16_dot) {
  TORCH_CHECK(query.dim() == 3, "query [tokens, heads, head_dim]");
  // Each token's heads must be contiguous (a dimension of size 1 may carry any stride, as torch's
  // own contiguity ignores it); a query laid out otherwise is copied whole here, the one place
  // that decides which layouts are read as they are.
  if ((query.stride(2) != 1 && query.size(2) != 1) || (query.stride(1) != query.size(2) && query.size(1) != 1))
    query = query.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  // A query with a token stride of its own (a view of the q/k/v product whose epilogue applied
  // RoPE, decode_layers.cpp): the grouped kernels read it in place; the others get a copy made
  // row by row on this thread (a few KiB a token; torch's copy would wake its own thread team
  // beside ferry's, csrc/pool.h).
  const int64_t q_st = query.stride(0);
  auto dense_query = [&]() {
    if (query.is_contiguous()) return query;
    torch::Tensor packed = torch::empty(query.sizes(), query.options());
    const int64_t row = query.size(1) * query.size(2) * query.element_size();
    const char* src = static_cast<const char*>(query.data_ptr());
    char* dst = static_cast<char*>(packed.data_ptr());
    for (int64_t t = 0; t < query.size(0); ++t) std::memcpy(dst + t * row, src + t * q_st * query.element_size(), row);
    return packed;
  };
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "contiguous tables");
  // A float8 (e4m3) cache is read with a query in the model's dtype; otherwise both share one.
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "keys and values share a dtype");
  TORCH_CHECK(fp8 || query.scalar_type() == k_cache.scalar_type(), "query and cache share a dtype");
  const int64_t num_decodes = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes");
  auto out = torch::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    auto with_cache = [&](auto cache_tag) {
      using cache_t = typename decltype(cache_tag)::type;
      const cache_t* kc = k_cache.data_ptr<cache_t>();
      const cache_t* vc = v_cache.data_ptr<cache_t>();
      auto run = [&](auto kernel) {
        kernel(dense_query().data_ptr<scalar_t>(), kc, vc, block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
               out.data_ptr<scalar_t>(), num_decodes, num_heads, num_kv_heads, head_dim, block_size,
               block_table.size(1), scale);
      };
#if defined(__AVX512F__)
      if constexpr (!std::is_same_v<scalar_t, double>) {
      // Enough requests to keep every thread busy, none longer than a thread's share: one item per request.
      const bool rows = whole_rows(seq_lens, head_dim);
      // Caches of the usual group sizes (query heads per KV head) and head sizes: sixteen tokens
      // per scoring pass, the group's accumulators in registers.
      const int64_t group = num_heads / num_kv_heads;
      bool done = false;
      auto grouped = [&](auto nv, auto g) {
        constexpr int64_t NV = decltype(nv)::value, G = decltype(g)::value;
        // float32 caches too: the grouped kernel of 2026-12-01 ran slower than whole rows per
        // pass on a Zen 4 EPYC's fresh layout (40 against 26-34 ms a step), the kernel as it is
        // now (its next-item requests) took 0.83-0.91x decode_kernel_avx512's time on a Xeon
        // with AMX on every layout, and 0.88x of the decode kernel's time in the offline float32
        // common load (docs/benchmarks.md, "Kernels: decode attention").
        if (done || head_dim != NV * 16 || group != G) return;
        done = true;
        auto go = [&](auto kernel) {
          kernel(query.data_ptr<scalar_t>(), q_st, kc, vc, block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                 out.data_ptr<scalar_t>(), num_decodes, num_kv_heads, block_size, block_table.size(1), scale, rows);
        };
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<cache_t, c10::Float8_e4m3fn> ||
                      (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>)) {
          if (bf16_dot) return go(decode_kernel_grouped<scalar_t, cache_t, NV, G, true>);
        }
#endif
        go(decode_kernel_grouped<scalar_t, cache_t, NV, G, false>);
      };
      using I4 = std::integral_constant<int64_t, 4>;
      using I8 = std::integral_constant<int64_t, 8>;
      auto groups = [&](auto nv) {
        grouped(nv, std::integral_constant<int64_t, 1>{});
        grouped(nv, std::integral_constant<int64_t, 2>{});
        grouped(nv, std::integral_constant<int64_t, 3>{});
        grouped(nv, std::integral_constant<int64_t, 4>{});
        grouped(nv, std::integral_constant<int64_t, 8>{});
      };
      groups(I4{});
      groups(I8{});
      if (done) return;
      if constexpr (std::is_same_v<scalar_t, cache_t>) {
        auto run_vec = [&](auto kernel) {
          kernel(dense_query().data_ptr<scalar_t>(), kc, vc, block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                 out.data_ptr<scalar_t>(), num_decodes, num_heads, num_kv_heads, block_size, block_table.size(1),
                 scale, rows);
        };
        if (head_dim == 64) return run_vec(decode_kernel_avx512<scalar_t, 4>);
        if (head_dim == 128) return run_vec(decode_kernel_avx512<scalar_t, 8>);
        if (head_dim == 256) return run_vec(decode_kernel_avx512<scalar_t, 16>);
      }
      }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      if constexpr (!std::is_same_v<scalar_t, double>) {
        const bool rows = whole_rows(seq_lens, head_dim);
        const int64_t group = num_heads / num_kv_heads;
        bool done = false;
        auto grouped = [&](auto nv, auto g) {
          constexpr int64_t NV = decltype(nv)::value, G = decltype(g)::value;
          if (done || head_dim != NV * 8 || group != G) return;
          done = true;
          decode_kernel_grouped8<scalar_t, cache_t, NV, G>(
              query.data_ptr<scalar_t>(), q_st, kc, vc, block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
              out.data_ptr<scalar_t>(), num_decodes, num_kv_heads, block_size, block_table.size(1), scale, rows);
        };
        auto groups = [&](auto nv) {
          grouped(nv, std::integral_constant<int64_t, 1>{});
          grouped(nv, std::integral_constant<int64_t, 2>{});
          grouped(nv, std::integral_constant<int64_t, 3>{});
          grouped(nv, std::integral_constant<int64_t, 4>{});
          grouped(nv, std::integral_constant<int64_t, 8>{});
        };
        groups(std::integral_constant<int64_t, 8>{});   // head size 64
        groups(std::integral_constant<int64_t, 16>{});  // 128
        groups(std::integral_constant<int64_t, 32>{});  // 256
        if (done) return;
      }
#endif
      if (head_dim == 64) run(decode_kernel<scalar_t, cache_t, 64>);
      else if (head_dim == 128) run(decode_kernel<scalar_t, cache_t, 128>);
      else run(decode_kernel<scalar_t, cache_t, 0>);
    };
    if (fp8) {
      with_cache(CacheType<c10::Float8_e4m3fn>{});
    } else {
      with_cache(CacheType<scalar_t>{});
    }
  });
  return out;
}

// float -> float8 e4m3fn exactly as c10 (torch's .to(torch.float8_e4m3fn)) rounds: nearest even,
// finite overflow and infinities saturated to +-448, NaN kept NaN, subnormals through a float
// add. Branch-free, so a loop over a row vectorizes (-fno-trapping-math: the unused arm's
// arithmetic on large inputs raises no flag anyone reads).
static inline uint8_t to_e4m3fn(float f) {
  constexpr uint32_t fp8_max = UINT32_C(1087) << 20;      // 480.0f: the first value past e4m3fn's range
  constexpr uint32_t denorm_mask = UINT32_C(141) << 23;   // ((127 - 7) + (23 - 3) + 1) << 23
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = u & UINT32_C(0x80000000), a = u ^ sign;
  float af, mf, df;
  std::memcpy(&af, &a, 4);
  std::memcpy(&mf, &denorm_mask, 4);
  df = af + mf;
  uint32_t d;
  std::memcpy(&d, &df, 4);
  d -= denorm_mask;                                                   // below 2^-6: a subnormal
  uint32_t n = (a + (UINT32_C(0) - (UINT32_C(120) << 23)) + UINT32_C(0x7FFFF) + ((a >> 20) & 1)) >> 20;
  n = n == 0x7F ? 0x7E : n;                                           // a carry into NaN's pattern
  uint32_t r = a < (UINT32_C(121) << 23) ? d : n;
  r = a >= fp8_max ? (a > UINT32_C(0x7F800000) ? 0x7F : 0x7E) : r;
  return static_cast<uint8_t>((r & 0xFF) | (sign >> 24));
}

#if defined(__AVX512F__)
// to_e4m3fn on sixteen lanes, step for step the same arithmetic (so the same bytes). The
// scalar loop below did not vectorize (0.34-0.58 ns per element: a float8 cache's writes took
// 3.7-5.7x a bfloat16 cache's copies); this takes about 1.5 instructions per element.
static inline __m128i to_e4m3fn16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(u, sign);
  const __m512i denorm_mask = _mm512_set1_epi32(141 << 23);
  const __m512i d = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm_mask))), denorm_mask);
  __m512i n = _mm512_add_epi32(_mm512_sub_epi32(a, _mm512_set1_epi32(120 << 23)), _mm512_set1_epi32(0x7FFFF));
  n = _mm512_srli_epi32(_mm512_add_epi32(n, _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1))), 20);
  n = _mm512_mask_mov_epi32(n, _mm512_cmpeq_epi32_mask(n, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7E));
  __m512i r = _mm512_mask_mov_epi32(n, _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(121 << 23)), d);
  const __m512i sat = _mm512_mask_mov_epi32(_mm512_set1_epi32(0x7E),
                                            _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7F));
  r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(1087 << 20)), sat);
  r = _mm512_or_si512(_mm512_and_si512(r, _mm512_set1_epi32(0xFF)), _mm512_srli_epi32(sign, 24));
  return _mm512_cvtepi32_epi8(r);
}
#endif

template <typename scalar_t>
static inline void rows_to_e4m3fn(const scalar_t* x, uint8_t* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<scalar_t, double>)  // double: instantiated by the dispatch, refused before it
    for (; i + 16 <= n; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), to_e4m3fn16(load16(x + i)));
#endif
  for (; i < n; ++i) y[i] = to_e4m3fn(static_cast<float>(x[i]));
}

// The step's new keys and values stored at their cache slots: key/value [T, KH, D] (any token
// and head strides, D contiguous) in the cache's dtype, or, for a float8 (e4m3fn) cache, in
// float32, bfloat16 or float16, converted here as torch's .to() would (one pass where .to()
// plus a copy took two, and its dispatch ~50 us per decode layer). Caches [blocks,
// block_size, KH, D] contiguous, slots [T] int64 (block * block_size + offset; negative: a
// padded row, skipped). One call for both caches and every token, where two index_copy_
// calls and their views cost ~80 us per layer in Python and dispatch (docs/benchmarks.md, "Where a prompt step goes").
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1,
              "key/value: [tokens, kv_heads, head_dim], head_dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "caches: [blocks, block_size, kv_heads, head_dim], contiguous, one dtype");
  const bool to_fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn && key.scalar_type() != at::kFloat8_e4m3fn;
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
              (key.scalar_type() == k_cache.scalar_type() ||
               (to_fp8 && (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16 ||
                           key.scalar_type() == at::kHalf))),
              "keys and values in their cache's dtype (or float32/bfloat16/float16 for a float8 cache)");
  const int64_t T = key.size(0), KH = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(key.size(1) == KH && key.size(2) == D && value.size(0) == T && value.size(1) == KH && value.size(2) == D,
              "key/value shapes match the cache's heads");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == T,
              "slots: [tokens] int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(s[t] < num_slots, "slot ", s[t], " past the cache's ", num_slots);
  const int64_t ke = key.element_size(), ce = k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t kt = key.stride(0) * ke, kh = key.stride(1) * ke, vt = value.stride(0) * ke, vh = value.stride(1) * ke;
  auto rows = [&](auto put) {
    parallel_for(0, T, 512, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (s[t] < 0) continue;
        put(kc + s[t] * KH * D * ce, kp + t * kt, kh);
        put(vc + s[t] * KH * D * ce, vp + t * vt, vh);
      }
    });
  };
  if (!to_fp8) {
    return rows([D, KH, ke](char* dst, const char* src, int64_t head_stride) {
      if (head_stride == D * ke) {
        std::memcpy(dst, src, KH * D * ke);
      } else {
        for (int64_t h = 0; h < KH; ++h) std::memcpy(dst + h * D * ke, src + h * head_stride, D * ke);
      }
    });
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv_fp8", [&] {
    rows([D, KH](char* dst, const char* src, int64_t head_stride) {
      for (int64_t h = 0; h < KH; ++h)
        rows_to_e4m3fn(reinterpret_cast<const scalar_t*>(src + h * head_stride), reinterpret_cast<uint8_t*>(dst) + h * D, D);
    });
  });
}


// Work taken between threads by the attention kernels (parallel_by_cost) and the row-wise ops
// (parallel_rows, work_split.h) on (the default) or off, for A/B measurements only.
void work_stealing(bool on) { stealing_on = on; }

// For the tests of ferry_pool (pool.h) through parallel_for: `items` items of about `item_us`
// microseconds each, grain 1; returns how many times each item ran, then how many threads ran
// any. fail_item >= 0: that item throws (the error must come back to the caller).
torch::Tensor pool_check(int64_t items, int64_t item_us, int64_t fail_item) {
  std::vector<std::atomic<int64_t>> counts(items);
  std::mutex mu;
  std::vector<std::thread::id> seen;
  parallel_for(0, items, 1, [&](int64_t lo, int64_t hi) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (std::find(seen.begin(), seen.end(), std::this_thread::get_id()) == seen.end())
        seen.push_back(std::this_thread::get_id());
    }
    for (int64_t i = lo; i < hi; ++i) {
      TORCH_CHECK(i != fail_item, "pool_check: item ", i, " failed as asked");
      const int64_t until = ferry_pool::now_ns() + 1000 * item_us;
      while (ferry_pool::now_ns() < until) ferry_pool::relax();
      counts[i].fetch_add(1, std::memory_order_relaxed);
    }
  });
  auto out = torch::empty({items + 1}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < items; ++i) o[i] = counts[i].load();
  o[items] = static_cast<int64_t>(seen.size());
  return out;
}
