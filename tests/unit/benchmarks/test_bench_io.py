"""benchmarks/bench_io.py: the bench scripts' JSON header and write-out."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.bench_io import header, write_json


def test_header_names_the_command_machine_and_date() -> None:
    h = header("benchmarks.kernels.bench_x", ["--rows", "1"])
    assert h["command"] == "python -m benchmarks.kernels.bench_x --rows 1"
    assert h["machine"]["cpus"] >= 1 and len(h["machine"]["loadavg"]) == 3
    assert h["date"].endswith(" UTC") and h["date"][:2] == "20"


def test_header_records_the_openmp_wait_policy(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    assert header("benchmarks.kernels.bench_x", [])["machine"]["openmp"] == {"OMP_WAIT_POLICY": None,
                                                                           "GOMP_SPINCOUNT": "123"}


def test_write_json_makes_the_folder_and_skips_without_a_path(tmp_path: Path,
                                                              capsys) -> None:  # type: ignore[no-untyped-def]
    write_json(None, {"a": 1})
    assert capsys.readouterr().out == ""
    out = tmp_path / "deep" / "r.json"
    write_json(out, {"a": [1, 2]})
    assert json.loads(out.read_text()) == {"a": [1, 2]} and f"wrote {out}" in capsys.readouterr().out
