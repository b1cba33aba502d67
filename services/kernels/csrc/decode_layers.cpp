// A decode step's whole decoder body in one call (lean_forward.py's fused path, every layer on
// the tiled bfloat16 kernels): the same kernels in the same order on the same tensors as the
// Python loop, so the same bits, without ~12 Python-to-C++ calls and their glue per layer. (On
// AMX the q/k/v product applies RoPE in its epilogue, amx_rope_linear, as the loop's PackedLinear
// does at these rows: the bits of the product then rotary.)
//
// At batch 1 a SmolLM2-135M decode step spent ~2 ms of its ~8 in the small per-layer calls
// (split + rotary 16 us a layer, the backend's attention call 27 us, each norm ~8 us) and the
// framework between them, against ~4.6 ms reading the weights (docs/benchmarks.md, "A decode
// step against memory bandwidth").
//
// x [T, hidden] (the embedded tokens), cos/sin [T, head_dim]; per layer, in `weights`, 10
// tensors: input norm, post-attention norm, q/k/v tiles and bias, o_proj tiles and bias,
// gate/up tiles and bias, down tiles and bias (a bias an empty tensor when there is none);
// `caches`: each layer's key and value caches; eps: each layer's two norms' then the final
// norm's; slots [T] int64, block_table [T, max_blocks] int32, seq_lens [T] int32 as
// write_kv and paged_decode take them. Returns the final norm's output, [T, hidden].
//
// packed: empty, or per layer 8 tensors, oneDNN's packed q/k/v, o_proj, gate/up and down weights
// then their biases in the model's dtype (empty tensors where none), where oneDNN keeps its copy
// beside the tiles (a CPU with AMX, or FERRY_CPU_TILED_LINEAR=small): a step of more than
// `tiled_rows` tokens takes its products there, as PackedLinear does (mkldnn::_linear_pointwise;
// the gate/up product then silu_and_mul, as FusedSiluMLP), the rest of the step unchanged. On
// a CPU with AMX such a step takes AMX tile products over the tiles instead (amx_linear and
// amx_silu_linear, tiled_linear.cpp), oneDNN's copy only under tiled_amx(0) or for shapes the
// AMX products do not take.
//
// times (optional, float64 [2, 4], added to): seconds in the norms, the products, the rotary
// embedding and the attention (cache write, decode kernel and their dtype conversions), wall
// clock in row 0 and the process's CPU time in row 1, for the profilers (bench_profile.py,
// bench_offline --attention-share), which otherwise see this call as one opaque op.

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <time.h>
#include <optional>
#include <vector>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                           torch::Tensor seq_lens, double scale, bool bf16_dot);
torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias);
torch::Tensor tiled_silu_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias);
torch::Tensor amx_silu_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias);
torch::Tensor amx_rope_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias, torch::Tensor cos,
                              torch::Tensor sin, int64_t rope_cols, int64_t head_dim);
int64_t amx_linear_rows();

// oneDNN's product over its packed weight, the op PackedLinear.forward calls (the same bits).
static torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias.numel() ? c10::IValue(bias) : c10::IValue(), c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}
constexpr int64_t DECODE_LAYER_PACKED = 8;

constexpr int64_t DECODE_LAYER_TENSORS = 10;

// Whether AMX q/k/v products take the rotary embedding as their epilogue (amx_rope_linear),
// here and in lean_forward.py's prompt steps: mode 0 off, 1 on, anything else only asks;
// returns whether they do from now on (for A/B runs and tests).
static bool g_rope_in_product = true;
bool amx_rope(int64_t mode) {
  if (mode == 0 || mode == 1) g_rope_in_product = mode == 1;
  return g_rope_in_product && amx_linear_rows() > 0;
}

// The parts' clocks: two clock reads at each boundary, and nothing at all without `times`.
class PartClock {
 public:
  enum Part { NORM = 0, LINEAR = 1, ROPE = 2, ATTENTION = 3, PARTS = 4 };
  explicit PartClock(double* times) : times_(times) { lap(); }
  // Charges the time since the last boundary to `part`.
  void charge(Part part) {
    if (times_ == nullptr) return;
    const double wall = wall_, cpu = cpu_;
    lap();
    times_[part] += wall_ - wall;
    times_[PARTS + part] += cpu_ - cpu;
  }

