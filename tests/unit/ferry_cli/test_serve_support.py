"""ferry serve's side duties: Redis's lines re-logged as JSON, sockets removed from a named runtime folder."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from ferry_cli.serve_support import redis_log_sink, remove_sockets, setup_serve_logs


def test_redis_lines_become_json_log_lines_with_redis_level(capsys: pytest.CaptureFixture[str]) -> None:
    setup_serve_logs("json")
    sink = redis_log_sink("json")
    sink("3721:M 30 Nov 2026 19:42:04.745 # Server initialized")
    sink("3721:C 30 Nov 2026 19:42:04.716 * oO0OoO0OoO0Oo Redis is starting oO0OoO0OoO0Oo")
    sink("something unexpected")
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [json.loads(line) for line in captured.err.splitlines()]
    assert [(r["service"], r["level"], r["msg"]) for r in lines] == [
        ("redis", "WARNING", "Server initialized"),
        ("redis", "INFO", "oO0OoO0OoO0Oo Redis is starting oO0OoO0OoO0Oo"),
        ("redis", "WARNING", "something unexpected"),
    ]
    assert lines[0]["redis_pid"] == "3721"


def test_only_the_sockets_are_removed(tmp_path: Path) -> None:
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    (tmp_path / "plan.sock").write_text("a file, not a socket: not ours")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "gateway.sock"))
        remove_sockets(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "plan.sock"]
