"""The operator's pages behind an admin key on a public bind (services/gateway/admission/ops_auth.py).

The app is built as for ``--host 0.0.0.0`` (served on loopback here: the decision
follows the configured host) with an ``--admin-key``, a static ``--api-key`` and a
Redis holding one ``ferry keys add --admin`` key and one ordinary key. Each page is
tried without a key (401 + WWW-Authenticate), with a non-admin key (403), and with
each kind of admin credential (Bearer and Basic); the API itself is unaffected. A
loopback bind leaves every page open.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.gateway.admission.keystore import KeyStore, sync_client
from services.gateway.admission.ops_auth import is_ops_path, presented_key
from services.gateway.api.app import build_app
from services.gateway.text.tokenizer import GatewayTokenizer
from shared.config import GatewayConfig
from tests.redis_server import RedisServer
from tests.unit.gateway.test_gateway_support import GatewayServer, build_tiny_tokenizer

ADMIN = "admin-sekrit"
USER = "user-key"
PAGES = ["/metrics", "/v1/config", "/dashboard", "/dashboard/static/dashboard.js", "/dashboard/data",
         "/dashboard/events"]


@pytest.fixture(scope="module")
def redis_keys() -> Iterator[tuple[str, str, str]]:
    srv = RedisServer().start()
    client = sync_client(srv.url)
    store = KeyStore(client)
    ops, _ = store.add("ops", admin=True)
    plain, _ = store.add("plain")
    client.close()
    yield srv.url, ops, plain
    srv.stop()


def serve(tmp: Path, **cfg: object) -> Iterator[httpx.Client]:
    folder = build_tiny_tokenizer(tmp / "tok")
    config = GatewayConfig(model=str(folder), served_model_name="tiny", scheduler_endpoint=f"ipc://{tmp}/gw.sock",
                           **cfg)  # type: ignore[arg-type]
    server = GatewayServer(build_app(config, GatewayTokenizer(folder)))
    with server, httpx.Client(base_url=server.url, timeout=10) as http:
        yield http


@pytest.fixture(scope="module")
def public(tmp_path_factory: pytest.TempPathFactory, redis_keys: tuple[str, str, str]) -> Iterator[httpx.Client]:
    yield from serve(tmp_path_factory.mktemp("public"), host="0.0.0.0", admin_key=ADMIN, api_key=USER,
                     redis_url=redis_keys[0])


def get(http: httpx.Client, path: str, **headers: str) -> int:
    if path == "/dashboard/events":  # an endless stream: the status line is the answer
        with http.stream("GET", path, headers=headers) as resp:
            return resp.status_code
    return http.get(path, headers=headers).status_code


def basic(key: str) -> str:
    return "Basic " + base64.b64encode(f"anyone:{key}".encode()).decode()


@pytest.mark.parametrize("path", PAGES)
def test_each_page_needs_an_admin_key_on_a_public_bind(public: httpx.Client, redis_keys: tuple[str, str, str],
                                                       path: str) -> None:
    _, ops, plain = redis_keys
    resp = public.get(path) if path != "/dashboard/events" else None
    assert get(public, path) == 401
    if resp is not None:
        assert "Basic" in resp.headers["www-authenticate"] and resp.json()["error"]["code"] == "missing_admin_key"
    assert get(public, path, authorization=f"Bearer {USER}") == 403  # the static API key is not an admin key
    assert get(public, path, authorization=f"Bearer {plain}") == 403  # nor is an ordinary ferry key
    assert get(public, path, authorization="Bearer wrong") == 403
    assert get(public, path, authorization=f"Bearer {ADMIN}") == 200
    assert get(public, path, authorization=basic(ADMIN)) == 200  # what a browser sends after its prompt
    assert get(public, path, authorization=f"Bearer {ops}") == 200  # ferry keys add ops --admin


def test_the_api_and_health_are_not_ops_pages(public: httpx.Client) -> None:
    assert public.get("/health").status_code == 200
    assert public.get("/v1/models", headers={"authorization": f"Bearer {USER}"}).status_code == 200
    cfg = public.get("/v1/config", headers={"authorization": f"Bearer {ADMIN}"}).json()
    assert cfg["gateway"]["admin_key"] == "<set>" and ADMIN not in str(cfg)


@pytest.fixture(scope="module")
def loopback(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    yield from serve(tmp_path_factory.mktemp("loop"), host="127.0.0.1", admin_key=ADMIN)


@pytest.mark.parametrize("path", PAGES)
def test_each_page_stays_open_on_loopback(loopback: httpx.Client, path: str) -> None:
    assert get(loopback, path) == 200


def test_explicitly_unauthenticated_public_bind_leaves_them_open(tmp_path: Path) -> None:
    for http in serve(tmp_path, host="0.0.0.0", allow_unauthenticated_public=True):
        assert all(get(http, p) == 200 for p in PAGES)


def test_credentials_parsing() -> None:
    assert presented_key("Bearer abc") == "abc" and presented_key("bearer  abc ") == "abc"
    assert presented_key(basic("k")) == "k" and presented_key("Basic " + base64.b64encode(b"u:").decode()) is None
    assert presented_key("Basic !!!") is None and presented_key("Token abc") is None and presented_key(None) is None
    assert is_ops_path("/dashboard") and is_ops_path("/dashboard/events") and not is_ops_path("/dashboards")
    assert is_ops_path("/metrics") and not is_ops_path("/metrics2") and not is_ops_path("/v1/completions")
