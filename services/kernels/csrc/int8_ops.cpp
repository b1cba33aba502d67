// The element-wise halves of ferry's int8 linear layers (services/worker/quantize.py).
//
// The product itself is PyTorch's own int8 matmul (torch._int_mm: int8 x int8 -> int32,
// oneDNN's VNNI kernels on x86). What is left around it is two passes over memory:
//  - quant_rows: each activation row (token) to int8 with its own scale, after dividing each
//    input channel by its SmoothQuant factor (x' = x * inv_smooth, when given),
//      scale = max(max|x'|, 1e-10) / 127,  q = clamp(round_half_even(x' / scale), -127, 127);
//  - dequant_rows: the int32 accumulators back to the model's dtype,
//      y = (float(acc) * row_scale) * col_scale (+ bias), rounded once to bfloat16 / float32.
// Both compute exactly what quantize.py's PyTorch fallback computes (same operations in
// the same order, no fused multiply-add), so the two paths agree bit for bit; in PyTorch
// ops they take several passes and a float32 temporary the size of the product.
// Inputs: contiguous rows; bfloat16 or float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include "vec512.h"
#endif

namespace {

constexpr float kMinAmax = 1e-10f;

int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

// x * inv_smooth (per input channel; nullptr: 1), as float32.
template <typename T>
inline float smoothed(const T* x, const float* inv_smooth, int64_t i) {
  return inv_smooth == nullptr ? static_cast<float>(x[i]) : static_cast<float>(x[i]) * inv_smooth[i];
}

template <typename T>
void quant_row(const T* x, const float* inv_smooth, int8_t* q, float* s, int64_t k) {
  float amax = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    __m512 m = _mm512_setzero_ps();
    if (inv_smooth == nullptr) {
      for (; i + 16 <= k; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x + i)));
    } else {
      for (; i + 16 <= k; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_mul_ps(load16(x + i), load16(inv_smooth + i))));
    }
    amax = _mm512_reduce_max_ps(m);
  }
#endif
  for (; i < k; ++i) amax = std::max(amax, std::abs(smoothed(x, inv_smooth, i)));
  const float scale = std::max(amax, kMinAmax) / 127.f;
  *s = scale;
  i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (; i + 16 <= k; i += 16) {
      __m512 v = load16(x + i);
      if (inv_smooth != nullptr) v = _mm512_mul_ps(v, load16(inv_smooth + i));
      v = _mm512_roundscale_ps(_mm512_div_ps(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
  }
#endif
  for (; i < k; ++i) {
    const float v = std::nearbyint(smoothed(x, inv_smooth, i) / scale);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
}

// No fused multiply-add here: PyTorch's fallback rounds the product before adding the bias.
// acc: int32, or float32 holding the same integers exactly (oneDNN's products, |acc| < 2^24).
template <typename T, typename A>
__attribute__((optimize("fp-contract=off")))
void dequant_row(const A* acc, float sx, const float* sw, const float* bias, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    const __m512 a = _mm512_set1_ps(sx);
    for (; i + 16 <= n; i += 16) {
      __m512 f;
      if constexpr (std::is_same_v<A, float>) f = _mm512_loadu_ps(acc + i);
      else f = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + i));
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(f, a), _mm512_loadu_ps(sw + i));
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + i));
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(out + i, v);
      } else {
        store16(out + i, v);
      }
    }
  }
#endif
  for (; i < n; ++i) {
    float v = static_cast<float>(acc[i]) * sx * sw[i];
    if (bias != nullptr) v = v + bias[i];
    out[i] = static_cast<T>(v);
  }
}

}  // namespace

// x: [rows, k] bfloat16 or float32, contiguous; inv_smooth: [k] float32 or None (SmoothQuant's
// per-channel 1/s) -> {q [rows, k] int8, scales [rows] float32}.
std::vector<torch::Tensor> quant_rows(torch::Tensor x, c10::optional<torch::Tensor> inv_smooth) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant_rows: a contiguous [rows, k] input");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "quant_rows: bfloat16 or float32");
  const int64_t rows = x.size(0), k = x.size(1);
  const float* sm = nullptr;
  if (inv_smooth.has_value() && inv_smooth->defined()) {
    TORCH_CHECK(inv_smooth->scalar_type() == at::kFloat && inv_smooth->is_contiguous() && inv_smooth->numel() == k,
                "quant_rows: float32 inv_smooth, one per input channel");
    sm = inv_smooth->data_ptr<float>();
  }
  auto q = torch::empty({rows, k}, x.options().dtype(at::kChar));
  auto s = torch::empty({rows}, x.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    parallel_for(0, rows, grain(k), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) quant_row<scalar_t>(xp + r * k, sm, qp + r * k, sp + r, k);
    });
  });
  return {q, s};
}

// acc: [rows, n] int32 (or float32 holding integers exactly); row_scale [rows], col_scale [n], bias [n] or None: float32 -> bfloat16 or float32.
torch::Tensor dequant_rows(torch::Tensor acc, torch::Tensor row_scale, torch::Tensor col_scale,
                           c10::optional<torch::Tensor> bias, bool out_bf16) {
  const auto out_dtype = out_bf16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && (acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat),
              "dequant_rows: contiguous int32 or float32 [rows, n]");
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() && row_scale.numel() == rows, "row scales");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() && col_scale.numel() == n, "column scales");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "float32 bias");
    bp = bias->data_ptr<float>();
  }
  auto out = torch::empty({rows, n}, acc.options().dtype(out_dtype));
  const bool int_acc = acc.scalar_type() == at::kInt;
  const int32_t* ap = int_acc ? acc.data_ptr<int32_t>() : nullptr;
  const float* fp = int_acc ? nullptr : acc.data_ptr<float>();
  const float* rs = row_scale.data_ptr<float>();
  const float* cs = col_scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out_dtype, "dequant_rows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (int_acc) dequant_row<scalar_t>(ap + r * n, rs[r], cs, bp, op + r * n, n);
        else dequant_row<scalar_t>(fp + r * n, rs[r], cs, bp, op + r * n, n);
      }
    });
  });
  return out;
}
