"""The device check's script and report, on the CPU: the goal verdicts from hand-made
stage results, and (slow) tests/device/run.sh --cpu-dry-run end to end on two stages."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.device.report import goals, load

ROOT = Path(__file__).resolve().parents[3]


def test_goals_judged_from_numbers_and_missing_is_not_a_pass(tmp_path: Path) -> None:
    numbers = {
        "graphs_b64": {"decode_step_ms": 6.0, "roofline_ms": 5.0, "x_roofline": 1.2, "generate_tok_s": 6000.0,
                       "prefill_x_matmul_rate": 0.55},
        "eager_b256": {"prefill_x_matmul_rate": 0.62},
        "transformers_generate_b64_tok_s": 1000.0,
    }
    def write() -> None:
        (tmp_path / "throughput_8b.json").write_text(json.dumps({"stage": "throughput_8b", "status": "pass",
                                                                 "numbers": numbers}))

    write()
    (tmp_path / "kernels.json").write_text(json.dumps({"stage": "kernels", "status": "running", "numbers": {}}))
    stages = load(tmp_path)
    assert stages["kernels"]["status"] == "timeout"  # killed by its time box while running
    assert stages["serve"]["status"] == "not run"
    verdicts = [v for _, _, v in goals(stages)]
    assert verdicts == ["pass", "pass", "pass"]
    numbers["graphs_b64"]["x_roofline"] = 1.31
    numbers["transformers_generate_b64_tok_s"] = 1500.0
    write()
    verdicts = [v for _, _, v in goals(load(tmp_path))]
    assert verdicts == ["fail", "pass", "fail"]
    assert [v for _, _, v in goals({})] == ["n/a", "n/a", "n/a"]


@pytest.mark.slow
def test_run_sh_cpu_dry_run(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "STAGES": "kernels throughput_small", "WORK": str(tmp_path / "work"),
           "PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    subprocess.run([str(ROOT / "tests" / "device" / "run.sh"), str(tmp_path / "out"), "--cpu-dry-run"],
                   cwd=ROOT, env=env, check=True, timeout=600, capture_output=True)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["stages"]["kernels"]["status"] == "pass"
    assert results["stages"]["kernels"]["numbers"]["failures"] == []
    small = results["stages"]["throughput_small"]
    assert small["status"] == "pass"
    assert small["numbers"]["eager_b4"]["decode_step_ms"] > 0
    assert small["numbers"]["transformers_generate_b4_tok_s"] > 0
    assert results["stages"]["serve"]["status"] == "not run"
    assert all("not judged" in g["verdict"] for g in results["goals"])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| kernels | pass |" in report
