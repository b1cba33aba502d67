"""Random sequences of ledger operations keep every invariant."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.ledger import BlockLedger, extend_block_hashes

BLOCK = 2
# A few token "documents" sharing prefixes, so lookups hit and miss.
DOCS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 6, 6, 7, 7, 8, 8], [1, 2, 7, 7]]

op = st.tuples(st.sampled_from(["alloc", "grow", "free", "reset"]), st.integers(0, 5), st.integers(0, 3), st.integers(1, 8))


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=st.lists(op, max_size=40))
def test_random_operations_keep_invariants(num_blocks: int, ops: list[tuple[str, int, int, int]]) -> None:
    led = BlockLedger(num_blocks, BLOCK)
    held: dict[str, tuple[int, int]] = {}  # req -> (doc, tokens)
    for kind, who, doc, n in ops:
        req = f"r{who}"
        tokens = DOCS[doc]
        hs: list[int] = []
        keys: list = []
        extend_block_hashes(hs, keys, tokens, BLOCK)
        if kind == "alloc" and req not in held:
            n = min(n, len(tokens))
            hits = led.lookup(hs, keys, (n - 1) // BLOCK)
            before = led.num_free_blocks
            if led.allocate(req, n, hits) is not None:
                held[req] = (doc, n)
                led.cache_blocks(req, hs, keys, n)
            else:
                assert led.num_free_blocks == before and req not in led.block_tables
        elif kind == "grow" and req in held:
            d, have = held[req]
            want = min(len(DOCS[d]), have + n)
            if led.allocate(req, want) is not None:
                held[req] = (d, want)
                dh: list[int] = []
                dk: list = []
                extend_block_hashes(dh, dk, DOCS[d], BLOCK)
                led.cache_blocks(req, dh, dk, want)
        elif kind == "free":
            led.free(req)
            held.pop(req, None)
        elif kind == "reset":
            led.reset_prefix_cache()
        led.check_invariants()
    for req in list(held):
        led.free(req)
    led.check_invariants()
    assert led.num_free_blocks == num_blocks
