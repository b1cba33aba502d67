"""The memory view of one configuration: what was measured beside what `ferry plan` predicts.

The reference material insists that every decision about batching knobs is also a
decision about memory. For each configuration of an experiment this puts side by
side:

- measured: model weights (the worker's own count, from ``/v1/config`` where the
  server reports it), KV blocks in use at peak and the blocks the engine has
  (sampled from ``/metrics`` during the runs), preemptions over all runs, and the
  peak resident memory of all server processes;
- predicted: ``ferry plan`` for the same model, dtype, block size, KV budget
  (``kv_cache_memory``) and ``max_num_seqs``, at the trace's mean prompt and
  output lengths: weight bytes, KV blocks, and how many sequences of typical
  length fit at once.

Only ``ferry`` servers get a prediction; for other servers it is "n/a".
"""

from __future__ import annotations

from typing import Any

from loadtests.trace import Trace


def _ferry_defaults() -> dict[str, Any]:
    """The defaults of ``ferry serve`` the prediction needs when an experiment does not set them."""
    from shared.config import SchedulerConfig, WorkerConfig

    sched, worker = SchedulerConfig(), WorkerConfig()
    return {"kv_cache_memory": worker.kv_cache_memory, "block_size": sched.block_size,
            "max_num_seqs": sched.max_num_seqs, "max_model_len": sched.max_model_len, "dtype": worker.dtype}


def _find(tree: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in a JSON tree (the config's shape may change)."""
    if isinstance(tree, dict):
        if key in tree and isinstance(tree[key], int | float):
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    elif isinstance(tree, list):
        for value in tree:
            found = _find(value, key)
            if found is not None:
                return found
    return None


def measured(entry: dict[str, Any]) -> dict[str, Any]:
    """What one configuration's runs showed."""
    runs = [r["summary"] for r in entry.get("runs", [])]

    def peak(key: str) -> float | None:
        values = [s.get(key) for s in runs if isinstance(s.get(key), int | float)]
        return max(values) if values else None

    preemptions = [s.get("preemptions") for s in runs]
    info = (entry.get("server") or {}).get("info") or {}
    return {
        "weight_bytes": _find(info.get("/v1/config"), "weight_bytes"),
        "kv_blocks_total": peak("kv_blocks_total") or _find(info.get("/v1/config"), "num_kv_blocks"),
        "peak_kv_blocks_used": peak("peak_kv_blocks_used"),
        "peak_kv_usage": peak("peak_kv_usage"),
        "preemptions": sum(p for p in preemptions if isinstance(p, int | float))
        if any(isinstance(p, int | float) for p in preemptions) else None,
        "peak_memory_bytes": peak("peak_memory_bytes"),
    }


def _arg_value(args: tuple[str, ...], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def predicted(model: str, server_args: tuple[str, ...], knobs: dict[str, Any], trace: Trace) -> dict[str, Any]:
    """``ferry plan`` for this configuration (CPU: the KV budget is kv_cache_memory exactly)."""
    from ferry_cli.plan import build_parser, run_plan

    settings: dict[str, Any] = {}
    for name, default in _ferry_defaults().items():
        from_args = _arg_value(server_args, "--" + name.replace("_", "-"))
        settings[name] = knobs.get(name, from_args if from_args is not None else default)
    prompts = [r.prompt_tokens for r in trace.requests if r.prompt_tokens]
    outputs = [r.max_tokens for r in trace.requests]
    prompt_len = max(1, round(sum(prompts) / len(prompts))) if prompts else 512
    output_len = max(1, round(sum(outputs) / len(outputs))) if outputs else 256
    argv = ["--model", model, "--devices", f"cpu:{int(settings['kv_cache_memory'])}",
            "--block-size", str(settings["block_size"]), "--concurrency", str(settings["max_num_seqs"]),
            "--dtype", str(settings["dtype"]), "--prompt-len", str(prompt_len), "--output-len", str(output_len)]
    if int(settings["max_model_len"] or 0) > 0:
        argv += ["--max-model-len", str(settings["max_model_len"])]
    try:
        _, _, rows, _ = run_plan(build_parser().parse_args(argv))
    except (ValueError, OSError, SystemExit) as exc:
        return {"error": f"ferry plan failed: {exc}"}
    row = rows[0]
    return {
        "weight_bytes": row["weight_bytes"], "kv_blocks": row["kv_blocks"], "kv_tokens": row["kv_tokens"],
        "typical_len": row["typical_len"], "max_concurrency_at_typical": row["max_concurrency_at_typical"],
        "dtype": row["dtype"], "command": "ferry plan " + " ".join(argv),
    }


def memory_view(entry: dict[str, Any], kind: str, model: str, server_args: tuple[str, ...],
                trace: Trace) -> dict[str, Any]:
    view: dict[str, Any] = {"measured": measured(entry)}
    knobs = (entry.get("server") or {}).get("knobs") or {}
    view["predicted"] = predicted(model, server_args, knobs, trace) if kind == "ferry" else None
    return view


def render(views: dict[str, dict[str, Any]]) -> list[str]:
    """A table, one row per configuration: measured beside predicted."""
    if not views:
        return []
    lines = ["| configuration | weights MiB (plan) | KV blocks at peak / total (plan) | peak KV usage | "
             "sequences of typical length that fit (plan) | preemptions | peak server MiB |",
             "|---|---|---|---|---|---|---|"]
    for name, view in views.items():
        m, p = view.get("measured") or {}, view.get("predicted") or {}
        lines.append(
            f"| {name} | {_mib(m.get('weight_bytes'))} ({_mib(p.get('weight_bytes'))}) | "
            f"{_int(m.get('peak_kv_blocks_used'))} / {_int(m.get('kv_blocks_total'))} ({_int(p.get('kv_blocks'))}) | "
            f"{_pct(m.get('peak_kv_usage'))} | {_int(p.get('max_concurrency_at_typical'))} "
            f"(typical {_int(p.get('typical_len'))} tokens) | {_int(m.get('preemptions'))} | "
            f"{_mib(m.get('peak_memory_bytes'))} |"
        )
    commands = sorted({str(v["predicted"]["command"]) for v in views.values()
                       if v.get("predicted") and v["predicted"].get("command")})
    lines += [""] + [f"- prediction: `{c}`" for c in commands]
    return lines


def _mib(value: Any) -> str:
    return "n/a" if not isinstance(value, int | float) else f"{value / 2**20:,.0f}"


def _int(value: Any) -> str:
    return "n/a" if not isinstance(value, int | float) else f"{value:,.0f}"


def _pct(value: Any) -> str:
    return "n/a" if not isinstance(value, int | float) else f"{value:.0%}"

