"""Running an experiment: the same trace and rates against each configuration's own server.

For the baseline and then each variant: start the server (``loadtests.server``),
warm it up, run every rate (``loadtests.bench.run_config``), stop it, and
rewrite the results so a later failure keeps what was measured. Then one
decision record per variant (``loadtests.experiment.decide``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtests.arrivals import ArrivalSpec
from loadtests.bench import BenchJob, bench_meta, load_or_generate, requests_needed, run_config, server_info
from loadtests.client import ClientConfig, discover_model_sync
from loadtests.decision import decide
from loadtests.experiment import Experiment
from loadtests.memory_view import memory_view
from loadtests.quality.builtin import load_taskset
from loadtests.quality.checkers import Answer
from loadtests.quality.judge import answers_of_items, quality_of_items
from loadtests.quality.mix import full_pass_trace, mix_tasks
from loadtests.quality.tasks import TaskSet
from loadtests.report import slug, write_results
from loadtests.runner import BenchSettings, RunPlan, run_once, warmup
from loadtests.server import ManagedServer, ServerStartError
from loadtests.trace import Trace, write_trace

Log = Callable[[str], None]


def run_experiment(experiment: Experiment, out_dir: Path, quiet: bool, command: list[str], log: Log) -> dict[str, Any]:
    """Baseline then each variant; returns (and writes) the results with the decision records."""
    trace, job, taskset = _prepare(experiment, out_dir)
    input_set = {
        "trace_sha256": trace.content_hash, "scenario": trace.meta.get("scenario", trace.meta.get("path")),
        "seed": trace.meta.get("seed"), "num_requests": len(trace.requests), "rates": experiment.rates,
        "duration_s": job.duration_s, "arrival": experiment.arrival.kind,
    }
    if taskset is not None:
        input_set["taskset"] = {k: v for k, v in taskset.describe().items() if k != "path"}
    results: dict[str, Any] = {
        "meta": bench_meta(command, trace, {
            "title": experiment.title, "description": experiment.description, "experiment": str(experiment.source),
            "arrival": experiment.arrival.kind, "slo": vars(experiment.slo), "goodput": vars(experiment.goodput),
            "cost": vars(experiment.cost), "baseline": experiment.baseline,
            "noise": {"baseline_repeats": experiment.baseline_repeats, "floor": experiment.noise_floor},
            "quality": None if experiment.quality is None else vars(experiment.quality),
        }),
        "configs": [],
        "decisions": [],
    }
    # The baseline's repeats are interleaved with the variants (A B C A) so its spread measures
    # the machine's noise over the experiment; loadtests/noise.py turns that into verdicts.
    references: dict[str, Answer] | None = None  # the first baseline's answers: what agree items are judged by
    for name, variant in experiment.run_order():
        knobs = dict(experiment.baseline) if variant is None else {**experiment.baseline, variant.knob: variant.value}
        entry = _run_one(experiment, name, knobs, trace, job, out_dir, quiet, log, taskset, references)
        if references is None and name == "baseline" and entry.get("quality_pass"):
            references = answers_of_items(entry["quality_pass"].get("items") or {})
        entry["memory"] = memory_view(entry, experiment.server.kind, experiment.server.model,
                                      experiment.server.args, trace)
        results["configs"].append(entry)
        write_results(results, out_dir)  # partial results survive a later failure
    results["decisions"] = decide_all(experiment, results, input_set)
    write_results(results, out_dir)
    return results


def redecide(experiment: Experiment, out_dir: Path) -> dict[str, Any]:
    """The decision records again from a finished run's results.json (no server started)."""
    import json

    path = out_dir / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot re-decide without the run's results ({exc})") from exc
    for key in ("tool", "results_version"):
        results.pop(key, None)
    old = results.get("decisions") or [{}]
    input_set: dict[str, Any] = next((d["input_set"] for d in old if isinstance(d.get("input_set"), dict)), {})
    results["decisions"] = decide_all(experiment, results, input_set)
    write_results(results, out_dir)
    return results


