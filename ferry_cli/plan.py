"""``ferry plan``: which device fits a model at a context length and concurrency.

Reads only the model's config (no weights, no torch), then for each device:
weights in the serving dtype, the activation peak and runtime overhead, the KV
budget left, the KV blocks it holds (the same ``shared.capacity.num_kv_blocks``
the worker calls at start-up), the largest concurrency at the typical and at the
maximum context, whether the requested concurrency fits, the headroom, and the
break-even cost per million output tokens. Markdown by default, ``--json`` for
machines. The method and every column are explained in docs/planning.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from shared import capacity
from shared.models import DEFAULT_MODEL, ModelNotFoundError

from .plan_devices import Device, lookup, parse_bytes, parse_devices, parse_name_values, with_prices
from .plan_model import PlannedModel, load_planned_model

KV_DTYPES = ("auto", "bfloat16", "float16", "fp8", "float32")


@dataclass(frozen=True)
class PlanOptions:
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    max_model_len: int = 0  # 0: the model's own limit
    concurrency: int = 1
    prompt_len: int = 512
    output_len: int = 256
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    safety_margin: str = "0"  # < 1: fraction of device memory; else bytes
    max_num_batched_tokens: int = 2048
    runtime_overhead_bytes: int = capacity.GPU_RUNTIME_OVERHEAD_BYTES
    tensor_parallel_size: int = 1  # devices one model is split across (each row: per device)
    quantization: str = "none"  # "int8": the worker's --quantization int8 (int8 decoder linears, the rest in dtype)


def safety_margin_bytes(spec: str, memory_bytes: int) -> int:
    value = float(spec) if _is_number(spec) else float(parse_bytes(spec))
    return int(value * memory_bytes) if value < 1 else int(value)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _memory_side(config: dict[str, Any], device: Device, opts: PlanOptions, dtype: str) -> dict[str, int]:
    """Weights, activations, overhead, margin and the KV budget (possibly negative before clamping),
    per device: with tensor parallelism ``config`` is one rank's and the weights are its share."""
    if opts.quantization == "int8":
        weights = capacity.int8_weight_bytes(config, dtype)
    else:
        weights = capacity.weight_bytes_per_rank(config, dtype, opts.tensor_parallel_size)
    if device.kind == "cpu":
        # The worker's CPU cache is exactly --kv-cache-memory; weights live elsewhere in RAM.
        return {"weight_bytes": weights, "activation_peak_bytes": 0, "runtime_overhead_bytes": 0,
                "safety_margin_bytes": 0, "kv_budget_bytes": device.memory_bytes, "kv_budget_raw": device.memory_bytes}
    seqs = max(opts.concurrency, 1)
    rank = capacity.tensor_parallel_config(config, opts.tensor_parallel_size)
    activations = capacity.activation_peak_bytes(rank, dtype, opts.max_num_batched_tokens, seqs)
    margin = safety_margin_bytes(opts.safety_margin, device.memory_bytes)
    budget = capacity.gpu_kv_budget_bytes(
        device.memory_bytes, opts.gpu_memory_utilization, weights, activations, opts.runtime_overhead_bytes, margin
    )
    raw = int(device.memory_bytes * opts.gpu_memory_utilization) - weights - activations
    raw -= opts.runtime_overhead_bytes + margin
    return {"weight_bytes": weights, "activation_peak_bytes": activations,
            "runtime_overhead_bytes": opts.runtime_overhead_bytes, "safety_margin_bytes": margin,
            "kv_budget_bytes": budget, "kv_budget_raw": raw}


def decode_ceiling_tok_s(device: Device, weights: int, kv_per_token: int, batch: int, context: int) -> float | None:
    """Memory-bandwidth roofline: each decode step reads every weight and each sequence's KV once."""
    if device.bandwidth_bytes_per_s <= 0 or batch <= 0:
        return None
    step_bytes = weights + batch * context * kv_per_token
    return batch * device.bandwidth_bytes_per_s / step_bytes


