"""Knob validation at the edge: one line per bad knob, exit 2, before anything starts."""

from __future__ import annotations

import pytest

from ferry_cli import serve
from shared.config import GatewayConfig, SchedulerConfig, WorkerConfig
from shared.config_checks import all_errors, config_errors


def test_defaults_are_valid() -> None:
    assert all_errors([SchedulerConfig(), WorkerConfig(), GatewayConfig()]) == []


def test_each_bad_knob_is_one_line_naming_the_flag_and_the_value() -> None:
    errors = config_errors(SchedulerConfig(max_num_seqs=0, block_size=12, scheduling_policy="lifo",
                                           queue_timeout_s=0.0))
    assert errors == [
        "--max-num-seqs must be at least 1 (got 0)",
        "--block-size must be a power of two such as 16 (got 12)",
        "--scheduling-policy must be one of 'fcfs', 'priority' (got 'lifo')",
        "--queue-timeout-s must be greater than 0 (got 0.0)",
    ]


def test_relations_between_knobs() -> None:
    assert config_errors(WorkerConfig(rank=2, num_workers=2)) == ["--rank (2) must be below --num-workers (2)"]
    assert config_errors(SchedulerConfig(queue_timeout_s=1.0, min_queue_timeout_s=5.0)) == [
        "--min-queue-timeout-s (5) must not exceed --queue-timeout-s (1)"]


def test_float16_is_refused_on_a_cpu_and_allowed_on_a_gpu() -> None:
    [line] = config_errors(WorkerConfig(dtype="float16", device="cpu"))
    assert line.startswith("--dtype float16 is refused on a CPU") and "bfloat16" in line
    assert config_errors(WorkerConfig(dtype="float16", device="cuda")) == []
    assert config_errors(WorkerConfig(dtype="half")) == [
        "--dtype must be one of 'auto', 'bfloat16', 'float32', 'float16' (got 'half')"]


def test_a_knob_shared_by_two_configs_is_reported_once() -> None:
    errors = all_errors([SchedulerConfig(max_num_seqs=0), WorkerConfig(max_num_seqs=0)])
    assert errors == ["--max-num-seqs must be at least 1 (got 0)"]


def test_ferry_serve_exits_2_with_every_error_before_starting_anything(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []
    monkeypatch.setattr(serve, "start_embedded_redis", lambda *a: started.append("redis"))
    monkeypatch.setattr(serve.Stack, "start", lambda self: started.append("stack"))
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--max-num-seqs", "0", "--dtype", "float16", "--port", "70000", "--model", "/nowhere",
                    "--max-restarts", "-1"])
    assert exit_info.value.code == 2
    assert started == []
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "ferry serve: error: --max-restarts must be at least 0 (got -1)",
        "ferry serve: error: --max-num-seqs must be at least 1 (got 0)",
        lines[2],
        "ferry serve: error: --port must be between 1 and 65535 (got 70000)",
        lines[4],
    ]
    assert lines[2].startswith("ferry serve: error: --dtype float16 is refused on a CPU")
    assert lines[4].startswith("ferry serve: error: --model '/nowhere' is neither a local Hugging Face folder")


def test_serve_and_bench_help_show_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtests.cli import build_parser

    text = serve.build_parser().format_help()
    assert "give up if /ready fails this long [default: 900.0]" in " ".join(text.split())
    assert "[default: 5]" in text
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    help_text = " ".join(run.format_help().split())
    assert "seconds of sending per run [default: 30.0]" in help_text
    assert "requests sent one by one before measuring [default: 1]" in help_text


def test_int8_quantization_is_refused_where_it_cannot_run() -> None:
    from shared.config import WorkerConfig

    assert config_errors(WorkerConfig(quantization="int8")) == []
    assert config_errors(WorkerConfig(quantization="int4")) == ["--quantization must be one of 'none', 'int8' (got 'int4')"]
    assert any("tensor-parallel" in e for e in config_errors(WorkerConfig(quantization="int8", tensor_parallel_size=2)))
    assert any("CPU only" in e for e in config_errors(WorkerConfig(quantization="int8", device="cuda")))
