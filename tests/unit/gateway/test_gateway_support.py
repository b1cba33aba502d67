"""Test support for the gateway (no tests here): a tiny tokenizer, a fake scheduler, a live server.

- ``build_tiny_tokenizer(folder)``: a byte-level BPE trained in milliseconds on a
  small corpus with accents, CJK and emoji (so tokens split UTF-8 characters),
  with a ChatML template, in the folder layout the gateway loads.
- ``FakeScheduler``: benchmarks/serving/fake_scheduler.py's stand-in scheduler (a
  real zmq ROUTER in a thread, deterministic tokens, records every message, can
  refuse, hold, fail, go silent or die on demand).
- ``GatewayServer``: the real gateway app under uvicorn on a free port, in a thread.
- ``GatewayEnv`` / ``running_env(tmp)``: that server on the tiny tokenizer with an
  HTTP client and a fake scheduler to start and stop, for module-scoped fixtures.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from benchmarks.serving.fake_scheduler import FakeScheduler as _FakeScheduler
from services.gateway.api.app import build_app
from services.gateway.text.tokenizer import GatewayTokenizer
from shared.config import GatewayConfig

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Héllo wörld! Ça va? Ünïcödé text with accents: é è ê ë à ç.",
    "日本語のテキスト、中文文本，한국어 텍스트.",
    "Emoji 🎉🚀👍🏽 and symbols ∑ ∞ ≠ → ✓.",
    "stop here. STOP there!! end\n\nnew paragraph\n\n",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MAX_MODEL_LEN = 256
SCRIPT_TEXT = "Hello world, the quick brown fox! 日本語 🎉 end.\n\nMore text follows here."


def build_tiny_tokenizer(folder: Path, max_position_embeddings: int = MAX_MODEL_LEN) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE}))
    (folder / "config.json").write_text(json.dumps({
        "vocab_size": tok.get_vocab_size(), "max_position_embeddings": max_position_embeddings,
        "eos_token_id": 2, "bos_token_id": 1}))
    return folder


class FakeScheduler(_FakeScheduler):
    """The fake with this module's max_model_len, which the tiny tokenizer's tests assume."""

    def __init__(self, endpoint: str, script: list[int], eos_id: int = 2, tick_s: float = 0.01) -> None:
        super().__init__(endpoint, script, eos_id, tick_s, max_model_len=MAX_MODEL_LEN)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class GatewayServer:
    """Run an ASGI app under uvicorn in a thread, on a free loopback port."""

    def __init__(self, app: Any) -> None:
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", proxy_headers=False,
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> GatewayServer:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "uvicorn did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def wait_until(cond: Callable[[], Any], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}")


class GatewayEnv:
    """The gateway app on a tiny tokenizer, live over HTTP, and the ipc endpoint its fake scheduler binds."""

    def __init__(self, tmp: Path) -> None:
        folder = build_tiny_tokenizer(tmp / "tok")
        self.tok = GatewayTokenizer(folder)
        self.endpoint = f"ipc://{tmp}/gateway.sock"
        self.script = self.tok.encode(SCRIPT_TEXT, add_special_tokens=False)
        cfg = GatewayConfig(model=str(folder), served_model_name="tiny", scheduler_endpoint=self.endpoint,
                            heartbeat_interval_s=0.2, scheduler_timeout_s=2.0, resume_timeout_s=3.0)
        self.app = build_app(cfg, self.tok)
        self.server = GatewayServer(self.app)
        self.http = httpx.Client(base_url=self.server.url, timeout=10)
        self.fake: FakeScheduler | None = None

    def start_fake(self) -> FakeScheduler:
        self.fake = FakeScheduler(self.endpoint, self.script)
        wait_until(lambda: self.http.get("/ready").status_code == 200, 5, "gateway ready")
        return self.fake

    def stop_fake(self) -> None:
        if self.fake is not None:
            self.fake.close()
            self.fake = None

    def text_of(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)


def running_env(tmp: Path) -> Iterator[GatewayEnv]:
    """A module fixture's body: the gateway served for the module, torn down after it."""
    env = GatewayEnv(tmp)
    with env.server:
        yield env
        env.stop_fake()
    env.http.close()