def plan_device(config: dict[str, Any], device: Device, opts: PlanOptions, throughput: float | None) -> dict[str, Any]:
    """One row of the plan: every number for one device."""
    dtype = capacity.resolve_dtype(opts.dtype, device.kind)
    kv_dtype = capacity.resolve_kv_dtype(opts.kv_cache_dtype, dtype)
    mem = _memory_side(config, device, opts, dtype)
    tp = opts.tensor_parallel_size
    rank = capacity.tensor_parallel_config(config, tp)  # each device holds 1/tp of the KV heads
    kv_per_token = capacity.kv_bytes_per_token(rank, kv_dtype)
    block_bytes = capacity.kv_block_bytes(rank, kv_dtype, opts.block_size)
    blocks = capacity.num_kv_blocks(mem["kv_budget_bytes"], rank, kv_dtype, opts.block_size)
    typical = opts.prompt_len + opts.output_len
    at_typical = capacity.max_concurrency(blocks, typical, opts.block_size)
    at_max = capacity.max_concurrency(blocks, opts.max_model_len, opts.block_size)
    # windowed layers keep only their window (the worker's hybrid KV cache, one rank)
    hybrid = None if tp > 1 else capacity.hybrid_kv_blocks(
        mem["kv_budget_bytes"], rank, kv_dtype, opts.block_size, max(1, opts.concurrency),
        opts.max_num_batched_tokens, opts.max_model_len)
    if hybrid is not None:
        has_global = len(hybrid.window_layers) < capacity.kv_shape_from_config(rank)[0]
        blocks = hybrid.num_full_blocks if has_global else hybrid.num_window_blocks
        at_typical = capacity.hybrid_concurrency(hybrid, typical, opts.block_size, opts.max_num_batched_tokens, has_global)
        at_max = capacity.hybrid_concurrency(hybrid, opts.max_model_len, opts.block_size, opts.max_num_batched_tokens,
                                             has_global)
    needed = opts.concurrency * capacity.blocks_for_tokens(opts.max_model_len, opts.block_size) * block_bytes
    weights_fit = mem["kv_budget_raw"] > 0
    batch = min(opts.concurrency, at_typical)
    ceiling = decode_ceiling_tok_s(device, mem["weight_bytes"], kv_per_token, batch, opts.prompt_len + opts.output_len // 2)
    tok_s, source = (throughput, "given") if throughput else (ceiling, "roofline" if ceiling else None)
    # the tp devices decode in lockstep, each reading its share: the roofline is per device; the price is tp x
    cost = tp * device.usd_per_hour / (tok_s * 3600) * 1e6 if tok_s and device.usd_per_hour > 0 else None
    row: dict[str, Any] = {
        "device": device.name if tp == 1 else f"{tp}x {device.name}", "kind": device.kind,
        "tensor_parallel_size": tp, "memory_bytes": device.memory_bytes,
        "dtype": dtype, "kv_cache_dtype": kv_dtype,
        **{k: v for k, v in mem.items() if k != "kv_budget_raw"},
        "kv_bytes_per_token": kv_per_token, "block_size": opts.block_size, "block_bytes": block_bytes,
        "kv_blocks": blocks, "kv_tokens": blocks * opts.block_size,
        "typical_len": typical, "max_model_len": opts.max_model_len,
        "max_concurrency_at_typical": at_typical, "max_concurrency_at_max_model_len": at_max,
        "concurrency": opts.concurrency, "weights_fit": weights_fit,
        "hybrid_kv": None if hybrid is None else {
            "window": hybrid.window, "window_layers": len(hybrid.window_layers),
            "global_blocks": hybrid.num_full_blocks, "window_blocks": hybrid.num_window_blocks},
        "fits": weights_fit and at_max >= opts.concurrency,
        "fits_at_typical": weights_fit and at_typical >= opts.concurrency,
        "headroom_bytes": mem["kv_budget_raw"] - needed,
        "usd_per_hour": tp * device.usd_per_hour or None, "decode_ceiling_tok_s": ceiling,
        "throughput_tok_s": tok_s, "throughput_source": source, "usd_per_million_output_tokens": cost,
    }
    row["warnings"] = device_warnings(row)
    return row


def device_warnings(row: dict[str, Any]) -> list[str]:
    name, gib = row["device"], capacity_gib
    if not row["weights_fit"]:
        return [f"{name}: the model does not fit at all: weights {gib(row['weight_bytes'])} plus activations "
                f"and overhead exceed the usable memory ({gib(row['memory_bytes'])} total)"]
    if row["max_concurrency_at_max_model_len"] == 0:
        return [f"{name}: max_model_len {row['max_model_len']} cannot be held by even one sequence: "
                f"the KV cache holds {row['kv_tokens']} tokens"]
    if not row["fits"]:
        where = "even at the typical length" if not row["fits_at_typical"] else "as sequences approach max_model_len"
        return [f"{name}: concurrency {row['concurrency']} will force preemption {where}: at most "
                f"{row['max_concurrency_at_max_model_len']} sequences at max_model_len, "
                f"{row['max_concurrency_at_typical']} at the typical length ({row['typical_len']} tokens)"]
    return []


def capacity_gib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


def _size(num_bytes: float) -> str:
    if abs(num_bytes) >= 1 << 30:
        return capacity_gib(num_bytes)
    if abs(num_bytes) >= 1 << 20:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes / 1024:.1f} KiB"


