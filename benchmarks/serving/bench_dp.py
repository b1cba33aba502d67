"""Data parallel on one machine: ``ferry bench`` at rising rates against 1 and 2 engines,
and the prefix-cache hit rate of prefix-affinity routing against round-robin.

    python -m benchmarks.serving.bench_dp --out results/bench-dp.json

For each system (``1 engine``, ``2 engines / prefix``, ``2 engines / round_robin``)
it starts ``ferry serve`` on a free port, runs ``ferry bench run`` (the
``agent-rag`` scenario: four long shared system prompts) at each rate, and reads
every engine's prefix-cache hits and queries from the gateway's ``/metrics``
before and after. Prints one line per run and writes all figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

SYSTEMS = {"dp1": (1, "prefix"), "dp2-prefix": (2, "prefix"), "dp2-round-robin": (2, "round_robin")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prefix_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5.0, trust_env=False).text
    out = {"hits": 0.0, "queries": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "ferry:prefix_cache_hits_total":
                out["hits"] += s.value
            elif s.name == "ferry:prefix_cache_queries_total":
                out["queries"] += s.value
    return out


def run_system(name: str, args: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    engines, policy = SYSTEMS[name]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(out_dir / f"serve-{name}.log", "wb")  # noqa: SIM115 - the child owns it
    cmd = [sys.executable, "-m", "ferry_cli", "serve", "--model", args.model, "--port", str(port),
           "--data-parallel-size", str(engines), "--routing-policy", policy, "--num-threads",
           str(max(1, args.threads // engines)), "--kv-cache-memory", str(args.kv_cache_memory),
           "--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, process_group=0)
    rows: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 600
        while b"ferry is serving" not in (out_dir / f"serve-{name}.log").read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ferry serve ({name}) did not start; see serve-{name}.log")
            time.sleep(0.5)
        for rate in args.rates.split(","):
            before = prefix_counters(base)
            run_dir = out_dir / f"{name}-{rate}"
            opts = [x for opt in args.scenario_opt for x in ("--scenario-opt", opt)]
            subprocess.run([sys.executable, "-m", "ferry_cli", "bench", "run", "--base-url", base,
                            "--scenario", "agent-rag", "--rates", rate, "--duration", str(args.duration),
                            *opts, "--seed", "1", "--quiet", "--out", str(run_dir)], check=True)
            after = prefix_counters(base)
            summary = json.loads((run_dir / "results.json").read_text())["configs"][0]["runs"][0]["summary"]
            queries = after["queries"] - before["queries"]
            row = {"system": name, "engines": engines, "policy": policy, "rate": float(rate),
                   "completed_rps": summary["completed_rps"], "output_tok_s": summary["output_tok_s"],
                   "ttft_p50_ms": summary.get("ttft_p50_ms"), "ttft_p95_ms": summary.get("ttft_p95_ms"),
                   "e2e_p95_ms": summary.get("e2e_p95_ms"), "errors": summary["errors"],
                   "prefix_hit_rate": (after["hits"] - before["hits"]) / queries if queries else None}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.bench_dp", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rates", default="0.25,0.5,1")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=2, help="torch threads in all (split among engines)")
    p.add_argument("--kv-cache-memory", type=int, default=128 << 20)
    p.add_argument("--scenario-opt", action="append", default=[], help="agent-rag overrides (ferry bench's)")
    p.add_argument("--out", default="results/bench-dp.json")
    args = p.parse_args(argv)
    # many shared prefixes in a KV cache that cannot hold them all twice over: where requests
    # go decides what stays cached (SmolLM2 in bf16: ~23 KB of KV per token, 128 MiB ~ 5,800 tokens)
    args.scenario_opt = args.scenario_opt or ["num_prefix_groups=16", "prefix_tokens=128:256",
                                              "prompt_tokens=16:48", "output_tokens=8:24", "cancel_fraction=0"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop ferry serve
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-dp-", dir=out.parent))
    rows: list[dict[str, Any]] = []
    for name in args.systems.split(","):
        rows += run_system(name, args, work)
    result = {"scenario_opts": args.scenario_opt, "command": "python -m benchmarks.serving.bench_dp " + " ".join(argv or sys.argv[1:]),
              "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": rows}
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
