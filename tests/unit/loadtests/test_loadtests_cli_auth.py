"""``ferry bench`` against a server that wants a key: it stops at once and says so; /v1 URLs work."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from loadtests.cli import base_url, main


class Handler(BaseHTTPRequestHandler):
    """/v1/models answers (or not, per ``open_models``); every POST is a 401 unless the key is right."""

    open_models = True
    seen: list[tuple[str, str, str]] = []

    def _send(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self) -> None:
        self._send(401, {"error": {"message": "Missing API key", "type": "invalid_request_error",
                                   "code": "invalid_api_key"}})

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.seen.append(("GET", self.path, self.headers.get("authorization", "")))
        if self.path == "/v1/models" and not self.open_models:
            return self._refuse()
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
        return self._send(404, {"error": {"message": "no"}})

    def do_POST(self) -> None:  # noqa: N802
        self.seen.append(("POST", self.path, self.headers.get("authorization", "")))
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self._refuse()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[str]:
    Handler.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_base_url_accepts_the_url_ferry_serve_prints() -> None:
    assert base_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000"
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert base_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


def bench(url: str, tmp_path: Path, *extra: str) -> list[str]:
    return ["run", "--base-url", url, "--scenario", "smoke", "--arrival", "poisson", "--rates", "20",
            "--duration", "2", "--no-server-metrics", "--quiet", "--out", str(tmp_path / "out"), *extra]


def test_stops_at_the_first_auth_refusal_of_a_generation_request(
        server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    Handler.open_models = True
    assert main(bench(server + "/v1", tmp_path, "--warmup", "0")) == 2
    err = capsys.readouterr().err
    assert "refused the request for authentication (HTTP 401: Missing API key)" in err
    assert "the key given was not accepted" in err
    posts = [s for s in Handler.seen if s[0] == "POST"]
    assert posts and all(s[2] == "Bearer sk-from-env" for s in posts)  # the environment's key was sent
    assert len(posts) < 10, "it should stop at once, not send the whole run"
    assert all(not s[1].startswith("/v1/v1") for s in Handler.seen)


def test_a_refused_model_listing_stops_before_any_load(
        server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    Handler.open_models = False
    assert main(bench(server, tmp_path)) == 2
    assert "pass --api-key KEY or set OPENAI_API_KEY" in capsys.readouterr().err
    assert not [s for s in Handler.seen if s[0] == "POST"]
