"""Arrival processes: when each request of a run is sent.

An open-loop process fixes send times in advance, independent of how fast the
server answers (that is what production clients do, and what exposes queueing);
the closed loop keeps a fixed number of requests in flight instead.

- ``poisson``: exponential gaps at the offered rate.
- ``gamma``: gamma-distributed gaps with shape ``burstiness`` and mean 1/rate;
  burstiness 1 is Poisson, below 1 burstier, above 1 more regular (the same
  parameterisation as ``vllm bench serve --burstiness``).
- ``constant``: one request every 1/rate seconds.
- ``trace``: the trace's own offsets, time-scaled so the trace's natural rate
  becomes the offered rate (its bursts and mix are kept).
- ``closed``: ``concurrency`` workers, each sending its next request as soon as
  the previous one ends; there is no offered rate, only the achieved one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ARRIVALS = ("poisson", "gamma", "constant", "trace", "closed")


@dataclass(frozen=True)
class ArrivalSpec:
    kind: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ValueError(f"unknown arrival process {self.kind!r}; choose one of {', '.join(ARRIVALS)}")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be positive")


def send_offsets(
    spec: ArrivalSpec, rate: float, duration_s: float, trace_offsets: list[float], natural_rate: float = 1.0
) -> list[float]:
    """Send times (seconds from the run's start) of the requests that fall within ``duration_s``.

    The i-th offset belongs to the i-th trace request; at most ``len(trace_offsets)``
    are returned, so a short trace ends the run early rather than repeating itself.
    """
    if spec.kind == "closed":
        raise ValueError("the closed loop has no send schedule")
    if rate <= 0:
        raise ValueError("the offered rate must be positive")
    limit = len(trace_offsets)
    if spec.kind == "trace":
        start = trace_offsets[0] if trace_offsets else 0.0
        scale = natural_rate / rate
        scaled = [(t - start) * scale for t in trace_offsets]
        return [t for t in scaled if t < duration_s]
    # The same unit-rate gaps at every rate, scaled by 1/rate (common random numbers):
    # runs at different rates then differ by the rate alone, not by a luckier draw.
    rng = random.Random(f"arrivals:{spec.kind}:{spec.seed}:{spec.burstiness}")
    offsets: list[float] = []
    t = 0.0
    while len(offsets) < limit and t < duration_s:
        offsets.append(t)
        t += next_gap(spec, rate, rng)
    return offsets


def next_gap(spec: ArrivalSpec, rate: float, rng: random.Random) -> float:
    if spec.kind == "constant":
        return 1.0 / rate
    if spec.kind == "poisson":
        return rng.expovariate(1.0) / rate
    # Gamma with shape k and scale 1/(rate*k) has mean 1/rate and CV 1/sqrt(k).
    return rng.gammavariate(spec.burstiness, 1.0 / spec.burstiness) / rate