def decide_all(experiment: Experiment, results: dict[str, Any], input_set: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per variant against every baseline run that started."""
    decisions: list[dict[str, Any]] = []
    baselines = [c for c in results["configs"] if c["name"].startswith("baseline") and not c.get("error")]
    by_name = {c["name"]: c for c in results["configs"]}
    for variant in experiment.variants:
        entry = by_name.get(variant.name)
        if entry is None:
            continue  # not run (yet)
        if entry.get("error"):
            decisions.append({
                "variant": variant.name, "hypothesis": variant.hypothesis,
                "changed_parameter": f"{variant.knob} -> {variant.value}", "input_set": input_set,
                "pass_condition": variant.pass_condition, "measured_outcome": entry["error"],
                "verdict": "inconclusive (the server did not start)",
            })
            continue
        record = decide(experiment, variant, baselines, entry, input_set)
        record["memory"] = {c["name"]: c["memory"] for c in (*baselines, entry) if "memory" in c}
        decisions.append(record)
    return decisions


def _prepare(experiment: Experiment, out_dir: Path) -> tuple[Trace, BenchJob, TaskSet | None]:
    """The one trace every configuration gets, written beside the results with the experiment file."""
    w = experiment.workload
    duration = float(w.get("duration_s", 30))
    trace_path = Path(w["trace"]) if w.get("trace") else None
    if trace_path is not None and not trace_path.is_absolute():
        trace_path = experiment.source.parent / trace_path
    num = int(w.get("num_requests") or requests_needed(experiment.arrival, experiment.rates, [], duration))
    tokenizer = str(w.get("tokenizer", experiment.server.model))
    trace = load_or_generate(trace_path, w.get("scenario"), int(w.get("seed", 0)), tokenizer, num,
                             experiment.scenario_overrides)
    taskset = None
    if experiment.quality is not None:
        source = experiment.quality.tasks
        if source != "builtin" and not Path(source).is_absolute():
            source = str(experiment.source.parent / source)
        taskset = load_taskset(source)
        trace = mix_tasks(trace, taskset, experiment.quality.mix, int(w.get("seed", 0)))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_trace(trace, out_dir / "trace.jsonl")
    # The file itself travels with the results, so the comparison can be repeated as run.
    (out_dir / "experiment.toml").write_text(experiment.source.read_text(encoding="utf-8"), encoding="utf-8")
    job = BenchJob(trace, duration, experiment.arrival, rates=tuple(experiment.rates),
                   max_concurrency=int(w.get("max_concurrency", 0)) or None,
                   stop_on_slo=bool(w.get("stop_on_slo", False)), cooldown_s=float(w.get("cooldown_s", 1.0)))
    return trace, job, taskset


def _run_one(experiment: Experiment, name: str, knobs: dict[str, Any], trace: Trace, job: BenchJob,
             out_dir: Path, quiet: bool, log: Log, taskset: TaskSet | None = None,
             references: dict[str, Answer] | None = None) -> dict[str, Any]:
    """Start this configuration's server, run every rate, stop it; a variant that fails to start is recorded."""
    w = experiment.workload
    server = ManagedServer(experiment.server, knobs, out_dir / "logs" / f"server-{slug(name)}.log")
    entry: dict[str, Any] = {"name": name, "runs": [], "sweep": {},
                             "server": {"command": server.command_line, "knobs": knobs}}
    log(f"[{name}] starting: {server.command_line}")
    try:
        with server:
            model = str(w.get("model") or discover_model_sync(server.base_url))
            entry["server"]["info"] = server_info(server.base_url)
            settings = BenchSettings(
                ClientConfig(server.base_url, model, request_timeout_s=float(w.get("request_timeout_s", 300)),
                             ignore_eos=bool(w.get("ignore_eos", False))),
                metrics_url=server.base_url + "/metrics", goodput=experiment.goodput, slo=experiment.slo,
                cost=experiment.cost, quiet=quiet, records_dir=out_dir / "requests" / slug(name),
                references=references,
            )
            warmup(trace, settings, int(w.get("warmup_requests", 2)))
            entry.update(run_config(name, job, settings, log))
            quality = experiment.quality
            if quality is not None and quality.full_pass and taskset is not None:
                entry["quality_pass"] = quality_pass(taskset, settings, quality.concurrency, name, log)
    except ServerStartError as exc:
        if name == "baseline":
            raise
        entry["error"] = str(exc).splitlines()[0]
        log(f"[{name}] {entry['error']}")
    return entry


def quality_pass(taskset: TaskSet, settings: BenchSettings, concurrency: int, name: str, log: Log,
                 retries: int = 4) -> dict[str, Any]:
    """Every item of the task set once, ``concurrency`` in flight, judged: the items the paired test uses.

    The pass is about answers, not latency: an item the server refused or failed (a 429 from a small
    waiting queue, a 503, a timeout) is asked again, up to ``retries`` more rounds with half the
    requests in flight each time, so a configuration with tight admission limits is still compared
    on every item. The result's quality counts every round; ``retried`` says how many went again."""
    trace = full_pass_trace(taskset)
    log(f"[{name}] quality pass: {len(trace.requests)} items, {concurrency} in flight")
    plan = RunPlan("quality-pass", 24 * 3600.0, ArrivalSpec("closed"), concurrency=concurrency)
    result = run_once(trace, plan, settings)
    items = dict(result.get("items") or {})
    result["retried"] = []
    for round_ in range(1, retries + 1):
        missing = [r for r in trace.requests if r.id not in items]
        if not missing:
            break
        concurrency = max(1, concurrency // 2)
        log(f"[{name}] quality pass: {len(missing)} items unanswered, asking again ({concurrency} in flight)")
        result["retried"].append(len(missing))
        time.sleep(1.0)
        again = run_once(Trace(missing, dict(trace.meta)), RunPlan(f"quality-pass-retry-{round_}", 24 * 3600.0,
                         ArrivalSpec("closed"), concurrency=concurrency), settings)
        items.update(again.get("items") or {})
    result["items"] = items
    result["summary"]["quality"] = quality_of_items(items, {r.id: str(r.task) for r in trace.requests})
    for task, q in result["summary"]["quality"].items():
        share = "n/a" if q["correct_rate"] is None else f"{q['correct_rate']:.1%}"
        log(f"[{name}] quality pass {task}: {q['correct']}/{q['judged']} correct ({share})"
            + (f", {q['unanswered']} unanswered" if q["unanswered"] else ""))
    return result
