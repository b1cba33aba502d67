"""``python -m benchmarks.kernels.bench_decode_layers``: a decode step's layers in one C++ call
(``decode_layers``, services/kernels/csrc/decode_layers.cpp) against the Python
layer loop, side by side.

- ``body``: one process, the default model in bfloat16 on the tiled kernels. A decode step of
  N requests (100-token contexts) is captured from a real generation, then the lean forward's
  body runs on it again and again, the two paths alternating call by call; medians per path.
  Same inputs, same cache slots: only the path differs.
- ``served``: ``ferry serve`` with ``FERRY_CPU_DECODE_LAYERS=0`` and ``=1`` in turn (one
  server at a time, ``--repeats`` rounds), each under closed-loop streams of 200-token prompts
  and 64 output tokens at each ``--concurrency``: output tok/s, ITL p50, TPOT mean, TTFT p50.

Prints one line per measurement and writes JSON with ``--out``. Speed is measured here, never
asserted in a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_io import header, write_json


def _decode_step(llm: Any, n: int) -> tuple[Any, Any, Any]:
    """The lean forward's arguments of a step of n decodes in a real generation of n requests."""
    from services.engine.offline import GenerationParams

    cls = type(llm.runner.lean)
    real_call = cls.__call__
    captured: list[tuple[Any, Any, Any]] = []

    def capture(self: Any, ids: Any, pos: Any, step: Any) -> Any:
        if not captured and ids.shape[-1] == n and getattr(step.metadata, "num_decodes", -1) == n:
            captured.append((ids.clone(), pos.clone(), step))
        return real_call(self, ids, pos, step)

    setattr(cls, "__call__", capture)  # noqa: B010 - the class's: the runner calls its instance
    try:
        llm.generate([[5 + i] * 100 for i in range(n)], GenerationParams(max_tokens=8, ignore_eos=True))
    finally:
        setattr(cls, "__call__", real_call)  # noqa: B010
    return captured[0]


def body(batches: list[int], calls: int) -> list[dict[str, Any]]:
    import torch

    from services.engine.offline import LLM

    llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", num_threads=2, kv_cache_memory=1 << 28,
              max_num_batched_tokens=2048, max_num_seqs=128)
    lean = llm.runner.lean
    if lean is None or lean.decode_args is None:
        raise SystemExit("no decode_layers path here (it needs the tiled bfloat16 kernel: AVX512-BF16, no AMX)")
    one_call = lean.decode_args
    out = []
    for n in batches:
        ids, pos, step = _decode_step(llm, n)
        times: dict[str, list[float]] = {"loop": [], "one_call": []}
        with torch.inference_mode():
            for _ in range(calls):
                for name, args in (("loop", None), ("one_call", one_call)):
                    lean.decode_args = args
                    t0 = time.perf_counter()
                    lean(ids, pos, step)
                    times[name].append(time.perf_counter() - t0)
        lean.decode_args = one_call
        row = {"requests": n, **{f"{k}_ms": round(statistics.median(v) * 1e3, 3) for k, v in times.items()}}
        row["one_call_over_loop"] = round(row["one_call_ms"] / row["loop_ms"], 3)
        print(f"body, {n} requests: loop {row['loop_ms']:.3f} ms, one call {row['one_call_ms']:.3f} ms "
              f"({row['one_call_over_loop']:.3f})", flush=True)
        out.append(row)
    return out


def served(concurrency: list[int], repeats: int, out_dir: Path) -> list[dict[str, Any]]:
    from benchmarks.peers.board import SERVED_NAME
    from loadtests.arrivals import ArrivalSpec
    from loadtests.client import ClientConfig
    from loadtests.runner import BenchSettings, RunPlan, run_once, warmup
    from loadtests.scenarios import generate
    from loadtests.server import ManagedServer, ServerSpec
    from loadtests.textgen import TextBuilder, load_tokenizer

    builder = TextBuilder(load_tokenizer("smollm2-135m-instruct"))
    opts: dict[str, object] = {"prompt_tokens": (200, 200), "output_tokens": (64, 64)}
    rows = []
    for rep in range(repeats):
        for flag in ("0", "1"):
            spec = ServerSpec(kind="ferry", model="smollm2-135m-instruct",
                              args=("--dtype", "bfloat16", "--num-threads", "2"), env={"FERRY_CPU_DECODE_LAYERS": flag})
            with ManagedServer(spec, {}, out_dir / f"serve-{flag}.log") as server:
                client = ClientConfig(server.base_url, SERVED_NAME, request_timeout_s=600, ignore_eos=True)
                warmup(generate("fixed", 2, 999, builder, opts), BenchSettings(client, quiet=True), 2)
                for c in concurrency:
                    trace = generate("fixed", max(8, 6 * c), 500 + 10 * rep + c, builder, opts)
                    s = run_once(trace, RunPlan(f"c{c}", 3600.0, ArrivalSpec("closed"), concurrency=c),
                                 BenchSettings(client, metrics_url=None, quiet=True))["summary"]
                    row = {"repeat": rep + 1, "decode_layers": flag == "1", "concurrency": c,
                           **{k: s.get(k) for k in ("output_tok_s", "itl_p50_ms", "tpot_mean_ms", "ttft_p50_ms", "errors")}}
                    print(f"served, repeat {rep + 1}, decode_layers={flag}, concurrency {c}: "
                          f"{row['output_tok_s']:.1f} out tok/s, ITL p50 {row['itl_p50_ms']:.1f} ms, "
                          f"TPOT mean {row['tpot_mean_ms']:.1f} ms, TTFT p50 {row['ttft_p50_ms']:.0f} ms", flush=True)
                    rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--parts", default="body,served", help="body, served or both")
    p.add_argument("--batches", default="1,8,64", help="requests per captured decode step (body)")
    p.add_argument("--calls", type=int, default=100, help="calls per path and batch (body)")
    p.add_argument("--concurrency", default="1,8", help="closed-loop streams (served)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of both servers (served)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as ferry serve gives its worker (read when OpenMP starts)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    result = header("benchmarks.kernels.bench_decode_layers", argv)
    if "body" in parts:
        result["body"] = body([int(x) for x in args.batches.split(",")], args.calls)
    if "served" in parts:
        out_dir = args.out.parent if args.out else Path("results")
        result["served"] = served([int(x) for x in args.concurrency.split(",")], args.repeats, out_dir / "decode-layers-logs")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
