"""``python -m services.worker`` as a real process on real ZeroMQ sockets (tiny model).

The test plays the scheduler: it binds the PUB for plans and the PULL for
results on private ipc paths, then checks the start-up handshake, heartbeats,
a step, a clean Shutdown, and that a bad step or a bad model is fatal with a
``WorkerError``. About 10 s (three worker start-ups).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shared.capacity import num_kv_blocks, resolve_dtype
from shared.messages import (
    CachedRequestData,
    FromWorker,
    NewRequestData,
    SamplingParams,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerHeartbeat,
    WorkerReady,
    encode,
    from_worker_decoder,
)
from tests.conftest import cached_tiny_model

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 3_000_017


class FakeScheduler:
    def __init__(self, model: str, *extra: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="ferry-worker-test-")
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"ipc://{self.dir}/plan")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{self.dir}/result")
        self.log = open(Path(self.dir) / "worker.log", "w+b")  # noqa: SIM115 - closed in close()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.worker", "--model", model, "--num-threads", "1",
             "--kv-cache-memory", str(BUDGET), "--block-size", "8", "--rank", "0",
             "--plan-endpoint", f"ipc://{self.dir}/plan", "--result-endpoint", f"ipc://{self.dir}/result", *extra],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def recv(self, kind: type, timeout_s: float = 60.0) -> FromWorker:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.pull.poll(200):
                msg = from_worker_decoder.decode(self.pull.recv())
                if isinstance(msg, kind):
                    return msg
                if isinstance(msg, WorkerError) and kind is not WorkerError:
                    raise AssertionError(f"worker error: {msg.message}")
        self.log.seek(0)
        raise AssertionError(f"no {kind.__name__} within {timeout_s}s; log:\n{self.log.read().decode()[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.pub.close()
        self.pull.close()
        self.ctx.term()
        self.log.close()


@pytest.fixture
def tiny() -> Iterator[tuple[FakeScheduler, Path]]:
    folder = cached_tiny_model("llama")
    sched = FakeScheduler(str(folder))
    try:
        yield sched, folder
    finally:
        sched.close()


def test_handshake_heartbeat_step_and_shutdown(tiny: tuple[FakeScheduler, Path]) -> None:
    sched, folder = tiny
    ready = sched.recv(WorkerReady)
    assert isinstance(ready, WorkerReady)
    config = json.loads((folder / "config.json").read_text())
    # --dtype auto: the KV cache is in the dtype the shared rule picks for this CPU.
    assert ready.num_kv_blocks == num_kv_blocks(BUDGET, config, resolve_dtype("auto", "cpu"), 8) > 0
    assert ready.block_size == 8 and ready.pid == sched.proc.pid
    assert ready.vocab_size == config["vocab_size"] and ready.max_model_len == config["max_position_embeddings"]
    assert 0 < ready.kv_cache_bytes <= BUDGET and ready.weight_bytes > 0
    beat = sched.recv(WorkerHeartbeat, timeout_s=5)
    assert isinstance(beat, WorkerHeartbeat) and beat.rss_bytes > 0 and beat.peak_rss_bytes >= beat.rss_bytes // 2
    new = NewRequestData(req_id="a", prompt_token_ids=[5, 6, 7, 8, 9], sampling=SamplingParams(temperature=0.0),
                         block_ids=[2], num_computed_tokens=0)
    sched.pub.send(encode(StepPlan(step_id=1, new_requests=[new], num_scheduled_tokens={"a": 5})))
    first = sched.recv(StepResult)
    assert isinstance(first, StepResult) and first.step_id == 1 and first.req_ids == ["a"]
    sched.pub.send(encode(StepPlan(step_id=2, cached_requests=[CachedRequestData("a", [], 5)],
                                   num_scheduled_tokens={"a": 1})))
    second = sched.recv(StepResult)
    assert isinstance(second, StepResult) and second.step_id == 2 and len(second.sampled_token_ids) == 1
    # a retirement aimed at this rank's previous process (another pid) is not for this one
    sched.pub.send(encode(Shutdown(reason="old process", rank=0, pid=sched.proc.pid + 100_000)))
    sched.pub.send(encode(StepPlan(step_id=3, cached_requests=[CachedRequestData("a", [], 6)],
                                   num_scheduled_tokens={"a": 1})))
    third = sched.recv(StepResult)
    assert isinstance(third, StepResult) and third.step_id == 3 and sched.proc.poll() is None
    assert ready.tensor_parallel_size == 1
    sched.pub.send(encode(Shutdown(reason="test", rank=0, pid=sched.proc.pid)))
    assert sched.proc.wait(20) == 0


def test_a_failing_step_is_fatal_and_reported(tiny: tuple[FakeScheduler, Path]) -> None:
    sched, _ = tiny
    sched.recv(WorkerReady)
    sched.pub.send(encode(StepPlan(step_id=7, cached_requests=[CachedRequestData("ghost", [], 0)],
                                   num_scheduled_tokens={"ghost": 1})))
    err = sched.recv(WorkerError)
    assert isinstance(err, WorkerError) and err.fatal and err.step_id == 7 and "ghost" in err.message
    assert sched.proc.wait(20) != 0


def test_an_unknown_model_fails_at_start_up_with_a_clear_message() -> None:
    sched = FakeScheduler("no-such-model-anywhere")
    try:
        err = sched.recv(WorkerError)
        assert isinstance(err, WorkerError) and err.fatal
        assert "no-such-model-anywhere" in err.message and "never downloads" in err.message
        assert sched.proc.wait(20) == 1
    finally:
        sched.close()
