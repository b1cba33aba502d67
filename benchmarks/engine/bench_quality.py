"""What ``--quantization int8`` costs in quality: greedy agreement and perplexity.

    python -m benchmarks.engine.bench_quality --threads 2 --out results/quality-int8.json

- Greedy agreement: 50 fixed prompts (chat template applied), ``--max-tokens`` greedy
  tokens each, from ferry's offline engine in float32 with its linears on ``F.linear``
  (``FERRY_CPU_FLOAT32_EXACT=1``: transformers' own float32 ops, the reference)
  and in each variant: float32 as served by default (linears packed and fused for oneDNN,
  summed in another order), bfloat16 (the default on CPUs with native bfloat16, for scale), int8 on
  bfloat16 (what ``--quantization int8`` serves there), int8 on float32, and bfloat16 with a
  float8 KV cache (``--kv-cache-dtype fp8``); reports the
  share of prompts whose outputs are identical and the mean share of tokens before the
  first difference.
- Perplexity: the same model in plain transformers, in each dtype, quantized by the very
  layers the worker uses, on a fixed text, this repository's README.md (its first
  ``--ppl-tokens`` tokens), teacher-forced in one pass, and the share of positions
  whose most likely next token equals float32's (greedy agreement without the
  compounding: one early flip no longer decides the rest of a generation).

Prints one line per measurement and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from services.engine.offline import LLM, GenerationParams
from services.worker.runner import set_num_threads
from shared import envs

SUBJECTS = ["the ocean", "a lighthouse keeper", "prime numbers", "bread baking", "the moon landing",
            "a lost cat", "photosynthesis", "chess openings", "winter in Norway", "a robot learning to paint"]
TEMPLATES = ["Write a short story about {}.", "Explain {} to a child.", "List three facts about {}.",
             "Write a haiku about {}.", "What is the most surprising thing about {}?"]
PROMPTS = [t.format(s) for s in SUBJECTS for t in TEMPLATES]  # 50


# (label, dtype, quantization): each compared with the float32 model, the token-exact reference
VARIANTS = [("bfloat16", "bfloat16", "none"), ("int8 (bfloat16)", "bfloat16", "int8"), ("int8 (float32)", "float32", "int8")]
# The float8 KV cache (--kv-cache-dtype fp8) on the bfloat16 model: greedy through ferry's engine;
# perplexity in transformers with keys and values rounded through float8 (register_fp8_kv_attention).
KV_VARIANTS = [("bfloat16, fp8 KV cache", "bfloat16", "none", "fp8")]


def greedy_agreement(model: str, max_tokens: int, threads: int, only: list[str] | None = None) -> dict[str, Any]:
    """Each variant's greedy outputs against the reference's (``only``: those variants' labels alone)."""
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs: dict[str, list[list[int]]] = {}
    timings: dict[str, float] = {}
    runs = [("float32", "float32", "none", "auto"), ("float32 (packed)", "float32", "none", "auto"),
            *[(*v, "auto") for v in VARIANTS], *KV_VARIANTS]
    if only:
        unknown = set(only) - {r[0] for r in runs[1:]}
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; known: {[r[0] for r in runs[1:]]}")
        runs = [runs[0], *(r for r in runs[1:] if r[0] in only)]
    saved = envs.CPU_FLOAT32_EXACT.raw()
    for label, dtype, quant, kv in runs:
        # the reference computes float32 with transformers' ops; every other run as served
        if label == "float32":
            os.environ["FERRY_CPU_FLOAT32_EXACT"] = "1"
        elif saved is None:
            os.environ.pop("FERRY_CPU_FLOAT32_EXACT", None)
        else:
            os.environ["FERRY_CPU_FLOAT32_EXACT"] = saved
        llm = LLM(model=model, dtype=dtype, num_threads=threads, quantization=quant, kv_cache_memory=1 << 28,
                  kv_cache_dtype=kv)
        t0 = time.perf_counter()
        outputs[label] = [o.token_ids for o in llm.chat(conversations, params)]
        seconds = time.perf_counter() - t0
        timings[label] = round(seconds, 2)
        print(f"greedy {label}: {len(PROMPTS)} prompts in {seconds:.1f}s", flush=True)
        del llm
    report: dict[str, Any] = {"prompts": len(PROMPTS), "max_tokens": max_tokens, "reference": "float32",
                              "seconds": timings}
    for label, *_ in runs[1:]:
        same, prefix = 0, 0.0
        for a, b in zip(outputs["float32"], outputs[label], strict=True):
            same += a == b
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            prefix += first / max(1, len(a))
        report[label] = {"identical": same, "identical_share": round(same / len(PROMPTS), 3),
                         "mean_agreeing_prefix": round(prefix / len(PROMPTS), 3)}
        print(f"greedy {label} vs float32: {same}/{len(PROMPTS)} identical, mean agreeing prefix "
              f"{prefix / len(PROMPTS):.3f}", flush=True)
    return report


FP8_KV_ATTENTION = "ferry_fp8_kv_sdpa"


def register_fp8_kv_attention() -> None:
    """transformers' SDPA attention with the keys (after RoPE) and values rounded through float8
    e4m3 first: what attention reads back from ``--kv-cache-dtype fp8`` in every decode step
    (a prompt's own first chunk reads its keys before they are rounded, so this is the
    token-by-token case, the pessimistic one)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8_kv_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        def rounded(x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.float8_e4m3fn).to(x.dtype)

        return sdpa_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kwargs)

    AttentionInterface.register(FP8_KV_ATTENTION, fp8_kv_sdpa)


def perplexity(model: str, text: str, num_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.worker.loader import model_dir
    from services.worker.model.quantize import apply_int8, int8_kernels
    from shared.models import resolve_model

    folder = model_dir(resolve_model(model))
    ids = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt")["input_ids"][:, :num_tokens]
    out: dict[str, Any] = {"tokens": int(ids.shape[1])}
    kernels = int8_kernels()
    reference: torch.Tensor | None = None
    register_fp8_kv_attention()
    runs = [("float32", "float32", "none", "auto"), *[(*v, "auto") for v in VARIANTS], *KV_VARIANTS]
    for label, dtype, quant, kv in runs:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        if kv == "fp8":  # every key and value rounded through float8 as the cache stores them
            hf.set_attn_implementation(FP8_KV_ATTENTION)
        if quant == "int8":
            apply_int8(hf, hf.model, hf.config.vocab_size, kernels)  # what the worker does to its model
        with torch.inference_mode():
            result = hf(ids, labels=ids)
        top1 = result.logits[0].argmax(-1)
        reference = top1 if reference is None else reference
        agree = float((top1 == reference).float().mean())
        out[label] = {"perplexity": round(math.exp(result.loss.item()), 3), "top1_agreement": round(agree, 4)}
        print(f"perplexity {label}: {out[label]['perplexity']} over {ids.shape[1]} tokens; next-token "
              f"argmax equal to float32's at {agree:.1%} of positions", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.bench_quality", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ppl-text", default=str(Path(__file__).resolve().parents[2] / "README.md"))
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--out", default="results/quality-int8.json")
    p.add_argument("--variants", default="", help="comma-separated variant labels to compare (default: all), "
                   "e.g. 'float32 (packed)'")
    p.add_argument("--no-perplexity", action="store_true", help="greedy agreement only")
    args = p.parse_args(argv)
    set_num_threads(args.threads)
    report = {
        "model": args.model, "ppl_text": args.ppl_text,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
        "greedy": greedy_agreement(args.model, args.max_tokens, args.threads,
                                   [v.strip() for v in args.variants.split(",") if v.strip()] or None),
    }
    if not args.no_perplexity:
        report["perplexity"] = perplexity(args.model, Path(args.ppl_text).read_text(), args.ppl_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
