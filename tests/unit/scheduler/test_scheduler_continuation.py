"""A continuation (``AddRequest.output_token_ids``): a request re-submitted by a gateway after
its scheduler died picks up exactly where the dead one stopped, within the same budget."""

from __future__ import annotations

import msgspec

from services.scheduler.scheduler import Scheduler
from tests.scheduler_fakes import (
    Driver,
    FakeClock,
    FakeWorker,
    default_token,
    expected_tokens,
    make_request,
    small_config,
)


def same_stream(req_id: str, position: int) -> int:
    """Tokens keyed by the gateway's request id, not the wire id (``<id>~r<k>``)."""
    return default_token(req_id.split("~")[0], position)


def make() -> tuple[Scheduler, Driver]:
    config = small_config()
    sched = Scheduler(config, 64, 256, clock=FakeClock())
    return sched, Driver(sched, FakeWorker(config.block_size, 64, token_fn=same_stream))


def test_a_continuation_generates_only_the_remaining_budget_with_the_same_tokens() -> None:
    full = expected_tokens("a", 10, 12, token_fn=same_stream)
    sched, drv = make()
    add = msgspec.structs.replace(make_request("a", 10, max_tokens=12), req_id="a~r1", output_token_ids=full[:5])
    assert sched.add_request(add) is None
    drv.run()
    out = drv.outcomes["a~r1"]
    assert out.token_ids == full[5:] and out.finish_reason == "length"
    # its first token was streamed by the dead scheduler: no second "first token" delta
    assert all(d.num_prompt_tokens == 0 for d in out.deltas)
    assert sched.ledger.num_free_blocks == sched.ledger.num_total_blocks


def test_a_continuation_with_no_budget_left_is_refused() -> None:
    sched, _ = make()
    add = msgspec.structs.replace(make_request("a", 10, max_tokens=3), output_token_ids=[11, 12, 13])
    rejected = sched.add_request(add)
    assert rejected is not None and rejected.reason == "invalid" and "no budget left" in rejected.message
    ok = msgspec.structs.replace(make_request("b", 10, max_tokens=3), output_token_ids=[11, 12])
    assert sched.add_request(ok) is None  # one token left: the edge on the other side
