"""What an attention variant costs on the CPU: backends/variant.py against cpu_paged's kernels.

    python -m benchmarks.engine.bench_variants --threads 2 --out results/variants.json

It times one step's attention for 30 layers of SmolLM2's shape (9 query heads over
3 KV heads of 64, bfloat16, block size 16): 64 decodes with contexts of 230-293 tokens, and ten
fresh 200-token prompts, through cpu_paged (plain attention) and through the variant path with a
window of 128 keys, a soft-cap of 50, and sinks. End to end: ``build_models DIR mistral-w128
mistral-w4096`` and ``bench_offline --model DIR/mistral-wN`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from services.worker.backends import select_backend
from services.worker.backends.build import build_paged_batch
from services.worker.backends.variant import AttentionVariant, variant_attention

BS, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 9, 3, 64, 30


def _case(q_lens: list[int], ctx: list[int]) -> dict[str, Any]:
    blocks = sum(-(-c // BS) for c in ctx) + 1
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(blocks, BS, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(blocks, BS, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    tables, first = [], 1
    for c in ctx:
        n = -(-c // BS)
        tables.append(list(range(first, first + n)))
        first += n
    batch, _ = build_paged_batch(q_lens, ctx, tables, BS, 8192, torch.device("cpu"))
    tokens = sum(q_lens)
    return dict(batch=batch, k_cache=k_cache, v_cache=v_cache,
                query=torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16),
                key=torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16),
                value=torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16))


def _time_ms(fn: Any, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(LAYERS):
            fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000, 1)


def timings() -> dict[str, dict[str, float]]:
    cases = {"64 decodes, contexts 230-293": _case([1] * 64, [230 + i for i in range(64)]),
             "ten 200-token prompts": _case([200] * 10, [200] * 10)}
    variants = {"window 128": AttentionVariant(window=128), "soft-cap 50": AttentionVariant(softcap=50.0),
                "sinks": AttentionVariant(sinks=torch.zeros(HEADS))}
    out: dict[str, dict[str, float]] = {}
    for name, c in cases.items():
        out[name] = _row(c, variants)
        print(name, json.dumps(out[name]), flush=True)
    return out


def _row(c: dict[str, Any], variants: dict[str, AttentionVariant]) -> dict[str, float]:
    backend = select_backend("cpu_paged", torch.device("cpu"))
    meta = backend.prepare(c["batch"])
    row = {"cpu_paged (plain)": _time_ms(lambda: backend.forward(
        0, c["query"], c["key"], c["value"], c["k_cache"], c["v_cache"], meta, 0.125))}
    for vname, v in variants.items():
        row[vname] = _time_ms(lambda v=v: variant_attention(  # type: ignore[misc]
            c["query"], c["k_cache"], c["v_cache"], c["batch"], 0.125, v))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/variants.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "layers": LAYERS,
              "ms_per_step": timings()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
