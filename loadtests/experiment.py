"""Experiments: a baseline and one-knob variants, the same trace at the same rates.

A TOML file (see loadtests/experiments/) names the server, the baseline's
knobs, the workload, the targets, and the variants. Each variant changes
exactly one knob (``knob`` + ``value``) and states a hypothesis and a pass
condition. The tool starts the server for each configuration in turn, runs the
same trace at the same offered rates, stops it, and writes the board plus one
decision record per variant.

A pass condition is an expression over the variant's measures and the
baseline's (``baseline.NAME``): every run summary field at the decision rate
(``ttft_p95_ms``, ``e2e_p95_ms``, ``goodput_rps``, ``cost_per_accepted``,
``error_rate``, ``preemptions``, ...) plus ``max_ok_rate``, the highest offered
rate that met the SLO. Only comparisons, ``and``/``or``/``not`` and arithmetic
are allowed. A measure the server could not give ("n/a") makes the verdict
``inconclusive`` rather than a pass or a fail.
"""

from __future__ import annotations

import ast
import operator
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.arrivals import ArrivalSpec
from loadtests.metrics import CostModel, GoodputSLO, RunSLO
from loadtests.scenarios import parse_overrides
from loadtests.server import ServerSpec

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
}
_CMPOPS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne,
}


class ExperimentError(ValueError):
    """An experiment file that cannot be run as written."""


class Unavailable(Exception):
    """A measure in a pass condition has no value (the server did not expose it)."""


@dataclass(frozen=True)
class Variant:
    name: str
    knob: str
    value: Any
    hypothesis: str
    pass_condition: str


@dataclass(frozen=True)
class Experiment:
    title: str
    server: ServerSpec
    baseline: dict[str, Any]
    variants: list[Variant]
    workload: dict[str, Any]
    slo: RunSLO
    goodput: GoodputSLO
    cost: CostModel
    source: Path
    description: str = ""
    scenario_overrides: dict[str, object] = field(default_factory=dict)

    @property
    def rates(self) -> list[float]:
        return [float(r) for r in self.workload["rates"]]

    @property
    def decision_rate(self) -> float:
        return float(self.workload.get("decision_rate") or max(self.rates))

    @property
    def arrival(self) -> ArrivalSpec:
        return ArrivalSpec(str(self.workload.get("arrival", "poisson")), float(self.workload.get("burstiness", 1.0)),
                           int(self.workload.get("seed", 0)))