def render_markdown(model: PlannedModel, rows: list[dict[str, Any]], opts: PlanOptions) -> str:
    counts = capacity.count_parameters(model.config)
    lines = [
        f"model {model.name}: {counts.total:,} parameters"
        + (f" (GGUF file {_size(model.file_bytes)}, quantized; served unquantized)" if model.file_bytes else ""),
        f"max_model_len {opts.max_model_len}, concurrency {opts.concurrency}, typical {opts.prompt_len}+"
        f"{opts.output_len} tokens, block_size {opts.block_size}, gpu_memory_utilization "
        f"{opts.gpu_memory_utilization}, safety margin {opts.safety_margin}"
        + (f", tensor parallel {opts.tensor_parallel_size} (every figure per device)"
           if opts.tensor_parallel_size > 1 else ""),
        "",
        "| device | memory | dtype / KV | weights | KV/token | KV budget | KV blocks | max conc @typical "
        "| max conc @max_len | fits | headroom | $/h | tok/s | $/M out tok |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        tok_s = "-" if r["throughput_tok_s"] is None else f"{r['throughput_tok_s']:,.0f}"
        if r["throughput_source"] == "roofline":
            tok_s = f"≤{tok_s}"
        cost = "-" if r["usd_per_million_output_tokens"] is None else f"{r['usd_per_million_output_tokens']:.4f}"
        if cost != "-" and r["throughput_source"] == "roofline":
            cost = f"≥{cost}"
        price = "-" if r["usd_per_hour"] is None else f"{r['usd_per_hour']:.2f}"
        lines.append(
            f"| {r['device']} | {_size(r['memory_bytes'])} | {r['dtype']} / {r['kv_cache_dtype']} "
            f"| {_size(r['weight_bytes'])} | {_size(r['kv_bytes_per_token'])} | {_size(r['kv_budget_bytes'])} "
            f"| {r['kv_blocks']:,} | {r['max_concurrency_at_typical']:,} | {r['max_concurrency_at_max_model_len']:,} "
            f"| {'yes' if r['fits'] else 'NO'} | {_size(r['headroom_bytes'])} | {price} | {tok_s} | {cost} |"
        )
    if any(r["throughput_source"] == "roofline" for r in rows):
        lines += ["", "tok/s marked ≤ is a memory-bandwidth ceiling, so $/M marked ≥ is a floor; "
                  "pass --throughput with a measured figure for a real break-even."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferry plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="local HF folder, GGUF file or built-in name")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="weights and activations (auto: bfloat16 on GPUs, float32 on CPU, as the worker)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES, help="auto: same as --dtype")
    p.add_argument("--max-model-len", type=int, default=0, help="longest prompt+output (0: the model's limit)")
    p.add_argument("--concurrency", type=int, default=1, help="sequences expected to run at once")
    p.add_argument("--prompt-len", type=int, default=512, help="typical prompt tokens")
    p.add_argument("--output-len", type=int, default=256, help="typical output tokens")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory ferry may use")
    p.add_argument("--safety-margin", default="0", help="below 1: fraction of device memory; else bytes (2GiB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (activation peak)")
    p.add_argument("--runtime-overhead", default=str(capacity.GPU_RUNTIME_OVERHEAD_BYTES),
                   help="GPU bytes for CUDA context, workspaces, graphs (default 1GiB)")
    p.add_argument("--devices", action="append", default=[],
                   help="comma list: built-in names, cpu:<bytes>, custom:<name>:<GiB> (default: built-in GPUs)")
    p.add_argument("--price", action="append", default=[], metavar="NAME=USD_PER_HOUR", help="override prices")
    p.add_argument("--throughput", action="append", default=[], metavar="[NAME=]TOK_S",
                   help="measured or assumed output tokens/s per device, for the break-even cost")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices one model is split across: weights (projections), KV cache and "
                        "activations per device divide by it; the price multiplies by it")
    p.add_argument("--quantization", default="none", choices=("none", "int8"),
                   help="int8: the worker's --quantization int8 (CPU only; int8 decoder linear layers, the rest in --dtype)")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per device")
    return p


