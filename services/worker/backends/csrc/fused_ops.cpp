// ferry's fused element-wise ops for bfloat16 on the CPU (services/worker/fused_ops.py).
//
// transformers' bfloat16 RMSNorm, rotary embedding and SiLU-and-multiply are five to ten
// small PyTorch ops each, every one a pass over memory with a bfloat16 round trip. These
// do each in one pass, sixteen lanes at a time, and round to bfloat16 exactly where the
// PyTorch ops store a bfloat16 tensor, so their outputs equal transformers' bit for bit
// except where a float32 sum is taken in another order (RMSNorm's mean of squares) or
// exp differs in its last bits (SiLU): there at most one bfloat16 step apart.
//
// Inputs: contiguous bfloat16 rows (rotary: query/key rows with any stride between tokens
// and heads, the head's own elements contiguous). Without AVX-512 these ops are absent
// and fused_ops.py leaves the model as it is.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

#if defined(__AVX512F__)
#include "vec512.h"

using bf16 = c10::BFloat16;

// Rows per parallel task: enough work per task that a step of a few tokens runs on one thread.
static int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

// out = weight * bf16(x * rsqrt(mean(x^2) + eps)), as LlamaRMSNorm computes it in bfloat16.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 inputs");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs");
  const int64_t n = x.size(-1);
  TORCH_CHECK(n % 16 == 0 && weight.numel() == n, "row length a multiple of 16, one weight per element");
  const int64_t rows = x.numel() / n;
  auto out = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* xr = xp + r * n;
      bf16* orow = op + r * n;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = load16(xr + i);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float var = _mm512_reduce_add_ps(acc) / static_cast<float>(n);
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(var + feps));
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 y = round_bf16(_mm512_mul_ps(load16(xr + i), inv));
        store16(orow + i, _mm512_mul_ps(load16(wp + i), y));
      }
    }
  });
  return out;
}

// The residual add and the next RMSNorm in one pass: sum = bf16(x + delta) (what
// `x + delta` stores), normed = rms_norm(sum). Returns {sum, normed}.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && delta.scalar_type() == at::kBFloat16 &&
              weight.scalar_type() == at::kBFloat16, "bfloat16 inputs");
  TORCH_CHECK(x.is_contiguous() && delta.is_contiguous() && weight.is_contiguous() && x.sizes() == delta.sizes(),
              "contiguous inputs of one shape");
  const int64_t n = x.size(-1);
  TORCH_CHECK(n % 16 == 0 && weight.numel() == n, "row length a multiple of 16, one weight per element");
  const int64_t rows = x.numel() / n;
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* dp = delta.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* sp = sum.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      bf16* srow = sp + r * n;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = round_bf16(_mm512_add_ps(load16(xp + r * n + i), load16(dp + r * n + i)));
        store16(srow + i, v);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float var = _mm512_reduce_add_ps(acc) / static_cast<float>(n);
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(var + feps));
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 y = round_bf16(_mm512_mul_ps(load16(srow + i), inv));
        store16(op + r * n + i, _mm512_mul_ps(load16(wp + i), y));
      }
    }
  });
  return {sum, out};
}

// x: [..., 2 * d] (gate | up) -> [..., d] = bf16(bf16(silu(gate)) * up), as act_fn(gate) * up does.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "contiguous bfloat16 input");
  const int64_t d = x.size(-1) / 2;
  TORCH_CHECK(d % 16 == 0 && x.size(-1) == 2 * d, "an even split into multiples of 16");
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  auto out = torch::empty(sizes, x.options());
  const int64_t rows = x.numel() / (2 * d);
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t r0, int64_t r1) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* g = xp + r * 2 * d;
      const bf16* u = g + d;
      bf16* orow = op + r * d;
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 gv = load16(g + i);
        // sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below: exp only of -|x|.
        const __m512 neg_abs = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(gv), _mm512_andnot_si512(abs_mask, _mm512_set1_epi32(-1))));
        const __m512 e = exp16(neg_abs);
        const __m512 denom = _mm512_add_ps(one, e);
        const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 sig = _mm512_div_ps(_mm512_mask_mov_ps(one, neg, e), denom);
        const __m512 act = round_bf16(_mm512_mul_ps(gv, sig));
        store16(orow + i, _mm512_mul_ps(act, load16(u + i)));
      }
    }
  });
  return out;
}

// One of query/key: [tokens, heads, head_dim] with any token and head strides, head_dim
// contiguous; cos/sin [tokens, head_dim] contiguous. Returns a contiguous
// [tokens, heads, head_dim] = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), as
// transformers' apply_rotary_pos_emb computes it in bfloat16.
static torch::Tensor rope_one(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(x.stride(2) == 1 && half % 16 == 0, "head_dim contiguous, a multiple of 32");
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const int64_t st = x.stride(0), sh = x.stride(1);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const bf16* c = cp + t * dim;
      const bf16* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const bf16* xr = xp + t * st + h * sh;
        bf16* orow = op + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 lo = load16(xr + i), hi = load16(xr + half + i);
          // first half: x*cos + (-x_hi)*sin; second half: x*cos + x_lo*sin
          const __m512 a = round_bf16(_mm512_mul_ps(lo, load16(c + i)));
          const __m512 b = round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), load16(s + i)));
          store16(orow + i, _mm512_add_ps(a, b));
          const __m512 a2 = round_bf16(_mm512_mul_ps(hi, load16(c + half + i)));
          const __m512 b2 = round_bf16(_mm512_mul_ps(lo, load16(s + half + i)));
          store16(orow + half + i, _mm512_add_ps(a2, b2));
        }
      }
    }
  });
  return out;
}

std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16, "bfloat16 query and key");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16, "bfloat16 cos/sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "contiguous cos/sin");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "[tokens, heads, dim]");
  TORCH_CHECK(cos.numel() == q.size(0) * q.size(2) && sin.numel() == cos.numel(), "cos/sin: [tokens, head_dim]");
  return {rope_one(q, cos, sin), rope_one(k, cos, sin)};
}

bool fused_ops_available() { return true; }
#else
torch::Tensor rms_norm(torch::Tensor, torch::Tensor, double) { TORCH_CHECK(false, "built without AVX-512"); }
torch::Tensor silu_and_mul(torch::Tensor) { TORCH_CHECK(false, "built without AVX-512"); }
std::vector<torch::Tensor> add_rms_norm(torch::Tensor, torch::Tensor, torch::Tensor, double) {
  TORCH_CHECK(false, "built without AVX-512");
}
std::vector<torch::Tensor> rotary(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "built without AVX-512");
}
bool fused_ops_available() { return false; }
#endif
