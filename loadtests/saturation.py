"""Is the server saturated in this run? Two signs, either one is enough.

A server keeps up with an offered load when it finishes requests as fast as they
arrive and its waiting queue stays bounded. The board marks a run **saturated**
when either sign says it did not:

1. **Completion falls behind the offer.** The client waits for every stream to
   end, so a backlog shows up as a long drain after the send window. With
   ``finished`` = completed + cancelled requests (cancellations are the client's
   own choice, not the server's failure) and ``sent_rps`` the achieved send rate
   over the send window::

       completion_ratio = finished / (duration_s - e2e_p50_s) / sent_rps

   The median end-to-end time is taken off the duration because even an idle
   server needs about that long to finish the last requests sent; what remains is
   backlog. A run is saturated when ``completion_ratio < 1 - margin``
   (``margin`` 0.1 by default: 10 % behind the offer). Errors (429, 503,
   timeouts) are not finished requests, so a server shedding load counts as
   falling behind, which it is.
2. **The waiting queue grows through the run.** From the server's waiting gauge
   sampled during the send window (its scraped ``/metrics``): the mean over the
   last third exceeds the mean over the first third by at least
   ``min_queue_growth`` requests (2 by default) and the least-squares slope over
   the window is positive. A server without the gauge gives no verdict on this
   sign ("n/a"), never a false "saturated".

A sweep stops at the first saturated rate by default (``--no-stop-on-saturation``
keeps going): past it, higher offered rates only measure the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MARGIN = 0.1
DEFAULT_MIN_QUEUE_GROWTH = 2.0


@dataclass(frozen=True)
class SaturationRule:
    margin: float = DEFAULT_MARGIN
    min_queue_growth: float = DEFAULT_MIN_QUEUE_GROWTH

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"the saturation margin must be in [0, 1), not {self.margin}")
        if self.min_queue_growth <= 0:
            raise ValueError(f"the queue growth threshold must be positive, not {self.min_queue_growth}")


def completion_ratio(summary: dict[str, Any], window_s: float) -> float | None:
    """Finished requests per second of backlog-free time, over the achieved send rate."""
    sent_rps = summary.get("sent_rps") or 0.0
    duration = float(summary.get("duration_s") or 0.0)
    if sent_rps <= 0 or duration <= 0:
        return None
    finished = int(summary.get("completed") or 0) + int(summary.get("cancelled") or 0)
    e2e_p50_s = (summary.get("e2e_p50_ms") or 0.0) / 1000.0
    # Never divide by less than the send window: a fast server finishing early is not "ahead".
    busy_s = max(duration - e2e_p50_s, min(window_s, duration), 1e-9)
    return finished / busy_s / sent_rps


def queue_growth(t_s: list[float], waiting: list[float | None], window_s: float) -> tuple[float, float] | None:
    """(last-third mean minus first-third mean, least-squares slope per second) of the waiting
    gauge inside the send window; None when the gauge was not sampled often enough."""
    points = [(t, w) for t, w in zip(t_s, waiting, strict=False) if w is not None and t <= window_s]
    if len(points) < 6:
        return None
    third = len(points) // 3
    first = [w for _, w in points[:third]]
    last = [w for _, w in points[-third:]]
    growth = sum(last) / len(last) - sum(first) / len(first)
    mean_t = sum(t for t, _ in points) / len(points)
    mean_w = sum(w for _, w in points) / len(points)
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    slope = 0.0 if var_t == 0 else sum((t - mean_t) * (w - mean_w) for t, w in points) / var_t
    return growth, slope


def judge(summary: dict[str, Any], series: dict[str, Any], window_s: float,
          rule: SaturationRule = SaturationRule()) -> dict[str, Any]:
    """The saturation verdict of one run, with the numbers behind it."""
    reasons: list[str] = []
    ratio = completion_ratio(summary, window_s)
    if ratio is not None and ratio < 1.0 - rule.margin:
        reasons.append(f"completed {ratio:.0%} of the offered rate (margin {rule.margin:.0%})")
    grown = queue_growth(list(series.get("t_s") or []), list(series.get("waiting") or []), window_s)
    if grown is not None and grown[0] >= rule.min_queue_growth and grown[1] > 0:
        reasons.append(f"waiting queue grew by {grown[0]:.1f} requests over the run")
    return {
        "saturated": bool(reasons),
        "saturation_reasons": reasons,
        "completion_ratio": ratio,
        "queue_growth": None if grown is None else round(grown[0], 3),
    }
