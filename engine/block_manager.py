"""Block allocation with reference counts, an LRU free list and a local prefix cache.

Every block is in exactly one of two states::

    in use   ref_count > 0   held by one or more sequences' block tables
    free     ref_count == 0  in the free list; may still hold a cached full block

The prefix cache maps a block key (``KeySpace.block_keys``: the same key the store uses, which
commits to the whole prefix) to the block that holds that full block's KV. A cached block
stays findable after its last user frees it, until the free list hands it out again: the free
list is an LRU (an ``OrderedDict``: O(1) pop, append and removal from the middle) whose head is
taken first. Blocks that hold nothing cacheable go to the head (reusing them loses nothing);
cached blocks go to the tail, and a sequence's blocks are freed last-first so that, among
equally old chains, tails are evicted before heads (a block is worthless without its prefix).

A cache hit is checked against the token ids stored with the block, so a key collision can
never hand out the wrong KV. Cached blocks are immutable: nobody writes into a block while its
key is registered (only full blocks are registered, and a sequence only writes past its
registered prefix).

Pure bookkeeping: no torch, no KV bytes. Not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import NewType

from kvstore.keys import BlockKey

BlockId = NewType("BlockId", int)


class NoFreeBlocks(RuntimeError):
    """An allocation asked for more blocks than are free. Nothing was changed."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockKey, int] = {}
        self.num_evictions = 0
        # When set, every key the prefix cache takes (True) or drops (False) is appended here,
        # in order: what engine.device_tier reports to the store's index.
        self.events: deque[tuple[bool, BlockKey]] | None = None

    # -- queries (no side effects) ------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take, including free blocks that still hold cached KV."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._key[block_id] is not None

    def cached_run(self, keys: Sequence[BlockKey]) -> list[BlockId]:
        """Blocks holding the leading run of ``keys`` (by key alone: they were registered with the
        tokens their key commits to). No references taken, LRU order untouched."""
        out: list[BlockId] = []
        for k in keys:
            b = self._cached.get(k)
            if b is None:
                break
            out.append(BlockId(b))
        return out

    def match_prefix(self, keys: Sequence[BlockKey], token_ids: Sequence[int]) -> list[BlockId]:
        """Blocks holding the leading run of ``keys`` whose stored tokens equal ``token_ids``'s.

        ``keys[i]`` must be the key of ``token_ids[i*B:(i+1)*B]``. Stops at the first miss or
        mismatch. Takes no references and does not touch the LRU order.
        """
        hits: list[BlockId] = []
        if not self.enable_caching:
            return hits
        bs = self.block_size
        for i, key in enumerate(keys):
            b = self._cached.get(key)
            if b is None or self._tokens[b] != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(BlockId(b))
        return hits

    def can_allocate(self, num_new: int, prefix: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` with these arguments would succeed."""
        return num_new + sum(1 for b in prefix if self._ref[b] == 0) <= len(self._free)

    # -- mutations ----------------------------------------------------------------------------

    def allocate(self, num_new: int, prefix: Sequence[int] = ()) -> list[BlockId]:
        """A block table: ``prefix`` (cache hits from :meth:`match_prefix`, one reference taken
        on each, taken out of the free list if they were free) followed by ``num_new`` fresh
        blocks from the head of the free list (a cached free block loses its key).

        All or nothing: raises :class:`NoFreeBlocks` and changes nothing if short.
        """
        if not self.can_allocate(num_new, prefix):
            raise NoFreeBlocks(f"need {num_new} new blocks (+ revived hits), {len(self._free)} free")
        table: list[BlockId] = []
        for b in prefix:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            table.append(BlockId(b))
        for _ in range(num_new):
            b, _ = self._free.popitem(last=False)
            self._uncache(b)
            self._ref[b] = 1
            table.append(BlockId(b))
        return table

    def append_block(self) -> BlockId:
        """One fresh block (for a sequence whose next token starts a new block)."""
        return self.allocate(1)[0]

    def cache_block(self, block_id: int, key: BlockKey, token_ids: Sequence[int]) -> bool:
        """Registers ``block_id`` (in use, full, KV written) as holding ``key``'s tokens.

        Returns False, and registers nothing, when caching is off or another block already
        holds the key (two sequences computed the same block at once: the first one wins).
        """
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(token_ids)} tokens, block is {self.block_size}")
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use")
        if not self.enable_caching or key in self._cached or self._key[block_id] is not None:
            return False
        self._cached[key] = block_id
        self._key[block_id] = key
        self._tokens[block_id] = tuple(token_ids)
        if self.events is not None:
            self.events.append((True, key))
        return True

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops one reference on each block (a sequence's whole table, in table order).

        Blocks reaching zero join the free list, last block first; cached ones stay findable.
        """
        for b in reversed(block_ids):
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._key[b] is None:
                    self._free.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block that no sequence uses; returns how many."""
        dropped = [b for b in self._free if self._key[b] is not None]
        for b in dropped:
            self._uncache(b)
            self._free.move_to_end(b, last=False)
        return len(dropped)

    def _uncache(self, b: int) -> None:
        key = self._key[b]
        if key is not None:
            del self._cached[key]
            self._key[b] = None
            self._tokens[b] = None
            self.num_evictions += 1
            if self.events is not None:
                self.events.append((False, key))

    # -- invariants ---------------------------------------------------------------------------

    def check_integrity(self, tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raises AssertionError naming the first broken invariant:

        - num_blocks == free + in use, where free = {ref == 0} = the free list exactly;
        - the prefix cache is a bijection key <-> block with that key, and holds full blocks only;
        - if ``tables`` (every live block table) is given: ref_count[b] == occurrences of b.
        """
        in_use = sum(1 for r in self._ref if r > 0)
        if any(r < 0 for r in self._ref):
            raise AssertionError("negative ref count")
        if self.num_blocks != len(self._free) + in_use:
            raise AssertionError(f"num_blocks {self.num_blocks} != free {len(self._free)} + in use {in_use}")
        zero = {b for b, r in enumerate(self._ref) if r == 0}
        if zero != set(self._free):
            raise AssertionError(f"free list != blocks with ref 0: {sorted(zero ^ set(self._free))[:8]}")
        for key, b in self._cached.items():
            if self._key[b] != key:
                raise AssertionError(f"cached key maps to block {b} which holds another key")
            tokens = self._tokens[b]
            if tokens is None or len(tokens) != self.block_size:
                raise AssertionError(f"cached block {b} does not hold a full block of tokens")
        keyed = sum(1 for k in self._key if k is not None)
        if keyed != len(self._cached):
            raise AssertionError(f"{keyed} blocks carry a key but the prefix cache has {len(self._cached)}")
        if tables is not None:
            counts = [0] * self.num_blocks
            for table in tables:
                for b in table:
                    counts[b] += 1
            bad = [b for b in range(self.num_blocks) if counts[b] != self._ref[b]]
            if bad:
                b = bad[0]
                raise AssertionError(f"block {b}: ref count {self._ref[b]} but {counts[b]} live tables use it")
