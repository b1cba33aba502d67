"""The CPU kernels' work split between threads: split once against taken from each other.

ferry's attention kernels split their work items between the threads by cost
(``csrc/work_split.h``, ``parallel_by_cost``), and a thread done with its own range takes the
other's items from the back; the row-wise ops do the same with pieces of rows
(``parallel_rows``). That pays when another process takes a core from one of the
worker's threads (the gateway, the scheduler, the load's client on a 2-core machine); on a
quiet machine it should cost nothing. This measures both, in one process, with the kernel's
switch (``work_stealing``, for A/B runs only) alternating round by round:

- ``decode``: SmolLM2-135M's decode attention at the common load's shape, 64 requests of
  201-264 tokens of context (9 query and 3 KV heads of 64, 16-token blocks scattered over a
  2,900-block bfloat16 cache), 30 layers, 8 steps a round (a round as long as a prompt
  step's, so each spans several of the neighbour's periods);
- ``prefill``: its prompt attention for one 2,048-token prompt step (ten 200-token prompts
  and a 48-token chunk, fresh: no cached prefix), 30 layers;
- ``rows``: the same prompt step's row-wise ops (``parallel_rows``), per layer two residual
  adds with their RMSNorm (2,048 x 576) and the rotary embedding of the queries and keys;

each quiet, then beside a neighbour process busy ``--neighbours`` of the time (busy
milliseconds / period milliseconds, e.g. 3/15 is 20 % of a core), then quiet again. Medians
of ``--rounds`` per cell; the ratio taken / split once below 1 is the gain.

    python -m benchmarks.kernels.bench_work_split --out /tmp/b/work-split.json

bfloat16 needs AVX512-BF16 for the kernels' dot products; elsewhere the float32 path runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS = 30
DECODE_STEPS = 8  # a round of decode: ~60 ms, as long as a prompt step's, so a round spans neighbour periods
NUM_BLOCKS = 2900  # what a 1 GiB bfloat16 cache holds for this model, per layer (the common load's)
NEIGHBOUR = "import time\nwhile True:\n t = time.perf_counter()\n while time.perf_counter() - t < {busy}: pass\n time.sleep({idle})"


def build(kernels: Any, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    # two caches alternating layer by layer, so a layer's blocks are not the previous one's
    caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
              for _ in range(2)]
    lens = torch.tensor([rng.randrange(201, 265) for _ in range(64)], dtype=torch.int32)
    width = -(-265 // BLOCK)
    order = list(range(NUM_BLOCKS))
    rng.shuffle(order)
    table = torch.tensor([order[i * width:(i + 1) * width] for i in range(64)], dtype=torch.int32)
    q = torch.randn(64, HEADS, HEAD_DIM, generator=gen).to(dtype)
    tokens = 2048
    qp = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    kp = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    vp = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    spans = torch.tensor([[s, min(s + 200, tokens)] for s in range(0, tokens, 200)], dtype=torch.int64)
    out = torch.empty(tokens, HEADS, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM**-0.5

    def decode() -> None:
        for _ in range(DECODE_STEPS):
            for layer in range(LAYERS):
                k, v = caches[layer % 2]
                kernels.paged_decode(q, k, v, table, lens, scale, True)

    def prefill() -> None:
        for _ in range(LAYERS):
            kernels.prefill_attention(qp, kp, vp, out, spans, scale, True)

    hidden = 576
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    delta = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    angles = torch.rand(tokens, HEAD_DIM // 2, generator=gen) * 6.28
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype).contiguous() for f in (torch.cos, torch.sin))

    def rows() -> None:
        for _ in range(LAYERS):
            kernels.add_rms_norm(x, delta, weight, 1e-5)
            kernels.rotary(qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], cos, sin)
            kernels.add_rms_norm(x, delta, weight, 1e-5)

    return {"decode": decode, "prefill": prefill, "rows": rows}


def measure(kernels: Any, parts: dict[str, Callable[[], Any]], rounds: int, label: str) -> list[dict[str, Any]]:
    rows = []
    for name, run in parts.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        run()  # warm
        for _ in range(rounds):
            for taken in (False, True):
                kernels.work_stealing(taken)
                t0 = time.perf_counter()
                run()
                times[taken].append(time.perf_counter() - t0)
        kernels.work_stealing(True)
        once, taken_ms = (statistics.median(times[b]) * 1e3 for b in (False, True))
        rows.append({"load": label, "part": name, "split_once_ms": round(once, 2), "taken_ms": round(taken_ms, 2),
                     "ratio": round(taken_ms / once, 3)})
        print(f"{label:>22s} {name:8s} split once {once:8.2f} ms  taken {taken_ms:8.2f} ms  taken/once "
              f"{taken_ms / once:.3f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="decode,prefill,rows", help="decode, prefill, rows (comma-separated)")
    p.add_argument("--neighbours", default="3/15,1/20", help="busy ms / period ms of each neighbour load")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from services.kernels.build import load_extension
    from shared.heap import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    kernels = load_extension()
    if not kernels.prefill_attention_available():
        print("this CPU's build has no prompt attention kernel (neither AVX-512 nor AVX2)")
        return 1
    every = build(kernels, getattr(torch, args.dtype))
    parts = {name: every[name] for name in args.parts.split(",")}
    rows = measure(kernels, parts, args.rounds, "quiet")
    for spec in filter(None, args.neighbours.split(",")):
        busy_ms, period_ms = (float(x) for x in spec.split("/"))
        code = NEIGHBOUR.format(busy=busy_ms / 1e3, idle=(period_ms - busy_ms) / 1e3)
        neighbour = subprocess.Popen([sys.executable, "-c", code])
        try:
            time.sleep(0.5)
            rows += measure(kernels, parts, args.rounds, f"neighbour {busy_ms:g}/{period_ms:g} ms")
        finally:
            neighbour.kill()
            neighbour.wait()
    rows += measure(kernels, parts, args.rounds, "quiet again")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"threads": args.threads, "dtype": args.dtype, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
