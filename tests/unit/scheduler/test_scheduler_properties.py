"""Property tests: random workloads keep every invariant and lose nothing.

Random arrivals, prompt lengths (from a tiny alphabet, so prefixes are shared
and the prefix cache hits), output lengths, EOS, priorities, aborts, clock jumps
(queue timeouts), worker restarts, budgets and KV sizes. After every step the
scheduler's invariant check runs and the fake worker verifies every KV slot it
reads. At the end every request finished, was aborted, was rejected or expired,
with exactly the tokens it would have produced alone, and every block is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.scheduler import Scheduler
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, expected_tokens, make_request, small_config


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int
    eos_at: int  # index into the reference output that is EOS, or -1
    abort_after: int  # abort this many steps after arrival, or -1


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 12),
    prompt=st.lists(st.integers(1, 3), min_size=1, max_size=24).map(tuple),
    max_tokens=st.integers(1, 12),
    priority=st.integers(0, 2),
    eos_at=st.one_of(st.just(-1), st.integers(0, 11)),
    abort_after=st.one_of(st.just(-1), st.just(-1), st.integers(0, 8)),
)

configs = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4]),
        "max_num_batched_tokens": st.integers(1, 40),
        "max_num_seqs": st.integers(1, 6),
        "long_prefill_token_threshold": st.sampled_from([0, 0, 3, 7]),
        "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
        "enable_chunked_prefill": st.sampled_from([True, True, False]),
        "enable_prefix_caching": st.sampled_from([True, True, False]),
        "max_waiting_requests": st.integers(1, 20),
        "queue_timeout_s": st.sampled_from([0.0, 0.0, 4.0]),
    }
)


def reference(rid: str, a: Arrival) -> tuple[list[int], list[int]]:
    """(the tokens it produces alone, its EOS list)."""
    plain = expected_tokens(rid, len(a.prompt), a.max_tokens)
    if a.eos_at < 0 or a.eos_at >= len(plain):
        return plain, []
    eos = [plain[a.eos_at]]
    return expected_tokens(rid, len(a.prompt), a.max_tokens, stop_ids=frozenset(eos)), eos


def run_scenario(
    cfg: dict[str, object], num_blocks: int, workload: list[Arrival], restarts: list[int], clock_jumps: list[int]
) -> tuple[Driver, dict[str, Arrival], dict[str, list[int]]]:
    config = small_config(**cfg)
    clock = FakeClock()
    sched = Scheduler(config, num_blocks, 64, clock=clock)
    drv = Driver(sched, FakeWorker(config.block_size, num_blocks))
    accepted: dict[str, Arrival] = {}
    want: dict[str, list[int]] = {}
    aborts: dict[int, list[str]] = {}
    for step in range(max(a.step for a in workload) + 10):
        for i, a in enumerate(workload):
            if a.step != step:
                continue
            rid = f"r{i}"
            tokens, eos = reference(rid, a)
            if sched.add_request(make_request(rid, list(a.prompt), a.max_tokens, priority=a.priority, eos=eos)) is None:
                accepted[rid], want[rid] = a, tokens
                if a.abort_after >= 0:
                    aborts.setdefault(step + a.abort_after, []).append(rid)
        sched.abort_requests(aborts.pop(step, []))
        if step in restarts:
            sched.preempt_all()
            drv.worker.restart()
            sched.check_invariants()
        if step in clock_jumps:
            clock.advance(3.0)
        drv.step()
    drv.run(max_steps=5000)
    return drv, accepted, want


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs,
    num_blocks=st.integers(4, 40),
    workload=st.lists(arrivals, min_size=1, max_size=10),
    restarts=st.lists(st.integers(0, 20), max_size=2),
    clock_jumps=st.lists(st.integers(0, 20), max_size=3),
)
def test_random_workloads_lose_nothing(
    cfg: dict[str, object], num_blocks: int, workload: list[Arrival], restarts: list[int], clock_jumps: list[int]
) -> None:
    drv, accepted, want = run_scenario(cfg, num_blocks, workload, restarts, clock_jumps)
    sched = drv.sched
    assert set(drv.outcomes) == set(accepted), "an accepted request never ended (or a rejected one ran)"
    for rid, out in drv.outcomes.items():
        assert out.finish_reason in ("length", "stop", "abort", "timeout"), (rid, out.finish_reason)
        if out.finish_reason in ("length", "stop"):
            assert out.token_ids == want[rid], f"{rid} produced different tokens"
        else:
            assert out.token_ids == want[rid][: len(out.token_ids)]
        if out.finish_reason == "timeout":
            assert out.token_ids == []
    assert not sched.has_unfinished_requests()
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert sched.ledger.num_free_blocks == num_blocks and not sched.ledger.block_tables
    sched.check_invariants()
    stats = sched.stats()
    assert sum(stats.finished_total.values()) == len(accepted)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs,
    num_blocks=st.integers(4, 40),
    workload=st.lists(arrivals, min_size=2, max_size=8),
)
def test_fcfs_never_lets_a_later_request_finish_its_prefill_first(
    cfg: dict[str, object], num_blocks: int, workload: list[Arrival]
) -> None:
    # FCFS, no per-request chunk cap (with a cap a short later prompt may legitimately
    # finish first), no aborts or timeouts (they remove requests from the comparison).
    cfg = {**cfg, "scheduling_policy": "fcfs", "long_prefill_token_threshold": 0, "queue_timeout_s": 0.0}
    workload = [Arrival(a.step, a.prompt, a.max_tokens, a.priority, a.eos_at, -1) for a in workload]
    drv, accepted, _ = run_scenario(cfg, num_blocks, workload, [], [])
    first_token_step = drv.first_token_step
    order = sorted(accepted, key=lambda rid: (accepted[rid].step, int(rid[1:])))
    for earlier, later in zip(order, order[1:], strict=False):
        assert first_token_step[earlier] <= first_token_step[later], (
            f"{later} finished its prefill at step {first_token_step[later]}, "
            f"before {earlier} (step {first_token_step[earlier]})"
        )
