// ferry's fused element-wise ops for bfloat16 and float32 on the CPU (services/worker/fused_ops.py).
//
// transformers' RMSNorm, rotary embedding and SiLU-and-multiply are five to ten small
// PyTorch ops each, every one a pass over memory (in bfloat16 with a round trip through
// bfloat16 at each). These do each in one pass and in bfloat16 round exactly where the
// PyTorch ops store a bfloat16 tensor, so their outputs equal transformers' bit for bit
// except where a float32 sum is taken in another order (RMSNorm's mean of squares) or exp
// differs in its last bits (SiLU): there at most one bfloat16 step apart. In float32 the
// same two differ by a few float32 ulps.
//
// Inputs: contiguous rows of one dtype, bfloat16 or float32 (rotary: query/key rows with
// any stride between tokens and heads, the head's own elements contiguous). The entry
// points at the end check their inputs and split the rows over threads; the per-row
// kernels come in two versions: AVX-512 intrinsics, sixteen lanes at a time, and plain
// loops the compiler vectorizes for CPUs without AVX-512 (AVX2).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include "work_split.h"

using bf16 = c10::BFloat16;

// The first NaN of a row (argmax_row's answer when the row holds one, as torch.argmax's).
template <typename T>
static int64_t first_nan(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(static_cast<float>(x[i]))) return i;
  return 0;
}

#if defined(__AVX512F__)
#include "vec512.h"

// What storing an intermediate tensor of dtype T does to sixteen float lanes. In float32
// the empty asm keeps the compiler from fusing the product with the add that follows
// (PyTorch rounds each), so the rotary embedding stays bit-identical in float32 too.
template <typename T>
static inline __m512 as_stored(__m512 x) {
  if constexpr (std::is_same_v<T, bf16>) {
    return round_bf16(x);
  } else {
    __asm__("" : "+v"(x));
    return x;
  }
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), as LlamaRMSNorm computes it in dtype T.
template <typename T>
static inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float var = _mm512_reduce_add_ps(acc) / static_cast<float>(n);
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(var + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 y = as_stored<T>(_mm512_mul_ps(load16(x + i), inv));
    store16(out + i, _mm512_mul_ps(load16(w + i), y));
  }
}

// sum = T(x + delta) (what `x + delta` stores), then out = the norm of sum (its row is
// still in L1 when the norm reads it back).
template <typename T>
static inline void add_norm_row(const T* x, const T* delta, const T* w, T* sum, T* out, int64_t n, float eps) {
  for (int64_t i = 0; i < n; i += 16) store16(sum + i, as_stored<T>(_mm512_add_ps(load16(x + i), load16(delta + i))));
  norm_row<T>(sum, w, out, n, eps);
}

// Four rows of norm_row at once: each row's sum of squares is the same chain of FMAs in the
// same order (so the same bits), four chains in flight instead of one. A 576-wide row's
// chain is 36 dependent FMAs; alone, the norm waited on their latency.
template <typename T>
static inline void norm_rows4(const T* x, const T* w, T* out, int64_t n, float eps) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < n; i += 16)
    for (int r = 0; r < 4; ++r) {
      const __m512 v = load16(x + r * n + i);
      acc[r] = _mm512_fmadd_ps(v, v, acc[r]);
    }
  __m512 inv[4];
  for (int r = 0; r < 4; ++r) {
    const float var = _mm512_reduce_add_ps(acc[r]) / static_cast<float>(n);
    inv[r] = _mm512_set1_ps(1.f / std::sqrt(var + eps));
  }
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 wv = load16(w + i);
    for (int r = 0; r < 4; ++r)
      store16(out + r * n + i, _mm512_mul_ps(wv, as_stored<T>(_mm512_mul_ps(load16(x + r * n + i), inv[r]))));
  }
}

