"""The KV block ledger: which block ids belong to which request.

The scheduler owns the *bookkeeping* of the paged KV cache; the worker owns the
tensors and simply follows the block ids it is sent. A block is always in
exactly one of three places:

    free (uncached)        ref_cnt == 0, no hash        -> ``_free`` (a stack)
    cached, unreferenced   ref_cnt == 0, has a hash     -> ``_evictable`` (LRU)
    in use                 ref_cnt >= 1                 -> one or more block tables

Allocation takes uncached free blocks first and only then evicts the least
recently freed cached block (dropping its hash), so prefix-cache entries live as
long as memory allows. Both pools are O(1) per block: a list used as a stack and
an ``OrderedDict`` used as an LRU list; no step does work proportional to the
total number of blocks.

Prefix caching: a *full* block is identified by a hash chained from its
parent block's hash and its own token ids, so equal hashes mean equal
prefixes. The index maps hash -> block id; a hit is confirmed against the
stored (parent hash, token ids) key, so a hash collision cannot serve a wrong
block. Only full blocks whose tokens are already computed are registered (see
``cache_blocks``), so a hit always points at KV the worker has written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BlockKey = tuple[int | None, tuple[int, ...]]


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> tuple[int, BlockKey]:
    """The chained hash of one full block and the key that confirms it."""
    key: BlockKey = (parent_hash, tuple(token_ids))
    return hash(key), key


def extend_block_hashes(
    hashes: list[int], keys: list[BlockKey], token_ids: Sequence[int], block_size: int
) -> None:
    """Append hashes for every full block of ``token_ids`` not hashed yet (in place)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        h, key = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(h)
        keys.append(key)


