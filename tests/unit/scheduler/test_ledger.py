"""The block ledger on its own: allocation, reference counts, the prefix-cache index, eviction."""

from __future__ import annotations

from services.scheduler.ledger import BlockLedger, extend_block_hashes


def hashes_of(tokens: list[int], block_size: int) -> tuple[list[int], list]:
    hs: list[int] = []
    keys: list = []
    extend_block_hashes(hs, keys, tokens, block_size)
    return hs, keys


def test_allocate_grows_tables_and_free_returns_everything() -> None:
    led = BlockLedger(8, 4)
    assert led.allocate("a", 5) == [0, 1]
    assert led.allocate("a", 8) == []  # still fits in two blocks
    assert led.allocate("a", 9) == [2]
    assert led.allocate("b", 4) == [3]
    led.check_invariants()
    assert led.num_free_blocks == 4 and led.num_used_blocks == 4
    assert led.ref_cnt[:4] == [1, 1, 1, 1]
    assert led.free("a") == 3
    led.check_invariants()
    assert led.num_free_blocks == 7
    assert led.free("a") == 0  # unknown ids are harmless
    led.check_invariants()


def test_failed_allocation_changes_nothing() -> None:
    led = BlockLedger(4, 4)
    led.allocate("a", 12)
    assert led.allocate("b", 8) is None
    assert "b" not in led.block_tables
    assert led.allocate("a", 20) is None
    assert led.block_tables["a"] == [0, 1, 2]
    assert led.num_free_blocks == 1
    led.check_invariants()


def test_cached_blocks_are_shared_with_reference_counts() -> None:
    led = BlockLedger(8, 4)
    tokens = list(range(10))
    hs, keys = hashes_of(tokens, 4)
    assert len(hs) == 2  # only full blocks are hashed
    led.allocate("a", 10)
    led.cache_blocks("a", hs, keys, 10)
    assert led.num_cached_blocks == 2
    hits = led.lookup(hs, keys, 2)
    assert hits == led.block_tables["a"][:2]
    new = led.allocate("b", 11, hits)
    assert new is not None and new[:2] == hits and len(new) == 3
    assert [led.ref_cnt[b] for b in hits] == [2, 2]
    led.check_invariants()
    led.free("a")
    led.check_invariants()
    assert [led.ref_cnt[b] for b in hits] == [1, 1]
    led.free("b")
    led.check_invariants()
    # unreferenced but still cached: counted free, found again by the next lookup
    assert led.num_free_blocks == 8 and led.num_cached_free_blocks == 2
    assert led.lookup(hs, keys, 2) == hits


def test_only_computed_full_blocks_are_cached() -> None:
    led = BlockLedger(8, 4)
    hs, keys = hashes_of(list(range(12)), 4)
    led.allocate("a", 12)
    led.cache_blocks("a", hs, keys, 7)  # one full block computed so far
    assert led.num_cached_blocks == 1
    led.cache_blocks("a", hs, keys, 12)
    assert led.num_cached_blocks == 3
    led.check_invariants()


def test_hit_is_confirmed_against_tokens() -> None:
    led = BlockLedger(8, 4)
    hs, keys = hashes_of(list(range(8)), 4)
    led.allocate("a", 8)
    led.cache_blocks("a", hs, keys, 8)
    # same hashes but different tokens (a forced collision): no hit
    other_keys = [(None, (9, 9, 9, 9)), keys[1]]
    assert led.lookup(hs, other_keys, 2) == []
    # a different first block breaks the chain for every later block
    hs2, keys2 = hashes_of([0, 1, 2, 99, 4, 5, 6, 7], 4)
    assert led.lookup(hs2, keys2, 2) == []


def test_uncached_blocks_are_used_before_evicting_and_eviction_is_lru() -> None:
    led = BlockLedger(4, 2)
    ha, ka = hashes_of([1, 2], 2)
    hb, kb = hashes_of([3, 4], 2)
    led.allocate("a", 2)
    led.cache_blocks("a", ha, ka, 2)
    led.allocate("b", 2)
    led.cache_blocks("b", hb, kb, 2)
    block_a, block_b = led.block_tables["a"][0], led.block_tables["b"][0]
    led.free("a")  # freed first: least recently used
    led.free("b")
    assert led.num_cached_free_blocks == 2
    led.allocate("c", 4)  # two uncached blocks exist: no eviction
    assert led.num_evictions == 0 and led.num_cached_blocks == 2
    led.allocate("d", 2)  # must evict: a's block goes first
    assert led.block_tables["d"] == [block_a]
    assert led.num_evictions == 1
    assert led.lookup(ha, ka, 1) == [] and led.lookup(hb, kb, 1) == [block_b]
    led.check_invariants()


def test_prefix_hit_revives_an_evictable_block_and_counts_it() -> None:
    led = BlockLedger(3, 2)
    h, k = hashes_of([1, 2, 3, 4], 2)
    led.allocate("a", 4)
    led.cache_blocks("a", h, k, 4)
    led.free("a")
    led.allocate("x", 2)  # takes the one uncached block
    hits = led.lookup(h, k, 2)
    assert len(hits) == 2
    # two evictable hits, no free block left: needing a 3rd block must fail
    assert not led.can_allocate("b", 5, hits)
    assert led.allocate("b", 5, hits) is None
    assert led.allocate("b", 4, hits) == hits
    led.check_invariants()


def test_reset_prefix_cache_forgets_every_hash() -> None:
    led = BlockLedger(4, 2)
    h, k = hashes_of([1, 2, 3, 4], 2)
    led.allocate("a", 4)
    led.cache_blocks("a", h, k, 4)
    led.allocate("b", 2)
    led.free("b")
    led.reset_prefix_cache()
    assert led.num_cached_blocks == 0 and led.lookup(h, k, 2) == []
    led.check_invariants()
    led.free("a")
    assert led.num_cached_free_blocks == 0 and led.num_free_blocks == 4
    led.check_invariants()


def test_duplicate_content_keeps_the_first_copy_cached() -> None:
    led = BlockLedger(4, 2)
    h, k = hashes_of([1, 2], 2)
    led.allocate("a", 2)
    led.allocate("b", 2)  # computed the same block without a hit (e.g. same step)
    led.cache_blocks("a", h, k, 2)
    led.cache_blocks("b", h, k, 2)
    assert led.lookup(h, k, 1) == led.block_tables["a"]
    led.free("b")
    assert led.num_cached_free_blocks == 0  # b's copy was never registered
    led.check_invariants()
