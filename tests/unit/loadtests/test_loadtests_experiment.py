"""Experiment files, pass conditions, decision records, and the server command lines they produce."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loadtests.decision import condition_names, decide
from loadtests.experiment import (
    ExperimentError,
    Unavailable,
    check_condition,
    evaluate,
    load_experiment,
)
from loadtests.server import ServerSpec, knob_flags, server_argv

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "loadtests" / "experiments").glob("*.toml"))

MINIMAL = """
title = "t"
[server]
kind = "command"
command = "my-server --port {port} --model {model} --batch {max_num_seqs}"
model = "m"
[baseline]
max_num_seqs = 8
[workload]
scenario = "chat"
rates = [1, 2]
decision_rate = 2
[[variants]]
name = "v"
knob = "max_num_seqs"
value = 4
hypothesis = "h"
pass = "ttft_p95_ms <= baseline.ttft_p95_ms"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


def test_example_files_load() -> None:
    assert {p.stem for p in EXAMPLES} >= {"chat", "long-context", "agent-rag"}
    for path in EXAMPLES:
        experiment = load_experiment(path)
        assert experiment.variants and experiment.rates
        for variant in experiment.variants:
            assert variant.knob and variant.hypothesis and variant.pass_condition


def test_minimal_file_and_the_command_template(tmp_path: Path) -> None:
    experiment = load_experiment(write(tmp_path, MINIMAL))
    assert experiment.decision_rate == 2.0 and experiment.arrival.kind == "poisson"
    argv = server_argv(experiment.server, {"max_num_seqs": 4, "enable_chunked_prefill": False}, "127.0.0.1", 9)
    # A knob the template names is substituted; the others become flags.
    assert argv == ["my-server", "--port", "9", "--model", "m", "--batch", "4", "--enable-chunked-prefill", "false"]


