"""Quantized checkpoints (compressed-tensors) against the unquantized model: quality and speed.

    python -m benchmarks.engine.bench_checkpoints --threads 2 --out results/checkpoints.json

The built-in model (SmolLM2-135M-Instruct, its converted safetensors folder) is quantized here
with data-free schemes by the compressed-tensors library (tests/quantized_models.py: each
weight's own min/max, as llm-compressor's default observer does, no calibration data): W8A8
int8, W4A16 int4 in groups of 64 (576 wide layers), FP8 weights with dynamic per-token activations. Each is
served by ferry's offline engine in bfloat16 beside the unquantized model, in one run:

- quality: greedy answers to the 50 chat prompts of bench_quality (``--max-tokens`` each)
  against the unquantized model's in bfloat16: identical answers and the mean share of
  tokens before the first difference; and the perplexity and next-token argmax agreement on
  README.md's first 512 tokens, teacher-forced in transformers with the checkpoint's weights
  decompressed (for W8A8 that leaves out its activation rounding: the served greedy
  agreement is the figure that has it);
- speed: output tokens per second of those 50 x max-tokens greedy generations, one batch.

Thresholds, written before the first run: W8A8 int8 perplexity within 5 % of the unquantized
model's and at least 60 % of next-token argmaxes equal; FP8 within 2 % and 85 %; W4A16 (RTN
int4 without calibration, a 135M model: the hardest case) within 25 %.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.bench_quality import PROMPTS
from services.engine.offline import LLM, GenerationParams
from services.worker.loader import model_dir
from services.worker.model.checkpoint_quant import load_kwargs, read_scheme
from shared.models import resolve_model

SCHEMES = ["W8A8", "FP8_DYNAMIC", "W4A16"]
GROUP = {"W4A16": 64}  # SmolLM2's width, 576, is not a multiple of the preset's 128
THRESHOLDS = {"W8A8": (1.05, 0.60), "FP8_DYNAMIC": (1.02, 0.85), "W4A16": (1.25, 0.0)}


def teacher_forced(folder: Path, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        kwargs = load_kwargs(read_scheme("bench", config["quantization_config"]))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kwargs)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(float(nll)), logits.argmax(-1)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from tests.quantized_models import build_compressed

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ppl-tokens", type=int, default=512)
    p.add_argument("--out", default="results/checkpoints.json")
    args = p.parse_args(argv)
    plain = model_dir(resolve_model("smollm2-135m-instruct"), "")
    work = Path(tempfile.mkdtemp(prefix="ferry-ckpt-"))
    folders = {"unquantized": plain,
               **{s: build_compressed(plain, work / s, s, group_size=GROUP.get(s)) for s in SCHEMES}}
    tok = AutoTokenizer.from_pretrained(plain)
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    ids = torch.tensor([tok(text)["input_ids"][: args.ppl_tokens]])
    params = GenerationParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    conversations = [[{"role": "user", "content": q}] for q in PROMPTS]
    report: dict[str, Any] = {"model": "smollm2-135m-instruct", "dtype": "bfloat16", "threads": args.threads,
                              "cpu": platform.processor() or platform.machine(), "variants": {}}
    outputs: dict[str, list[list[int]]] = {}
    ref_argmax = None
    ref_ppl = 0.0
    for label, folder in folders.items():
        ppl, argmax = teacher_forced(folder, ids)
        llm = LLM(model=str(folder), dtype="bfloat16", num_threads=args.threads, kv_cache_memory=1 << 28)
        llm.chat(conversations[:2], GenerationParams(max_tokens=4, temperature=0.0))  # warm
        t0 = time.perf_counter()
        outputs[label] = [o.token_ids for o in llm.chat(conversations, params)]
        seconds = time.perf_counter() - t0
        del llm
        row: dict[str, Any] = {"perplexity": round(ppl, 3), "output_tok_s": round(len(PROMPTS) * args.max_tokens / seconds, 1)}
        if ref_argmax is None:
            ref_argmax, ref_ppl = argmax, ppl
        else:
            same, prefix = 0, 0.0
            for a, b in zip(outputs["unquantized"], outputs[label], strict=True):
                same += a == b
                prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) / len(a)
            ppl_limit, argmax_limit = THRESHOLDS[label]
            row.update(identical=f"{same}/{len(PROMPTS)}", mean_agreeing_prefix=round(prefix / len(PROMPTS), 3),
                       next_token_argmax_equal=round(float((argmax == ref_argmax).float().mean()), 3),
                       perplexity_ratio=round(ppl / ref_ppl, 3))
            row["passes_thresholds"] = (row["perplexity_ratio"] <= ppl_limit
                                        and row["next_token_argmax_equal"] >= argmax_limit)
        report["variants"][label] = row
        print(label, json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
