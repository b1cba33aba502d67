"""``ferry bench`` (also ``python -m loadtests``): run, sweep, experiment, generate.

- ``run``: a trace at each listed offered rate against a running server;
  writes DIR/board.md, DIR/results.json, PNG plots, the trace and the
  per-request records.
- ``sweep``: the same, rates ascending, stopping by itself after the first
  rate that breaks the SLO; reports the highest rate that met it.
- ``experiment FILE``: start the server per configuration (baseline and
  one-knob variants), run the same trace at the same rates, write the board
  and one decision record per variant.
- ``generate``: write a scenario's trace file (to inspect it, or to replay it
  later with ``--trace``).
- ``quality``: every item of a task set once against a running server, each answer
  checked; the share correct per task type (and, against an earlier pass, which greedy
  answers changed).
- ``tasks``: write the built-in task set (the format to bring your own in).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx

from loadtests.arrivals import ARRIVALS, ArrivalSpec
from loadtests.scenarios import SCENARIO_NAMES, parse_overrides
from loadtests.textgen import DEFAULT_TOKENIZER
from shared.config_checks import DefaultsHelpFormatter


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("values must be positive")
    return values


def base_url(text: str) -> str:
    """The server root: ``http://host:port``, also when given as ``http://host:port/v1`` or with a slash."""
    url = text.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return url


def _ints(text: str) -> list[int]:
    return [int(v) for v in _floats(text)]


