"""Memory arithmetic shared by the worker (sizing its KV cache at start-up) and
``ferry plan`` (sizing a deployment), so the two can never disagree.

It owns four things, all pure functions of an HF config dict (no torch here):

- dtype names and sizes (``DTYPE_BYTES``, ``normalize_dtype``, ``resolve_dtype``,
  ``resolve_kv_dtype``);
- the shape of the KV cache and its size (``kv_shape_from_config``,
  ``kv_bytes_per_token``, ``kv_block_bytes``, ``num_kv_blocks``,
  ``blocks_for_tokens``, ``max_concurrency``);
- the parameter count and weight bytes (``count_parameters``, ``weight_bytes``),
  including GQA/MQA projections and tied or separate embeddings;
- the GPU KV budget: device memory times the utilization fraction minus weights,
  the activation peak, runtime overhead and a safety margin (``gpu_kv_budget_bytes``,
  ``activation_peak_bytes``). On CPU the budget is exactly ``--kv-cache-memory``.

The worker passes *measured* weight and activation bytes to ``gpu_kv_budget_bytes``;
``ferry plan`` passes the estimates from this module. The block arithmetic after
the budget is identical.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32", "float": "float32", "torch.float32": "float32",
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "torch.float16": "float16",
    "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8_e5m2": "fp8", "float8_e4m3fn": "fp8",
}

# Runtime memory outside weights, activations and KV on a GPU: the CUDA context,
# cuBLAS/attention workspaces and captured graphs. A rough constant; the worker
# measures the real value instead.
GPU_RUNTIME_OVERHEAD_BYTES = 1 << 30


def normalize_dtype(name: str) -> str:
    """Canonical dtype name ('bf16' -> 'bfloat16'); raises ValueError for unknown names."""
    key = name.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; expected one of float32, bfloat16, float16, fp8")
    return key


# CPU flags of native bfloat16 matrix support (Intel AMX, AVX-512 BF16). Where present,
# bf16 measured 1.5-2.2x fp32 throughput in ferry's engine at batch 1 and 8 alike
# (docs/worker.md); without them bf16 is emulated and slower than fp32.
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    return not BF16_CPU_FLAGS.isdisjoint(line.split(":", 1)[1].split())
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str, device: str, cpu_bf16: bool | None = None) -> str:
    """What 'auto' means, the one rule the worker's loader and ``ferry plan`` share:
    bfloat16 on a GPU; on a CPU bfloat16 where it has native bf16 matrix instructions
    (``cpu_bf16``, detected from /proc/cpuinfo when None), else float32."""
    if dtype != "auto":
        return normalize_dtype(dtype)
    if not device.startswith("cpu"):
        return "bfloat16"
    native = cpu_has_native_bf16() if cpu_bf16 is None else cpu_bf16
    return "bfloat16" if native else "float32"


def resolve_kv_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """'auto' keeps the KV cache in the model dtype."""
    return normalize_dtype(dtype if kv_cache_dtype == "auto" else kv_cache_dtype)


@dataclass(frozen=True)
class ModelShape:
    """The sizes that memory depends on, normalized across config spellings."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    gated_mlp: bool  # gate+up+down (SwiGLU) vs up+down
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    norm_bias: bool  # LayerNorm (weight+bias) vs RMSNorm (weight)
    norms_per_layer: int
    num_learned_positions: int  # absolute position embeddings (0 with RoPE)
    qk_norm: bool  # per-head q/k RMSNorm (Qwen3)
    num_experts: int  # 0: dense MLP
    expert_intermediate_size: int


