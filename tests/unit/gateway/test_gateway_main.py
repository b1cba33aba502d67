"""The gateway's command line: every config field is a flag, and public binds need authentication."""

from __future__ import annotations

import pytest

from services.gateway.__main__ import build_parser, check_public_bind, is_loopback, main
from shared.config import GatewayConfig, config_from_args


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("gateway.example", False),
])
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_public_bind_needs_authentication() -> None:
    assert check_public_bind(GatewayConfig(host="127.0.0.1")) is None
    refusal = check_public_bind(GatewayConfig(host="0.0.0.0"))
    assert refusal is not None and "--allow-unauthenticated-public" in refusal
    assert check_public_bind(GatewayConfig(host="0.0.0.0", api_key="k")) is None
    assert check_public_bind(GatewayConfig(host="0.0.0.0", allow_unauthenticated_public=True)) is None
    # a Redis that does not answer cannot vouch for keys
    unreachable = check_public_bind(GatewayConfig(host="0.0.0.0", redis_url="redis://127.0.0.1:1/0"))
    assert unreachable is not None and "did not answer" in unreachable


def test_main_refuses_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--host", "0.0.0.0", "--model", "/nonexistent"]) == 2
    assert "refusing to listen on '0.0.0.0'" in capsys.readouterr().err


def test_flags_and_environment_build_the_config() -> None:
    args = build_parser().parse_args(["--port", "9001", "--max-n", "3", "--scheduler-timeout-s", "4.5",
                                      "--allow-unauthenticated-public", "--log-format", "text"])
    cfg = config_from_args(GatewayConfig, args)
    assert (cfg.port, cfg.max_n, cfg.scheduler_timeout_s, cfg.allow_unauthenticated_public) == (9001, 3, 4.5, True)