// Rows [r0, r1) of rms_norm (sum == nullptr) or add_rms_norm: four at a time, then one by one.
template <typename T>
static inline void norm_rows(const T* x, const T* delta, const T* w, T* sum, T* out, int64_t n, float eps, int64_t r0,
                             int64_t r1) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    if (sum != nullptr)
      for (int64_t i = 0; i < 4 * n; i += 16)
        store16(sum + r * n + i, as_stored<T>(_mm512_add_ps(load16(x + r * n + i), load16(delta + r * n + i))));
    norm_rows4<T>((sum != nullptr ? sum : x) + r * n, w, out + r * n, n, eps);
  }
  for (; r < r1; ++r) {
    if (sum != nullptr)
      add_norm_row<T>(x + r * n, delta + r * n, w, sum + r * n, out + r * n, n, eps);
    else
      norm_row<T>(x + r * n, w, out + r * n, n, eps);
  }
}

// out[i] = T(T(silu(gate[i])) * up[i]), as act_fn(gate) * up does.
template <typename T>
static inline void silu_row(const T* g, const T* u, T* out, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 act = as_stored<T>(silu16(load16(g + i)));  // vec512.h
    store16(out + i, _mm512_mul_ps(act, load16(u + i)));
  }
}

// Sixteen lanes of one head's rotation: lo = x[i], hi = x[i + half] (values as stored in T),
// c/s the token's cos/sin rows; out_lo[0..16) = T(T(lo * cos[i]) + T(-hi * sin[i])) and
// out_hi[0..16) = T(T(hi * cos[i + half]) + T(lo * sin[i + half])). rope_token and the AMX q/k/v
// product's epilogue (tiled_linear.cpp, amx_rope_linear) both rotate here: the same bits.
template <typename T>
static inline void rope16(__m512 lo, __m512 hi, const T* c, const T* s, int64_t i, int64_t half, T* out_lo,
                          T* out_hi) {
  const __m512 a = as_stored<T>(_mm512_mul_ps(lo, load16(c + i)));
  const __m512 b = as_stored<T>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), load16(s + i)));
  store16(out_lo, _mm512_add_ps(a, b));
  const __m512 a2 = as_stored<T>(_mm512_mul_ps(hi, load16(c + half + i)));
  const __m512 b2 = as_stored<T>(_mm512_mul_ps(lo, load16(s + half + i)));
  store16(out_hi, _mm512_add_ps(a2, b2));
}

// One token's heads: out = T(T(x * cos) + T(rotate_half(x) * sin)), as transformers'
// apply_rotary_pos_emb computes it in dtype T.
template <typename T>
static inline void rope_token(const T* x, int64_t sh, const T* c, const T* s, T* out, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xr = x + h * sh;
    T* orow = out + h * dim;
    for (int64_t i = 0; i < half; i += 16)
      rope16<T>(load16(xr + i), load16(xr + half + i), c, s, i, half, orow + i, orow + half + i);
  }
}

// Greedy sampling's argmax of one row (see argmax_rows): the row's largest value and
// whether it holds a NaN in one pass, then the first index of that value in a second (the
// row, 96 KiB of bfloat16 logits for a 49,152-token vocabulary, is still in L2).
template <typename T>
static inline int64_t argmax_row(const T* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  float m = _mm512_reduce_max_ps(mx);
  bool has_nan = nan != 0;
  for (int64_t j = i; j < n; ++j) {
    const float v = static_cast<float>(x[j]);
    has_nan |= v != v;
    m = v > m ? v : m;
  }
  if (has_nan) return first_nan(x, n);
  const __m512 target = _mm512_set1_ps(m);
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(load16(x + i), target, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
  for (; i < n; ++i)
    if (static_cast<float>(x[i]) == m) return i;
  return 0;
}

// e[i] = exp((x[i] - m) * inv_t), 0 below e^-87 (and for -inf logits), with each 16-element
// block's float sum in bsum (the last block's over its valid elements). For sample_row.
template <typename T>
static inline void exp_shifted_row(const T* x, int64_t n, float m, float inv_t, float* e, float* bsum) {
  const __m512 mv = _mm512_set1_ps(m), it = _mm512_set1_ps(inv_t), floor = _mm512_set1_ps(-87.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 d = _mm512_mul_ps(_mm512_sub_ps(load16(x + i), mv), it);
    const __m512 v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, floor, _CMP_GE_OQ), exp16(d));
    _mm512_storeu_ps(e + i, v);
    bsum[i / 16] = _mm512_reduce_add_ps(v);
  }
  if (i < n) {
    float tail = 0.f;
    for (int64_t j = i; j < n; ++j) {
      const float d = (static_cast<float>(x[j]) - m) * inv_t;
      e[j] = d >= -87.f ? std::exp(d) : 0.f;
      tail += e[j];
    }
    bsum[i / 16] = tail;
  }
}

