"""Prefix caching through the scheduler: hits skip computation, are counted, and die by eviction."""

from __future__ import annotations

from services.scheduler.ledger import BlockKey, extend_block_hashes
from services.scheduler.scheduler import Scheduler
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, expected_tokens, make_request, small_config

SHARED = list(range(7000, 7032))  # 32 tokens = 8 blocks of 4


def make(num_blocks: int = 64, **cfg: object) -> tuple[Scheduler, Driver]:
    config = small_config(**cfg)
    sched = Scheduler(config, num_blocks, 512, clock=FakeClock())
    return sched, Driver(sched, FakeWorker(config.block_size, num_blocks))


def test_second_request_schedules_only_its_uncached_suffix() -> None:
    sched, drv = make()
    sched.add_request(make_request("a", SHARED + [1, 2, 3, 4, 5], max_tokens=4))
    drv.step()  # a's 37 tokens computed: 9 full blocks registered
    sched.add_request(make_request("b", SHARED + [9, 9, 9], max_tokens=4))
    plan = drv.step()
    new = {r.req_id: r for r in plan.new_requests}
    assert new["b"].num_computed_tokens == 32
    assert plan.num_scheduled_tokens["b"] == 3
    a_blocks = sched.ledger.block_tables["a"]
    assert new["b"].block_ids[:8] == a_blocks[:8]  # shared, not copied
    assert all(sched.ledger.ref_cnt[b] == 2 for b in a_blocks[:8])
    drv.run()
    assert drv.outcomes["b"].deltas[0].num_cached_tokens == 32
    assert drv.outcomes["a"].deltas[0].num_cached_tokens == 0
    assert drv.outcomes["b"].token_ids == expected_tokens("b", 35, 4)
    stats = sched.stats()
    assert stats.prefix_cache_queries_total == 37 + 35
    assert stats.prefix_cache_hits_total == 32


def test_identical_prompt_still_computes_its_last_token() -> None:
    sched, drv = make()
    sched.add_request(make_request("a", SHARED, max_tokens=2))
    drv.run()
    sched.add_request(make_request("b", SHARED, max_tokens=2))
    plan = drv.step()
    # 32 tokens all cached, but the last block is recomputed so there is a token to sample from
    assert plan.new_requests[0].num_computed_tokens == 28
    assert plan.num_scheduled_tokens == {"b": 4}
    drv.run()
    assert drv.outcomes["b"].token_ids == expected_tokens("b", 32, 2)


def test_generated_tokens_are_cached_too() -> None:
    sched, drv = make()
    sched.add_request(make_request("a", SHARED[:6], max_tokens=10))
    drv.run()
    # a's prompt plus its first 6 outputs = 12 tokens = 3 full blocks
    follow_up = SHARED[:6] + drv.outcomes["a"].token_ids[:6] + [1]
    sched.add_request(make_request("b", follow_up, max_tokens=1))
    plan = drv.step()
    assert plan.new_requests[0].num_computed_tokens == 12


def test_eviction_drops_the_hashes_of_reused_blocks() -> None:
    sched, drv = make(num_blocks=12)
    sched.add_request(make_request("a", SHARED + [1], max_tokens=2))
    drv.run()
    led = sched.ledger
    assert led.num_cached_blocks == 8 and led.num_cached_free_blocks == 8  # the partial 9th is not cached
    a_blocks = drv.plans[0].new_requests[0].block_ids
    # x needs 10 blocks: the 4 uncached ones first, then 6 evictions. A freed request's
    # tail blocks are the least recently used, so a's first two blocks survive.
    sched.add_request(make_request("x", 40, max_tokens=1))
    drv.run()
    assert led.num_evictions == 6
    hashes: list[int] = []
    keys: list[BlockKey] = []
    extend_block_hashes(hashes, keys, SHARED, 4)
    assert led.lookup(hashes, keys, 8) == a_blocks[:2]  # the 6 evicted hashes are gone from the index
    assert all(led.block_hash[b] != h for b, h in zip(a_blocks[2:8], hashes[2:8], strict=True))
    sched.add_request(make_request("c", SHARED + [2], max_tokens=2))
    plan = drv.step()
    assert plan.new_requests[0].num_computed_tokens == 8
    assert plan.new_requests[0].block_ids[:2] == a_blocks[:2]
    drv.run()  # the fake worker checks every KV slot c reads
    assert drv.outcomes["c"].token_ids == expected_tokens("c", 33, 2)
    stats = sched.stats()
    assert stats.prefix_cache_hits_total == 8


def test_prefix_caching_disabled_never_hits() -> None:
    sched, drv = make(enable_prefix_caching=False)
    sched.add_request(make_request("a", SHARED + [1], max_tokens=2))
    drv.run()
    sched.add_request(make_request("b", SHARED + [2], max_tokens=2))
    plan = drv.step()
    assert plan.new_requests[0].num_computed_tokens == 0
    assert sched.ledger.num_cached_blocks == 0
    stats = sched.stats()
    assert stats.prefix_cache_queries_total == 0 and stats.prefix_cache_hits_total == 0