class BlockLedger:
    """Block ids, reference counts, block tables and the prefix-cache index."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        # Reversed so that pop() hands out block 0 first: plans are easier to read.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._index: dict[int, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        # How many leading blocks of each table are registered in the index.
        self._num_cached_blocks: dict[str, int] = {}
        self.num_evictions = 0

    # ------------------------------------------------------------------ counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: uncached free plus cached-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix-cache index (in use or not)."""
        return len(self._index)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------- prefix cache

    def lookup(self, block_hashes: Sequence[int], block_keys: Sequence[BlockKey], max_blocks: int) -> list[int]:
        """The longest run of leading blocks already cached (not yet referenced)."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        index = self._index
        for i in range(min(max_blocks, len(block_hashes))):
            block_id = index.get(block_hashes[i])
            if block_id is None or self.block_key[block_id] != block_keys[i]:
                break
            hits.append(block_id)
        return hits

    def cache_blocks(
        self, req_id: str, block_hashes: Sequence[int], block_keys: Sequence[BlockKey], num_computed_tokens: int
    ) -> None:
        """Register the request's full, computed blocks in the prefix-cache index."""
        if not self.enable_prefix_caching:
            return
        start = self._num_cached_blocks[req_id]
        end = min(num_computed_tokens // self.block_size, len(block_hashes))
        if end <= start:
            return
        table = self.block_tables[req_id]
        index = self._index
        for i in range(start, end):
            block_id = table[i]
            if self.block_hash[block_id] is not None:
                continue  # a prefix hit: already registered
            h = block_hashes[i]
            if h in index:
                continue  # the same content computed twice: keep the first copy cached
            index[h] = block_id
            self.block_hash[block_id] = h
            self.block_key[block_id] = block_keys[i]
        self._num_cached_blocks[req_id] = end

    def reset_prefix_cache(self) -> None:
        """Forget every hash (the worker's KV contents are gone, e.g. after a restart)."""
        for block_id in self._index.values():
            self.block_hash[block_id] = None
            self.block_key[block_id] = None
        self._index.clear()
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        for req_id in self._num_cached_blocks:
            self._num_cached_blocks[req_id] = 0

    # --------------------------------------------------------------- allocation

    def can_allocate(self, req_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        table = self.block_tables.get(req_id)
        have = len(table) if table is not None else 0
        need = self.num_blocks_for(num_tokens) - have - len(computed_blocks)
        if need <= 0:
            return True
        ref_cnt = self.ref_cnt
        reviving = sum(1 for b in computed_blocks if ref_cnt[b] == 0)
        return need <= self.num_free_blocks - reviving

    def allocate(self, req_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow ``req_id``'s block table to hold ``num_tokens`` tokens.

        ``computed_blocks`` (prefix-cache hits, only for a request without a table)
        are referenced first. Returns the block ids appended to the table, hits
        included, or None (and changes nothing) when there are not enough blocks.
        """
        table = self.block_tables.get(req_id)
        # Fast path for decodes: the last block still has room.
        if table is not None and not computed_blocks and len(table) * self.block_size >= num_tokens:
            return []
        if not self.can_allocate(req_id, num_tokens, computed_blocks):
            return None
        if table is None:
            table = self.block_tables[req_id] = []
            self._num_cached_blocks[req_id] = 0
        elif computed_blocks:
            raise ValueError(f"prefix hits for {req_id}, which already holds blocks")
        new_ids: list[int] = []
        ref_cnt = self.ref_cnt
        for block_id in computed_blocks:
            if ref_cnt[block_id] == 0:
                del self._evictable[block_id]
            ref_cnt[block_id] += 1
            new_ids.append(block_id)
        if computed_blocks:
            self._num_cached_blocks[req_id] = len(computed_blocks)
        for _ in range(self.num_blocks_for(num_tokens) - len(table) - len(computed_blocks)):
            block_id = self._take_free_block()
            ref_cnt[block_id] = 1
            new_ids.append(block_id)
        table.extend(new_ids)
        return new_ids

    def _take_free_block(self) -> int:
        if self._free:
            return self._free.pop()
        block_id, _ = self._evictable.popitem(last=False)  # least recently freed
        h = self.block_hash[block_id]
        if h is not None and self._index.get(h) == block_id:
            del self._index[h]
        self.block_hash[block_id] = None
        self.block_key[block_id] = None
        self.num_evictions += 1
        return block_id

    def free(self, req_id: str) -> int:
        """Drop ``req_id``'s references; returns how many blocks it held. Unknown ids: 0."""
        table = self.block_tables.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        if table is None:
            return 0
        ref_cnt = self.ref_cnt
        # Tail blocks first: they are the least likely to be shared, so evicted first.
        for block_id in reversed(table):
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                if self.block_hash[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None
        return len(table)

    def release_behind(self, req_id: str, first_position: int) -> int:
        """A hybrid KV cache's hook (HybridLedger): every layer here keeps every block."""
        return 0

    def pressure(self) -> tuple[int, int]:
        """(total, free) blocks of the pool nearest full: what EngineStats reports."""
        return self.num_total_blocks, self.num_free_blocks

    # --------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Assert the ledger is consistent. O(total blocks): for tests and debug runs."""
        n = self.num_total_blocks
        free_set = set(self._free)
        evictable_set = set(self._evictable)
        assert len(free_set) == len(self._free), "a block is twice in the free list"
        assert not free_set & evictable_set, f"blocks both free and evictable: {free_set & evictable_set}"
        expected = [0] * n
        for req_id, table in self.block_tables.items():
            assert len(set(table)) == len(table), f"{req_id} holds a block twice: {table}"
            for block_id in table:
                assert 0 <= block_id < n, f"{req_id} holds block {block_id} outside 0..{n - 1}"
                expected[block_id] += 1
            num_cached = self._num_cached_blocks[req_id]
            assert 0 <= num_cached <= len(table), f"{req_id}: {num_cached} cached of {len(table)} blocks"
        assert expected == self.ref_cnt, "reference counts differ from block-table references"
        in_use = sum(1 for c in expected if c > 0)
        assert len(free_set) + len(evictable_set) + in_use == n, (
            f"free {len(free_set)} + cached-unreferenced {len(evictable_set)} + in use {in_use} != total {n}"
        )
        for block_id in free_set:
            assert self.ref_cnt[block_id] == 0 and self.block_hash[block_id] is None, (
                f"free block {block_id} has ref_cnt {self.ref_cnt[block_id]} or a hash"
            )
        for block_id in evictable_set:
            assert self.ref_cnt[block_id] == 0 and self.block_hash[block_id] is not None, (
                f"evictable block {block_id} is referenced or has no hash"
            )
        for h, block_id in self._index.items():
            assert self.block_hash[block_id] == h, f"index entry {h} -> {block_id} disagrees with the block"
        num_hashed = sum(1 for h in self.block_hash if h is not None)
        assert num_hashed == len(self._index), f"{num_hashed} hashed blocks but {len(self._index)} index entries"


RELEASED = -1  # a window table's entry for a block its window has left behind


class WindowLedger:
    """The windowed layers' pool of a hybrid KV cache (shared.capacity.HybridKV).

    A request's window table is indexed by position like its global block table (entry i holds
    positions [i * block_size, (i + 1) * block_size)), but a block whose positions every later
    query's window has passed is released back to the pool (``release_behind``) and its entry
    becomes ``RELEASED``: the windowed layers never read keys behind a query's window
    (services/worker/backends/variant.py). No prefix caching: a windowed layer's block holds
    a window's keys, not a prefix's."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}  # leading entries released, per request

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_total_blocks

    def need(self, req_id: str, num_tokens: int) -> int:
        table = self.tables.get(req_id)
        return max(0, -(-num_tokens // self.block_size) - (len(table) if table is not None else 0))

    def allocate(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grow the table to ``num_tokens`` positions: the new ids, or None (nothing changed)."""
        n = self.need(req_id, num_tokens)
        if n > len(self._free):
            return None
        table = self.tables.setdefault(req_id, [])
        self._released.setdefault(req_id, 0)
        new_ids = [self._free.pop() for _ in range(n)]
        table.extend(new_ids)
        return new_ids

    def release_behind(self, req_id: str, first_needed: int) -> int:
        """Release the blocks wholly before position ``first_needed`` (the first key the next
        query's window reaches); returns how many were released."""
        table = self.tables.get(req_id)
        if table is None:
            return 0
        start = self._released[req_id]
        end = min(len(table), max(0, first_needed) // self.block_size)  # block i ends at (i + 1) * bs <= first_needed
        for i in range(start, end):
            self._free.append(table[i])
            table[i] = RELEASED
        if end > start:
            self._released[req_id] = end
            return end - start
        return 0

    def free(self, req_id: str) -> None:
        table = self.tables.pop(req_id, None)
        released = self._released.pop(req_id, 0)
        if table is not None:
            self._free.extend(reversed(table[released:]))

    def check_invariants(self) -> None:
        held = [b for t in self.tables.values() for b in t if b != RELEASED]
        assert len(held) == len(set(held)), "a window block is held twice"
        assert not set(held) & set(self._free), "a window block is both held and free"
        assert len(held) + len(self._free) == self.num_total_blocks, (
            f"window blocks: held {len(held)} + free {len(self._free)} != {self.num_total_blocks}")
        for req_id, table in self.tables.items():
            released = self._released[req_id]
            assert all(b == RELEASED for b in table[:released]), f"{req_id}: a released entry holds a block"
            assert all(b != RELEASED for b in table[released:]), f"{req_id}: a live entry is released"


class HybridLedger(BlockLedger):
    """A hybrid KV cache's two pools behind ``BlockLedger``'s interface: this ledger's own tables
    are the global layers' (the scheduler's accounting of a sequence's length), ``window`` the
    windowed layers'. Each allocation takes from both or from neither; the windowed layers' new
    blocks of a step wait in ``new_window_ids`` until the plan is built; prefix caching is off."""

    def __init__(self, num_blocks: int, block_size: int, window: int, num_window_blocks: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.window = window
        self.windows = WindowLedger(num_window_blocks, block_size)
        self.new_window_ids: dict[str, list[int]] = {}

    @property
    def usage(self) -> float:
        return max(super().usage, self.windows.usage)

    def can_allocate(self, req_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        return (super().can_allocate(req_id, num_tokens, computed_blocks)
                and self.windows.need(req_id, num_tokens) <= self.windows.num_free_blocks)

    def allocate(self, req_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> list[int] | None:
        if not self.can_allocate(req_id, num_tokens, computed_blocks):
            return None
        new_ids = super().allocate(req_id, num_tokens, computed_blocks)
        window_ids = self.windows.allocate(req_id, num_tokens)
        assert new_ids is not None and window_ids is not None
        self.new_window_ids.setdefault(req_id, []).extend(window_ids)
        return new_ids

    def release_behind(self, req_id: str, first_position: int) -> int:
        """The next query of ``req_id`` is at ``first_position``: release the windowed layers'
        blocks its window no longer reaches."""
        return self.windows.release_behind(req_id, first_position - self.window + 1)

    def pressure(self) -> tuple[int, int]:
        if self.windows.usage > self.num_used_blocks / self.num_total_blocks:
            return self.windows.num_total_blocks, self.windows.num_free_blocks
        return self.num_total_blocks, self.num_free_blocks

    def window_table(self, req_id: str) -> list[int]:
        return self.windows.tables.get(req_id, [])

    def take_new_window_ids(self, req_id: str) -> list[int]:
        return self.new_window_ids.pop(req_id, [])

    def free(self, req_id: str) -> int:
        self.windows.free(req_id)
        self.new_window_ids.pop(req_id, None)
        return super().free(req_id)

    def check_invariants(self) -> None:
        super().check_invariants()
        self.windows.check_invariants()
        assert set(self.windows.tables) == set(self.block_tables), "window tables and block tables name other requests"
        for req_id, table in self.block_tables.items():
            assert len(self.windows.tables[req_id]) == len(table), f"{req_id}: window table of another length"