// Over e (nonnegative floats, compared by their bits, which order them): how many elements
// are at least `t`, and their sum (flushed to double every 1,024 elements). For sample_row's
// top-k and top-p thresholds.
static inline void at_least(const float* e, int64_t n, int32_t t, int64_t& count, double& mass) {
  const __m512i tv = _mm512_set1_epi32(t);
  count = 0;
  mass = 0.0;
  int64_t i = 0;
  while (i + 16 <= n) {
    __m512 acc = _mm512_setzero_ps();
    for (const int64_t stop = std::min(n - 15, i + 1024); i < stop; i += 16) {
      const __m512 v = _mm512_loadu_ps(e + i);
      const __mmask16 k = _mm512_cmpge_epi32_mask(_mm512_castps_si512(v), tv);
      acc = _mm512_mask_add_ps(acc, k, acc, v);
      count += __builtin_popcount(k);
    }
    mass += _mm512_reduce_add_ps(acc);
  }
  for (; i < n; ++i) {
    int32_t b;
    std::memcpy(&b, e + i, sizeof b);
    if (b >= t) {
      ++count;
      mass += e[i];
    }
  }
}

// The elements of e whose bits are at least `t`, in order, into dst (room for n + 16: every
// store writes a whole vector); how many. dst may be e itself (each store lands at or before
// what it read). For sample_row's bisections, which then search fewer elements.
static inline int64_t keep_at_least(const float* e, int64_t n, int32_t t, float* dst) {
  const __m512i tv = _mm512_set1_epi32(t);
  int64_t c = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(e + i);
    const __mmask16 k = _mm512_cmpge_epi32_mask(_mm512_castps_si512(v), tv);
    _mm512_storeu_ps(dst + c, _mm512_maskz_compress_ps(k, v));  // compress in a register: a store-compress is slow on Zen 4
    c += __builtin_popcount(k);
  }
  for (; i < n; ++i) {
    int32_t b;
    std::memcpy(&b, e + i, sizeof b);
    dst[c] = e[i];
    c += b >= t;
  }
  return c;
}

#else
// Without AVX-512: the same arithmetic as plain loops over floats (independent lanes;
// partial sums in sixteen accumulators; exp as the same polynomial with the rounding and
// the power of two in integer arithmetic). With -fno-trapping-math (the build's flags)
// the compiler vectorizes them.

template <typename T>
static inline float stored(float x) {
  if constexpr (std::is_same_v<T, bf16>) {
    return static_cast<float>(bf16(x));  // round to nearest even, as a bfloat16 tensor stores it
  } else {
    return x;
  }
}

template <typename T>
static inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float acc[16] = {};
  for (int64_t i = 0; i < n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const float v = static_cast<float>(x[i + j]);
      acc[j] += v * v;
    }
  }
  float total = 0.f;
  for (int j = 0; j < 16; ++j) total += acc[j];
  const float inv = 1.f / std::sqrt(total / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<T>(static_cast<float>(w[i]) * stored<T>(static_cast<float>(x[i]) * inv));
  }
}

template <typename T>
static inline void add_norm_row(const T* x, const T* delta, const T* w, T* sum, T* out, int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) sum[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(delta[i]));
  norm_row<T>(sum, w, out, n, eps);
}

template <typename T>
static inline void norm_rows(const T* x, const T* delta, const T* w, T* sum, T* out, int64_t n, float eps, int64_t r0,
                             int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    if (sum != nullptr)
      add_norm_row<T>(x + r * n, delta + r * n, w, sum + r * n, out + r * n, n, eps);
    else
      norm_row<T>(x + r * n, w, out + r * n, n, eps);
  }
}

