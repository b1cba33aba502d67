"""Which engine replica serves a request: prefix affinity balanced against load.

A pure function over the engines' states, so every gateway that sees the same
states picks the same engine, and the policy is tested without sockets.

The algorithm (``prefix`` policy) is consistent hashing with bounded loads
(Mirrokni, Thorup, Zadimoghaddam, 2018):

1. The request's **key** is a hash of the first ``prefix_blocks`` KV blocks of
   its prompt (``prefix_blocks * block_size`` tokens; the whole prompt when it is
   shorter). Requests that share those blocks share the key. The hash is
   blake2b, not Python's ``hash`` (salted per process), so all gateways agree.
2. Each ready engine owns ``VNODES`` points on a hash ring (from its name, so
   adding or removing an engine moves only about 1/N of the keys). The engines
   are visited clockwise from the key's point.
3. An engine's **load** is its running + waiting requests from its latest
   ``EngineStats``, plus what this gateway sent it since. The first engine on
   the walk whose load after taking this request stays within the bound
   ``ceil(load_factor * (total + 1) / n) + slack`` takes it. So the busiest
   engine carries at most ``load_factor`` times the mean load plus ``slack``
   requests; a shared prefix stays on the engine that caches it until that
   engine is that far ahead, then spills to the next engine on the ring (which
   then builds the same prefix: the hot prefix is cached on two engines).

``round_robin`` and ``least_loaded`` exist to measure against (docs/benchmarks.md, "Data parallel and
an engine killed under load").
"""

from __future__ import annotations

import bisect
import hashlib
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from shared.config import GatewayConfig

POLICIES = ("prefix", "least_loaded", "round_robin")
VNODES = 64  # ring points per engine: the spread of keys is even to a few percent


@dataclass(frozen=True)
class EngineLoad:
    """What the router knows of one engine."""

    name: str
    ready: bool
    num_running: int = 0
    num_waiting: int = 0
    num_pending: int = 0  # sent by this gateway since the engine's latest stats

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting + self.num_pending


@dataclass(frozen=True)
class RoutingPolicy:
    policy: str = "prefix"
    prefix_blocks: int = 4
    block_size: int = 16
    load_factor: float = 1.25
    slack: int = 8

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.prefix_blocks < 1 or self.block_size < 1:
            raise ValueError("routing prefix blocks and block size must be at least 1")
        if self.load_factor < 1.0 or self.slack < 0:
            raise ValueError("the routing load factor must be >= 1 and the slack >= 0")


def policy_from_config(config: GatewayConfig) -> RoutingPolicy:
    """The gateway's routing knobs as a policy; ValueError names the bad one."""
    return RoutingPolicy(policy=config.routing_policy, prefix_blocks=config.routing_prefix_blocks,
                         load_factor=config.routing_load_factor, slack=config.routing_load_slack)


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(prompt_token_ids: Sequence[int], prefix_blocks: int, block_size: int) -> int:
    """The hash of the first ``prefix_blocks`` blocks of the prompt (all of it when shorter)."""
    head = prompt_token_ids[: prefix_blocks * block_size]
    return _h64(array("q", head).tobytes())


@lru_cache(maxsize=64)
def _ring(names: tuple[str, ...]) -> tuple[list[int], list[str]]:
    points = sorted((_h64(f"{name}#{i}".encode()), name) for name in names for i in range(VNODES))
    return [p for p, _ in points], [n for _, n in points]


def ring_walk(key: int, names: Sequence[str]) -> list[str]:
    """Every engine once, in clockwise ring order from ``key``."""
    if not names:
        return []
    positions, owners = _ring(tuple(sorted(set(names))))
    start = bisect.bisect_left(positions, key)
    seen: list[str] = []
    for i in range(len(owners)):
        name = owners[(start + i) % len(owners)]
        if name not in seen:
            seen.append(name)
            if len(seen) == len(set(names)):
                break
    return seen


def load_bound(engines: Sequence[EngineLoad], load_factor: float, slack: int) -> int:
    """The most requests one engine may carry after taking one more."""
    total = sum(e.load for e in engines) + 1
    return math.ceil(load_factor * total / len(engines)) + slack


def route(key: int, engines: Sequence[EngineLoad], policy: RoutingPolicy, counter: int = 0) -> list[str]:
    """Ready engines in the order to try them (the first is the choice); [] if none is ready.

    ``counter`` drives ``round_robin`` (the caller's running request count).
    The rest of the list is the fallback order should the first refuse at once.
    """
    ready = sorted((e for e in engines if e.ready), key=lambda e: e.name)
    if not ready:
        return []
    if policy.policy == "round_robin":
        i = counter % len(ready)
        return [e.name for e in ready[i:] + ready[:i]]
    if policy.policy == "least_loaded":
        return [e.name for e in sorted(ready, key=lambda e: (e.load, e.name))]
    by_name = {e.name: e for e in ready}
    walk = ring_walk(key, list(by_name))
    bound = load_bound(ready, policy.load_factor, policy.slack)
    within = [n for n in walk if by_name[n].load + 1 <= bound]
    # the bound always admits the least loaded engine (its load is at most the mean)
    return within + [n for n in walk if n not in within]
