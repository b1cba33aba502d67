"""The evaluation board (markdown), results.json, and the PNG plots.

Everything a reader needs to repeat the comparison goes at the top of the
board: the exact command, the server configuration, the trace's content hash
and version, the arrival process, the targets. Then one row per run with the
columns the method asks for, the other measures, and a table per scenario
group when the trace mixes groups. Missing server measures show as "n/a".
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402

from loadtests.memory_view import render as render_memory  # noqa: E402

RESULTS_VERSION = 1

MAIN_COLUMNS: list[tuple[str, str, str]] = [
    ("offered req/s", "offered_rps", "{:.3g}"),
    ("completed req/s", "completed_rps", "{:.3g}"),
    ("p95 TTFT ms", "ttft_p95_ms", "{:.0f}"),
    ("p95 queue ms", "queue_p95_ms", "{:.0f}"),
    ("p95 end-to-end ms", "e2e_p95_ms", "{:.0f}"),
    ("error rate", "error_rate", "{:.3f}"),
    ("preemptions", "preemptions", "{:.0f}"),
]
OTHER_COLUMNS: list[tuple[str, str, str]] = [
    ("sent req/s", "sent_rps", "{:.3g}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("TTFT p50/p99 ms", "ttft_p50_ms|ttft_p99_ms", "{:.0f}"),
    ("ITL p95 ms", "itl_p95_ms", "{:.1f}"),
    ("queue mean ms", "queue_mean_ms", "{:.1f}"),
    ("TPOT mean/p95 ms", "tpot_mean_ms|tpot_p95_ms", "{:.1f}"),
    ("done/cancel/err", "completed|cancelled|errors", "{:.0f}"),
    ("err 429/503/timeout/other", "errors_429|errors_503|errors_timeout|errors_other", "{:.0f}"),
    ("peak server MiB", "peak_memory_mib", "{:.0f}"),
    ("goodput req/s", "goodput_rps", "{:.3g}"),
    ("accepted / on time", "accepted|accepted_slo_only", "{:.0f}"),
    ("cost per accepted", "cost_per_accepted", "{:.6f}"),
]


def fmt(value: Any, pattern: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return pattern.format(value)


def cell(summary: dict[str, Any], keys: str, pattern: str) -> str:
    if keys == "queue_p95_ms" and summary.get("queue_p95_below_ms") is not None:
        return "<" + pattern.format(summary["queue_p95_below_ms"])
    values = dict(summary)
    if values.get("peak_memory_bytes") is not None:
        values["peak_memory_mib"] = values["peak_memory_bytes"] / 2**20
    return " / ".join(fmt(values.get(k), pattern) for k in keys.split("|"))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def all_runs(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(config["name"], run) for config in results["configs"] for run in config["runs"]]


def render_board(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [f"# {meta.get('title', 'Load test')}", ""]
    lines += [f"- command: `{meta.get('command', '')}`", f"- started: {meta.get('started_at', '')}"]
    trace = meta.get("trace", {})
    lines.append(
        f"- trace: {trace.get('scenario', trace.get('path', '?'))} seed {trace.get('seed', 'n/a')}, "
        f"{trace.get('num_requests')} requests, sha256 `{trace.get('sha256', '')[:16]}`, "
        f"format v{trace.get('format_version')}, tokenizer {trace.get('tokenizer', 'n/a')}"
    )
    for key in ("base_url", "model", "arrival", "slo", "goodput", "cost", "host"):
        value = meta.get(key)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None} or None
            value = json.dumps(value) if value else None
        if value not in (None, ""):
            lines.append(f"- {key}: {value}")
    for config in results["configs"]:
        if config.get("server"):
            lines.append(f"- server `{config['name']}`: `{config['server'].get('command', '')}`")
        if config.get("determinism"):
            lines.append(f"- greedy answers of `{config['name']}` against the reference: "
                         f"{determinism_words(config['determinism'])}")
        if config.get("sweep", {}).get("checked"):
            sweep = config["sweep"]
            what, unit = ("concurrency", "") if sweep.get("axis") == "concurrency" else ("rate", " req/s")
            lines.append(
                f"- sweep `{config['name']}`: highest {what} meeting the SLO: "
                + (f"{sweep['max_rate_meeting_slo']:g}{unit}" if sweep.get("max_rate_meeting_slo") is not None
                   else "none (the first rate already broke it)")
                + (f"; stopped at {sweep['stopped_at']:g}{unit} ({'; '.join(sweep['broken'])})"
                   if sweep.get("stopped_at") is not None else "")
            )
    runs = all_runs(results)
    lines += ["", "## Evaluation board", ""]
    lines += _table(
        ["run", *[c[0] for c in MAIN_COLUMNS], "saturated"],
        [[_run_label(c, r), *[cell(r["summary"], k, p) for _, k, p in MAIN_COLUMNS], saturation_cell(r)]
         for c, r in runs],
    )
    lines += ["", "## Other measures", ""]
    lines += _table(
        ["run", *[c[0] for c in OTHER_COLUMNS], "SLO"],
        [
            [_run_label(c, r), *[cell(r["summary"], k, p) for _, k, p in OTHER_COLUMNS],
             slo_cell(r)]
            for c, r in runs
        ],
    )
    grouped = [(c, r) for c, r in runs if r.get("groups")]
    if grouped:
        lines += ["", "## By scenario group", ""]
        wanted = ("completed req/s", "p95 TTFT ms", "p95 end-to-end ms", "error rate", "output tok/s",
                  "done/cancel/err", "goodput req/s")
        group_cols = [c for name in wanted for c in (*MAIN_COLUMNS, *OTHER_COLUMNS) if c[0] == name]
        rows = [
            [_run_label(c, r), g, *[cell(s, k, p) for _, k, p in group_cols]]
            for c, r in grouped
            for g, s in r["groups"].items()
        ]
        lines += _table(["run", "group", *[c[0] for c in group_cols]], rows)
    lines += quality_tables(runs + [(c["name"], c["quality_pass"]) for c in results["configs"]
                                    if c.get("quality_pass")])
    for decision in results.get("decisions", []):
        lines += ["", render_decision(decision)]
    lines += ["", "Definitions: docs/loadtests.md (TTFT, TPOT, ITL and goodput as in `vllm bench serve`).", ""]
    return "\n".join(lines)


def quality_tables(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Per run and task type: answers judged, correct share with its 95 % Wilson interval."""
    rows = []
    for config, run in runs:
        for task, q in (run["summary"].get("quality") or {}).items():
            share = "n/a" if q.get("correct_rate") is None else f"{q['correct_rate']:.1%}"
            ci = ("n/a" if q.get("ci_low") is None
                  else f"{q['ci_low']:.1%} - {q['ci_high']:.1%}")
            rows.append([_run_label(config, run), task, str(q["judged"]), str(q["correct"]), share, ci,
                         str(q["unjudged"]), str(q["unanswered"])])
    if not rows:
        return []
    lines = ["", "## Answer quality by task type", "",
             "An answer counts as accepted only when it met the SLOs **and** is correct "
             "(docs/loadtests.md, \"Answer quality\").", ""]
    return lines + _table(["run", "task type", "judged", "correct", "correct %", "95% CI", "unjudged",
                           "unanswered"], rows)