// exp(x) for x <= 0, the polynomial of vec512.h's exp16; x is clamped at -87 (where 2^n
// would leave float32's normal range), so it never returns less than ~1.6e-38.
static inline float exp_neg(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.4426950408889634f;
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest (|t| < 2^22)
  const float f = (t - n) * 0.6931471805599453f;
  float p = 1.f / 5040;
  p = p * f + 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T>
static inline void silu_row(const T* g, const T* u, T* out, int64_t d) {
  for (int64_t i = 0; i < d; ++i) {
    const float gv = static_cast<float>(g[i]);
    const float e = exp_neg(-std::fabs(gv));  // sigmoid from e^-|x| alone, as in the AVX-512 path
    const float sig = (gv < 0.f ? e : 1.f) / (1.f + e);
    out[i] = static_cast<T>(stored<T>(gv * sig) * static_cast<float>(u[i]));
  }
}

// No multiply fused into the add that follows it (PyTorch rounds each product): the
// attribute needs a function of its own (it does not reach into the callers' lambdas),
// and keeps this one from being inlined into them.
template <typename T>
__attribute__((optimize("fp-contract=off"))) static void rope_token(const T* x, int64_t sh, const T* c,
                                                                     const T* s, T* out, int64_t heads,
                                                                     int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xr = x + h * sh;
    T* orow = out + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      const float lo = static_cast<float>(xr[i]), hi = static_cast<float>(xr[half + i]);
      const float a = stored<T>(lo * static_cast<float>(c[i]));
      const float b = stored<T>(-hi * static_cast<float>(s[i]));
      orow[i] = static_cast<T>(a + b);
      const float a2 = stored<T>(hi * static_cast<float>(c[half + i]));
      const float b2 = stored<T>(lo * static_cast<float>(s[half + i]));
      orow[half + i] = static_cast<T>(a2 + b2);
    }
  }
}
template <typename T>
static inline int64_t argmax_row(const T* x, int64_t n) {
  float m = -INFINITY;
  bool has_nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    has_nan |= v != v;
    m = v > m ? v : m;
  }
  if (has_nan) return first_nan(x, n);
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<float>(x[i]) == m) return i;
  return 0;
}
template <typename T>
static inline void exp_shifted_row(const T* x, int64_t n, float m, float inv_t, float* e, float* bsum) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t end = std::min<int64_t>(n, i + 16);
    float acc = 0.f;
    for (int64_t j = i; j < end; ++j) {
      const float d = (static_cast<float>(x[j]) - m) * inv_t;
      e[j] = d >= -87.f ? exp_neg(d) : 0.f;
      acc += e[j];
    }
    bsum[i / 16] = acc;
  }
}
static inline void at_least(const float* e, int64_t n, int32_t t, int64_t& count, double& mass) {
  count = 0;
  mass = 0.0;
  for (int64_t i = 0; i < n; i += 1024) {
    const int64_t end = std::min<int64_t>(n, i + 1024);
    float acc = 0.f;
    int64_t c = 0;
    for (int64_t j = i; j < end; ++j) {
      int32_t b;
      std::memcpy(&b, e + j, sizeof b);
      const bool keep = b >= t;
      acc += keep ? e[j] : 0.f;
      c += keep;
    }
    count += c;
    mass += acc;
  }
}
static inline int64_t keep_at_least(const float* e, int64_t n, int32_t t, float* dst) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) {
    int32_t b;
    std::memcpy(&b, e + i, sizeof b);
    dst[c] = e[i];
    c += b >= t;
  }
  return c;
}
#endif

// Runs fn(T{}) for the tensor's dtype, bfloat16 or float32.
template <typename Fn>
static auto dispatch_float(const torch::Tensor& x, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kBFloat16: return fn(bf16{});
    case at::kFloat: return fn(float{});
    default: TORCH_CHECK(false, "bfloat16 or float32 inputs");
  }
}

