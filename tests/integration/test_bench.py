"""``ferry bench`` end to end: real servers, real sockets, the board, the JSON and the plots.

The same smoke run goes against a ferry cluster and against an independent
OpenAI-compatible server (transformers' own ``transformers serve`` on the same
tiny model folder), which proves the client is not tied to ferry; the
experiment test starts and stops ferry itself for a baseline and a variant.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ferry_cli.main import main as ferry_main
from loadtests.server import ManagedServer, ServerSpec
from loadtests.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
SMOKE = [
    "--scenario", "mixed", "--rates", "2,4", "--duration", "2", "--seed", "3",
    "--scenario-opt", "prompt_tokens=8:48", "--scenario-opt", "prefix_tokens=32:64",
    "--scenario-opt", "output_tokens=2:12", "--warmup", "1", "--cooldown", "0.2", "--quiet",
    "--goodput", "ttft:10000", "--price-per-gpu-hour", "2", "--request-timeout", "60",
]


def smoke(base_url: str, out: Path, *extra: str) -> dict:
    assert ferry_main(["bench", "run", "--base-url", base_url, "--out", str(out), *SMOKE, *extra]) == 0
    for name in ("board.md", "results.json", "latency_vs_rate.png", "throughput_vs_rate.png",
                 "timeline-2rps.png", "timeline-4rps.png", "trace.jsonl"):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    runs = results["configs"][0]["runs"]
    assert [r["rate"] for r in runs] == [2.0, 4.0]
    for run in runs:
        s = run["summary"]
        assert s["num_requests"] > 0 and s["completed"] > 0
        assert s["completed"] + s["cancelled"] + s["errors"] == s["num_requests"]
        assert s["ttft_p95_ms"] > 0 and s["e2e_p95_ms"] >= s["ttft_p95_ms"] and s["output_tok_s"] > 0
        records = (out / "requests" / f"requests-{run['name']}.jsonl").read_text().splitlines()
        assert len(records) == s["num_requests"]
    # The trace written beside the board is the one measured, byte for byte in hash.
    assert read_trace(out / "trace.jsonl").content_hash == results["meta"]["trace"]["sha256"]
    board = (out / "board.md").read_text()
    assert "| 2rps | 2 |" in board and "| 4rps | 4 |" in board
    return results


def test_python_m_loadtests_generate(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    cmd = [sys.executable, "-m", "loadtests", "generate", "--scenario", "agent-rag", "--num-requests", "12",
           "--out", str(out)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    assert first == again and re.search(r"12 requests, sha256 [0-9a-f]{64}", first)
    assert len(read_trace(out).requests) == 12


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "{tmp}/missing.jsonl", "--rates", "1"], "cannot read trace"),
        (["--scenario", "chat"], "pass the offered rates"),
        (["--arrival", "closed"], "needs --concurrency"),
        (["--scenario", "chat", "--rates", "1", "--num-requests", "2"], "cannot talk to http://127.0.0.1:9/v1/models"),
        (["--rates", "1", "--scenario-opt", "bogus=1"], "scenario option"),
    ],
)
def test_bad_arguments_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    argv = ["bench", "run", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path), "--duration", "1"]
    assert ferry_main(argv + [a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ferry bench: error:") and message in err and "Traceback" not in err


@pytest.mark.slow
def test_smoke_against_ferry(serve_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    results = smoke(serve_cluster.base_url, tmp_path)
    for run in results["configs"][0]["runs"]:
        s = run["summary"]
        assert run["server_metrics"] is True
        # ferry returns each request's queue time in its response ("timings"), and its
        # /metrics gives preemptions and process memory.
        assert s["queue_source"] == "per-request" and s["queue_p95_ms"] is not None
        assert s["preemptions"] is not None and s["preemptions"] >= 0
        assert s["peak_memory_bytes"] > 50 * 2**20
        assert any(v is not None for v in run["series"]["running"])
        assert set(run["groups"]) <= {"chat", "long-context", "agent-rag"} and run["groups"]


@pytest.fixture(scope="module")
def transformers_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``transformers serve`` on the tiny model folder: an OpenAI-compatible server that is not ferry."""
    binary = Path(sys.executable).parent / "transformers"
    spec = ServerSpec(
        kind="command", model=str(tiny_model_dir), ready_path="/v1/models", startup_timeout_s=240,
        command=f"{binary} serve {{model}} --host {{host}} --port {{port}} --device cpu --dtype float32",
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    with ManagedServer(spec, {}, tmp_path_factory.mktemp("peer") / "transformers-serve.log") as server:
        yield server.base_url


@pytest.mark.slow
def test_smoke_against_transformers_serve(transformers_server: str, tmp_path: Path) -> None:
    results = smoke(transformers_server, tmp_path)
    board = (tmp_path / "board.md").read_text()
    for run in results["configs"][0]["runs"]:
        # No /metrics on this server: the server-side columns are n/a, not a crash.
        assert run["server_metrics"] is False
        assert run["summary"]["queue_p95_ms"] is None and run["summary"]["preemptions"] is None
    assert re.search(r"\| 2rps \| 2 \| [0-9.]+ \| [0-9]+ \| n/a \| [0-9]+ \| [0-9.]+ \| n/a \|", board)


TASKS = [
    {"id": "add-1", "task": "arithmetic", "checker": "numeric", "expected": 5, "max_tokens": 4,
     "messages": [{"role": "user", "content": "What is 2 + 3?"}]},
    {"id": "add-2", "task": "arithmetic", "checker": "numeric", "expected": 7, "max_tokens": 4,
     "prompt": "4 + 3 ="},
    {"id": "json-1", "task": "structured", "checker": "json_schema", "expected": {"city": "Lisbon"}, "max_tokens": 24,
     "messages": [{"role": "user", "content": "Ana lives in Lisbon. Her city as JSON."}],
     "request": {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
         "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
         "additionalProperties": False}}}}},
    {"id": "tool-1", "task": "tools", "checker": "tool_call", "expected": {"name": "set_timer"}, "max_tokens": 24,
     "messages": [{"role": "user", "content": "Set a timer for 5 minutes."}],
     "request": {"tool_choice": "required", "tools": [
         {"type": "function", "function": {"name": "set_timer", "parameters": {
             "type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 99}},
             "required": ["minutes"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
             "additionalProperties": False}}}]}},
    {"id": "open-1", "task": "open", "checker": "agree", "max_tokens": 6,
     "messages": [{"role": "user", "content": "Say something about the sea."}]},
]


