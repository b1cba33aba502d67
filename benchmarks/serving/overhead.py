"""Serving overhead: ``ferry serve`` against ferry's offline engine on the same trace, with repeats.

Issue 11's target 3: serving may cost at most 5 % over the offline engine. Both run
the same fixed-length trace (distinct plain prompts, ``max_tokens`` with
``ignore_eos``, temperature 0, all sent at once) with the same threads and dtype:

- offline: ``services.engine.offline.LLM.generate`` in a child process (so its
  torch threads and memory are gone before the server runs), timed around
  ``generate`` only, with the runner's own forward and sample seconds summed;
- serve: one ``ferry serve`` kept up for the whole job (idle between its runs),
  driven by the load generator as a burst; the server's
  ``ferry:step_phase_seconds`` sums before and after split its time into
  forward, sample and idle.

Runs alternate (offline, serve, offline, serve, ...) with fresh prompts per
repeat, so both see the same drift of a shared machine. The report gives each
side's mean and spread, the per-repeat ratio, and where serving's extra time
went: a forward slower than offline's (CPU taken by the gateway, scheduler and
client) or idle time between steps (scheduling, transport, waiting for a plan).

    python -m benchmarks.serving.overhead --repeats 3 --out results/overhead
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.peers.board import SERVED_NAME, load_average, log
from loadtests.arrivals import ArrivalSpec
from loadtests.client import ClientConfig
from loadtests.runner import BenchSettings, RunPlan, run_once, warmup
from loadtests.scenarios import generate
from loadtests.server import ManagedServer, ServerSpec
from loadtests.textgen import TextBuilder, load_tokenizer
from loadtests.trace import Trace, read_trace, write_trace


def offline_one(trace_path: Path, dtype: str, threads: int, model: str) -> dict[str, Any]:
    """Run one trace through the offline engine in this process; what ``--offline-one`` prints."""
    from services.engine.offline import LLM, GenerationParams

    trace = read_trace(trace_path)
    llm = LLM(model=model, dtype=dtype, num_threads=threads)
    spent = {"forward": 0.0, "sample": 0.0, "steps": 0}
    execute = llm.runner.execute

    def timed_execute(plan: Any) -> Any:
        result = execute(plan)
        if plan.total_num_scheduled_tokens:
            spent["forward"] += result.forward_s
            spent["sample"] += result.sample_s
            spent["steps"] += 1
        return result

    llm.runner.execute = timed_execute  # type: ignore[method-assign]
    warm = llm.generate(["warm up"], GenerationParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert warm[0].finish_reason == "length"
    prompts = [r.prompt or "" for r in trace.requests]
    params = [GenerationParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in trace.requests]
    spent.update(forward=0.0, sample=0.0, steps=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, decode=True)
    wall = time.perf_counter() - start
    num_out = sum(len(o.token_ids) for o in outs)
    return {"seconds": wall, "output_tokens": num_out, "output_tok_s": num_out / wall, **spent}


def phase_sums(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10.0, trust_env=False).text
    out: dict[str, float] = {"steps": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "ferry:step_phase_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    out[sample.labels["phase"]] = out.get(sample.labels["phase"], 0.0) + sample.value
                elif sample.name.endswith("_count") and sample.labels["phase"] == "forward":
                    out["steps"] += sample.value
    return out


def cpu_seconds(server: ManagedServer) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process of the stack, by role, and of this
    client process: who takes the cores from the worker."""
    out: dict[str, float] = {}
    assert server.proc is not None
    procs = [psutil.Process(server.proc.pid)]
    procs += procs[0].children(recursive=True)
    for proc in procs:
        try:
            cmd = " ".join(proc.cmdline())
            times = proc.cpu_times()
        except psutil.Error:
            continue
        role = next((r for r, mark in (("worker", "services.worker"), ("scheduler", "services.scheduler"),
                                       ("gateway", "services.gateway"), ("redis", "redis-server")) if mark in cmd),
                    "supervisor")
        out[role] = out.get(role, 0.0) + times.user + times.system
    own = psutil.Process().cpu_times()
    out["client"] = own.user + own.system
    return out