// Rows per parallel task: enough work per task that a step of a few tokens runs on one thread.
static int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

static int64_t check_norm_row(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs");
  const int64_t n = x.size(-1);
  TORCH_CHECK(n % 16 == 0 && weight.numel() == n, "row length a multiple of 16, one weight per element");
  return n;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "one dtype");
  const int64_t n = check_norm_row(x, weight), rows = x.numel() / n;
  auto out = torch::empty_like(x);
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.data_ptr<T>(), *wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    parallel_rows(rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      norm_rows<T>(xp, nullptr, wp, nullptr, op, n, static_cast<float>(eps), r0, r1);
    });
  });
  return out;
}

// The residual add and the next RMSNorm in one pass. Returns {x + delta, rms_norm(x + delta)}.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == delta.scalar_type() && x.scalar_type() == weight.scalar_type(), "one dtype");
  TORCH_CHECK(delta.is_contiguous() && x.sizes() == delta.sizes(), "contiguous inputs of one shape");
  const int64_t n = check_norm_row(x, weight), rows = x.numel() / n;
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.data_ptr<T>(), *dp = delta.data_ptr<T>(), *wp = weight.data_ptr<T>();
    T *sp = sum.data_ptr<T>(), *op = out.data_ptr<T>();
    parallel_rows(rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      norm_rows<T>(xp, dp, wp, sp, op, n, static_cast<float>(eps), r0, r1);
    });
  });
  return {sum, out};
}

// x: [..., 2 * d] (gate | up) -> [..., d].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "contiguous input");
  const int64_t d = x.size(-1) / 2;
  TORCH_CHECK(d % 16 == 0 && x.size(-1) == 2 * d, "an even split into multiples of 16");
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  auto out = torch::empty(sizes, x.options());
  const int64_t rows = x.numel() / (2 * d);
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    parallel_rows(rows, grain_rows(2 * d), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) silu_row<T>(xp + r * 2 * d, xp + r * 2 * d + d, op + r * d, d);
    });
  });
  return out;
}

// One of query/key: [tokens, heads, head_dim] with any token and head strides, head_dim
// contiguous; cos/sin [tokens, head_dim] contiguous. Returns it rotated, contiguous.
template <typename T>
static torch::Tensor rope_one(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && (dim / 2) % 16 == 0, "head_dim contiguous, a multiple of 32");
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const int64_t st = x.stride(0), sh = x.stride(1);
  const T *xp = x.data_ptr<T>(), *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  parallel_rows(tokens, grain_rows(heads * dim), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      rope_token<T>(xp + t * st, sh, cp + t * dim, sp + t * dim, op + t * heads * dim, heads, dim);
    }
  });
  return out;
}

std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "one dtype for query, key, cos and sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "contiguous cos/sin");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "[tokens, heads, dim]");
  TORCH_CHECK(cos.numel() == q.size(0) * q.size(2) && sin.numel() == cos.numel(), "cos/sin: [tokens, head_dim]");
  return dispatch_float(q, [&](auto tag) -> std::vector<torch::Tensor> {
    using T = decltype(tag);
    return {rope_one<T>(q, cos, sin), rope_one<T>(k, cos, sin)};
  });
}

// Greedy sampling: each row's argmax, as torch.argmax(x, dim=-1) gives it on the CPU (the
// first index of the largest value; the first NaN's when a row holds one). PyTorch's CPU
// argmax is a scalar reduction (2.4 ms for 64 x 49,152 float32 logits on two threads, and the
// sampler first copied bfloat16 logits to float32); this reads bfloat16 or float32 rows as
// they are, one row per task.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "contiguous [rows, n] logits with n > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    int64_t* op = out.data_ptr<int64_t>();
    parallel_rows(rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row<T>(xp + r * n, n);
    });
  });
  return out;
}