def load_experiment(path: Path) -> Experiment:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ExperimentError(f"{path}: {exc}") from exc
    try:
        return _parse(raw, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ExperimentError(f"{path}: {exc}") from exc


TOP_KEYS = {"title", "description", "server", "baseline", "workload", "slo", "goodput", "cost", "variants"}
WORKLOAD_KEYS = {"scenario", "trace", "seed", "num_requests", "rates", "duration_s", "arrival", "burstiness",
                 "max_concurrency", "tokenizer", "request_timeout_s", "stop_on_slo", "cooldown_s", "decision_rate",
                 "model", "ignore_eos", "warmup_requests", "scenario_options"}


def _parse(raw: dict[str, Any], path: Path) -> Experiment:
    for where, keys, allowed in (("the file", raw, TOP_KEYS), ("[workload]", raw.get("workload", {}), WORKLOAD_KEYS)):
        unknown = set(keys) - allowed
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    server_raw = dict(raw.get("server", {}))
    server = ServerSpec(
        kind=str(server_raw.get("kind", "ferry")),
        model=str(server_raw.get("model", "smollm2-135m-instruct")),
        args=tuple(str(a) for a in server_raw.get("args", [])),
        command=str(server_raw.get("command", "")),
        ready_path=str(server_raw.get("ready_path", "")),
        startup_timeout_s=float(server_raw.get("startup_timeout_s", 600)),
        env={str(k): str(v) for k, v in server_raw.get("env", {}).items()},
    )
    workload = dict(raw["workload"])
    if "scenario" not in workload and "trace" not in workload:
        raise ValueError("[workload] needs a scenario or a trace")
    if not workload.get("rates"):
        raise ValueError("[workload] needs rates = [...]")
    baseline = dict(raw.get("baseline", {}))
    variants = []
    for item in raw.get("variants", []):
        extra = set(item) - {"name", "knob", "value", "hypothesis", "pass"}
        if extra:
            raise ValueError(f"variant {item.get('name')!r}: unknown keys {sorted(extra)}; a variant changes one knob")
        for key in ("name", "knob", "value", "hypothesis", "pass"):
            if key not in item:
                raise ValueError(f"variant {item.get('name', '?')!r} needs {key!r}")
        if item["knob"] in baseline and baseline[item["knob"]] == item["value"]:
            raise ValueError(f"variant {item['name']!r} sets {item['knob']} to the baseline's own value")
        check_condition(str(item["pass"]))
        variants.append(Variant(str(item["name"]), str(item["knob"]), item["value"], str(item["hypothesis"]),
                                str(item["pass"])))
    if len({v.name for v in variants}) != len(variants) or any(v.name == "baseline" for v in variants):
        raise ValueError("variant names must be unique and not 'baseline'")
    overrides = workload.pop("scenario_options", {})
    items = [f"{k}={':'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in overrides.items()]
    return Experiment(
        title=str(raw.get("title", path.stem)),
        description=str(raw.get("description", "")),
        server=server,
        baseline=baseline,
        variants=variants,
        workload=workload,
        slo=RunSLO(**raw.get("slo", {})),
        goodput=GoodputSLO(**raw.get("goodput", {})),
        cost=CostModel(**raw.get("cost", {})),
        source=path,
        scenario_overrides=parse_overrides(items),
    )


def check_condition(text: str) -> ast.Expression:
    """Parse a pass condition, refusing anything but comparisons, logic and arithmetic on names."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"pass condition {text!r}: {exc.msg}") from exc
    allowed = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.BinOp,
               ast.Compare, ast.Name, ast.Attribute, ast.Constant, ast.Load, *_BINOPS, *_CMPOPS)
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise ValueError(f"pass condition {text!r}: {type(node).__name__} is not allowed")
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id == "baseline"):
            raise ValueError(f"pass condition {text!r}: only baseline.NAME may be dotted")
        if isinstance(node, ast.Constant) and not isinstance(node.value, int | float):
            raise ValueError(f"pass condition {text!r}: only numbers may be literals")
    return tree


def evaluate(text: str, variant: dict[str, Any], baseline: dict[str, Any]) -> bool:
    """Evaluate a pass condition; raises Unavailable when a measure it uses is n/a."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name | ast.Attribute):
            scope, name = (baseline, node.attr) if isinstance(node, ast.Attribute) else (variant, node.id)
            if name not in scope:
                raise ValueError(f"pass condition {text!r}: unknown measure {name!r}")
            if scope[name] is None:
                raise Unavailable(("baseline." if scope is baseline else "") + name)
            return scope[name]
        if isinstance(node, ast.BoolOp):
            results = [bool(value(v)) for v in node.values]
            return all(results) if isinstance(node.op, ast.And) else any(results)
        if isinstance(node, ast.UnaryOp):
            operand = value(node.operand)
            return (not operand) if isinstance(node.op, ast.Not) else -operand
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Compare):
            left = value(node.left)
            for op, comparator in zip(node.ops, node.comparators, strict=True):
                right = value(comparator)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        raise ValueError(f"pass condition {text!r}: unsupported expression")

    return bool(value(check_condition(text)))


def measures(config_result: dict[str, Any], decision_rate: float) -> dict[str, Any]:
    """The names a pass condition can use, for one configuration."""
    runs = config_result["runs"]
    at_rate = [r for r in runs if r.get("rate") is not None and abs(r["rate"] - decision_rate) < 1e-9]
    summary = dict(at_rate[0]["summary"]) if at_rate else {}
    summary["max_ok_rate"] = config_result["sweep"].get("max_rate_meeting_slo") or 0.0
    summary["slo_met"] = 1.0 if at_rate and not at_rate[0]["slo_violations"] else 0.0
    return summary


OUTCOME_KEYS = ("completed_rps", "goodput_rps", "ttft_p95_ms", "queue_p95_ms", "queue_p95_below_ms", "e2e_p95_ms",
                "itl_p95_ms", "error_rate", "preemptions", "peak_memory_bytes", "cost_per_accepted", "max_ok_rate")


def condition_names(text: str) -> list[str]:
    """The measures a pass condition reads, in order of appearance."""
    names: list[str] = []
    for node in ast.walk(check_condition(text)):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name is not None and name != "baseline" and name not in names:
            names.append(name)
    return names


def decide(experiment: Experiment, variant: Variant, baseline_result: dict[str, Any],
           variant_result: dict[str, Any], input_set: dict[str, Any]) -> dict[str, Any]:
    """One decision record: hypothesis, changed parameter, input set, pass condition, outcome, verdict."""
    base = measures(baseline_result, experiment.decision_rate)
    mine = measures(variant_result, experiment.decision_rate)
    try:
        verdict = "pass" if evaluate(variant.pass_condition, mine, base) else "fail"
    except Unavailable as exc:
        verdict = f"inconclusive ({exc} is n/a on this server)"
    before = experiment.baseline.get(variant.knob, "server default")
    keys = list(OUTCOME_KEYS) + [k for k in condition_names(variant.pass_condition) if k not in OUTCOME_KEYS]
    return {
        "variant": variant.name,
        "hypothesis": variant.hypothesis,
        "changed_parameter": f"{variant.knob}: {before} -> {variant.value}",
        "input_set": input_set,
        "pass_condition": variant.pass_condition,
        "measured_outcome": {
            "decision_rate": experiment.decision_rate,
            "variant": {k: mine.get(k) for k in keys},
            "baseline": {k: base.get(k) for k in keys},
        },
        "verdict": verdict,
    }