def test_ferry_command_line() -> None:
    argv = server_argv(ServerSpec(model="tiny", args=("--num-threads", "1")), {"max_num_seqs": 2}, "127.0.0.1", 5)
    assert argv == [sys.executable, "-m", "ferry_cli", "serve", "--host", "127.0.0.1", "--port", "5",
                    "--model", "tiny", "--num-threads", "1", "--max-num-seqs", "2"]
    assert knob_flags({"enable_prefix_caching": True}) == ["--enable-prefix-caching", "true"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('knob = "max_num_seqs"', 'knob = "max_num_seqs"\nset = {a = 1}'), "unknown keys"),
        (("value = 4", "value = 8"), "baseline's own value"),
        (('pass = "ttft_p95_ms <= baseline.ttft_p95_ms"', 'pass = "__import__(1)"'), "not allowed"),
        (("rates = [1, 2]", "rates = []"), "rates"),
        (('hypothesis = "h"\n', ""), "needs 'hypothesis'"),
        (('kind = "command"', 'kind = "docker"'), "kind"),
        (("decision_rate = 2", "decision_rate = 2\n[extra]"), "unknown keys"),
        (("decision_rate = 2", "decision_rat = 2"), "unknown keys"),
    ],
)
def test_bad_files_are_refused(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    with pytest.raises(ExperimentError, match=message):
        load_experiment(write(tmp_path, MINIMAL.replace(*change)))


def test_conditions_are_restricted() -> None:
    check_condition("a < 1 and (b >= baseline.b * 1.1 or not c)")
    for bad in ("f(x)", "a.b < 1", "x[0] > 1", "'s' == a", "lambda: 1", "a if b else c"):
        with pytest.raises(ValueError):
            check_condition(bad)


def test_condition_names() -> None:
    assert condition_names("a < baseline.b and (c > 1 or a == baseline.a)") == ["a", "b", "c"]


def test_evaluate() -> None:
    mine, base = {"a": 2.0, "b": None}, {"a": 3.0, "b": 1.0}
    assert evaluate("a < baseline.a", mine, base) is True
    assert evaluate("a * 2 > baseline.a and not a > 5", mine, base) is True
    assert evaluate("1 < a < 1.5", mine, base) is False
    with pytest.raises(Unavailable, match="b"):
        evaluate("b < 1", mine, base)
    with pytest.raises(ValueError, match="unknown measure"):
        evaluate("zzz < 1", mine, base)


def _config(name: str, ttft: float | None, ok_rate: float | None) -> dict:
    runs = [{"rate": r, "slo_violations": [], "summary": {"ttft_p95_ms": ttft, "goodput_rps": r}} for r in (1.0, 2.0)]
    return {"name": name, "runs": runs, "sweep": {"max_rate_meeting_slo": ok_rate}}


def test_decision_records_read_the_verdict_through_the_noise(tmp_path: Path) -> None:
    experiment = load_experiment(write(tmp_path, MINIMAL))
    variant = experiment.variants[0]
    inputs = {"trace_sha256": "abc"}
    # Two baseline runs: 100 and 104 ms, mean 102; spread = max(4, 0.05 x 102 = 5.1) = 5.1.
    baselines = [_config("baseline", 100.0, 2.0), _config("baseline (repeat 2)", 104.0, 2.0)]
    record = decide(experiment, variant, baselines, _config("v", 90.0, 2.0), inputs)
    assert record["verdict"] == "better"  # 90 is 12 below the mean, outside the 5.1 spread
    assert record["changed_parameter"] == "max_num_seqs: 8 -> 4"
    assert record["input_set"] == inputs and record["hypothesis"] == "h"
    outcome = record["measured_outcome"]
    assert outcome["variant"]["ttft_p95_ms"] == 90.0
    assert outcome["baseline"]["ttft_p95_ms"] == pytest.approx(102.0)
    assert outcome["baseline_runs"]["ttft_p95_ms"] == [100.0, 104.0]
    assert outcome["spread"]["ttft_p95_ms"] == pytest.approx(5.1)
    assert outcome["difference"]["ttft_p95_ms"] == pytest.approx(-12.0)
    assert outcome["call"]["ttft_p95_ms"] == "better"
    assert outcome["baseline"]["max_ok_rate"] == 2.0
    assert "slo_met" not in outcome["variant"]
    worse = decide(experiment, variant, baselines, _config("v", 120.0, 1.0), inputs)
    assert worse["verdict"] == "worse" and worse["measured_outcome"]["call"]["ttft_p95_ms"] == "worse"
    # 99 ms: better on the means (99 < 102) but inside the noise, so no decision, and the record says how to settle.
    close = decide(experiment, variant, baselines, _config("v", 99.0, 2.0), inputs)
    assert close["verdict"] == "no decision: within noise"
    assert close["condition_on_means"] == "pass"
    assert "ttft_p95_ms moved -3" in close["to_settle"] and "spread of 5.1" in close["to_settle"]
    unknown = decide(experiment, variant, [_config("baseline", None, 2.0)] * 2, _config("v", 120.0, 1.0), inputs)
    assert unknown["verdict"].startswith("inconclusive")


def test_baseline_repeats_interleave_with_the_variants(tmp_path: Path) -> None:
    two = MINIMAL + MINIMAL[MINIMAL.index("[[variants]]"):].replace('name = "v"', 'name = "w"').replace(
        "value = 4", "value = 2")
    experiment = load_experiment(write(tmp_path, two))
    assert [name for name, _ in experiment.run_order()] == ["baseline", "v", "w", "baseline (repeat 2)"]
    three = load_experiment(write(tmp_path, two + "\n[noise]\nbaseline_repeats = 3\nfloor = 0.1\n"))
    assert [name for name, _ in three.run_order()] == [
        "baseline", "v", "baseline (repeat 2)", "w", "baseline (repeat 3)"]
    assert three.noise_floor == 0.1
    with pytest.raises(ExperimentError, match="at least 2"):
        load_experiment(write(tmp_path, MINIMAL + "\n[noise]\nbaseline_repeats = 1\n"))
    with pytest.raises(ExperimentError, match="floor"):
        load_experiment(write(tmp_path, MINIMAL + "\n[noise]\nfloor = 1.5\n"))


def test_a_run_with_no_accepted_answer_costs_infinitely_much(tmp_path: Path) -> None:
    text = MINIMAL.replace('pass = "ttft_p95_ms <= baseline.ttft_p95_ms"', 'pass = "cost_per_accepted <= baseline.cost_per_accepted"')
    experiment = load_experiment(write(tmp_path, text + "\n[cost]\nprice_per_gpu_hour = 2.0\n"))

    def config(cost: float | None, accepted: int) -> dict:
        runs = [{"rate": r, "slo_violations": [], "summary": {"cost_per_accepted": cost, "accepted": accepted}}
                for r in (1.0, 2.0)]
        return {"name": "c", "runs": runs, "sweep": {"max_rate_meeting_slo": None}}

    record = decide(experiment, experiment.variants[0], [config(0.001, 10), config(0.0011, 9)], config(None, 0), {})
    assert record["verdict"] == "worse"
    assert record["measured_outcome"]["call"]["cost_per_accepted"] == "worse"


def test_decide_only_rewrites_the_records_from_results_json(tmp_path: Path) -> None:
    import json

    from loadtests.experiment_run import redecide

    experiment = load_experiment(write(tmp_path, MINIMAL))
    configs = [_config("baseline", 100.0, 2.0), _config("v", 80.0, 2.0), _config("baseline (repeat 2)", 104.0, 2.0)]
    for config in configs:  # what the board needs of a run
        for run in config["runs"]:
            run["name"] = f"{run['rate']:g}rps"
            run["summary"]["offered_rps"] = run["rate"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"meta": {"title": "t", "trace": {}}, "configs": configs,
                                                  "decisions": [{"input_set": {"trace_sha256": "x"}}]}))
    results = redecide(experiment, out)
    assert [d["verdict"] for d in results["decisions"]] == ["better"]
    assert results["decisions"][0]["input_set"] == {"trace_sha256": "x"}
    assert "verdict**: better" in (out / "decision-v.md").read_text()
    with pytest.raises(ValueError, match="cannot re-decide"):
        redecide(experiment, tmp_path / "missing")