// The filters of one random row on e = exp((x - max) / T) (e of the top token is 1), as
// thresholds on e: top-k keeps the tokens at least as likely as the k-th, top-p (over the
// top-k renormalized distribution, as the sampler defines it) the fewest most likely tokens
// holding top_p of the mass, min-p those at least min_p as likely as the top token; each
// threshold is found by a bisection over e's bits (searching, once the lower bound has
// risen, only the elements above it: `kept`), and a token tied with the last one kept is
// kept too (a sort would cut ties in its own order). Fills e (dropped tokens 0) and its
// 16-element block sums; returns the top token, or -1 when the row is drawable (a row with
// a NaN answers its first NaN, as argmax does; a row of -inf, 0).
template <typename T>
static int64_t filtered_row(const T* x, int64_t n, float inv_t, int64_t top_k, float top_p, float min_p,
                            std::vector<float>& e, std::vector<float>& bsum, std::vector<float>& kept,
                            int64_t& top) {
  top = argmax_row<T>(x, n);
  const float m = static_cast<float>(x[top]);
  if (std::isnan(m) || m == -INFINITY) return top;
  const int64_t blocks = (n + 15) / 16;
  e.resize(n);
  bsum.resize(blocks);
  exp_shifted_row<T>(x, n, m, inv_t, e.data(), bsum.data());
  const bool by_k = top_k > 0 && top_k < n, by_p = top_p < 1.f, by_min_p = min_p > 0.f;
  if (by_k || by_p || by_min_p) {
    int32_t one, tau = 0;
    const float unit = 1.f;
    std::memcpy(&one, &unit, sizeof one);
    int64_t count;
    double mass = 0.0;
    // The bisections count and sum over `cand`: the row's e at first, then only what is at or
    // above the bisection's lower bound (every later query is above it), copied out whenever
    // that is at most half of what is searched. A typical row keeps a few per cent after the
    // first steps, so ~30 passes over the whole row become a few.
    const float* cand = e.data();
    int64_t cn = n;
    auto narrow = [&](int32_t lo, int64_t at_lo) {
      if (2 * at_lo > cn) return;
      if (cand == e.data()) kept.resize(n + 16);
      cn = keep_at_least(cand, cn, lo, kept.data());
      cand = kept.data();
    };
    // The largest threshold in [lo, one] whose tokens (count, mass) still satisfy `keeps`,
    // which holds at lo.
    auto bisect = [&](int32_t lo, auto keeps) {
      int32_t hi = one;
      while (lo < hi) {
        const int32_t mid = lo + (hi - lo + 1) / 2;
        at_least(cand, cn, mid, count, mass);
        if (keeps(count, mass)) {
          lo = mid;
          narrow(lo, count);
        } else {
          hi = mid - 1;
        }
      }
      return lo;
    };
    if (by_k)  // at least k tokens
      tau = bisect(0, [&](int64_t c, double) { return c >= top_k; });
    if (by_p) {  // top_p of the mass that top-k kept
      at_least(cand, cn, tau, count, mass);
      narrow(tau, count);
      const double need = static_cast<double>(top_p) * mass;
      tau = bisect(tau, [&](int64_t, double m) { return m >= need; });
    }
    if (by_min_p) {
      int32_t b;
      std::memcpy(&b, &min_p, sizeof b);
      tau = std::max(tau, std::min(b, one));
    }
    for (int64_t blk = 0; blk < blocks; ++blk) {  // drop what the thresholds drop; block sums again
      float acc = 0.f;
      for (int64_t j = 16 * blk, end = std::min<int64_t>(n, 16 * blk + 16); j < end; ++j) {
        int32_t b;
        std::memcpy(&b, &e[j], sizeof b);
        if (b < tau) e[j] = 0.f;
        acc += e[j];
      }
      bsum[blk] = acc;
    }
  }
  return -1;
}

