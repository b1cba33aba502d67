"""Authentication before any work (services/gateway/admission/auth_gate.py, auth_failures.py).

The real gateway app under uvicorn, built as for ``--host 0.0.0.0 --api-key K
--admin-key A``. Every API endpoint is tried without a key and with a wrong one,
with bodies at the size limit and with grammar requests: each is refused with 401
in OpenAI's error shape, naming no model, and spies show that neither the body
check, the tokenizer, the chat template, the grammar compiler, the model lookup nor
the backpressure check ran. Then the per-address throttle at its exact edge, with
and without a trusted proxy, its Redis-shared count, and the operator's view
(``ferry:auth_failures_total``, the dashboard's events).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import services.gateway.api.middleware as middleware
import services.gateway.api.validation as validation
from services.gateway.admission.auth import Admission
from services.gateway.admission.auth_failures import FailureThrottle, TrustedProxies
from services.gateway.admission.keystore import KeyStore, sync_client
from services.gateway.api.app import build_app
from services.gateway.errors import APIError
from services.gateway.text.structured import GrammarChecker
from services.gateway.text.tokenizer import GatewayTokenizer
from shared.config import GatewayConfig
from shared.config_checks import config_errors
from tests.redis_server import BUSY_HOST_REDIS_TIMEOUT_S, RedisServer
from tests.unit.gateway.test_gateway_support import GatewayServer, build_tiny_tokenizer

KEY = "user-key"
ADMIN = "admin-key"
MAX_BODY = 64 * 1024
SCHEMA = {"type": "object", "properties": {f"f{i}": {"type": "string", "maxLength": 5} for i in range(40)},
          "required": ["f0"]}


class Spies:
    """Counts of the work a refused request must not cause."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def hit(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def total(self) -> int:
        return sum(self.calls.values())


class SpyTokenizer(GatewayTokenizer):
    spies: Spies

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.spies.hit("encode")
        return super().encode(text, add_special_tokens)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.spies.hit("chat_template")
        return super().apply_chat_template(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        self.spies.hit("decode")
        return super().decode(*args, **kwargs)


class Gateway:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, **cfg: Any) -> None:
        folder = build_tiny_tokenizer(tmp / "tok")
        self.spies = Spies()
        tok = SpyTokenizer(folder)
        tok.spies = self.spies
        config = GatewayConfig(model=str(folder), served_model_name="tiny", scheduler_endpoint=f"ipc://{tmp}/gw.sock",
                               host="0.0.0.0", max_body_bytes=MAX_BODY, **cfg)
        self.app = build_app(config, tok)
        st = self.app.state.gateway
        spies = self.spies
        real_refusal, real_check, real_body = st.early_refusal, GrammarChecker.check, middleware.check_body
        real_model = validation.check_model

        def early_refusal() -> APIError | None:
            spies.hit("backpressure")
            return self.refusal if self.refusal is not None else real_refusal()

        def grammar_check(checker: GrammarChecker, grammar: str) -> None:
            spies.hit("grammar")
            real_check(checker, grammar)

        def body_check(*args: Any) -> None:
            spies.hit("body_check")
            real_body(*args)

        def check_model(*args: Any) -> None:
            spies.hit("check_model")
            real_model(*args)

        self.refusal: APIError | None = None
        monkeypatch.setattr(st, "early_refusal", early_refusal)
        monkeypatch.setattr(GrammarChecker, "check", grammar_check)
        monkeypatch.setattr(middleware, "check_body", body_check)
        monkeypatch.setattr(validation, "check_model", check_model)
        self.server = GatewayServer(self.app)

    def metric(self, reason: str) -> float:
        text = self.app.state.gateway.metrics.render()[0].decode()
        for line in text.splitlines():
            if line.startswith("ferry:auth_failures_total{") and f'reason="{reason}"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no auth_failures series for {reason}")


@pytest.fixture
def gw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Gateway, httpx.Client]]:
    g = Gateway(tmp_path, monkeypatch, api_key=KEY, admin_key=ADMIN, auth_failure_limit=1000)
    with g.server, httpx.Client(base_url=g.server.url, timeout=20) as http:
        yield g, http


