"""What the scheduler service tells gateways about the engine: ``EngineHealth`` (is it
ready, which ranks are up) and ``EngineStats`` (the core's counters plus what only the
service knows: worker restarts, per-process memory, ranks up).
"""

from __future__ import annotations

import resource
import time
import uuid

import msgspec
import psutil

from services.scheduler.ranks import RankTable
from shared.messages import EngineHealth, EngineStats

# This process's identity in every EngineHealth (see EngineHealth.incarnation): fixed at
# import, so it changes exactly when a new scheduler process starts.
INCARNATION = uuid.uuid4().hex[:12]


def engine_health(
    ranks: RankTable, *, ready: bool, stopping: bool, model: str, max_model_len: int, block_size: int,
    config: dict[str, int | float | bool | str] | None = None,
) -> EngineHealth:
    missing = ranks.missing_ranks()
    if stopping:
        detail = "shutting down"
    elif missing:
        detail = f"waiting for WorkerReady from rank(s) {missing}"
    else:
        detail = "ready"
    return EngineHealth(
        time=time.time(),
        scheduler_ready=ready and not stopping,
        num_workers=len(ranks),
        workers_ready=ranks.ready_ranks(),
        model=model,
        max_model_len=max_model_len,
        block_size=block_size,
        detail=detail,
        workers=ranks.infos(),
        config=config or {},
        incarnation=INCARNATION,
    )


def engine_stats(
    core_stats: EngineStats,
    ranks: RankTable,
    process: psutil.Process,
    worker_restarts_total: int,
    config_strings: dict[str, str],
) -> EngineStats:
    worker_rss, worker_peak, device = ranks.memory()
    rss = {"scheduler": process.memory_info().rss, **worker_rss}
    # ru_maxrss is in KiB on Linux.
    peak = {"scheduler": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **worker_peak}
    return msgspec.structs.replace(
        core_stats,
        time=time.time(),
        worker_restarts_total=worker_restarts_total,
        process_rss_bytes={**core_stats.process_rss_bytes, **rss},
        process_peak_rss_bytes={**core_stats.process_peak_rss_bytes, **peak},
        device_memory_peak_bytes={**core_stats.device_memory_peak_bytes, **device},
        workers_ready=ranks.ready_ranks(),
        config={**config_strings, **core_stats.config},
    )