// Sampling one row by inverse CDF over the filtered e: the first token whose running sum of
// e passes u times the kept total. One uniform per row where the exponential race (argmax
// p / E) needs one per token. The total and the search add the same float block sums in
// double in the same order, so a u below 1 always lands on a kept token.
template <typename T>
static int64_t sample_row(const T* x, int64_t n, float inv_t, int64_t top_k, float top_p, float min_p, float u,
                          std::vector<float>& e, std::vector<float>& bsum, std::vector<float>& kept) {
  int64_t top;
  const int64_t early = filtered_row<T>(x, n, inv_t, top_k, top_p, min_p, e, bsum, kept, top);
  if (early >= 0) return early;
  const int64_t blocks = (n + 15) / 16;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) total += bsum[b];
  const double target = static_cast<double>(u) * total;
  double cum = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (cum + bsum[b] > target) {
      const int64_t end = std::min<int64_t>(n, 16 * b + 16);
      int64_t last = -1;
      for (int64_t j = 16 * b; j < end; ++j) {
        if (e[j] <= 0.f) continue;
        cum += e[j];
        last = j;
        if (cum > target) return j;
      }
      if (last >= 0) return last;  // the block's float sum rounded above its elements' double sum
    }
    cum += bsum[b];
  }
  return top;  // u * total rounded onto the total itself: the likeliest token
}

// splitmix64's finalizer: a counter-based stream, token j of key k is mix(k + (j + 1) * golden).
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Sampling one row by the exponential race over the filtered e: argmax e_j / E_j with E_j =
// -log U_j ~ Exp(1), U_j in (0, 1) from 53 bits of a hash of (key, token id). Exact sampling
// like the inverse CDF, but a token's noise belongs to the token: the winner changes only if
// the logits change enough to reorder it against a contender, where the inverse CDF's pick
// moves whenever any earlier token's mass or the top-p cut moves by a last bit (a seeded
// request resumed on recomputed KV draws from logits a few ulps away from the first run's).
template <typename T>
static int64_t race_row(const T* x, int64_t n, float inv_t, int64_t top_k, float top_p, float min_p, uint64_t key,
                        std::vector<float>& e, std::vector<float>& bsum, std::vector<float>& kept) {
  int64_t top;
  const int64_t early = filtered_row<T>(x, n, inv_t, top_k, top_p, min_p, e, bsum, kept, top);
  if (early >= 0) return early;
  // -log U >= 1 - U, so e_j / (1 - U_j) bounds the score from above: a token that cannot beat
  // the best so far (nearly all of them once a few hundred are seen) costs a hash, no logarithm.
  // The hashes and bounds go 16 at a time (loops the compiler vectorizes), and a block none of
  // whose bounds beats the best is skipped whole: no branch per token (dropped tokens, e = 0,
  // fall out with the rest since best starts at 0, where a branch on them mispredicts often).
  constexpr int64_t B = 16;
  alignas(64) double u[B];
  alignas(64) double ev[B];
  double best = 0.0;
  int64_t pick = top;
  for (int64_t j0 = 0; j0 < n; j0 += B) {
    const int64_t m = std::min<int64_t>(B, n - j0);
    for (int64_t i = 0; i < B; ++i) {
      const uint64_t z = mix64(key + static_cast<uint64_t>(j0 + i + 1) * 0x9E3779B97F4A7C15ULL);
      u[i] = (static_cast<double>(static_cast<int64_t>(z >> 11)) + 0.5) * 0x1.0p-53;
    }
    if (m == B) {
      for (int64_t i = 0; i < B; ++i) ev[i] = static_cast<double>(e[j0 + i]);
    } else {
      for (int64_t i = 0; i < B; ++i) ev[i] = i < m ? static_cast<double>(e[j0 + i]) : 0.0;
    }
    bool any = false;
    for (int64_t i = 0; i < B; ++i) any |= ev[i] > best * (1.0 - u[i]);
    if (!any) continue;
    for (int64_t i = 0; i < m; ++i) {
      const double ej = ev[i];
      if (ej <= best * (1.0 - u[i])) continue;
      const double score = ej / -std::log(u[i]);
      if (score > best) {
        best = score;
        pick = j0 + i;
      }
    }
  }
  return pick;
}

