"""The device check's last step: every stage's JSON into one results.json and a short
report.md, with the issue's goals judged from the numbers (a missing number is
"not measured", never a pass)."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any

STAGES = ["kernels", "exactness", "determinism", "throughput_small", "throughput_8b", "serve"]
OPT_IN = ["profile"]  # listed only when they ran


def load(work: Path) -> dict[str, Any]:
    stages: dict[str, Any] = {}
    for name in STAGES + OPT_IN:
        path = work / f"{name}.json"
        if name in OPT_IN and not path.is_file():
            continue
        if not path.is_file():
            stages[name] = {"stage": name, "status": "not run"}
            continue
        data = json.loads(path.read_text())
        if data.get("status") == "running":
            data["status"] = "timeout"  # killed by its time box; the numbers it had are kept
        stages[name] = data
    return stages


def goals(stages: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(goal, measured, verdict) for the issue's three targets, from the 8B stage with graphs."""
    n = stages.get("throughput_8b", {}).get("numbers", {})
    rows: list[tuple[str, str, str]] = []
    b64 = n.get("graphs_b64") or {}
    x = b64.get("x_roofline")
    rows.append(("8B decode step at batch 64 within 1.3x of the HBM roofline",
                 f"{x}x ({b64.get('decode_step_ms')} ms vs {b64.get('roofline_ms')} ms)" if x else "not measured",
                 "pass" if x is not None and x <= 1.3 else ("fail" if x is not None else "n/a")))
    rates = [v.get("prefill_x_matmul_rate") for k, v in n.items()
             if k.startswith(("graphs_b", "eager_b")) and isinstance(v, dict)]
    best = max((r for r in rates if r is not None), default=None)
    rows.append(("prefill >= 60% of the measured bf16 matmul rate", f"{best:.0%}" if best is not None else "not measured",
                 "pass" if best is not None and best >= 0.6 else ("fail" if best is not None else "n/a")))
    ours = b64.get("generate_tok_s")
    peer = n.get("transformers_generate_b64_tok_s")
    ratio = ours / peer if ours and peer else None
    rows.append((">= 5x transformers generate output tok/s at batch 64",
                 f"{ratio:.1f}x ({ours} vs {peer} tok/s)" if ratio else "not measured",
                 "pass" if ratio is not None and ratio >= 5 else ("fail" if ratio is not None else "n/a")))
    return rows


def headline(stage: dict[str, Any]) -> str:
    n = stage.get("numbers", {})
    if not n:
        return str(stage.get("reason", ""))
    if stage.get("stage") == "kernels":
        return f"{n.get('num_cases')} cases, max err {n.get('max_abs_err')}, {len(n.get('failures', []))} failures"
    if stage.get("stage") == "exactness":
        return (f"fp32 token-exact {n.get('fp32_token_exact')}, graph replays {n.get('fp32_graph_replays')}, "
                f"bf16 mean abs logprob diff {n.get('bf16_mean_abs_logprob_diff')}, "
                f"top-1 {n.get('bf16_top1_agreement')} (transformers' bf16: "
                f"{n.get('hf_bf16_mean_abs_logprob_diff')}, top-1 {n.get('hf_bf16_top1_agreement')})")
    if stage.get("stage") == "determinism":
        return (f"--deterministic: {n.get('deterministic_equal_to_alone')} seeded requests equal to alone in a mix "
                f"(default: {n.get('default_equal_to_alone')}); out tok/s against the default, median of pairs: "
                f"{n.get('deterministic_over_default_median')}x")
    if str(stage.get("stage", "")).startswith("throughput"):
        parts = [f"{k}: {v.get('decode_step_ms')} ms ({v.get('x_roofline')}x roof)"
                 for k, v in n.items() if isinstance(v, dict) and "decode_step_ms" in v]
        return "; ".join(parts[:8])
    if stage.get("stage") == "profile":
        return "; ".join(f"{k}: {v.get('step_wall_us')} us wall, {v.get('device_us')} us kernels"
                         for k, v in n.items() if isinstance(v, dict) and "step_wall_us" in v)
    if stage.get("stage") == "serve":
        s = n.get("summary", {})
        return (f"{s.get('completed')} done, {s.get('output_tok_s', 0):.0f} out tok/s, "
                f"TTFT p95 {s.get('ttft_p95_ms', 0):.0f} ms, TPOT p95 {s.get('tpot_p95_ms', 0):.1f} ms") if s else ""
    return ""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--device-name", default="")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stages = load(args.work)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": args.device_name,
            "python": platform.python_version(), "total_seconds": args.seconds, **versions()}
    goal_rows = goals(stages)
    if args.dry_run:  # tiny shapes on a CPU: the numbers test the script, not the engine
        goal_rows = [(g, m, "not judged (CPU dry run)") for g, m, _ in goal_rows]
    (args.out / "results.json").write_text(json.dumps(
        {"meta": meta, "goals": [dict(goal=g, measured=m, verdict=v) for g, m, v in goal_rows], "stages": stages},
        indent=1, default=str))
    lines = [f"# ferry device check, {meta['date']}", "",
             f"{meta['device']}; Python {meta['python']}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
             f"transformers {meta.get('transformers')}; {args.seconds:.0f} s in all.", "",
             "| stage | status | seconds | headline |", "|---|---|---|---|"]
    for name, st in stages.items():
        lines.append(f"| {name} | {st.get('status')} | {st.get('seconds', '')} | {headline(st)} |")
    lines += ["", "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {v} |" for g, m, v in goal_rows]
    for name, st in stages.items():
        if st.get("status") in ("fail", "timeout") and st.get("error"):
            lines += ["", f"**{name}**: {st['error']}"]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    board = args.work / "serve" / "board.md"
    if board.is_file():
        shutil.copy(board, args.out / "board.md")
    print("\n".join(lines))


def versions() -> dict[str, str]:
    out = {}
    for mod in ("torch", "triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = "absent"
    return out


if __name__ == "__main__":
    main()