def slo_cell(run: dict[str, Any]) -> str:
    """'met' only when run-level targets were given and every one held: a check without
    targets cannot fail, so it never says 'met'."""
    violations = run.get("slo_violations") or []
    if not run.get("slo_targets", True):
        return "no targets" + (" (" + "; ".join(violations) + ")" if violations else "")
    return "met" if not violations else "missed: " + "; ".join(violations)


def saturation_cell(run: dict[str, Any]) -> str:
    summary = run["summary"]
    if "saturated" not in summary:
        return "n/a"
    if summary["saturated"]:
        return "**yes**: " + "; ".join(summary.get("saturation_reasons") or [])
    ratio = summary.get("completion_ratio")
    return "no" + (f" ({ratio:.0%} completed)" if ratio is not None else "")


def _run_label(config: str, run: dict[str, Any]) -> str:
    return run["name"] if config in ("", "run") else f"{config} {run['name']}"


def render_decision(decision: dict[str, Any]) -> str:
    lines = [f"## Decision record: {decision['variant']}", ""]
    for label, key in (
        ("hypothesis", "hypothesis"),
        ("changed parameter", "changed_parameter"),
        ("input set", "input_set"),
        ("pass condition", "pass_condition"),
    ):
        value = decision.get(key)
        text = json.dumps(value) if isinstance(value, dict | list) else str(value)
        lines.append(f"- **{label}**: {text}")
    lines.append("- **measured outcome**: " + _outcome(decision.get("measured_outcome")))
    lines += _quality_lines(decision)
    lines.append(f"- **verdict**: {decision.get('verdict')}")
    if decision.get("latency_verdict") and decision["latency_verdict"] != decision.get("verdict"):
        lines.append(f"- **latency and cost alone**: {decision['latency_verdict']}")
    if decision.get("noise_rule"):
        lines.append(f"- **noise rule**: {decision['noise_rule']} (docs/loadtests.md, \"Noise-aware decisions\"); "
                     f"the condition on the baseline's mean alone: {decision.get('condition_on_means')}")
    if decision.get("to_settle"):
        lines.append(f"- **to settle it**: {decision['to_settle']}")
    if decision.get("memory"):
        lines += ["- **memory** (measured, with `ferry plan`'s prediction in brackets):", ""]
        lines += ["  " + line for line in render_memory(decision["memory"])]
    return "\n".join(lines)