def chat_body(size: int | None = None, grammar: bool = True) -> bytes:
    body: dict[str, Any] = {"model": "nope-not-served", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4}
    if grammar:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    if size is None:
        return json.dumps(body).encode()
    body["user"] = ""
    pad = size - len(json.dumps(body).encode())
    assert pad >= 0
    body["user"] = "x" * pad
    raw = json.dumps(body).encode()
    assert len(raw) == size, len(raw)
    return raw


REQUESTS = [
    ("POST", "/v1/chat/completions", chat_body()),
    ("POST", "/v1/chat/completions", chat_body(MAX_BODY)),
    ("POST", "/v1/chat/completions", chat_body(MAX_BODY + 1)),
    ("POST", "/v1/completions", json.dumps({"model": "nope", "prompt": "word " * 6000,
                                            "response_format": {"type": "json_schema", "json_schema":
                                                                {"name": "s", "schema": SCHEMA}}}).encode()),
    ("POST", "/tokenize", json.dumps({"model": "nope", "prompt": "hello " * 100}).encode()),
    ("POST", "/detokenize", json.dumps({"model": "nope", "tokens": [1, 2, 3]}).encode()),
    ("GET", "/v1/models", b""),
    ("GET", "/v1/models/tiny", b""),
    ("POST", "/v1/responses", b"{}"),  # an endpoint added later under /v1/ is covered too
    ("POST", "/v1/chat/completions", b"{not json"),
]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", "Basic dXNlcjp1c2VyLWtleQ=="])
@pytest.mark.parametrize(("method", "path", "body"), REQUESTS,
                         ids=[f"{m} {p} {len(b)}B" for m, p, b in REQUESTS])
def test_a_stranger_gets_401_and_nothing_runs(gw: tuple[Gateway, httpx.Client], method: str, path: str,
                                             body: bytes, authorization: str | None) -> None:
    g, http = gw
    headers = {"content-type": "application/json"}
    if authorization is not None:
        headers["authorization"] = authorization
    resp = http.request(method, path, content=body or None, headers=headers)
    assert resp.status_code == 401, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert set(resp.json()) == {"error"} and error["param"] is None
    assert "tiny" not in resp.text and "nope" not in resp.text  # no model names, no echo of the body
    assert resp.headers["www-authenticate"] == "Bearer"
    assert g.spies.calls == {}
    reason = "missing_key" if authorization is None or authorization.startswith("Basic") else "invalid_key"
    assert g.metric(reason) == 1.0


def test_the_body_limit_at_its_edge_with_a_valid_key(gw: tuple[Gateway, httpx.Client]) -> None:
    g, http = gw
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    at_limit = http.post("/v1/chat/completions", content=chat_body(MAX_BODY), headers=headers)
    over = http.post("/v1/chat/completions", content=chat_body(MAX_BODY + 1), headers=headers)
    assert over.status_code == 413
    # the body at the limit is read and checked; its unknown model is the first thing wrong with it
    assert at_limit.status_code == 404 and at_limit.json()["error"]["code"] == "model_not_found"
    assert g.spies.calls["body_check"] == 1 and g.spies.calls["check_model"] == 1
    assert g.spies.calls["backpressure"] == 1


