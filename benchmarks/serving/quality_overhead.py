"""What checking answers costs the load tool: its CPU per request with the checks on and off.

Issue 55's budget: checking answers may add less than 1 % CPU to the load tool at the common
load. One ``ferry serve`` (the default model) stays up; the same trace (chat traffic with a
quarter of the requests drawn from the built-in task set) is sent at the same offered rate in
alternating runs, checks on then off, ``--repeats`` pairs. "Off" keeps every request identical
on the wire (the task items are still sent, with their schemas and tools) and only stops the
client from keeping the answers and judging them, so the difference is the checks' own cost.

The load tool's CPU is this process's (``time.process_time``: every thread, user and system)
over the run; per request it is divided by the requests sent. The report gives each pair's
ratio and their median, and the checking cost measured apart: the judge over every finished
task answer of the "on" runs, timed alone, per answer.

    python -m benchmarks.serving.quality_overhead --repeats 3 --rate 4 --duration 40 \\
        --out results/bench-quality-overhead
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import loadtests.client as client_module
import loadtests.runner as runner_module
from benchmarks.bench_io import header
from benchmarks.peers.board import SERVED_NAME, load_average, log
from loadtests.arrivals import ArrivalSpec
from loadtests.client import ClientConfig
from loadtests.quality.builtin import load_taskset
from loadtests.quality.checkers import check
from loadtests.quality.judge import item_answer
from loadtests.quality.mix import mix_tasks
from loadtests.runner import BenchSettings, RunPlan, run_once, warmup
from loadtests.scenarios import generate
from loadtests.server import ManagedServer, ServerSpec
from loadtests.textgen import TextBuilder, load_tokenizer
from loadtests.trace import Trace


@contextlib.contextmanager
def checks_off() -> Iterator[None]:
    """The client neither keeps answers nor judges them; the requests sent are unchanged."""
    judge, init = runner_module.judge, client_module._StreamState.__init__

    def no_keep(self: Any, record: Any, start: float, cancel_after: int | None, keep: bool = False) -> None:
        init(self, record, start, cancel_after, False)

    runner_module.judge = lambda *args, **kwargs: None  # type: ignore[assignment]
    client_module._StreamState.__init__ = no_keep  # type: ignore[method-assign]
    try:
        yield
    finally:
        runner_module.judge = judge  # type: ignore[assignment]
        client_module._StreamState.__init__ = init  # type: ignore[method-assign]


def one_run(trace: Trace, settings: BenchSettings, rate: float, duration: float, name: str) -> dict[str, Any]:
    plan = RunPlan(name, duration, ArrivalSpec("poisson", 1.0, 0), rate=rate)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = run_once(trace, plan, settings)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    s = result["summary"]
    return {"cpu_s": cpu, "wall_s": wall, "sent": s["num_requests"], "completed": s["completed"],
            "output_tokens": s["total_output_tokens"], "checked": s.get("checked", 0),
            "cpu_ms_per_request": 1000.0 * cpu / max(s["num_requests"], 1), "items": result.get("items") or {}}


def judge_cost(trace: Trace, items: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The checkers alone over the answers a run gave, timed (best of 5 passes), per answer."""
    by_id = {r.id: r for r in trace.requests}
    work = [(by_id[rid].check, item_answer(i)) for rid, i in items.items() if rid in by_id]
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for spec, answer in work:
            check(spec, answer)  # type: ignore[arg-type]
        best = min(best, time.process_time() - t0)
    return {"answers": len(work), "us_per_answer": 1e6 * best / max(len(work), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs (on, off)")
    p.add_argument("--rate", type=float, default=4.0, help="offered requests/s")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of sending per run")
    p.add_argument("--task-fraction", type=float, default=0.25)
    p.add_argument("--model", default=SERVED_NAME)
    p.add_argument("--ferry-args", default="", help="extra flags for ferry serve")
    p.add_argument("--out", type=Path, default=Path("results/bench-quality-overhead"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    builder = TextBuilder(load_tokenizer(args.model))
    num = int(args.rate * args.duration * 1.5) + 16
    base = generate("chat", num, 0, builder, {"output_tokens": (8, 64)})
    trace = mix_tasks(base, load_taskset("builtin"), args.task_fraction, 0)
    results: dict[str, Any] = {**header("benchmarks.serving.quality_overhead", argv),
                               "trace_sha256": trace.content_hash, "rate": args.rate, "duration_s": args.duration,
                               "task_fraction": args.task_fraction, "pairs": []}
    spec = ServerSpec(kind="ferry", model=args.model, args=tuple(args.ferry_args.split()))
    with ManagedServer(spec, {}, args.out / "serve.log") as server:
        settings = BenchSettings(ClientConfig(server.base_url, SERVED_NAME, request_timeout_s=300.0),
                                 metrics_url=None, quiet=True)
        warmup(trace, settings, 2)
        for i in range(args.repeats):
            on = one_run(trace, settings, args.rate, args.duration, f"on-{i}")
            with checks_off():
                off = one_run(trace, settings, args.rate, args.duration, f"off-{i}")
            ratio = on["cpu_ms_per_request"] / off["cpu_ms_per_request"]
            log(f"pair {i + 1}: on {on['cpu_ms_per_request']:.2f} ms/request ({on['checked']} checked), "
                f"off {off['cpu_ms_per_request']:.2f} ms/request: ratio {ratio:.4f}")
            results["pairs"].append({"on": {k: v for k, v in on.items() if k != "items"},
                                     "off": {k: v for k, v in off.items() if k != "items"}, "ratio": ratio,
                                     "judge": judge_cost(trace, on["items"])})
            (args.out / "quality_overhead.json").write_text(json.dumps(results, indent=1))
    ratios = [pair["ratio"] for pair in results["pairs"]]
    judged = [pair["judge"]["us_per_answer"] for pair in results["pairs"]]
    per_request_off = statistics.median(pair["off"]["cpu_ms_per_request"] for pair in results["pairs"])
    results["median_ratio"] = statistics.median(ratios)
    results["judge_us_per_answer"] = statistics.median(judged)
    results["judge_share_of_client_cpu"] = (results["judge_us_per_answer"] / 1000.0 * args.task_fraction
                                            / per_request_off)
    results["load_average_end"] = load_average()
    (args.out / "quality_overhead.json").write_text(json.dumps(results, indent=1))
    print(f"client CPU per request, checks on / off: median ratio {results['median_ratio']:.4f} "
          f"(pairs: {', '.join(f'{r:.4f}' for r in ratios)})")
    print(f"the checkers alone: {results['judge_us_per_answer']:.1f} us per answer = "
          f"{100 * results['judge_share_of_client_cpu']:.3f} % of the client's CPU per request "
          f"({per_request_off:.2f} ms) at a task fraction of {args.task_fraction}")
    print(f"wrote {args.out / 'quality_overhead.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
