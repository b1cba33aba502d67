"""Two engines, two gateways, ``ferry bench`` load on both, and one engine SIGKILLed mid-load.

    python -m benchmarks.serving.engine_kill --model PATH --rate 2 --duration 60 --kill-at 20 --out DIR

It starts ``ferry serve --data-parallel-size 2`` (two engines, the first gateway,
the embedded Redis) and a second gateway (``python -m services.gateway``) told of
engine 0 only, which finds engine 1 in the Redis registry. Then it runs the same
load as ``ferry bench run`` (one open-loop run of the trace at ``--rate`` req/s per
gateway, streamed) against both gateways at once, and ``--kill-at`` seconds in,
once engine 1 is running requests, SIGKILLs every process of engine 1 (its
scheduler and its workers). ``ferry serve``'s supervisor restarts them.

What happens to the requests (docs/operations.md, "An engine"): those that never
started on engine 1 go to another engine (``rerouted``); streams that had started
there are held by their gateway and resumed on the restarted engine
(``resumed``), so clients see a pause, not an error. The board (DIR/board.md) is the
usual ``ferry bench`` board with one run per gateway (completed, errors by kind,
latencies), followed by the kill: when, which processes, when engine 1 was back in
both gateways, and per gateway the rerouted and resumed counts from ``/metrics``
and the streams that paused across the kill and then completed (from the client's
own token times). DIR/results.json holds every figure, DIR/requests/ every request.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from loadtests.arrivals import ArrivalSpec
from loadtests.bench import bench_meta, load_or_generate, requests_needed
from loadtests.client import ClientConfig
from loadtests.report import write_results
from loadtests.runner import BenchSettings, RunPlan, run_once_async
from loadtests.scenarios import parse_overrides
from loadtests.server import ManagedServer, ServerSpec, free_port
from loadtests.textgen import DEFAULT_TOKENIZER
from loadtests.trace import write_trace
from shared.config_checks import DefaultsHelpFormatter

VICTIM = "1"  # the engine killed (engine 0 is the one both gateways were told of)
PAUSE_S = 1.0  # a gap between two tokens this long, spanning the kill, is a stream held and resumed
IN_TRANSIT_S = 0.25


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.engine_kill", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="what ferry serve loads (a name or a folder)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", default="16000000", help="per engine")
    p.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                   help="one more ferry serve argument (repeat; e.g. --serve-arg=--max-num-seqs --serve-arg=8)")
    p.add_argument("--scenario", default="chat")
    p.add_argument("--scenario-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="scenario option, as ferry bench's (e.g. output_tokens=128:512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    p.add_argument("--rate", type=float, default=2.0, help="offered req/s at each gateway (Poisson)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of sending")
    p.add_argument("--kill-at", type=float, default=20.0, help="seconds into the run (then as soon as engine "
                   f"{VICTIM} runs --kill-when-running requests)")
    p.add_argument("--kill-when-running", type=int, default=2,
                   help=f"after --kill-at, wait (until the end of sending) for engine {VICTIM} to run this many")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quiet", action="store_true")
    return p


def counters(base_url: str) -> dict[str, dict[str, float]]:
    """The gateway's routing and resume counters: {metric: {label value: total}}."""
    text = httpx.get(f"{base_url}/metrics", timeout=10.0, trust_env=False).text
    out: dict[str, dict[str, float]] = {"rerouted": {}, "resumed": {}, "routed": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "ferry:requests_routed_total":
                kind = "rerouted" if s.labels.get("outcome") == "rerouted" else "routed"
                out[kind][s.labels["engine"]] = out[kind].get(s.labels["engine"], 0.0) + s.value
            elif s.name == "ferry:requests_resumed_total":
                out["resumed"][s.labels["cause"]] = out["resumed"].get(s.labels["cause"], 0.0) + s.value
    return out


def delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {k: {label: v - before.get(k, {}).get(label, 0.0) for label, v in values.items()
                if v - before.get(k, {}).get(label, 0.0)} for k, values in after.items()}


def engine_rows(base_url: str) -> dict[str, dict[str, Any]]:
    try:
        body = httpx.get(f"{base_url}/health", timeout=5.0, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {str(e["name"]): e for e in body.get("engines") or []}


def engine_processes(serve: ManagedServer, runtime_dir: str, engine: str) -> list[tuple[psutil.Process, str]]:
    """(process, which) for the scheduler and workers of one engine: their sockets live in its own
    runtime folder."""
    assert serve.proc is not None
    folder = os.path.join(runtime_dir, f"engine{engine}") + "/"
    found = []
    for p in psutil.Process(serve.proc.pid).children(recursive=True):
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        cmd = " ".join(argv)
        for module in ("services.scheduler", "services.worker"):
            if folder in cmd and module in argv:
                rank = argv[argv.index("--rank") + 1] if "--rank" in argv else ""
                found.append((p, module.split(".")[1] + rank))
    return found


async def kill_mid_load(serve: ManagedServer, runtime_dir: str, gateways: list[str], t0: float,
                        kill_at: float, min_running: int, deadline: float, log: Any) -> dict[str, Any]:
    """At ``kill_at`` s (then once engine VICTIM runs ``min_running`` requests) SIGKILL it; then wait
    until it is back."""
    await asyncio.sleep(max(0.0, t0 + kill_at - time.perf_counter()))
    running = waiting = 0
    while time.perf_counter() < t0 + deadline:
        row = (await asyncio.to_thread(engine_rows, gateways[0])).get(VICTIM, {})
        running, waiting = row.get("num_running") or 0, row.get("num_waiting") or 0
        if running >= min_running:
            break
        await asyncio.sleep(0.1)
    old = {(await asyncio.to_thread(engine_rows, g)).get(VICTIM, {}).get("incarnation") for g in gateways}
    procs = engine_processes(serve, runtime_dir, VICTIM)
    killed = []
    for p, cmd in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
            killed.append({"pid": p.pid, "cmd": cmd})
        except ProcessLookupError:
            pass
    t_kill = time.perf_counter() - t0
    log(f"t={t_kill:.1f}s: SIGKILL engine {VICTIM} (running {running}): {', '.join(str(k['pid']) for k in killed)}")
    back: float | None = None
    while time.perf_counter() < t0 + deadline + 300:
        await asyncio.sleep(0.25)
        rows = [(await asyncio.to_thread(engine_rows, g)).get(VICTIM, {}) for g in gateways]
        # back: both gateways route to it again, and it is the restarted scheduler (a new incarnation)
        if all(r.get("ready") and r.get("incarnation") not in old for r in rows):
            back = time.perf_counter() - t0
            break
    log(f"engine {VICTIM} back in both gateways at t={back:.1f}s" if back else f"engine {VICTIM} not back")
    return {"engine": VICTIM, "kill_at_s": round(t_kill, 2), "processes": killed, "running_at_kill": running,
            "waiting_at_kill": waiting,
            "back_in_both_gateways_at_s": None if back is None else round(back, 2)}


def paused_streams(records_path: Path, kill_s: float) -> dict[str, int]:
    """From the client's records: streams with a token before the kill that then paused across it
    (a gap of PAUSE_S or more spanning the kill) and completed, or failed."""
    import json

    resumed_ok = failed = spanning = 0
    for line in records_path.read_text().splitlines():
        r = json.loads(line)
        if r["ttft_s"] is None:
            continue
        times = [r["sent_s"] + r["ttft_s"]]
        for gap in r["itl_s"]:
            times.append(times[-1] + gap)
        end = r["sent_s"] + (r["latency_s"] or 0.0)
        if times[0] >= kill_s or end < kill_s:
            continue
        spanning += 1  # streaming when the engine died (on either engine)
        # tokens already on their way may land just after the kill: the gap may start a moment later
        paused = any(b - a >= PAUSE_S and a <= kill_s + IN_TRANSIT_S and b >= kill_s
                     for a, b in itertools.pairwise(times))
        if r["status"] == "ok" and paused:
            resumed_ok += 1
        elif r["status"] != "ok":
            failed += 1
    return {"streaming_at_kill": spanning, "paused_then_completed": resumed_ok, "streaming_at_kill_failed": failed}


def render_kill(kill: dict[str, Any], per_gateway: list[dict[str, Any]]) -> str:
    lines = ["## The engine SIGKILL", ""]
    procs = ", ".join(f"{p['cmd']} (pid {p['pid']})" for p in kill["processes"])
    back = kill["back_in_both_gateways_at_s"]
    lines.append(f"- SIGKILL at t={kill['kill_at_s']:g} s of the run, engine {kill['engine']} running "
                 f"{kill['running_at_kill']} and queueing {kill['waiting_at_kill']} request(s) by its last stats "
                 f"(as gateway a saw them): {procs}")
    lines.append("- engine back in both gateways' routing at "
                 + (f"t={back:g} s ({back - kill['kill_at_s']:.1f} s after the kill)" if back is not None
                    else "never (within the wait)"))
    lines += ["", "| gateway | requests | completed | errors 429/503/timeout/other | streaming at the kill "
              "| of those: paused, then completed | of those: failed | rerouted (server) | resumed (server) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in per_gateway:
        s = g["summary"]
        errs = "/".join(str(s[f"errors_{k}"]) for k in ("429", "503", "timeout", "other"))
        rerouted = int(sum(g["server"]["rerouted"].values()))
        resumed = ", ".join(f"{int(v)} ({cause})" for cause, v in sorted(g["server"]["resumed"].items())) or "0"
        c = g["client"]
        lines.append(f"| {g['name']} | {s['num_requests']} | {s['completed']} | {errs} | {c['streaming_at_kill']} "
                     f"| {c['paused_then_completed']} | {c['streaming_at_kill_failed']} | {rerouted} | {resumed} |")
    lines += ["", "rerouted: sent again to the other engine before producing a token; resumed: held by the "
              "gateway while their engine was down and re-submitted to it when it came back (issue 15); "
              f"paused: a gap of {PAUSE_S:g} s or more between two tokens across the kill, as the client saw it.",
              ""]
    return "\n".join(lines)


async def run_both(traces: list[Any], args: argparse.Namespace, gateways: list[str], model: str,
                   serve: ManagedServer, runtime_dir: str, log: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    plan = RunPlan(f"{args.rate:g}rps", args.duration, ArrivalSpec("poisson", 1.0, args.seed), rate=args.rate)
    settings = [BenchSettings(ClientConfig(g, model, "", args.request_timeout, ignore_eos=True),
                              metrics_url=g + "/metrics", quiet=True, records_dir=args.out / "requests" / name)
                for g, name in zip(gateways, ("a", "b"), strict=True)]
    t0 = time.perf_counter()
    killer = asyncio.create_task(kill_mid_load(serve, runtime_dir, gateways, t0, args.kill_at,
                                               args.kill_when_running, args.duration, log))
    runs = await asyncio.gather(*(run_once_async(trace, plan, s) for trace, s in zip(traces, settings, strict=True)))
    kill = await killer
    return list(runs), kill


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    runtime_dir = tempfile.mkdtemp(prefix="ferry-k-")  # short: ipc paths are limited to ~100 bytes
    serve = ManagedServer(ServerSpec(kind="ferry", model=args.model, startup_timeout_s=600, args=(
        "--data-parallel-size", "2", "--runtime-dir", runtime_dir, "--dtype", args.dtype,
        "--kv-cache-memory", args.kv_cache_memory, *args.serve_arg)), {}, args.out / "serve.log")
    second: subprocess.Popen[bytes] | None = None
    try:
        log(f"starting: {serve.command_line}")
        serve.start()
        port = free_port()
        gateway_cmd = [sys.executable, "-m", "services.gateway", "--model", args.model, "--port", str(port),
                       "--scheduler-endpoint", f"ipc://{runtime_dir}/engine0/gateway.sock",
                       "--redis-url", f"unix://{runtime_dir}/redis.sock"]
        with open(args.out / "gateway-b.log", "wb") as glog:
            second = subprocess.Popen(gateway_cmd, stdout=glog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        gateways = [serve.base_url, f"http://127.0.0.1:{port}"]
        deadline = time.monotonic() + 120
        while not all(len([e for e in engine_rows(g).values() if e.get("ready")]) == 2 for g in gateways):
            if second.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the second gateway did not see both engines; see {args.out / 'gateway-b.log'}")
            time.sleep(0.5)
        log(f"two engines, two gateways: {gateways[0]} (ferry serve's) and {gateways[1]} (engine 1 from Redis)")
        arrival = ArrivalSpec("poisson", 1.0, args.seed)
        # each gateway its own clients: the same scenario, a different seed (so different prompts)
        traces = [load_or_generate(None, args.scenario, args.seed + i, args.tokenizer,
                                   requests_needed(arrival, [args.rate], [], args.duration),
                                   parse_overrides(args.scenario_opt)) for i in range(2)]
        for trace, name in zip(traces, ("a", "b"), strict=True):
            write_trace(trace, args.out / f"trace-{name}.jsonl")
        command = ["python", "-m", "benchmarks.serving.engine_kill", *(argv if argv is not None else sys.argv[1:])]
        meta = bench_meta(command, traces[0], {
            "title": f"Engine SIGKILL under load: 2 engines, 2 gateways, {args.scenario}",
            "model": args.model, "arrival": f"poisson, {args.rate:g} req/s at each gateway",
            "base_url": ", ".join(gateways), "trace_b": traces[1].describe(),
        })
        before = [counters(g) for g in gateways]
        log(f"load: {args.scenario} at {args.rate:g} req/s on each gateway for {args.duration:g}s, "
            f"SIGKILL of engine {VICTIM} from t={args.kill_at:g}s")
        runs, kill = asyncio.run(run_both(traces, args, gateways, args.model, serve, runtime_dir, log))
        after = [counters(g) for g in gateways]
        per_gateway = []
        for name, folder_name, run, b, a in zip(("gateway a (ferry serve's)", "gateway b (second)"), "ab", runs,
                                                before, after, strict=True):
            folder = args.out / "requests" / folder_name
            client = paused_streams(folder / f"requests-{run['name']}.jsonl", kill["kill_at_s"])
            per_gateway.append({"name": name, "summary": run["summary"], "server": delta(a, b), "client": client})
        configs = [{"name": g["name"], "runs": [run], "server": {"command": cmd}}
                   for g, run, cmd in zip(per_gateway, runs, (serve.command_line, " ".join(gateway_cmd)), strict=True)]
        results = {"meta": meta, "configs": configs, "engine_kill": {"kill": kill, "gateways": per_gateway}}
        written = write_results(results, args.out)
        board = written["board"]
        board.write_text(board.read_text() + "\n" + render_kill(kill, per_gateway))
        print(f"board: {board}")
        return 0
    finally:
        if second is not None and second.poll() is None:
            os.killpg(second.pid, signal.SIGTERM)
            try:
                second.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(second.pid, signal.SIGKILL)
        serve.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