def test_backpressure_answers_only_clients(gw: tuple[Gateway, httpx.Client]) -> None:
    g, http = gw
    g.refusal = APIError(429, "queue full", code="queue_full", headers={"retry-after": "3"})
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    stranger = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert stranger.status_code == 401 and "retry-after" not in stranger.headers
    assert "backpressure" not in g.spies.calls
    client = http.post("/v1/completions", content=body,
                       headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    assert client.status_code == 429 and client.json()["error"]["code"] == "queue_full"
    assert g.spies.calls["backpressure"] == 1


def test_the_operator_pages_count_as_failures(gw: tuple[Gateway, httpx.Client]) -> None:
    g, http = gw
    assert http.get("/metrics").status_code == 401
    assert http.get("/dashboard/data", headers={"authorization": f"Bearer {KEY}"}).status_code == 403
    assert http.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert g.metric("missing_admin_key") == 1.0 and g.metric("not_admin") == 1.0


def test_repeated_failures_are_throttled_at_the_exact_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g = Gateway(tmp_path, monkeypatch, api_key=KEY, admin_key=ADMIN, auth_failure_limit=3,
                auth_failure_block_s=45)
    with g.server, httpx.Client(base_url=g.server.url, timeout=20) as http:
        statuses = [http.get("/v1/models", headers={"authorization": "Bearer bad"}).status_code for _ in range(3)]
        assert statuses == [401, 401, 401]  # the limit itself is still allowed
        fourth = http.get("/v1/models")
        assert fourth.status_code == 429 and fourth.headers["retry-after"] == "45"
        assert fourth.headers["connection"] == "close"  # a blocked address's body is never read
        assert fourth.json()["error"]["code"] == "auth_failures"
        assert http.get("/metrics").status_code == 429  # the operator's pages share the count
        # a valid key from the same address is never throttled by it
        assert http.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert http.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200
        assert g.metric("invalid_key") == 3.0 and g.metric("throttled") == 2.0
        events = [text for _, text in g.app.state.gateway.metrics.events]
        assert any(t == "127.0.0.1 answered 429 for 45 s: more than 3 failed authentications in a minute"
                   for t in events), events
        assert g.spies.total() == 0


@pytest.mark.parametrize("trusted", ["", "127.0.0.1", "127.0.0.0/8"])
def test_forwarded_for_is_believed_only_from_a_configured_proxy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               trusted: str) -> None:
    g = Gateway(tmp_path, monkeypatch, api_key=KEY, auth_failure_limit=2, forwarded_allow_ips=trusted)
    with g.server, httpx.Client(base_url=g.server.url, timeout=20) as http:
        def status(client: str) -> int:
            return http.get("/v1/models", headers={"x-forwarded-for": client}).status_code

        first = [status("203.0.113.5") for _ in range(3)]
        other = status("203.0.113.6")
    assert first == [401, 401, 429]
    # behind a trusted proxy the second client is someone else; otherwise both are the proxy
    assert other == (401 if trusted else 429)


def test_trusted_proxies_follow_uvicorns_rules() -> None:
    none = TrustedProxies("")
    assert none.client("10.0.0.1", "1.1.1.1") == "10.0.0.1"
    one = TrustedProxies("10.0.0.1, 192.168.0.0/16")
    assert one.client("10.0.0.2", "1.1.1.1") == "10.0.0.2"  # an untrusted peer's header is ignored
    assert one.client("10.0.0.1", None) == "10.0.0.1"
    assert one.client("10.0.0.1", "1.1.1.1, 2.2.2.2") == "2.2.2.2"  # the right-most untrusted hop
    assert one.client("10.0.0.1", "1.1.1.1, 2.2.2.2, 192.168.3.4") == "2.2.2.2"
    assert one.client("10.0.0.1", "192.168.1.1, 10.0.0.1") == "192.168.1.1"  # all trusted: the first
    assert one.client("10.0.0.1", "[2001:db8::1]:443") == "2001:db8::1"
    assert one.client("10.0.0.1", "5.6.7.8:1234") == "5.6.7.8"
    anyone = TrustedProxies("*")
    assert anyone.client("8.8.8.8", "1.1.1.1, 2.2.2.2") == "1.1.1.1"
    with pytest.raises(ValueError):
        TrustedProxies("10.0.0.1, not-an-ip")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_local_throttle_edges_and_memory_bound() -> None:
    clock = Clock()
    t = FailureThrottle(3, 30.0, window_s=60.0, max_addresses=2, clock=clock)

    async def run(address: str) -> tuple[float, bool]:
        v = await t.on_failure(address)
        return v.retry_after_s, v.started

    go = asyncio.run
    assert [go(run("a")) for _ in range(3)] == [(0.0, False)] * 3
    assert go(run("a")) == (30.0, True)  # the (limit + 1)th failure in the window blocks
    clock.now += 29.0
    assert go(run("a")) == (pytest.approx(1.0), False)
    clock.now += 1.0  # the block is over, but the window (60 s from the first failure) is not
    assert go(run("a")) == (30.0, True)

    # the window's edge: a failure at 59.9 s still counts in it, one at 60 s starts a new one
    clock.now = 5000.0
    assert [go(run("b"))[0] for _ in range(3)] == [0.0, 0.0, 0.0]
    clock.now += 59.9
    assert go(run("b")) == (30.0, True)
    clock.now = 9000.0
    assert [go(run("c"))[0] for _ in range(3)] == [0.0, 0.0, 0.0]
    clock.now += 60.0
    assert go(run("c")) == (0.0, False)
    assert t.tracked() == 2  # "a" was forgotten: at most max_addresses are held
    assert go(run("a")) == (0.0, False)

    off = FailureThrottle(0, 30.0, clock=clock)
    assert all(not asyncio.run(off.on_failure("x")).blocked for _ in range(100)) and off.tracked() == 0