 private:
  static double seconds(clockid_t id) {
    timespec ts;
    clock_gettime(id, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  void lap() {
    if (times_ == nullptr) return;
    wall_ = seconds(CLOCK_MONOTONIC);
    cpu_ = seconds(CLOCK_PROCESS_CPUTIME_ID);
  }
  double* times_;
  double wall_ = 0, cpu_ = 0;
};

torch::Tensor decode_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> weights,
                            std::vector<torch::Tensor> caches, std::vector<double> eps, std::vector<double> scales,
                            torch::Tensor final_norm, torch::Tensor slots, torch::Tensor block_table,
                            torch::Tensor seq_lens, int64_t heads, int64_t kv_heads, int64_t head_dim, bool bf16_dot,
                            std::vector<torch::Tensor> packed, int64_t tiled_rows, std::optional<torch::Tensor> times) {
  const int64_t layers = static_cast<int64_t>(scales.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == DECODE_LAYER_TENSORS * layers &&
              static_cast<int64_t>(caches.size()) == 2 * layers && static_cast<int64_t>(eps.size()) == 2 * layers + 1,
              "per layer: 10 weights, 2 caches, 2 norm epsilons, a scale; and the final norm's epsilon");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [tokens, hidden], contiguous");
  const int64_t T = x.size(0), qw = heads * head_dim, kw = kv_heads * head_dim;
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == T && block_table.dim() == 2 && block_table.size(0) == T,
              "every token a decode: one block-table row and one length per token");
  TORCH_CHECK(packed.empty() || static_cast<int64_t>(packed.size()) == DECODE_LAYER_PACKED * layers,
              "packed: none, or per layer 4 oneDNN weights and 4 biases");
  const bool past_tiled = T > tiled_rows;
  // Past the tiled kernel's rows: AMX tile products over the same tiles where the CPU has AMX
  // (tiled_linear.cpp's amx_linear, up to its rows; every product's N and K multiples of 32),
  // else oneDNN's: as PackedLinear and FusedSiluMLP choose.
  bool on_amx = past_tiled && T <= amx_linear_rows();
  for (int64_t l = 0; on_amx && l < layers; ++l)
    for (int64_t i : {2, 4, 6, 8}) {
      const torch::Tensor& tiles = weights[DECODE_LAYER_TENSORS * l + i];
      on_amx = on_amx && tiles.dim() == 3 && tiles.size(0) % 2 == 0 && tiles.size(1) % 16 == 0;
    }
  const bool on_onednn = past_tiled && !on_amx;
  // the rotary embedding in the q/k/v product's epilogue (bfloat16 cos/sin, heads a multiple of 32 wide)
  const bool rope_in_product = g_rope_in_product && cos.scalar_type() == at::kBFloat16 && head_dim % 32 == 0 &&
                               cos.is_contiguous() && sin.is_contiguous();
  TORCH_CHECK(!on_onednn || !packed.empty(), "more tokens than the tiled kernels take and no oneDNN weights");
  if (times.has_value())
    TORCH_CHECK(times->scalar_type() == at::kDouble && times->is_contiguous() &&
                times->numel() == 2 * PartClock::PARTS, "times: float64 [2, 4], contiguous");
  PartClock clock(times.has_value() ? times->data_ptr<double>() : nullptr);
  const bool fp8 = caches[0].scalar_type() == at::kFloat8_e4m3fn;
  torch::Tensor h = rms_norm(x, weights[0], eps[0]);
  clock.charge(PartClock::NORM);
  torch::Tensor delta;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + DECODE_LAYER_TENSORS * l;
    const torch::Tensor* pw = on_onednn ? packed.data() + DECODE_LAYER_PACKED * l : nullptr;  // weights, then biases
    const torch::Tensor &k_cache = caches[2 * l], &v_cache = caches[2 * l + 1];
    if (l > 0) {
      auto sum_norm = add_rms_norm(x, delta, w[0], eps[2 * l]);
      x = sum_norm[0], h = sum_norm[1];
      clock.charge(PartClock::NORM);
    }
    // on AMX the rotary embedding is the q/k/v product's epilogue (amx_rope_linear: the same bits)
    const bool rope_fused = on_amx && rope_in_product;
    const torch::Tensor qkv = rope_fused ? amx_rope_linear(h, w[2], w[3], cos, sin, qw + kw, head_dim)
                              : on_amx   ? amx_linear(h, w[2], w[3])
                              : pw       ? onednn_linear(h, pw[0], pw[4])
                                         : tiled_linear(h, w[2], w[3]);  // [T, qw + 2 kw]
    TORCH_CHECK(qkv.size(1) == qw + 2 * kw, "q/k/v widths");
    clock.charge(PartClock::LINEAR);
    std::vector<torch::Tensor> qk;
    if (rope_fused) {
      qk = {qkv.narrow(1, 0, qw).view({T, heads, head_dim}), qkv.narrow(1, qw, kw).view({T, kv_heads, head_dim})};
    } else {
      qk = rotary(qkv.narrow(1, 0, qw).view({T, heads, head_dim}), qkv.narrow(1, qw, kw).view({T, kv_heads, head_dim}),
                  cos, sin);
      clock.charge(PartClock::ROPE);
    }
    const torch::Tensor v = qkv.narrow(1, qw + kw, kw).view({T, kv_heads, head_dim});
    // as the backend's forward: keys and values in the cache's dtype (a float8 cache converts them itself)
    write_kv(fp8 ? qk[1] : qk[1].to(k_cache.scalar_type()), fp8 ? v : v.to(v_cache.scalar_type()), k_cache, v_cache,
             slots);
    const torch::Tensor q = fp8 ? qk[0] : qk[0].to(k_cache.scalar_type());  // paged_decode takes a token stride
    const torch::Tensor o = paged_decode(q, k_cache, v_cache, block_table, seq_lens, scales[l], bf16_dot)
                                .to(x.scalar_type());
    clock.charge(PartClock::ATTENTION);
    const torch::Tensor o2 = o.reshape({T, qw});
    const torch::Tensor projected = on_amx ? amx_linear(o2, w[4], w[5])
                                    : pw   ? onednn_linear(o2, pw[1], pw[5])
                                           : tiled_linear(o2, w[4], w[5]);
    clock.charge(PartClock::LINEAR);
    auto sum_norm = add_rms_norm(x, projected, w[1], eps[2 * l + 1]);
    x = sum_norm[0], h = sum_norm[1];
    clock.charge(PartClock::NORM);
    delta = on_amx ? amx_linear(amx_silu_linear(h, w[6], w[7]), w[8], w[9])
            : pw   ? onednn_linear(silu_and_mul(onednn_linear(h, pw[2], pw[6])), pw[3], pw[7])
                   : tiled_linear(tiled_silu_linear(h, w[6], w[7]), w[8], w[9]);
    clock.charge(PartClock::LINEAR);
  }
  torch::Tensor out = add_rms_norm(x, delta, final_norm, eps[2 * layers])[1];
  clock.charge(PartClock::NORM);
  return out;
}