def _first(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        value = config.get(key)
        if value is not None:
            return value
    return default


_UNGATED = {"gpt2", "gpt_bigcode", "falcon", "gpt_neox", "opt", "phi", "bloom", "gptj"}
_LAYERNORM = _UNGATED  # these families use LayerNorm with a bias


def _num_kv_heads(config: Mapping[str, Any], model_type: str, num_heads: int) -> int:
    if model_type == "falcon":
        if config.get("new_decoder_architecture"):
            return int(_first(config, "num_kv_heads", default=num_heads))
        return 1 if config.get("multi_query", True) else num_heads
    if model_type == "gpt_bigcode":
        return 1 if config.get("multi_query", True) else num_heads
    return int(_first(config, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=num_heads) or num_heads)


def _norms_per_layer(config: Mapping[str, Any], model_type: str) -> int:
    if model_type == "falcon" and not config.get("new_decoder_architecture"):
        return 1 if config.get("parallel_attn", True) else 2
    if model_type in ("gemma2", "gemma3_text"):
        return 4  # pre and post norms around attention and MLP
    return 2


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """Normalize an HF config dict (Llama-style, GPT-2-style or Falcon-style keys)."""
    if "text_config" in config and "num_hidden_layers" not in config:
        config = {**config["text_config"], **{k: v for k, v in config.items() if k == "tie_word_embeddings"}}
    model_type = str(config.get("model_type") or "llama")
    hidden = int(_first(config, "hidden_size", "n_embd", "d_model"))
    num_heads = int(_first(config, "num_attention_heads", "n_head"))
    num_layers = int(_first(config, "num_hidden_layers", "n_layer", "num_layers"))
    head_dim = int(_first(config, "head_dim", default=0) or hidden // num_heads)
    inter = int(_first(config, "intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim", default=0) or 4 * hidden)
    num_experts = int(_first(config, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    ungated = model_type in _UNGATED
    bias_all = bool(config.get("bias", False)) if model_type == "falcon" else model_type in ("gpt2", "gpt_bigcode")
    attention_bias = bool(config.get("attention_bias", False))
    return ModelShape(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=_num_kv_heads(config, model_type, num_heads),
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=int(_first(config, "vocab_size", "padded_vocab_size")),
        max_position_embeddings=int(_first(config, "max_position_embeddings", "n_positions", "n_ctx", default=2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type in ("gpt2", "gpt_bigcode", "falcon"))),
        gated_mlp=not ungated,
        qkv_bias=bias_all or attention_bias or model_type == "qwen2",
        o_bias=bias_all or attention_bias,
        mlp_bias=bias_all or bool(config.get("mlp_bias", False)),
        norm_bias=model_type in _LAYERNORM,
        norms_per_layer=_norms_per_layer(config, model_type),
        num_learned_positions=int(_first(config, "n_positions", default=0)) if model_type in ("gpt2", "gpt_bigcode") else 0,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2"),
        num_experts=num_experts,
        expert_intermediate_size=int(_first(config, "moe_intermediate_size", default=0) or inter),
    )


# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------


def kv_shape_from_config(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from an HF config dict."""
    shape = model_shape(config)
    return shape.num_layers, shape.num_kv_heads, shape.head_dim


def kv_bytes_per_token(config: Mapping[str, Any], kv_dtype: str) -> int:
    """Keys and values of one token across every layer."""
    num_layers, num_kv_heads, head_dim = kv_shape_from_config(config)
    return 2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[normalize_dtype(kv_dtype)]


def kv_block_bytes(config: Mapping[str, Any], kv_dtype: str, block_size: int) -> int:
    """One block of ``block_size`` tokens, keys and values, every layer."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return kv_bytes_per_token(config, kv_dtype) * block_size


def num_kv_blocks(kv_budget_bytes: int, config: Mapping[str, Any], kv_dtype: str, block_size: int) -> int:
    """How many KV blocks of ``block_size`` tokens fit in ``kv_budget_bytes``."""
    return max(0, int(kv_budget_bytes) // kv_block_bytes(config, kv_dtype, block_size))


def window_layers(config: Mapping[str, Any]) -> tuple[int, tuple[int, ...]]:
    """(window, the layers that attend through it) from an HF config dict; (0, ()) when none.

    ``layer_types`` names each layer ("sliding_attention" / "full_attention": Gemma 2/3,
    Cohere 2, gpt-oss, Qwen2 with windows); without it a ``sliding_window`` is every layer's
    (Mistral). Qwen2-style ``use_sliding_window: false`` turns it off."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 or config.get("use_sliding_window") is False:
        return 0, ()
    num_layers = kv_shape_from_config(config)[0]
    types = config.get("layer_types")
    if isinstance(types, list | tuple) and len(types) == num_layers:
        return window, tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return window, tuple(range(num_layers))


def window_blocks_per_sequence(window: int, block_size: int) -> int:
    """Blocks a windowed layer keeps for one sequence between steps: its last ``window`` keys
    and the next token's slot (positions p - window + 1 .. p + 1) span at most this many."""
    return -(-window // block_size) + 1


@dataclass(frozen=True)
class HybridKV:
    """A KV cache split by layer kind: global layers keep every block of a sequence, windowed
    layers only the blocks their window still reaches (scheduler/ledger.py's WindowLedger)."""

    window: int
    window_layers: tuple[int, ...]
    num_full_blocks: int  # the global layers' pool (no memory behind it when every layer is windowed)
    num_window_blocks: int  # the windowed layers' pool


def hybrid_kv_blocks(kv_budget_bytes: int, config: Mapping[str, Any], kv_dtype: str, block_size: int,
                     max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> HybridKV | None:
    """How a KV budget splits between global and windowed layers (None: not a windowed model, or a
    window as wide as ``max_model_len``, where every layer keeps every block).

    The split is the one where sequences of ``max_model_len`` tokens run out of both pools
    together: per such sequence the windowed layers keep ``window_blocks_per_sequence`` blocks
    where the global layers keep all of its blocks; on top the windowed pool holds one step's
    new tokens (a prompt chunk's queries reach back a window from their first token), and it is
    never larger than the global pool (a windowed layer never needs more blocks than a global
    one). Shorter sequences may fill the windowed pool first (preemption then frees both).
    With every layer windowed (Mistral) the whole budget is the windowed pool, and the global
    pool only counts sequences' lengths: ``max_num_seqs`` sequences of ``max_model_len``, no memory."""
    window, layers = window_layers(config)
    if not window or window >= max_model_len or not layers:
        return None
    num_layers = kv_shape_from_config(config)[0]
    layer_block = kv_block_bytes(config, kv_dtype, block_size) // num_layers
    budget_blocks = int(kv_budget_bytes) // layer_block  # one layer's block each
    full_layers, window_layers_n = num_layers - len(layers), len(layers)
    per_seq_window = window_blocks_per_sequence(window, block_size)
    per_seq_full = blocks_for_tokens(max_model_len, block_size)
    step_blocks = blocks_for_tokens(max_num_batched_tokens, block_size)
    if full_layers == 0:
        return HybridKV(window, layers, max_num_seqs * per_seq_full, max(0, budget_blocks // window_layers_n))
    ratio = per_seq_window / per_seq_full
    num_full = int((budget_blocks - step_blocks * window_layers_n) / (full_layers + window_layers_n * ratio))
    num_full = max(0, num_full)
    num_window = min(num_full, math.ceil(num_full * ratio) + step_blocks)
    num_full = max(0, (budget_blocks - num_window * window_layers_n) // full_layers)  # what the windows leave
    return HybridKV(window, layers, num_full, num_window)


def hybrid_concurrency(h: HybridKV, num_tokens: int, block_size: int, max_num_batched_tokens: int,
                       has_global_layers: bool) -> int:
    """Sequences of ``num_tokens`` that a hybrid cache holds at once: each keeps all of its blocks
    in the global pool and at most ``window_blocks_per_sequence`` in the windowed one, which also
    keeps one step's new tokens."""
    per_window = min(blocks_for_tokens(num_tokens, block_size), window_blocks_per_sequence(h.window, block_size))
    windows = max(0, h.num_window_blocks - blocks_for_tokens(max_num_batched_tokens, block_size)) // max(1, per_window)
    if not has_global_layers:
        return windows
    return min(windows, max_concurrency(h.num_full_blocks, num_tokens, block_size))


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks one sequence of ``num_tokens`` occupies (the last one may be partly empty)."""
    return -(-num_tokens // block_size)


def max_concurrency(num_blocks: int, num_tokens: int, block_size: int) -> int:
    """Sequences of ``num_tokens`` tokens that fit in ``num_blocks`` blocks at once."""
    per_seq = blocks_for_tokens(num_tokens, block_size)
    return num_blocks // per_seq if per_seq > 0 else 0


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCount:
    embeddings: int  # token (+ learned position) embeddings
    attention: int  # q, k, v, o projections (+ biases, q/k norms), all layers
    mlp: int  # dense MLP or experts + router, all layers
    norms: int  # per-layer norms and the final norm
    lm_head: int  # 0 when tied to the embeddings

    @property
    def total(self) -> int:
        return self.embeddings + self.attention + self.mlp + self.norms + self.lm_head


def _attention_params(s: ModelShape) -> int:
    q_out = s.num_heads * s.head_dim
    kv_out = s.num_kv_heads * s.head_dim
    params = s.hidden_size * (q_out + 2 * kv_out) + q_out * s.hidden_size
    if s.qkv_bias:
        params += q_out + 2 * kv_out
    if s.o_bias:
        params += s.hidden_size
    if s.qk_norm:
        params += 2 * s.head_dim
    return params


def _mlp_params(s: ModelShape, inter: int) -> int:
    if s.gated_mlp:
        return 3 * s.hidden_size * inter + (2 * inter + s.hidden_size if s.mlp_bias else 0)
    return 2 * s.hidden_size * inter + (inter + s.hidden_size if s.mlp_bias else 0)


def count_parameters(config: Mapping[str, Any]) -> ParamCount:
    """Parameters from the config alone (MoE: every expert plus the router)."""
    s = model_shape(config)
    if s.num_experts:
        mlp = s.num_experts * _mlp_params(s, s.expert_intermediate_size) + s.hidden_size * s.num_experts
    else:
        mlp = _mlp_params(s, s.intermediate_size)
    norm = s.hidden_size * (2 if s.norm_bias else 1)
    embeddings = s.vocab_size * s.hidden_size + s.num_learned_positions * s.hidden_size
    return ParamCount(
        embeddings=embeddings,
        attention=s.num_layers * _attention_params(s),
        mlp=s.num_layers * mlp,
        norms=(s.num_layers * s.norms_per_layer + 1) * norm,
        lm_head=0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size,
    )


def weight_bytes(config: Mapping[str, Any], dtype: str) -> int:
    """Bytes the weights take when served in ``dtype`` (unquantized)."""
    return count_parameters(config).total * DTYPE_BYTES[normalize_dtype(dtype)]


def int8_weight_bytes(config: Mapping[str, Any], dtype: str = "float32") -> int:
    """Bytes the weights take under ``--quantization int8`` (services/worker/model/quantize.py).

    The decoder's linear layers become W8A8 layers, q/k/v and gate/up fused into one each:
    one byte per weight, plus float32 per output channel (the weight's scale, the bias
    where there is one) and per input channel (the SmoothQuant factor). Embeddings, norms
    and the LM head stay in ``dtype``.
    """
    s = model_shape(config)
    if s.num_experts:
        raise ValueError("--quantization int8 is not planned for mixture-of-experts models")
    q_out, kv_out, h, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.hidden_size, s.intermediate_size
    # (in, out, has bias) of each int8 layer of one decoder layer
    layers = [(h, q_out + 2 * kv_out, s.qkv_bias), (q_out, h, s.o_bias)]
    layers += [(h, 2 * inter, s.mlp_bias)] if s.gated_mlp else [(h, inter, s.mlp_bias)]
    layers += [(inter, h, s.mlp_bias)]
    per_layer = sum(i * o + 4 * (i + o + (o if bias else 0)) for i, o, bias in layers)
    counts = count_parameters(config)
    linear_params = sum(i * o + (o if bias else 0) for i, o, bias in layers)
    rest = counts.total - s.num_layers * linear_params  # embeddings, norms, the LM head when untied
    return s.num_layers * per_layer + rest * DTYPE_BYTES[normalize_dtype(dtype)]


def tensor_parallel_config(config: Mapping[str, Any], size: int) -> dict[str, Any]:
    """The config one tensor-parallel rank of ``size`` sees: 1/size of the attention heads,
    KV heads and MLP width, the same head size. ValueError when one of them does not divide."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, not {size}")
    s = model_shape(config)
    if size == 1:
        return dict(config)
    if s.num_experts:
        raise ValueError("tensor parallelism is not supported for mixture-of-experts models")
    for what, n in (("attention heads", s.num_heads), ("KV heads", s.num_kv_heads),
                    ("intermediate size", s.intermediate_size)):
        if n % size:
            raise ValueError(f"tensor parallel size {size} does not divide the model's {what} ({n})")
    return {**config, "num_attention_heads": s.num_heads // size, "num_key_value_heads": s.num_kv_heads // size,
            "head_dim": s.head_dim, "intermediate_size": s.intermediate_size // size}


def weight_bytes_per_rank(config: Mapping[str, Any], dtype: str, size: int) -> int:
    """Weight bytes on each of ``size`` tensor-parallel devices: the attention and MLP projections
    split ``size`` ways; embeddings, norms, the LM head and the row-parallel biases whole on each."""
    tensor_parallel_config(config, size)  # the same divisibility rule as the worker
    s = model_shape(config)
    counts = count_parameters(config)
    whole_biases = s.num_layers * s.hidden_size * (int(s.o_bias) + int(s.mlp_bias))
    split = counts.attention + counts.mlp - whole_biases
    per_rank = counts.total - split + split // size
    return per_rank * DTYPE_BYTES[normalize_dtype(dtype)]


# ---------------------------------------------------------------------------
# GPU budget
# ---------------------------------------------------------------------------


def activation_peak_bytes(
    config: Mapping[str, Any], dtype: str, max_num_batched_tokens: int, max_num_seqs: int
) -> int:
    """Estimated peak of one forward over ``max_num_batched_tokens`` tokens.

    Per token: the residual, normed and attention-output hidden states, q/k/v, and
    the MLP's gate, up and activated tensors, live at once in one layer (layers
    run one after another, so this does not scale with depth). Plus fp32 logits and
    sampling probabilities for one row per sequence.
    """
    s = model_shape(config)
    inter = s.expert_intermediate_size if s.num_experts else s.intermediate_size
    per_token = 3 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + 3 * inter
    hidden = max_num_batched_tokens * per_token * DTYPE_BYTES[normalize_dtype(dtype)]
    logit_rows = min(max_num_seqs, max_num_batched_tokens)
    return hidden + 2 * logit_rows * s.vocab_size * 4


def gpu_kv_budget_bytes(
    total_memory_bytes: int,
    gpu_memory_utilization: float,
    weight_bytes: int,
    activation_peak_bytes: int,
    runtime_overhead_bytes: int = 0,
    safety_margin_bytes: int = 0,
) -> int:
    """KV bytes on a GPU: total * utilization - weights - activation peak - overhead - margin.

    Never negative; a result of 0 means the model does not fit.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    usable = int(total_memory_bytes * gpu_memory_utilization)
    return max(0, usable - weight_bytes - activation_peak_bytes - runtime_overhead_bytes - safety_margin_bytes)