def test_gateways_sharing_redis_count_together() -> None:
    server = RedisServer().start()
    try:
        client_url = server.url

        async def go() -> list[tuple[float, bool]]:
            from redis.asyncio import Redis

            clients = [Redis.from_url(client_url), Redis.from_url(client_url)]
            throttles = [FailureThrottle(3, 20.0, redis=lambda c=c: c, namespace="t:",  # type: ignore[misc]
                                         redis_timeout_s=BUSY_HOST_REDIS_TIMEOUT_S) for c in clients]
            out = []
            for i in range(6):
                v = await throttles[i % 2].on_failure("198.51.100.7")
                out.append((v.retry_after_s, v.started))
            other = await throttles[0].on_failure("198.51.100.8")
            out.append((other.retry_after_s, other.started))
            for c in clients:
                await c.aclose()
            return out

        out = asyncio.run(go())
    finally:
        server.stop()
    assert out[:3] == [(0.0, False)] * 3
    assert out[3] == (20.0, True) and out[4][0] > 0 and not out[4][1] and not out[5][1]
    assert out[6] == (0.0, False)


def test_a_cached_valid_key_costs_no_extra_redis_round_trip() -> None:
    server = RedisServer().start()
    try:
        store = KeyStore(sync_client(server.url))
        secret, _ = store.add("alice")

        def calls(name: str) -> int:
            stats = store.client.info("commandstats")
            return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))

        async def go() -> list[int]:
            admission = Admission(GatewayConfig(redis_url=server.url, redis_timeout_s=BUSY_HOST_REDIS_TIMEOUT_S), "g")
            await admission.check_now()  # the watcher's refresh: keys on, alice cached
            exists = calls("exists")
            await admission.authenticate(f"Bearer {secret}", checked_later=True)
            after_generation = calls("exists") - exists
            try:
                await admission.authenticate(None, checked_later=True)
            except Exception as exc:  # noqa: BLE001 - the status is what matters
                missing = getattr(exc, "status", 0)
            after_missing = calls("exists") - exists
            await admission.authenticate(f"Bearer {secret}")  # /v1/models: asks Redis now
            after_models = calls("exists") - exists
            await admission.close()
            return [after_generation, missing, after_missing, after_models]

        result = asyncio.run(go())
        store.client.close()
    finally:
        server.stop()
    assert result == [0, 401, 0, 2]


@pytest.mark.parametrize(("field", "value", "ok"), [
    ("auth_failure_limit", 0, True), ("auth_failure_limit", -1, False),
    ("auth_failure_block_s", 0.5, True), ("auth_failure_block_s", 0.0, False),
    ("forwarded_allow_ips", "*", True), ("forwarded_allow_ips", "10.0.0.0/8, ::1", True),
    ("forwarded_allow_ips", "proxy.local", False),
])
def test_the_knobs_are_checked(field: str, value: Any, ok: bool) -> None:
    errors = config_errors(GatewayConfig(**{field: value}))
    assert (errors == []) is ok, errors


def test_a_blocked_address_gets_its_429_without_sending_the_body(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    g = Gateway(tmp_path, monkeypatch, api_key=KEY, auth_failure_limit=1)
    with g.server, httpx.Client(base_url=g.server.url, timeout=20) as http:
        headers = {"content-type": "application/json"}
        statuses = [http.post("/v1/chat/completions", content=chat_body(MAX_BODY), headers=headers).status_code
                    for _ in range(3)]
    assert statuses == [401, 429, 429] and g.spies.calls == {}


def test_a_closing_connection_still_reads_its_401(gw: tuple[Gateway, httpx.Client]) -> None:
    """Connection: close: the refused body is drained first, so the client is not reset mid-send."""
    g, http = gw
    resp = http.post("/v1/chat/completions", content=chat_body(MAX_BODY),
                     headers={"content-type": "application/json", "connection": "close"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert g.spies.calls == {}
