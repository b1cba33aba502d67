"""The engine-kill board (benchmarks/serving/engine_kill.py): which streams paused across the kill, the
counter deltas, and the section appended to the board, from hand-built records."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.serving.engine_kill import delta, paused_streams, render_kill


def record(req_id: str, sent: float, ttft: float | None, itl: list[float], status: str = "ok") -> dict[str, object]:
    latency = None if ttft is None else ttft + sum(itl)
    return {"req_id": req_id, "sent_s": sent, "ttft_s": ttft, "itl_s": itl, "latency_s": latency, "status": status}


def test_paused_streams_counts_only_streams_that_spanned_the_kill(tmp_path: Path) -> None:
    kill = 10.0
    rows = [
        record("before", 1.0, 0.1, [0.1] * 5),  # done before the kill
        record("after", 11.0, 0.1, [0.1] * 5),  # first token after the kill
        record("other-engine", 9.0, 0.1, [0.1] * 20),  # streaming at the kill on engine 0: no pause
        record("held", 9.0, 0.1, [0.1, 0.1, 12.0, 0.1]),  # 9.3 -> 21.3 spans the kill: held and resumed
        record("failed", 9.0, 0.1, [0.1, 0.1], status="error"),  # still streaming at 9.3, ended by an error
        record("late-gap", 9.0, 0.1, [0.1] * 15 + [3.0]),  # streams on past the kill, then a gap: not held
    ]
    rows[4]["latency_s"] = 5.0  # the error came at 14.0, after the kill
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert paused_streams(path, kill) == {"streaming_at_kill": 4, "paused_then_completed": 1,
                                          "streaming_at_kill_failed": 1}


def test_delta_keeps_only_what_moved() -> None:
    before = {"rerouted": {"0": 1.0, "1": 0.0}, "resumed": {"connection_lost": 2.0}, "routed": {"0": 5.0}}
    after = {"rerouted": {"0": 4.0, "1": 0.0}, "resumed": {"connection_lost": 2.0, "new_incarnation": 1.0},
             "routed": {"0": 9.0}}
    assert delta(after, before) == {"rerouted": {"0": 3.0}, "resumed": {"new_incarnation": 1.0},
                                    "routed": {"0": 4.0}}


def test_the_kill_section_names_the_processes_and_the_counts() -> None:
    kill = {"engine": "1", "kill_at_s": 20.5, "running_at_kill": 8, "waiting_at_kill": 3,
            "processes": [{"pid": 11, "cmd": "scheduler"}, {"pid": 12, "cmd": "worker0"}],
            "back_in_both_gateways_at_s": 33.0}
    summary = {"num_requests": 10, "completed": 9, "errors_429": 0, "errors_503": 1, "errors_timeout": 0,
               "errors_other": 0}
    gateways = [{"name": "gateway a", "summary": summary, "server": {"rerouted": {"0": 2.0},
                                                                     "resumed": {"connection_lost": 5.0}},
                 "client": {"streaming_at_kill": 6, "paused_then_completed": 5, "streaming_at_kill_failed": 1}}]
    text = render_kill(kill, gateways)
    assert "engine 1 running 8 and queueing 3" in text and "scheduler (pid 11), worker0 (pid 12)" in text
    assert "t=33 s (12.5 s after the kill)" in text
    assert "| gateway a | 10 | 9 | 0/1/0/0 | 6 | 5 | 1 | 2 | 5 (connection_lost) |" in text