def serve_one(server: ManagedServer, trace: Trace, timeout_s: float) -> dict[str, Any]:
    client = ClientConfig(server.base_url, SERVED_NAME, request_timeout_s=timeout_s, ignore_eos=True)
    settings = BenchSettings(client, metrics_url=None, quiet=True)
    n = len(trace.requests)
    before, cpu_before = phase_sums(server.base_url), cpu_seconds(server)
    result = run_once(trace, RunPlan("burst", 24 * 3600.0, ArrivalSpec("closed"), concurrency=n), settings)
    cpu_after = cpu_seconds(server)
    time.sleep(1.0)  # the last EngineStats reach the gateway every 0.25 s
    after = phase_sums(server.base_url)
    summary = result["summary"]
    spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()}
    return {"seconds": summary["duration_s"], "output_tokens": summary["total_output_tokens"],
            "output_tok_s": summary["output_tok_s"], "errors": summary["errors"], **spent, "cpu_s": cpu}


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def report(results: dict[str, Any]) -> str:
    meta, runs = results["meta"], results["runs"]
    off = [r["offline"]["output_tok_s"] for r in runs]
    srv = [r["serve"]["output_tok_s"] for r in runs]
    ratios = [s / o for s, o in zip(srv, off, strict=True)]
    o, s, q = spread(off), spread(srv), spread(ratios)
    lines = [
        f"{meta['date']}; {meta['num_requests']} x {meta['prompt_tokens']}-token prompts, max_tokens "
        f"{meta['max_tokens']} (ignore_eos, temperature 0), all at once; dtype {meta['dtype']}, "
        f"{meta['threads']} threads; load average {meta['load_average_start']} at start, "
        f"{meta['load_average_end']} at end (other jobs shared the machine). Command: `{meta['command']}`", "",
        "| repeat | offline out tok/s | serve out tok/s | serve / offline | offline forward+sample s | "
        "serve forward+sample s | serve idle s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(runs):
        of, sv = r["offline"], r["serve"]
        lines.append(f"| {i + 1} | {of['output_tok_s']:.1f} | {sv['output_tok_s']:.1f} | "
                     f"{sv['output_tok_s'] / of['output_tok_s']:.3f} | {of['forward'] + of['sample']:.1f} | "
                     f"{sv.get('forward', 0) + sv.get('sample', 0):.1f} | {sv.get('idle', 0):.1f} |")
    cpu = [r["serve"].get("cpu_s") for r in runs if r["serve"].get("cpu_s")]
    if cpu:
        roles = sorted({k for c in cpu for k in c})
        lines += ["", "CPU seconds per serve run, by process (2 cores = 2 CPU-seconds per second of run): " + "; ".join(
            f"{role} {statistics.fmean(c.get(role, 0.0) for c in cpu):.1f}" for role in roles) + "."]
    lines += [
        "", f"offline: mean {o['mean']:.1f} out tok/s (stdev {o['stdev']:.1f}, {o['min']:.1f}-{o['max']:.1f}); "
        f"serve: mean {s['mean']:.1f} (stdev {s['stdev']:.1f}, {s['min']:.1f}-{s['max']:.1f}); "
        f"serve/offline: mean {q['mean']:.3f} (stdev {q['stdev']:.3f}, {q['min']:.3f}-{q['max']:.3f}), "
        f"i.e. serving costs {100 * (1 / q['mean'] - 1):.1f} % more time on average.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/overhead"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=SERVED_NAME)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ferry-args", default="", help="extra flags for ferry serve, e.g. '--async-scheduling true'")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--offline-one", type=Path, help=argparse.SUPPRESS)  # internal: one offline run
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.offline_one:
        print(json.dumps(offline_one(args.offline_one, args.dtype, args.threads, args.model)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    builder = TextBuilder(load_tokenizer(args.model))
    opts: dict[str, object] = {"prompt_tokens": (args.prompt_tokens, args.prompt_tokens),
                               "output_tokens": (args.max_tokens, args.max_tokens)}
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average_start": load_average(),
        "command": " ".join(["python -m benchmarks.serving.overhead", *(argv if argv is not None else sys.argv[1:])]),
        "num_requests": args.num_requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "dtype": args.dtype, "threads": args.threads,
    }
    spec = ServerSpec(kind="ferry", model=args.model, args=(
        "--dtype", args.dtype, "--num-threads", str(args.threads), *args.ferry_args.split()))
    runs: list[dict[str, Any]] = []
    with ManagedServer(spec, {}, args.out / "serve.log") as server:
        client = ClientConfig(server.base_url, SERVED_NAME, request_timeout_s=args.request_timeout, ignore_eos=True)
        warmup(generate("fixed", 2, 999, builder, opts), BenchSettings(client, quiet=True), 2)
        for i in range(args.repeats):
            trace = generate("fixed", args.num_requests, 200 + i, builder, opts)
            path = args.out / f"trace-{i}.jsonl"
            write_trace(trace, path)
            cmd = [sys.executable, "-m", "benchmarks.serving.overhead", "--offline-one", str(path), "--dtype", args.dtype,
                   "--threads", str(args.threads), "--model", args.model]
            # The offline engine with the OpenMP wait policy ferry serve gives its worker.
            # (services/worker/service.py: GOMP_SPINCOUNT=10000 unless the operator chose).
            env = dict(os.environ)
            if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(env):
                env["GOMP_SPINCOUNT"] = "10000"
            offline = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)
            log(f"repeat {i + 1}: offline {offline['output_tok_s']:.1f} out tok/s")
            served = serve_one(server, trace, args.request_timeout)
            log(f"repeat {i + 1}: serve {served['output_tok_s']:.1f} out tok/s "
                f"(forward {served.get('forward', 0):.1f} s, idle {served.get('idle', 0):.1f} s)")
            runs.append({"offline": offline, "serve": served})
            (args.out / "overhead.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    meta["load_average_end"] = load_average()
    results = {"meta": meta, "runs": runs}
    (args.out / "overhead.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