def options_from_args(args: argparse.Namespace, model: PlannedModel) -> PlanOptions:
    """Validate flags against the model; raises ValueError with the message to show."""
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1 (got {args.concurrency})")
    if args.block_size < 1 or args.prompt_len < 1 or args.output_len < 0 or args.max_num_batched_tokens < 1:
        raise ValueError("--block-size, --prompt-len and --max-num-batched-tokens must be positive, --output-len >= 0")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1] (got {args.gpu_memory_utilization})")
    margin = float(args.safety_margin) if _is_number(args.safety_margin) else parse_bytes(args.safety_margin)
    if margin < 0:
        raise ValueError("--safety-margin must not be negative")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1 (got {args.tensor_parallel_size})")
    capacity.tensor_parallel_config(model.config, args.tensor_parallel_size)  # divisible, as the worker needs
    quantization = getattr(args, "quantization", "none")
    if quantization == "int8":  # the worker refuses the same combinations before it starts
        if args.tensor_parallel_size > 1:
            raise ValueError("--quantization int8 does not combine with --tensor-parallel-size")
    max_len = args.max_model_len or capacity.model_shape(model.config).max_position_embeddings
    if max_len < 1:
        raise ValueError(f"--max-model-len must be positive (got {max_len})")
    if args.prompt_len + args.output_len > max_len:
        raise ValueError(f"--prompt-len + --output-len ({args.prompt_len + args.output_len}) exceeds max_model_len {max_len}")
    return PlanOptions(
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=max_len,
        concurrency=args.concurrency, prompt_len=args.prompt_len, output_len=args.output_len,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        safety_margin=args.safety_margin, max_num_batched_tokens=args.max_num_batched_tokens,
        runtime_overhead_bytes=parse_bytes(args.runtime_overhead), tensor_parallel_size=args.tensor_parallel_size,
        quantization=quantization,
    )


def run_plan(args: argparse.Namespace) -> tuple[PlannedModel, PlanOptions, list[dict[str, Any]], list[str]]:
    model = load_planned_model(args.model)
    opts = options_from_args(args, model)
    devices = with_prices(parse_devices(args.devices), args.price)
    default_tok_s, per_device = parse_name_values(args.throughput, "--throughput")
    notes: list[str] = []
    model_limit = capacity.model_shape(model.config).max_position_embeddings
    if opts.max_model_len > model_limit:
        notes.append(f"max_model_len {opts.max_model_len} exceeds the model's own limit ({model_limit} positions)")
    rows = []
    for device in devices:
        tok_s = lookup(per_device, device)
        row = plan_device(model.config, device, opts, tok_s if tok_s is not None else default_tok_s)
        if opts.quantization == "int8" and device.kind != "cpu":
            row["warnings"].append(f"{device.name}: --quantization int8 runs on the CPU only; the worker refuses it here")
        rows.append(row)
    return model, opts, rows, notes + [w for r in rows for w in r["warnings"]]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model, opts, rows, warnings = run_plan(args)
    except (ValueError, ModelNotFoundError) as exc:
        print(f"ferry plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(render_markdown(model, rows, opts))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
