"""Where the offline engine's time goes, and the trace's GEMM limit on this machine.

Two measurements that ``bench_offline --profile`` takes in the same run as the
throughput figure (docs/benchmarks.md, "Where a prompt step goes"):

- ``gemm_limit``: ``torch.matmul`` rates for the model's own linear shapes (every
  layer's q/k/v/o and MLP projections at a prefill-sized and a decode-sized M, and
  the LM head at the decode M) per dtype, and from them the time the trace's matrix
  work alone would take: prefill bodies + decode bodies + LM heads. Output tokens
  over that time is the ceiling no engine on this CPU beats without cheaper math.
- ``profile_shares``: the engine under cProfile, reduced to the shares of the model
  forward that go to linear layers, attention (the backend, gathers included),
  RMSNorm, RoPE, the MLP's activation, and the rest (Python, embedding, residuals),
  plus the sampler.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _matmul_s(m: int, k: int, n: int, dtype: torch.dtype, min_s: float = 0.3) -> float:
    """Seconds for one [m, k] @ [k, n] (the weight read as nn.Linear does, transposed)."""
    a = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    torch.nn.functional.linear(a, w)
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < min_s:
        torch.nn.functional.linear(a, w)
        reps += 1
    return (time.perf_counter() - t0) / reps


def layer_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of one decoder layer (Llama/Qwen2 shape)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    return [(hidden, heads * head_dim), (hidden, kv_heads * head_dim), (hidden, kv_heads * head_dim),
            (heads * head_dim, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]


def gemm_limit(config: dict[str, Any], num_prompt_tokens: int, num_output_tokens: int, num_requests: int,
               dtypes: list[str], prefill_m: int = 2048, decode_m: int = 64) -> dict[str, Any]:
    """Matmul rates at the model's shapes and the trace's matrix-work time, per dtype.

    The trace's decode steps run ``decode_m`` rows (the batch), its prefill steps
    ``prefill_m`` rows (the step budget); each output token but the first of every
    request is a decode row, each sampled token one LM-head row.
    """
    shapes = layer_shapes(config)
    layers = int(config["num_hidden_layers"])
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    layer_flop = sum(2 * i * o for i, o in shapes)
    out: dict[str, Any] = {"layer_flop_per_token": layer_flop * layers, "lm_head_flop_per_token": 2 * hidden * vocab}
    for name in dtypes:
        dt = DTYPES[name]
        t_pre = sum(_matmul_s(prefill_m, i, o, dt) for i, o in shapes)
        t_dec = sum(_matmul_s(decode_m, i, o, dt) for i, o in shapes)
        t_head = _matmul_s(decode_m, hidden, vocab, dt)
        prefill_s = num_prompt_tokens / prefill_m * layers * t_pre
        decode_rows = max(0, num_output_tokens - num_requests)  # each first token comes from the prefill
        decode_s = decode_rows / decode_m * layers * t_dec
        head_s = num_output_tokens / decode_m * t_head
        total = prefill_s + decode_s + head_s
        out[name] = {
            "gflops_prefill": round(prefill_m * layer_flop / t_pre / 1e9, 1),
            "gflops_decode": round(decode_m * layer_flop / t_dec / 1e9, 1),
            "gflops_lm_head": round(decode_m * 2 * hidden * vocab / t_head / 1e9, 1),
            "prefill_s": round(prefill_s, 2), "decode_s": round(decode_s, 2), "lm_head_s": round(head_s, 2),
            "limit_s": round(total, 2), "limit_output_tok_s": round(num_output_tokens / total, 1),
        }
        r = out[name]
        print(f"gemm {name:9s}: {r['gflops_prefill']} GFLOP/s at M={prefill_m}, {r['gflops_decode']} at M={decode_m}, "
              f"{r['gflops_lm_head']} LM head; trace limit {r['limit_s']} s = {r['limit_output_tok_s']} output tok/s",
              flush=True)
    return out


def _key(fn: Any) -> tuple[str, int, str]:
    code = fn.__code__
    return code.co_filename, code.co_firstlineno, code.co_name


def profile_shares(fn: Callable[[], Any], model: Any, sampler: Any, lean: Any = None,
                   backend: Any = None) -> dict[str, Any]:
    """Run ``fn`` under cProfile; seconds per part of the decoder body and their shares.

    Parts are recognized by the code objects of the model's own modules (cProfile keys
    functions by file, line and name), so this follows whatever classes the model uses;
    with the runner's lean forward (``lean``, services/worker/model/lean_forward.py) the body is
    its ``__call__``, attention is the backend's ``forward`` it calls, and the CPU kernels it
    calls directly (``add_rms_norm``, ``rotary``, ``silu_and_mul``) count by name; its
    decode steps in one C++ call (``decode_layers``) count by the call's own part clocks.
    Times are process CPU seconds. Shares are of the body's cumulative time; the LM head (a
    linear layer called by the runner) and the sampler are reported beside it. cProfile
    inflates Python-heavy parts.
    """
    import sys

    from services.worker.model.attention import paged_attention
    from services.worker.model.lean_forward import DECODE_LAYER_PARTS
    from services.worker.model.packed_linear import PackedLinear
    from services.worker.model.quantize import Int8Linear

    body = model.get_decoder()
    keys: dict[str, set[tuple[str, int, str]]] = {k: set() for k in ("rmsnorm", "rope", "activation")}
    for mod in body.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm") and name != "FusedRMSNorm":  # the fused one counts as its kernel, below
            keys["rmsnorm"].add(_key(type(mod).forward))
        elif name.endswith("RotaryEmbedding"):
            keys["rope"].add(_key(type(mod).forward))
        elif isinstance(mod, torch.nn.SiLU | torch.nn.GELU) or name.endswith("Activation"):
            keys["activation"].add(_key(type(mod).forward))
    modeling = sys.modules[type(body).__module__]
    if hasattr(modeling, "apply_rotary_pos_emb"):
        keys["rope"].add(_key(modeling.apply_rotary_pos_emb))  # fused_ops' patched one when it is on
    if lean is not None and backend is not None:
        keys["attention"] = {_key(type(backend).forward)}
        body_key = _key(type(lean).__call__)
    else:
        keys["attention"] = {_key(paged_attention)}
        body_key = _key(type(body).forward)
    # the leaf linear layers: nn.Linear, the oneDNN-packed one, --quantization int8's (a fused
    # q/k/v or gate/up group's FusedHead only calls one of these)
    leaves = (torch.nn.Linear, PackedLinear, Int8Linear)
    linear_keys = {_key(type(m).forward) for m in model.modules() if type(m) in leaves}
    # CPU time of the whole process (every intra-op thread), not wall time: on a shared
    # machine wall time charges other jobs' turns to whatever function was running.
    # The LM head is often the same class as the body's linears: a wrapper of its own
    # (an instance attribute over the class's forward) gives it its own cProfile key.
    head = model.get_output_embeddings()
    inner = head.forward

    def lm_head_forward(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    head.forward = lm_head_forward
    # A decode step's layers in one C++ call (lean_forward's decode_layers) are one opaque op
    # to cProfile: the call times its own parts, in process CPU seconds as cProfile's clock.
    one_call = lean is not None and getattr(lean, "decode_args", None) is not None
    part_times = torch.zeros(2, len(DECODE_LAYER_PARTS), dtype=torch.float64)
    if one_call:
        lean.part_times = part_times
    prof = cProfile.Profile(time.process_time)
    try:
        prof.enable()
        fn()
        prof.disable()
    finally:
        del head.forward
        if one_call:
            lean.part_times = None
    stats: dict[Any, Any] = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def cum(k: tuple[str, int, str]) -> float:
        return float(stats[k][3]) if k in stats else 0.0

    def kernel(name: str, caller: tuple[str, int, str] | None = None) -> float:
        """A compiled op's time, by its name (only its calls from ``caller`` if given)."""
        total = 0.0
        for k, row in stats.items():
            if k[0] == "~" and k[2].startswith("<built-in method ") and k[2].endswith(f".{name}>"):
                total += float(row[3]) if caller is None else sum(float(v[3]) for c, v in row[4].items() if c == caller)
        return total

    body_s = cum(body_key)
    parts = {name: sum(cum(k) for k in ks) for name, ks in keys.items()}
    parts["rmsnorm"] += kernel("rms_norm") + kernel("add_rms_norm")
    parts["activation"] += kernel("silu_and_mul")
    if lean is not None:
        parts["rope"] += kernel("rotary", caller=body_key)  # the lean forward's own calls (fused mode)
    head_s = cum(_key(lm_head_forward))
    # the gated MLP's first product with its activation on the accumulators (FusedSiluMLP on
    # the tiled kernel) is a compiled op, not a leaf layer's forward: it counts as linear
    parts["linear"] = sum(cum(k) for k in linear_keys) - head_s + kernel("tiled_silu_linear")
    for name, seconds in zip(DECODE_LAYER_PARTS, part_times[1].tolist(), strict=True):
        parts[name] += seconds
    parts["other"] = body_s - sum(parts.values())
    sampler_s = cum(_key(type(sampler).__call__))
    shares = {k: round(v / body_s, 3) if body_s else 0.0 for k, v in parts.items()}
    out: dict[str, Any] = {
        "body_s": round(body_s, 4), "lm_head_s": round(head_s, 4), "sampler_s": round(sampler_s, 4),
        "parts_s": {k: round(v, 4) for k, v in parts.items()},
        "shares_of_body": shares,
    }
    print("profile: body {body_s} s, LM head {lm_head_s} s, sampler {sampler_s} s; shares of the body: ".format(**out)
          + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()), flush=True)
    return out
