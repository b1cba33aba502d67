"""``ferry keys``: --runtime-dir before or after the subcommand, and what it says when Redis is unreachable."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway.admission import keys_cli
from tests.redis_server import RedisServer


def target(argv: list[str]) -> tuple[str, str]:
    return keys_cli.redis_target(keys_cli._parser().parse_args(argv))


def test_runtime_dir_goes_before_or_after_the_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FERRY_REDIS_URL", raising=False)
    assert target(["--runtime-dir", "/tmp/f", "list"]) == ("unix:///tmp/f/redis.sock", "--runtime-dir /tmp/f")
    assert target(["list", "--runtime-dir", "/tmp/f"]) == ("unix:///tmp/f/redis.sock", "--runtime-dir /tmp/f")
    assert target(["add", "x", "--runtime-dir", "/tmp/f"])[0] == "unix:///tmp/f/redis.sock"
    assert target(["list"]) == ("redis://127.0.0.1:6379/0", "the default")
    monkeypatch.setenv("FERRY_REDIS_URL", "redis://h:1/0")
    assert target(["list"]) == ("redis://h:1/0", "FERRY_REDIS_URL")
    assert target(["revoke", "x", "--redis-url", "redis://o:2/0"]) == ("redis://o:2/0", "--redis-url")


def test_unreachable_redis_names_what_was_tried_and_how_to_reach_ferry_serve(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_cli.main(["list", "--runtime-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach Redis at unix://{tmp_path}/redis.sock (--runtime-dir {tmp_path})" in err
    assert "--runtime-dir RUNTIME_DIR" in err and "--redis-url" in err


def test_keys_cli_reaches_a_redis_given_after_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    server = RedisServer().start()
    try:
        assert keys_cli.main(["add", "alice", "--rpm", "5", "--redis-url", server.url]) == 0
        assert keys_cli.main(["list", "--redis-url", server.url]) == 0
    finally:
        server.stop()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ferry-")  # the secret, once
    assert out[1].split() == ["NAME", "PRIORITY", "RPM", "TPM", "CREATED", "ADMIN"]
    assert out[2].split()[:4] == ["alice", "0", "5", "-"]