// The checks both draws share: contiguous [rows, n] logits, and float32 inv_temp, top_p and
// min_p and int64 top_k, one per row. Returns rows.
static int64_t checked_rows(const torch::Tensor& logits, const torch::Tensor& inv_temp, const torch::Tensor& top_k,
                            const torch::Tensor& top_p, const torch::Tensor& min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0, "contiguous [rows, n] logits");
  const int64_t rows = logits.size(0);
  for (const auto* t : {&inv_temp, &top_p, &min_p})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == rows,
                "float32 inv_temp, top_p and min_p, one per row");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == rows,
              "int64 top_k, one per row");
  return rows;
}

// The row loop both draws share (checked_rows first): draw(row, n, inv_t, top_k, top_p, min_p,
// r, scratch...) per row, with per-thread scratch; int64 [rows] out.
template <typename Draw>
static torch::Tensor draw_rows(const torch::Tensor& logits, const torch::Tensor& inv_temp, const torch::Tensor& top_k,
                               const torch::Tensor& top_p, const torch::Tensor& min_p, Draw draw) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  const float *tp = inv_temp.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  dispatch_float(logits, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = logits.data_ptr<T>();
    parallel_rows(rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> e, bsum, kept;
      for (int64_t r = r0; r < r1; ++r) op[r] = draw(xp + r * n, n, tp[r], kp[r], pp[r], mp[r], r, e, bsum, kept);
    });
  });
  return out;
}

// Sampling: row r of `logits` [rows, n] (bfloat16 or float32) drawn from softmax(logits[r] *
// inv_temp[r]) after top_k[r] (int64, 0: off), top_p[r] (1: off) and min_p[r] (0: off), with
// the uniform u[r] in [0, 1). Exact sampling, as the sampler's exponential race is, without
// a random number per token and without sorting (sampler.py).
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor inv_temp, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p, torch::Tensor u) {
  const int64_t rows = checked_rows(logits, inv_temp, top_k, top_p, min_p);
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.is_contiguous() && u.numel() == rows, "float32 u, one per row");
  const float* up = u.data_ptr<float>();
  return draw_rows(logits, inv_temp, top_k, top_p, min_p,
                   [up](const auto* x, int64_t n, float inv_t, int64_t k, float p, float mp, int64_t r,
                        std::vector<float>& e, std::vector<float>& bsum, std::vector<float>& kept) {
                     return sample_row(x, n, inv_t, k, p, mp, up[r], e, bsum, kept);
                   });
}

// Seeded sampling: as sample_rows, by the exponential race with each token's noise keyed by
// (keys[r], token id) (int64 keys, one per row; the sampler derives a key from a request's
// seed and output position), so a draw depends on nothing but its own row.
torch::Tensor race_rows(torch::Tensor logits, torch::Tensor inv_temp, torch::Tensor top_k, torch::Tensor top_p,
                        torch::Tensor min_p, torch::Tensor keys) {
  const int64_t rows = checked_rows(logits, inv_temp, top_k, top_p, min_p);
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.is_contiguous() && keys.numel() == rows,
              "int64 keys, one per row");
  const int64_t* keyp = keys.data_ptr<int64_t>();
  return draw_rows(logits, inv_temp, top_k, top_p, min_p,
                   [keyp](const auto* x, int64_t n, float inv_t, int64_t k, float p, float mp, int64_t r,
                          std::vector<float>& e, std::vector<float>& bsum, std::vector<float>& kept) {
                     return race_row(x, n, inv_t, k, p, mp, static_cast<uint64_t>(keyp[r]), e, bsum, kept);
                   });
}

// float32 -> bfloat16 through the kernels' own store (vec512.h's store16 where the build has
// AVX-512, c10's rounding elsewhere): tests hold it bit for bit to torch's conversion.
torch::Tensor to_bfloat16(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "contiguous float32");
  auto out = torch::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const float* xp = x.data_ptr<float>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t n = x.numel();
  parallel_for(0, (n + 15) / 16, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t i = b * 16;
#if defined(__AVX512F__)
      if (i + 16 <= n) {
        store16(op + i, _mm512_loadu_ps(xp + i));
        continue;
      }
#endif
      for (; i < std::min(n, b * 16 + 16); ++i) op[i] = static_cast<bf16>(xp[i]);
    }
  });
  return out;
}

bool fused_ops_available() { return true; }
