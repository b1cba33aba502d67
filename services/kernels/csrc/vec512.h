// AVX-512 helpers shared by ferry's CPU kernels (paged_decode.cpp, fused_ops.cpp).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Float8_e4m3fn.h>

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// float8 e4m3 (a KV cache of one byte per element): its seven magnitude bits moved into a
// float16's exponent and mantissa give the value times 2^-8 (normals and subnormals alike:
// the exponent biases differ by 8), so widen as float16 and scale by 256.
static inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

// exp(x) for x <= 0 (scores minus their max); relative error ~1e-7. Zero below -87, as
// vec256.h's exp8: 2^n past float32's normal range (the old clamp at -100 made e^-100, a
// subnormal) costs a microcode assist on Intel cores per vector holding one, and every masked
// or padded score (-inf) made one. The decode kernel's softmax took 4x as long on a Xeon
// (docs/benchmarks.md, "Kernels: decode attention"); only results below 1.7e-38 change.
static inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);  // NaN: 0
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // |f| <= ln2/2
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// 2^t in the lanes of `mask` (zero in the others), for t < 128 (log2 units; the prompt
// kernel's t reach 64 past its kept reference), and 2^-126 (a normal float, nothing a
// bfloat16 probability or its sum can tell from zero) for t <= -126 or NaN: the clamp's max
// returns its second operand for a NaN. 2^floor(t) times a degree-4 polynomial for 2^f,
// f = t - floor(t) in [0, 1) (vreduceps, one instruction, and vscalefps takes floor(t) from t
// itself), fitted for the least largest relative error: < 2.7e-6, for the prompt kernel's
// probabilities, which are rounded to bfloat16 (2^-9) next. Every result is normal (p(0) > 1):
// subnormal results cost a microcode assist, as exp16 says.
#if defined(__AVX512DQ__)  // vreduceps
static inline __m512 exp2_16(__m512 t, __mmask16 mask) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.013534121215343475f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.052011482417583466f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24144279956817627f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6930038332939148f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226043701f));
  return _mm512_maskz_scalef_ps(mask, p, t);
}
#endif

// Sixteen floats to bfloat16, rounded to nearest even as c10::BFloat16 rounds (NaN -> 0x7FC0).
static inline __m256i to_bf16x16_exact(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
// With AVX512-BF16 one instruction rounds to nearest even as above, but it reads float32
// subnormals as zero and keeps a NaN's sign and payload: any lane of those kinds (never in a
// forward that is going well) takes the exact path, so the result is the same bits.
static inline __m256i to_bf16x16(__m512 x) {
  if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0xA1) != 0, 0)) return to_bf16x16_exact(x);  // NaN, subnormal
  return (__m256i)_mm512_cvtneps_pbh(x);
}
#else
static inline __m256i to_bf16x16(__m512 x) { return to_bf16x16_exact(x); }
#endif
static inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(x));
}
// Round sixteen floats to bfloat16 and back: what storing an intermediate bfloat16 tensor does.
static inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(x)), 16));
}

// silu(g) = g * sigmoid(g), the sigmoid from e^-|g| alone (never overflows): 1 / (1 + e^-g)
// for g >= 0, e^g / (1 + e^g) below. fused_ops.cpp's silu_and_mul and tiled_linear.cpp's
// gated product both compute it here, so they give the same bits.
static inline __m512 silu16(__m512 gv) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m512 e = exp16(neg_abs);
  const __m512 denom = _mm512_add_ps(one, e);
  const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mul_ps(gv, _mm512_div_ps(_mm512_mask_mov_ps(one, neg, e), denom));
}
#endif
