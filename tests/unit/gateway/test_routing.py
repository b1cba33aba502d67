"""The router as a pure function over engine states: affinity, the load bound, stability."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.gateway.engines.routing import (
    EngineLoad,
    RoutingPolicy,
    load_bound,
    prefix_key,
    ring_walk,
    route,
)

POLICY = RoutingPolicy(policy="prefix", prefix_blocks=2, block_size=4, load_factor=1.25, slack=2)


def engines(*loads: int, ready: bool = True) -> list[EngineLoad]:
    return [EngineLoad(name=f"e{i}", ready=ready, num_running=load) for i, load in enumerate(loads)]


def test_prefix_key_covers_only_the_first_blocks() -> None:
    shared = list(range(8))  # two blocks of four
    assert prefix_key(shared + [100, 101], 2, 4) == prefix_key(shared + [7, 7, 7], 2, 4)
    assert prefix_key(shared, 2, 4) != prefix_key([0, 1, 2, 3, 4, 5, 6, 9], 2, 4)
    # shorter than the window: the whole prompt is the key
    assert prefix_key([1, 2, 3], 2, 4) != prefix_key([1, 2, 4], 2, 4)


def test_prefix_key_is_the_same_in_another_process() -> None:
    import subprocess
    import sys

    code = "from services.gateway.engines.routing import prefix_key; print(prefix_key(list(range(40)), 4, 16))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(other.stdout) == prefix_key(list(range(40)), 4, 16)


def test_same_prefix_same_engine_when_loads_are_even() -> None:
    state = engines(3, 3, 3)
    key = prefix_key(list(range(8)) + [42], 2, 4)
    first = route(key, state, POLICY)[0]
    for tail in range(50):
        assert route(prefix_key(list(range(8)) + [tail], 2, 4), state, POLICY)[0] == first


def test_distinct_prefixes_spread_over_all_engines() -> None:
    state = engines(0, 0, 0, 0)
    rng = random.Random(0)
    picks = Counter(route(prefix_key([rng.randrange(50_000) for _ in range(8)], 2, 4), state, POLICY)[0]
                    for _ in range(4000))
    assert set(picks) == {"e0", "e1", "e2", "e3"}
    assert max(picks.values()) < 1.35 * 1000, picks  # 64 ring points each: within about a third of even


def test_the_load_bound_spills_a_hot_prefix_to_the_next_engine_on_the_ring() -> None:
    key = prefix_key(list(range(8)), 2, 4)
    walk = ring_walk(key, ["e0", "e1", "e2"])
    hot, runner_up = walk[0], walk[1]
    loads = {"e0": 0, "e1": 0, "e2": 0}
    loads[hot] = 10
    state = [EngineLoad(name=n, ready=True, num_running=v) for n, v in sorted(loads.items())]
    # total 10 (+1) over 3 engines: bound = ceil(1.25 * 11 / 3) + 2 = 7; the hot engine is at 10
    assert load_bound(state, 1.25, 2) == 7
    order = route(key, state, POLICY)
    assert order[0] == runner_up
    assert order[-1] == hot  # still tried last, should everything else refuse at once


def test_the_bound_holds_under_any_sequence_of_one_hot_prefix() -> None:
    """Route 300 requests of one prefix one by one, nothing finishing: the max stays within the bound."""
    loads = {"e0": 0, "e1": 0, "e2": 0}
    key = prefix_key(list(range(8)), 2, 4)
    for _ in range(300):
        state = [EngineLoad(name=n, ready=True, num_running=v) for n, v in loads.items()]
        bound = load_bound(state, POLICY.load_factor, POLICY.slack)
        choice = route(key, state, POLICY)[0]
        loads[choice] += 1
        assert loads[choice] <= bound
    mean = sum(loads.values()) / 3
    assert max(loads.values()) <= 1.25 * mean + POLICY.slack + 1


def test_pending_requests_count_as_load() -> None:
    key = prefix_key(list(range(8)), 2, 4)
    hot = ring_walk(key, ["e0", "e1"])[0]
    state = [EngineLoad(name=n, ready=True, num_pending=20 if n == hot else 0) for n in ("e0", "e1")]
    assert route(key, state, POLICY)[0] != hot


def test_engines_that_are_not_ready_are_never_chosen() -> None:
    state = [EngineLoad("e0", ready=False), EngineLoad("e1", ready=True, num_running=100)]
    assert route(123, state, POLICY) == ["e1"]
    assert route(123, engines(0, 0, ready=False), POLICY) == []


def test_removing_an_engine_moves_only_its_own_keys() -> None:
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(3000)]
    before = {k: ring_walk(k, ["e0", "e1", "e2", "e3"])[0] for k in keys}
    after = {k: ring_walk(k, ["e0", "e1", "e3"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "e2" for k in moved)
    assert 0.15 < len(moved) / len(keys) < 0.35  # about a quarter


def test_round_robin_and_least_loaded() -> None:
    rr = RoutingPolicy(policy="round_robin")
    assert [route(0, engines(5, 0, 9), rr, counter=c)[0] for c in range(4)] == ["e0", "e1", "e2", "e0"]
    ll = RoutingPolicy(policy="least_loaded")
    assert route(0, engines(5, 0, 9), ll) == ["e1", "e0", "e2"]


@pytest.mark.parametrize("kwargs", [{"policy": "random"}, {"prefix_blocks": 0}, {"load_factor": 0.5},
                                    {"slack": -1}])
def test_bad_policies_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RoutingPolicy(**kwargs)  # type: ignore[arg-type]


def test_the_gateway_refuses_a_bad_routing_knob_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    from services.gateway.__main__ import main

    assert main(["--routing-load-factor", "0.9"]) == 2
    assert "load factor must be >= 1" in capsys.readouterr().err