def test_a_variant_that_fails_more_requests_is_never_better_on_its_survivors(tmp_path: Path) -> None:
    experiment = load_experiment(write(tmp_path, MINIMAL))

    def config(ttft: float, errors: float) -> dict:
        runs = [{"rate": r, "slo_violations": [], "summary": {"ttft_p95_ms": ttft, "error_rate": errors}}
                for r in (1.0, 2.0)]
        return {"name": "c", "runs": runs, "sweep": {"max_rate_meeting_slo": 2.0}}

    baselines = [config(100.0, 0.0), config(104.0, 0.0)]
    # 78 % of requests refused, the rest fast: the latency condition alone would call it better
    record = decide(experiment, experiment.variants[0], baselines, config(50.0, 0.78), {})
    assert record["verdict"] == ("worse: errors (error rate 0.780 against 0.000; the pass condition does not "
                                 "weigh errors)")
    # at the guard's edge: 1 point more errors still lets the condition decide; just past it does not
    assert decide(experiment, experiment.variants[0], baselines, config(50.0, 0.01), {})["verdict"] == "better"
    assert decide(experiment, experiment.variants[0], baselines, config(50.0, 0.0101),
                  {})["verdict"].startswith("worse: errors")
    # a condition that weighs errors itself (a queue limit trading refusals for latency) is left to decide
    text = MINIMAL.replace('pass = "ttft_p95_ms <= baseline.ttft_p95_ms"',
                           'pass = "ttft_p95_ms <= baseline.ttft_p95_ms and error_rate <= 0.9"')
    weighed = load_experiment(write(tmp_path, text))
    assert decide(weighed, weighed.variants[0], baselines, config(50.0, 0.78), {})["verdict"] == "better"