def write_tasks(path: Path) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in TASKS))
    return path


def check_quality(summary: dict, judged_types: set[str]) -> None:
    """Every task type answered was judged (or, for open items, counted unjudged); accepted <= on time."""
    quality = summary["quality"]
    assert set(quality) <= {"arithmetic", "structured", "tools", "open"} and judged_types <= set(quality)
    for task, q in quality.items():
        if task == "open":
            assert q["judged"] + q["unjudged"] >= 1
        else:
            assert q["judged"] >= 1 and 0 <= q["correct"] <= q["judged"]
    assert summary["accepted"] <= summary["accepted_slo_only"]


@pytest.mark.slow
def test_task_items_mixed_into_the_load_and_a_quality_pass(serve_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    results = smoke(serve_cluster.base_url, tmp_path / "mixed", "--tasks", str(tasks), "--task-fraction", "0.5")
    summaries = [run["summary"] for run in results["configs"][0]["runs"]]
    assert sum(s.get("checked", 0) for s in summaries) >= 2
    assert "## Answer quality by task type" in (tmp_path / "mixed" / "board.md").read_text()
    # a quality pass, then the same pass judged against the first: the tiny model's grammar-bound answers
    first, second = tmp_path / "q1", tmp_path / "q2"
    base = ["bench", "quality", "--base-url", serve_cluster.base_url, "--tasks", str(tasks), "--concurrency", "2",
            "--quiet"]
    assert ferry_main([*base, "--out", str(first)]) == 0
    assert ferry_main([*base, "--out", str(second), "--reference", str(first / "results.json")]) == 0
    one = json.loads((first / "results.json").read_text())["configs"][0]
    two = json.loads((second / "results.json").read_text())["configs"][0]
    check_quality(one["quality_pass"]["summary"], {"arithmetic", "structured", "tools"})
    assert one["quality_pass"]["summary"]["quality"]["open"]["unjudged"] == 1  # nothing to agree with yet
    assert two["quality_pass"]["summary"]["quality"]["open"]["judged"] == 1  # judged against the first pass
    assert two["determinism"]["compared"] == len(TASKS)
    # a structured answer is valid JSON for its schema: the grammar saw to it, the checker confirms it
    structured = one["quality_pass"]["items"]["json-1"]
    assert json.loads(structured["text"])["city"] and structured["reason"] is not None
    tool = one["quality_pass"]["items"]["tool-1"]
    assert tool["tool_calls"] and tool["tool_calls"][0][0] in ("set_timer", "get_weather")
    assert tool["correct"] == (tool["tool_calls"][0][0] == "set_timer")


EXPERIMENT = """
title = "smoke experiment"
[server]
kind = "ferry"
model = "{model}"
args = ["--num-threads", "1", "--kv-cache-memory", "16777216"]
startup_timeout_s = 240
[baseline]
max_num_seqs = 8
[workload]
scenario = "chat"
rates = [3]
duration_s = 2
warmup_requests = 1
cooldown_s = 0
request_timeout_s = 60
[workload.scenario_options]
prompt_tokens = [8, 32]
output_tokens = [2, 8]
[goodput]
ttft_ms = 10000
[cost]
price_per_gpu_hour = 2.0
[quality]
tasks = "tasks.jsonl"
mix = 0.3
concurrency = 2
[[variants]]
name = "seq-cap-1"
knob = "max_num_seqs"
value = 1
hypothesis = "One sequence at a time queues the rest, so TTFT p95 rises."
pass = "completed_rps > 0 and ttft_p95_ms >= 0"
"""


@pytest.mark.slow
def test_experiment_starts_and_stops_ferry(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "smoke.toml"
    path.write_text(EXPERIMENT.format(model=tiny_model_dir))
    write_tasks(tmp_path / "tasks.jsonl")
    out = tmp_path / "out"
    assert ferry_main(["bench", "experiment", str(path), "--out", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    # the baseline runs twice, around the variant, so its spread is the noise the verdict respects
    assert [c["name"] for c in results["configs"]] == ["baseline", "seq-cap-1", "baseline (repeat 2)"]
    assert "--max-num-seqs 1" in results["configs"][1]["server"]["command"]
    (decision,) = results["decisions"]
    assert decision["latency_verdict"] == "better" and decision["changed_parameter"] == "max_num_seqs: 8 -> 1"
    # quality: every configuration answered every item once; a scheduling knob must not change answers,
    # so the record pairs the items per task type, open ones by agreement, and says whether greedy
    # answers were identical; one item per type cannot show a drop beyond noise, so a lost answer
    # turns the faster variant's "better" into "no decision"
    assert decision["answers"] == "same" and decision["determinism"]["compared"] == len(TASKS)
    assert {q["task"] for q in decision["quality"]} == {"arithmetic", "structured", "tools", "open"}
    lost = [q["task"] for q in decision["quality"] if q["baseline_only"] > q["variant_only"]]
    assert decision["verdict"] == (f"no decision: quality within noise ({', '.join(lost)})" if lost else "better")
    for config in results["configs"]:
        check_quality(config["quality_pass"]["summary"], {"arithmetic", "structured", "tools"})
    assert len(decision["measured_outcome"]["baseline_runs"]["completed_rps"]) == 2
    memory = decision["memory"]["seq-cap-1"]
    assert memory["measured"]["kv_blocks_total"] == memory["predicted"]["kv_blocks"] > 0  # ferry plan agrees
    assert decision["input_set"]["trace_sha256"] == results["meta"]["trace"]["sha256"]
    assert (out / "decision-seq-cap-1.md").is_file() and "Decision record: seq-cap-1" in (out / "board.md").read_text()
    for config in results["configs"]:
        assert config["runs"][0]["summary"]["completed"] > 0
        port = re.search(r"--port (\d+)", config["server"]["command"]).group(1)  # type: ignore[union-attr]
        with pytest.raises(httpx.ConnectError):  # the server was stopped
            httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2.0, trust_env=False)
