"""The tensor-parallel ranks of an in-process engine: rank 0 here, ranks 1..N-1 as child processes.

The offline engine (``offline.LLM``) runs its model runner in its own process;
with ``tensor_parallel_size`` N it starts N-1 more processes (spawned, so no
torch state is forked), each a ``ModelRunner`` of its rank that joins the same
``torch.distributed`` group (a rendezvous file in a private temp folder) and
then runs every plan it is sent, in order. Only rank 0's results are read, as
the scheduler service does; the KV block count is the smallest any rank has.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from shared.config import WorkerConfig
from shared.messages import StepPlan, encode, to_worker_decoder

READY_TIMEOUT_S = 600.0


def _rank_main(config: WorkerConfig, conn: Connection) -> None:
    from services.worker.runner import ModelRunner, set_num_threads
    from shared.heap import keep_freed_memory

    try:
        set_num_threads(config.num_threads)
        runner = ModelRunner(config)
        keep_freed_memory()  # step buffers reused without page faults (shared/heap.py)
        conn.send(("ready", runner.num_kv_blocks, runner.max_model_len))
        while True:
            data = conn.recv_bytes()
            if not data:
                return
            plan = to_worker_decoder.decode(data)
            assert isinstance(plan, StepPlan)
            runner.execute(plan)
    except (EOFError, KeyboardInterrupt):
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then this rank ends
        try:
            conn.send(("error", f"rank {config.rank}: {exc!r}", 0))
        except OSError:
            pass
        raise


class HelperRanks:
    """Ranks 1..N-1 of one tensor-parallel engine, each in its own process."""

    def __init__(self, config: WorkerConfig) -> None:
        self.size = config.tensor_parallel_size
        self.folder = tempfile.mkdtemp(prefix="ferry-tp-")
        self.init_method = f"file://{os.path.join(self.folder, 'rendezvous')}"
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        # every rank is on this host: gloo's pairs over loopback (not whatever the hostname resolves to)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ctx = mp.get_context("spawn")
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            cfg = msgspec.structs.replace(config, rank=rank, tp_init_method=self.init_method)
            proc = ctx.Process(target=_rank_main, args=(cfg, child), name=f"ferry-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def rank0_config(self, config: WorkerConfig) -> WorkerConfig:
        return msgspec.structs.replace(config, rank=0, tp_init_method=self.init_method)

    def wait_ready(self) -> list[tuple[int, int]]:
        """(num_kv_blocks, max_model_len) of each helper rank, once all have loaded."""
        out = []
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(READY_TIMEOUT_S):
                raise RuntimeError(f"tensor-parallel rank {rank} did not start")
            kind, a, b = conn.recv()
            if kind != "ready":
                raise RuntimeError(str(a))
            out.append((int(a), int(b)))
        return out

    def send(self, plan: StepPlan) -> None:
        data = encode(plan)
        for rank, conn in enumerate(self.conns, start=1):
            if conn.poll():  # a rank that failed said so before its collectives broke
                kind, message, _ = conn.recv()
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {message}")
            conn.send_bytes(data)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.folder, ignore_errors=True)