def _quality_lines(decision: dict[str, Any]) -> list[str]:
    """The quality part of a decision record: per task type on the same items, determinism, in words."""
    quality = decision.get("quality")
    if quality is None:
        return []
    lines = []
    if decision.get("answers"):
        lines.append("- **answers**: " + ("must not change (greedy answers compared item by item; open prompts "
                                          "judged by agreement with the baseline)" if decision["answers"] == "same"
                                          else "may change (judged on correctness alone)"))
    if isinstance(quality, str):
        return lines + [f"- **quality**: {quality}"]
    lines += [f"- **quality** ({decision.get('quality_rule', '')}):", "",
              "  | task type | items | baseline correct | variant correct | baseline only | variant only | p | call "
              "| items to settle |", "  |---|---|---|---|---|---|---|---|---|"]
    for q in quality:
        n = q["items"] or 1
        lines.append(f"  | {q['task']} | {q['items']} | {q['baseline_correct']} ({q['baseline_correct'] / n:.0%}) | "
                     f"{q['variant_correct']} ({q['variant_correct'] / n:.0%}) | {q['baseline_only']} | "
                     f"{q['variant_only']} | {q['p_value']:.3g} | {q['call']} | {q['items_to_settle'] or ''} |")
    lines += ["", "- **quality in words**: " + quality_words(quality)]
    for key, label in (("determinism", "greedy answers against the baseline"),
                       ("baseline_repeatability", "the baseline against its own repeat")):
        if decision.get(key):
            lines.append(f"- **{label}**: {determinism_words(decision[key])}")
    return lines


def quality_words(quality: list[dict[str, Any]]) -> str:
    worse = [q for q in quality if q["call"] == "worse"]
    close = [q for q in quality if q["call"] == "within noise"]
    better = [q for q in quality if q["call"] == "better"]
    parts = []
    if worse:
        parts.append("quality dropped beyond noise in " + ", ".join(
            f"{q['task']} ({q['baseline_correct']} -> {q['variant_correct']} of {q['items']} correct)" for q in worse))
    if close:
        parts.append("a difference inside the items' noise in " + ", ".join(
            f"{q['task']} ({q['baseline_correct']} -> {q['variant_correct']} of {q['items']})" for q in close))
    if better:
        parts.append("better beyond noise in " + ", ".join(q["task"] for q in better))
    steady = [q["task"] for q in quality if q["call"] == "not worse"]
    if steady:
        parts.append("not worse in " + ", ".join(steady))
    return "; ".join(parts) + "." if parts else "no task type could be compared."


def determinism_words(check: dict[str, Any]) -> str:
    if not check.get("compared"):
        return "no item answered by both"
    if check.get("identical"):
        return f"identical on all {check['compared']} items"
    first = ", ".join(f"`{i}`" for i in check.get("first_differing") or [])
    return f"not identical: {check['differing']} of {check['compared']} items differ (first: {first})"


def _outcome(outcome: Any) -> str:
    """Variant against baseline, one measure a row (a plain string when there was nothing to measure).
    With baseline repeats: every repeat, the spread used as noise, and the difference beside it."""
    if not isinstance(outcome, dict) or "variant" not in outcome:
        return str(outcome)
    mine, base = outcome["variant"], outcome["baseline"]
    runs, spread = outcome.get("baseline_runs"), outcome.get("spread")
    diff, call = outcome.get("difference") or {}, outcome.get("call") or {}
    rows = [f"at {fmt(outcome.get('decision_rate'), '{:g}')} req/s", ""]
    if runs is None:
        rows += ["  | measure | baseline | variant |", "  |---|---|---|"]
    else:
        rows += ["  | measure | baseline runs | baseline mean | variant | difference | spread (noise) | call |",
                 "  |---|---|---|---|---|---|---|"]
    for key in mine:
        if key.endswith("_below_ms"):
            continue
        if runs is None:
            rows.append(f"  | {key} | {_num(base, key)} | {_num(mine, key)} |")
            continue
        repeats = ", ".join(_num({key: v}, key) for v in (runs.get(key) or []))
        rows.append(f"  | {key} | {repeats or 'n/a'} | {_num(base, key)} | {_num(mine, key)} | "
                    f"{_signed(diff.get(key))} | {_num(spread or {}, key)} | {call.get(key, 'n/a')} |")
    return "\n".join(rows)


