"""Stage 3: offline throughput against the machine's own ceilings, graphs on and off.

``--model small``: the default model's architecture (random weights, bf16);
``--model 8b``: a Llama-3-8B-shaped model built on the GPU from its config (bf16).
For each: measured HBM bandwidth (device-to-device copy) and bf16 matmul rate
first; then with CUDA graphs off and on, for batch 1, 16, 64, 256: prefill
tokens/s (against the matmul rate) and the median decode step (against the HBM
roofline: weight bytes plus the KV bytes the step reads, over the bandwidth);
last, transformers ``generate`` at batch 64 on the same device as the peer.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

from tests.device.common import (
    LLAMA3_8B,
    SMOLLM2_135M,
    TINY,
    Options,
    SkipStage,
    Stage,
    measure_bandwidth,
    measure_matmul,
    random_model_in_memory,
    run_stage,
    sync,
)
from tests.device.drive import run_batch

PROMPT_LEN = 512
DECODE_STEPS = 64  # = PEER_NEW_TOKENS: generate_tok_s at batch 64 compares with the peer
PEER_BATCH = 64
PEER_NEW_TOKENS = 64


def model_flops_per_token(arch: dict[str, Any], ctx: float) -> float:
    """Forward FLOPs per token: 2 x matmul weights (no embedding, no LM head: ferry applies
    it to sampling rows only) plus QK^T and PV over ``ctx`` keys."""
    h, layers, inter = arch["hidden_size"], arch["num_hidden_layers"], arch["intermediate_size"]
    hd = arch.get("head_dim") or h // arch["num_attention_heads"]
    q, kv = arch["num_attention_heads"] * hd, arch["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return 2 * layers * per_layer + 4 * layers * q * ctx


def make_runner(opts: Options, model: Any, arch: dict[str, Any], dtype: Any, enforce_eager: bool,
                max_num_seqs: int, budget: int, max_model_len: int) -> Any:
    """A ModelRunner over an in-memory model (the loader is bypassed: no weights on disk)."""
    import services.worker.runner as runner_mod
    from services.worker.loader import LoadedModel
    from services.worker.model.attention import ATTN_IMPLEMENTATION, register_paged_attention
    from shared.config import WorkerConfig

    register_paged_attention()
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    config_dict = model.config.to_dict()
    loaded = LoadedModel(model, model.config, config_dict, Path("/nonexistent"), dtype, 0.0)
    original = runner_mod.load_model
    runner_mod.load_model = lambda *a, **k: loaded
    try:
        cfg = WorkerConfig(model="in-memory", device=opts.device, dtype=str(dtype).removeprefix("torch."),
                           enforce_eager=enforce_eager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           max_model_len=max_model_len, gpu_memory_utilization=0.8, kv_cache_memory=256 << 20)
        return runner_mod.ModelRunner(cfg)
    finally:
        runner_mod.load_model = original


def body(opts: Options, stage: Stage) -> None:
    import torch

    which = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "small"
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SkipStage("no CUDA device")
    arch = TINY if opts.cpu_dry_run else (LLAMA3_8B if which == "8b" else SMOLLM2_135M)
    dtype = torch.float32 if opts.cpu_dry_run else torch.bfloat16
    batches = [1, 4] if opts.cpu_dry_run else [1, 16, 64, 256]
    prompt_len, steps = (16, 3) if opts.cpu_dry_run else (PROMPT_LEN, DECODE_STEPS)
    budget = 64 if opts.cpu_dry_run else 8192
    bw = measure_bandwidth(opts.device, (64 << 20) if opts.cpu_dry_run else (2 << 30))
    mm = measure_matmul(opts.device, 256 if opts.cpu_dry_run else 8192)
    stage.record("hbm_bandwidth_GBps", round(bw / 1e9, 1))
    stage.record("matmul_TFLOPs", round(mm / 1e12, 1))
    model = random_model_in_memory(arch, dtype, opts.device)
    from shared.capacity import kv_bytes_per_token

    kv_per_token = kv_bytes_per_token(model.config.to_dict(), str(dtype).removeprefix("torch."))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    stage.record("weight_GB", round(weight_bytes / 1e9, 3))
    max_len = prompt_len + steps + 64
    for eager in (True, False):
        mode = "eager" if eager else "graphs"
        t0 = time.perf_counter()
        runner = make_runner(opts, model, arch, dtype, eager, max(batches), budget, max_len)
        stage.record(f"{mode}_runner_start_s", round(time.perf_counter() - t0, 1))
        stage.record(f"{mode}_graphs_captured", sorted(getattr(runner, "graphs", None).graphs)  # type: ignore[union-attr]
                     if getattr(runner, "graphs", None) is not None else [])
        for b in batches:
            timing = run_batch(runner, b, prompt_len, steps, budget, arch["vocab_size"])
            step = timing.decode_median_s
            roof = (weight_bytes + timing.kv_tokens_read * kv_per_token) / bw
            flops = b * prompt_len * model_flops_per_token(arch, prompt_len / 2)
            stage.record(f"{mode}_b{b}", {
                "decode_step_ms": round(step * 1e3, 3),
                "roofline_ms": round(roof * 1e3, 3),
                "x_roofline": round(step / roof, 2),
                "decode_tok_s": round(b / step, 1),
                "prefill_tok_s": round(b * prompt_len / timing.prefill_s, 1),
                "prefill_x_matmul_rate": round(flops / timing.prefill_s / mm, 3),
                "generate_tok_s": round(b * steps / (timing.prefill_s + sum(timing.decode_step_s)), 1),
            })
        del runner
        gc.collect()
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    peer(opts, stage, model, arch, 4 if opts.cpu_dry_run else PEER_BATCH, prompt_len,
         4 if opts.cpu_dry_run else PEER_NEW_TOKENS)


def peer(opts: Options, stage: Stage, model: Any, arch: dict[str, Any], batch: int, prompt_len: int,
         new_tokens: int) -> None:
    """transformers ``generate`` on the same weights and device (sdpa attention, its own cache)."""
    import torch

    model.config._attn_implementation = "sdpa"
    ids = torch.randint(3, arch["vocab_size"], (batch, prompt_len), device=opts.device)
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        sync(opts.device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync(opts.device)
    elapsed = time.perf_counter() - t0
    stage.record(f"transformers_generate_b{batch}_tok_s", round(batch * new_tokens / elapsed, 1))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:]]
    name = "throughput"
    if "--model" in args:
        i = args.index("--model")
        name = f"throughput_{args[i + 1]}"
        del args[i : i + 2]
    run_stage(name, body, args)
