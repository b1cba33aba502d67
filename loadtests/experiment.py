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
    answers: str = "may_change"
    """'same': the knob must not change any greedy answer (checked item by item, and ``agree``
    items are judged); 'may_change': judged on correctness alone (loadtests/quality/decide.py)."""


@dataclass(frozen=True)
class QualitySpec:
    """``[quality]``: answers checked on a task set (loadtests/quality/), per task type."""

    tasks: str = "builtin"
    """'builtin' or a task-set file (relative to the experiment file)."""
    mix: float = 0.0
    """Share of the rate runs' requests replaced by task items (their answers are checked, and an
    accepted answer must be correct)."""
    full_pass: bool = True
    """After the rates, every item once on each server: the items the paired test compares."""
    concurrency: int = 8
    """Requests in flight during the full pass."""
    confidence: float = 0.95
    margin: float = 0.0
    """A drop of at most this share (0.02: two points) counts as not worse once its interval fits."""


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
    baseline_repeats: int = 2
    noise_floor: float = 0.05
    quality: QualitySpec | None = None

    @property
    def rates(self) -> list[float]:
        return [float(r) for r in self.workload["rates"]]

    @property
    def decision_rate(self) -> float:
        return float(self.workload.get("decision_rate") or max(self.rates))

    def run_order(self) -> list[tuple[str, Variant | None]]:
        """The configurations in the order they run: the baseline's repeats spread evenly among
        the variants (A B C A; A B A C A with three repeats), so a drift of the machine over the
        experiment shows up in the baseline's spread instead of in one variant's difference."""
        chunks: list[list[Variant]] = [[] for _ in range(self.baseline_repeats - 1)]
        for i, variant in enumerate(self.variants):
            chunks[i * len(chunks) // max(len(self.variants), 1)].append(variant)
        order: list[tuple[str, Variant | None]] = [("baseline", None)]
        for repeat, chunk in enumerate(chunks, start=2):
            order += [(v.name, v) for v in chunk]
            order.append((f"baseline (repeat {repeat})", None))
        return order

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


TOP_KEYS = {"title", "description", "server", "baseline", "workload", "slo", "goodput", "cost", "variants", "noise",
            "quality"}
QUALITY_KEYS = {"tasks", "mix", "full_pass", "concurrency", "confidence", "margin"}
NOISE_KEYS = {"baseline_repeats", "floor"}
WORKLOAD_KEYS = {"scenario", "trace", "seed", "num_requests", "rates", "duration_s", "arrival", "burstiness",
                 "max_concurrency", "tokenizer", "request_timeout_s", "stop_on_slo", "cooldown_s", "decision_rate",
                 "model", "ignore_eos", "warmup_requests", "scenario_options"}


def _parse(raw: dict[str, Any], path: Path) -> Experiment:
    for where, keys, allowed in (("the file", raw, TOP_KEYS), ("[workload]", raw.get("workload", {}), WORKLOAD_KEYS),
                                 ("[noise]", raw.get("noise", {}), NOISE_KEYS),
                                 ("[quality]", raw.get("quality", {}), QUALITY_KEYS)):
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
        extra = set(item) - {"name", "knob", "value", "hypothesis", "pass", "answers"}
        if extra:
            raise ValueError(f"variant {item.get('name')!r}: unknown keys {sorted(extra)}; a variant changes one knob")
        for key in ("name", "knob", "value", "hypothesis", "pass"):
            if key not in item:
                raise ValueError(f"variant {item.get('name', '?')!r} needs {key!r}")
        if item["knob"] in baseline and baseline[item["knob"]] == item["value"]:
            raise ValueError(f"variant {item['name']!r} sets {item['knob']} to the baseline's own value")
        check_condition(str(item["pass"]))
        from loadtests.quality.decide import answers_mode

        variants.append(Variant(str(item["name"]), str(item["knob"]), item["value"], str(item["hypothesis"]),
                                str(item["pass"]), answers_mode(str(item["knob"]), item.get("answers"))))
    if len({v.name for v in variants}) != len(variants) or any(v.name == "baseline" for v in variants):
        raise ValueError("variant names must be unique and not 'baseline'")
    noise = dict(raw.get("noise", {}))
    repeats = int(noise.get("baseline_repeats", 2))
    if repeats < 2:
        raise ValueError("[noise] baseline_repeats must be at least 2: one baseline run cannot show its own noise")
    floor = float(noise.get("floor", 0.05))
    if not 0.0 <= floor < 1.0:
        raise ValueError(f"[noise] floor must be in [0, 1), not {floor}")
    quality = _quality(raw["quality"]) if "quality" in raw else None
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
        baseline_repeats=repeats,
        noise_floor=floor,
        quality=quality,
    )


def _quality(raw: dict[str, Any]) -> QualitySpec:
    spec = QualitySpec(
        tasks=str(raw.get("tasks", "builtin")), mix=float(raw.get("mix", 0.0)),
        full_pass=bool(raw.get("full_pass", True)), concurrency=int(raw.get("concurrency", 8)),
        confidence=float(raw.get("confidence", 0.95)), margin=float(raw.get("margin", 0.0)),
    )
    if not 0.0 <= spec.mix <= 1.0:
        raise ValueError(f"[quality] mix must be in [0, 1], not {spec.mix}")
    if not 0.5 <= spec.confidence < 1.0:
        raise ValueError(f"[quality] confidence must be in [0.5, 1), not {spec.confidence}")
    if not 0.0 <= spec.margin < 1.0:
        raise ValueError(f"[quality] margin must be in [0, 1), not {spec.margin}")
    if spec.concurrency < 1:
        raise ValueError("[quality] concurrency must be at least 1")
    if not spec.full_pass and spec.mix == 0.0:
        raise ValueError("[quality] checks nothing with full_pass = false and mix = 0")
    return spec


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