def _signed(value: Any) -> str:
    if not isinstance(value, int | float):
        return "n/a"
    return f"{value:+,.0f}" if abs(value) >= 1000 else f"{value:+.4g}"


def _num(values: dict[str, Any], key: str) -> str:
    below = values.get(key.replace("_ms", "_below_ms")) if key.endswith("_p95_ms") else None
    if below is not None:
        return f"<{below:.0f}"
    value = values.get(key)
    if not isinstance(value, int | float):
        return fmt(value, "{}")
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def write_results(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """board.md, results.json and the plots; returns what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {"results": out_dir / "results.json", "board": out_dir / "board.md"}
    results = {"tool": "ferry-loadtests", "results_version": RESULTS_VERSION, **results}
    written["results"].write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    written["board"].write_text(render_board(results), encoding="utf-8")
    written.update(write_plots(results, out_dir))
    for decision in results.get("decisions", []):
        path = out_dir / f"decision-{slug(decision['variant'])}.md"
        path.write_text(render_decision(decision) + "\n", encoding="utf-8")
        written[f"decision:{decision['variant']}"] = path
    return written


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "run"


def write_plots(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    written: dict[str, Path] = {}
    configs = [(c["name"], c["runs"]) for c in results["configs"] if c["runs"]]
    if not configs:
        return written
    written["latency_plot"] = _vs_rate_plot(
        configs, out_dir / "latency_vs_rate.png", "latency against offered rate", "ms",
        [("ttft_p50_ms", "TTFT p50"), ("ttft_p95_ms", "TTFT p95"), ("ttft_p99_ms", "TTFT p99"),
         ("e2e_p95_ms", "end-to-end p95"), ("itl_p95_ms", "ITL p95"), ("queue_p95_ms", "queue p95")],
        log_y=True,
    )
    written["throughput_plot"] = _vs_rate_plot(
        configs, out_dir / "throughput_vs_rate.png", "throughput against offered rate", "req/s",
        [("completed_rps", "completed req/s"), ("goodput_rps", "goodput req/s")],
        second=("output_tok_s", "output tok/s"),
    )
    for config, runs in configs:
        for run in runs:
            name = slug(f"{config}-{run['name']}" if config not in ("", "run") else run["name"])
            written[f"timeline:{name}"] = _timeline_plot(run, out_dir / f"timeline-{name}.png", name)
    return written


def _vs_rate_plot(
    configs: list[tuple[str, list[dict[str, Any]]]],
    path: Path,
    title: str,
    unit: str,
    series: list[tuple[str, str]],
    log_y: bool = False,
    second: tuple[str, str] | None = None,
) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    ax2 = ax.twinx() if second else None
    multi = len(configs) > 1
    plotted = False
    for config, runs in configs:
        runs = sorted(runs, key=lambda r: r["summary"]["offered_rps"] or 0.0)
        xs = [r["summary"]["offered_rps"] for r in runs]
        for key, label in series:
            ys = [r["summary"].get(key) for r in runs]
            if any(y is not None for y in ys):
                plotted = plotted or any(y is not None and y > 0 for y in ys)
                ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o",
                        label=f"{config}: {label}" if multi else label)
        if ax2 is not None and second is not None:
            ys = [r["summary"].get(second[0]) for r in runs]
            ax2.plot(xs, [math.nan if y is None else y for y in ys], linestyle="--", marker="x", color="gray",
                     label=f"{config}: {second[1]}" if multi else second[1])
    if log_y and plotted:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("offered req/s")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if ax2 is not None:
        ax2.set_ylabel(second[1] if second else "")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _timeline_plot(run: dict[str, Any], path: Path, title: str) -> Path:
    series = run.get("series") or {}
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label in (("running", "server running"), ("waiting", "server waiting")):
        ys = series.get(key) or []
        if any(y is not None for y in ys):
            ax.step(series.get("t_s") or [], [math.nan if y is None else y for y in ys], where="post", label=label)
    server = bool(ax.get_lines())
    if series.get("client_t_s"):
        ax.step(series["client_t_s"], series["client_in_flight"], where="post", label="client in flight",
                color="gray", alpha=0.7)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("requests")
    ax.set_title(f"{title}: running and waiting over time" + ("" if server else " (server gauges n/a)"))
    ax.grid(True, alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