def _add_traffic_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("traffic")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--scenario", choices=[*SCENARIO_NAMES, "tasks"],
                     help="built-in scenario (default: chat); 'tasks': only items of --tasks")
    src.add_argument("--trace", type=Path, help="replay a JSONL trace file instead of a scenario")
    g.add_argument("--seed", type=int, default=0, help="scenario and arrival seed")
    g.add_argument("--num-requests", type=int, default=0, help="trace length (0: enough for the longest run)")
    g.add_argument("--scenario-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario option, e.g. prompt_tokens=32:64 or cancel_fraction=0.5")
    g.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help="tokenizer for prompt lengths: built-in model name, model folder, .gguf, or tokenizer.json folder")
    g.add_argument("--tasks", default="",
                   help="a task set ('builtin' or a JSONL file): its items replace --task-fraction of the traffic, "
                        "and every answer is checked (docs/loadtests.md, \"Answer quality\")")
    g.add_argument("--task-fraction", type=float, default=0.25,
                   help="share of the scenario's requests replaced by task items (with --tasks)")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--base-url", required=True, type=base_url,
                   help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1, as ferry serve prints it, is accepted)")
    g.add_argument("--model", default="", help="model name to send ('': the first one /v1/models lists)")
    g.add_argument("--api-key", default="", help="bearer token, if the server wants one [env OPENAI_API_KEY]")
    g.add_argument("--duration", type=float, default=30.0, help="seconds of sending per run")
    g.add_argument("--arrival", choices=("auto", *ARRIVALS), default="auto",
                   help="auto: the trace's own timestamps for agent-rag, mixed, smoke and --trace, else poisson")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1: Poisson, <1: burstier)")
    g.add_argument("--concurrency", type=_ints, default=[], help="closed loop: in-flight levels, e.g. 1,4,16")
    g.add_argument("--max-concurrency", type=int, default=0, help="cap on in-flight requests in the open loop")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as a timeout")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so outputs reach max_tokens")
    g.add_argument("--warmup", type=int, default=1, help="requests sent one by one before measuring")
    g.add_argument("--cooldown", type=float, default=1.0, help="seconds between runs")
    g.add_argument("--out", type=Path, required=True, help="output folder")
    g.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    s = p.add_argument_group("targets and cost")
    s.add_argument("--goodput", default="", help="per-request SLOs for goodput, e.g. ttft:500,tpot:50,e2el:5000 (ms)")
    s.add_argument("--slo-ttft-p95-ms", type=float, help="run target: p95 TTFT")
    s.add_argument("--slo-e2e-p95-ms", type=float, help="run target: p95 end-to-end latency")
    s.add_argument("--slo-error-rate", type=float, help="run target: share of requests that fail")
    s.add_argument("--slo-queue-p95-ms", type=float, help="run target: p95 server queue time")
    s.add_argument("--saturation-margin", type=float, default=0.1,
                   help="a run is saturated when it completes less than (1 - margin) of the offered rate "
                        "(see docs/loadtests.md)")
    s.add_argument("--price-per-gpu-hour", type=float, help="for the cost per accepted answer")
    s.add_argument("--num-gpus", type=int, default=1)
    m = p.add_argument_group("server metrics")
    m.add_argument("--metrics-url", default="", help="Prometheus endpoint ('': BASE_URL/metrics)")
    m.add_argument("--no-server-metrics", action="store_true", help="do not scrape the server")
    m.add_argument("--metric-name", action="append", default=[], metavar="KIND=NAME[,NAME]",
                   help="metric names to read (kinds: queue_time, preemptions, running, waiting, memory)")
    m.add_argument("--sample-interval", type=float, default=0.5, help="seconds between /metrics samples")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="a trace at each listed rate against a running server",
                         formatter_class=DefaultsHelpFormatter)
    _add_traffic_args(run)
    _add_load_args(run)
    run.add_argument("--rates", type=_floats, default=[], help="offered req/s, e.g. 0.5,1,2")
    sweep = sub.add_parser("sweep", help="rates ascending until the SLO breaks", formatter_class=DefaultsHelpFormatter)
    _add_traffic_args(sweep)
    _add_load_args(sweep)
    sweep.add_argument("--rates", type=_floats, default=[], help="explicit rates (else --start/--factor/--max-rate)")
    sweep.add_argument("--start", type=float, default=0.25)
    sweep.add_argument("--factor", type=float, default=2.0)
    sweep.add_argument("--max-rate", type=float, default=64.0)
    sweep.add_argument("--no-stop-on-saturation", action="store_true",
                       help="keep sweeping past the first saturated rate (default: stop there)")
    exp = sub.add_parser("experiment", help="baseline and one-knob variants from a TOML file",
                         formatter_class=DefaultsHelpFormatter)
    exp.add_argument("file", type=Path)
    exp.add_argument("--out", type=Path, default=None, help="output folder (default: results/bench/<file stem>)")
    exp.add_argument("--quiet", action="store_true")
    exp.add_argument("--decide-only", action="store_true",
                     help="start no server: re-read OUT/results.json and rewrite the decision records and the board "
                          "(after changing a pass condition or the [noise] rule)")
    quality = sub.add_parser("quality", help="every item of a task set once, each answer checked",
                             formatter_class=DefaultsHelpFormatter)
    quality.add_argument("--base-url", required=True, type=base_url)
    quality.add_argument("--model", default="")
    quality.add_argument("--api-key", default="", help="bearer token [env OPENAI_API_KEY]")
    quality.add_argument("--tasks", default="builtin", help="'builtin' or a task-set JSONL file")
    quality.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    quality.add_argument("--request-timeout", type=float, default=300.0)
    quality.add_argument("--reference", type=Path, default=None,
                         help="an earlier quality pass's results.json: open items are judged by agreement with it, "
                              "and the board says which greedy answers changed")
    quality.add_argument("--out", type=Path, required=True, help="output folder")
    quality.add_argument("--quiet", action="store_true")
    tasks = sub.add_parser("tasks", help="write the built-in task set", formatter_class=DefaultsHelpFormatter)
    tasks.add_argument("--out", type=Path, required=True, help="task-set file to write (.jsonl)")
    gen = sub.add_parser("generate", help="write a scenario's trace file", formatter_class=DefaultsHelpFormatter)
    _add_traffic_args(gen)
    gen.add_argument("--out", type=Path, required=True, help="trace file to write (.jsonl)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(args_list)
    if hasattr(args, "api_key") and not args.api_key:
        args.api_key = os.environ.get("OPENAI_API_KEY", "")  # after parsing: --help never shows a secret
    # A SIGTERM unwinds like Ctrl-C, so servers started by an experiment are stopped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    command = ["ferry", "bench", *args_list]
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "tasks":
            return _tasks(args)
        if args.command == "quality":
            return _quality(args, command)
        if args.command == "experiment":
            return _experiment(args, command)
        return _bench(args, command)
    except KeyboardInterrupt:
        print("ferry bench: interrupted", file=sys.stderr)
        return 130
    except httpx.HTTPError as exc:
        where = exc.request.url if _has_request(exc) else "the server"
        print(f"ferry bench: error: cannot talk to {where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"ferry bench: error: {exc}", file=sys.stderr)
        return 2


def _has_request(exc: httpx.HTTPError) -> bool:
    try:
        return exc.request is not None
    except RuntimeError:  # httpx raises when the error carries no request
        return False


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _log(quiet: bool) -> Any:
    def log(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr, flush=True)

    return log


def _generate(args: argparse.Namespace) -> int:
    from loadtests.trace import write_trace

    scenario = args.scenario or "chat"
    trace = _traffic(args, scenario, args.num_requests or 100)
    digest = write_trace(trace, args.out)
    print(f"{args.out}: {len(trace.requests)} requests, sha256 {digest}")
    return 0


def _experiment(args: argparse.Namespace, command: list[str]) -> int:
    from loadtests.experiment import load_experiment
    from loadtests.experiment_run import redecide, run_experiment

    experiment = load_experiment(args.file)
    out = args.out or Path("results") / "bench" / args.file.stem
    if args.decide_only:
        results = redecide(experiment, out)
    else:
        results = run_experiment(experiment, out, args.quiet, command, _log(args.quiet))
    for decision in results["decisions"]:
        print(f"{decision['variant']}: {decision['verdict']}")
    print(f"board: {out / 'board.md'}")
    return 0


def _traffic(args: argparse.Namespace, scenario: str | None, num: int) -> Any:
    """The trace a run sends: a scenario's or a file's, with task items mixed in when --tasks is given."""
    from loadtests.bench import load_or_generate
    from loadtests.quality.builtin import load_taskset
    from loadtests.quality.mix import mix_tasks, taskset_trace

    if scenario == "tasks":
        return taskset_trace(load_taskset(args.tasks or "builtin"), num, args.seed)
    trace = load_or_generate(args.trace, scenario, args.seed, args.tokenizer, num, parse_overrides(args.scenario_opt))
    if args.tasks:
        trace = mix_tasks(trace, load_taskset(args.tasks), args.task_fraction, args.seed)
    return trace


def _tasks(args: argparse.Namespace) -> int:
    from loadtests.quality.builtin import load_taskset
    from loadtests.quality.tasks import write_taskset

    taskset = load_taskset("builtin")
    digest = write_taskset(taskset, args.out)
    counts = {t: sum(1 for i in taskset.items if i.task == t) for t in taskset.task_types}
    print(f"{args.out}: {len(taskset.items)} items ({', '.join(f'{t} {n}' for t, n in counts.items())}), "
          f"sha256 {digest}")
    return 0


def _quality(args: argparse.Namespace, command: list[str]) -> int:
    """One quality pass against a running server (the same pass an experiment runs per configuration)."""
    import json

    from loadtests.bench import bench_meta, server_info
    from loadtests.client import ClientConfig, discover_model_sync
    from loadtests.decision import config_items
    from loadtests.experiment_run import quality_pass
    from loadtests.quality.builtin import load_taskset
    from loadtests.quality.decide import determinism
    from loadtests.quality.judge import answers_of_items
    from loadtests.quality.mix import full_pass_trace
    from loadtests.report import determinism_words, write_results
    from loadtests.runner import BenchSettings

    if args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    taskset = load_taskset(args.tasks)
    reference_items = None
    if args.reference is not None:
        earlier = json.loads(args.reference.read_text(encoding="utf-8"))
        reference_items = config_items(earlier["configs"][0], 0.0)
        if reference_items is None:
            raise ValueError(f"{args.reference}: no quality pass in it")
    model = args.model or discover_model_sync(args.base_url, args.api_key)
    settings = BenchSettings(
        ClientConfig(args.base_url, model, args.api_key, args.request_timeout), metrics_url=None, quiet=args.quiet,
        records_dir=args.out / "requests",
        references=None if reference_items is None else answers_of_items(reference_items))
    meta = bench_meta(command, full_pass_trace(taskset), {
        "title": f"ferry bench quality: {taskset.meta.get('name', args.tasks)}", "base_url": args.base_url,
        "model": model, "server": server_info(args.base_url, args.api_key),
        "taskset": {k: v for k, v in taskset.describe().items() if k != "path"}, "concurrency": args.concurrency,
    })
    result = quality_pass(taskset, settings, args.concurrency, "quality", _log(args.quiet))
    config: dict[str, Any] = {"name": "quality", "runs": [], "sweep": {}, "quality_pass": result}
    if reference_items is not None:
        config["determinism"] = determinism(reference_items, result.get("items") or {})
        meta["reference"] = str(args.reference)
    written = write_results({"meta": meta, "configs": [config]}, args.out)
    for task, q in (result["summary"].get("quality") or {}).items():
        share = "n/a" if q["correct_rate"] is None else f"{q['correct_rate']:.1%}"
        print(f"{task}: {q['correct']}/{q['judged']} correct ({share})")
    if reference_items is not None:
        print(f"greedy answers against {args.reference}: {determinism_words(config['determinism'])}")
    print(f"board: {written['board']}")
    return 0


def _arrival_and_rates(args: argparse.Namespace, scenario: str | None) -> tuple[ArrivalSpec, list[float]]:
    from loadtests.bench import sweep_rates

    kind = args.arrival
    if kind == "auto":
        kind = "trace" if args.trace or scenario in ("agent-rag", "mixed", "smoke") else "poisson"
    rates = list(args.rates)
    if args.command == "sweep" and not rates and kind != "closed":
        rates = sweep_rates(args.start, args.factor, args.max_rate)
    if kind == "closed" and not args.concurrency:
        raise ValueError("--arrival closed needs --concurrency, e.g. --concurrency 1,4,16")
    if kind != "closed" and not rates:
        raise ValueError("pass the offered rates, e.g. --rates 0.5,1,2 (or --arrival closed --concurrency N)")
    return ArrivalSpec(kind, args.burstiness, args.seed), rates


def _settings(args: argparse.Namespace, model: str) -> Any:
    from loadtests.client import ClientConfig
    from loadtests.metrics import CostModel, GoodputSLO, RunSLO
    from loadtests.runner import BenchSettings
    from loadtests.saturation import SaturationRule
    from loadtests.scrape import MetricNames

    return BenchSettings(
        ClientConfig(args.base_url, model, args.api_key, args.request_timeout, ignore_eos=args.ignore_eos),
        metrics_url=None if args.no_server_metrics else (args.metrics_url or args.base_url.rstrip("/") + "/metrics"),
        metric_names=MetricNames.with_overrides(args.metric_name),
        sample_interval_s=args.sample_interval,
        goodput=GoodputSLO.parse(args.goodput) if args.goodput else GoodputSLO(),
        slo=RunSLO(args.slo_ttft_p95_ms, args.slo_e2e_p95_ms, args.slo_error_rate, args.slo_queue_p95_ms),
        cost=CostModel(args.price_per_gpu_hour, args.num_gpus),
        quiet=args.quiet,
        records_dir=args.out / "requests",
        saturation=SaturationRule(margin=args.saturation_margin),
    )


def _bench(args: argparse.Namespace, command: list[str]) -> int:
    from loadtests.bench import (
        BenchJob,
        bench_meta,
        requests_needed,
        run_config,
        server_info,
    )
    from loadtests.client import discover_model_sync
    from loadtests.report import write_results
    from loadtests.runner import warmup
    from loadtests.trace import write_trace

    scenario = None if args.trace else (args.scenario or "chat")
    arrival, rates = _arrival_and_rates(args, scenario)
    num = args.num_requests or requests_needed(arrival, rates, args.concurrency, args.duration)
    trace = _traffic(args, scenario, num)
    args.out.mkdir(parents=True, exist_ok=True)
    write_trace(trace, args.out / "trace.jsonl")
    model = args.model or discover_model_sync(args.base_url, args.api_key)
    settings = _settings(args, model)
    job = BenchJob(trace, args.duration, arrival, tuple(rates), tuple(args.concurrency),
                   args.max_concurrency or None, stop_on_slo=args.command == "sweep", cooldown_s=args.cooldown,
                   stop_on_saturation=args.command == "sweep" and not args.no_stop_on_saturation)
    meta = bench_meta(command, trace, {
        "title": f"ferry bench {args.command}: {scenario or args.trace}",
        "base_url": args.base_url, "model": model, "server": server_info(args.base_url, args.api_key),
        "arrival": arrival.kind if arrival.kind != "gamma" else f"gamma(burstiness={args.burstiness:g})",
        "slo": vars(settings.slo), "goodput": vars(settings.goodput), "cost": vars(settings.cost),
    })
    warmup(trace, settings, args.warmup)
    config = run_config("run", job, settings, _log(args.quiet))
    written = write_results({"meta": meta, "configs": [config]}, args.out)
    print(f"board: {written['board']}")
    if args.command == "sweep":
        best = config["sweep"]["max_rate_meeting_slo"]
        what = "concurrency" if config["sweep"]["axis"] == "concurrency" else "rate"
        print(f"highest {what} meeting the SLO: {'none' if best is None else f'{best:g}'}")
    return 0
