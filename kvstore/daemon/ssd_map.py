"""The SSD segment's committed blocks by offset, for tens of millions of them: sorted columns
plus a bounded overlay of the changes since they were last merged.

A dict of one Python object per block takes about 200 bytes a block and, at tens of millions of
blocks, gigabytes and minutes to build at a restart. Here the bulk is columns ordered by offset
(:class:`kvstore.blocks.BlockCols`, 48 bytes a block), found by binary search; blocks committed
or removed since are in a dict (offset -> block, or None for removed) that is merged into the
columns once it holds an eighth as many entries (at least 64k), in one vectorised pass.

Readers (any thread) take one snapshot of (columns, overlay) and look in both; the one writer
(the segment, under its journal lock) changes the overlay in place, and a merge publishes new
columns with an empty overlay in one assignment, so a reader never sees half a merge.
"""

from __future__ import annotations

import numpy as np

from kvstore.blocks import U64, Block, BlockCols

_MERGE_MIN = 1 << 16


class BlockMap:
    """offset -> committed :class:`~kvstore.blocks.Block`."""

    def __init__(self, blocks: BlockCols | None = None) -> None:
        base = BlockCols.empty() if blocks is None else blocks.by_offset()
        if len(base) > 1 and not bool((base.offset[1:] > base.offset[:-1]).all()):
            raise ValueError("a block map holds one block per offset")
        self._state: tuple[BlockCols, dict[int, Block | None]] = (base, {})
        self._n = len(base)

    def __len__(self) -> int:
        return self._n

    @staticmethod
    def _row(base: BlockCols, offset: int) -> Block | None:
        offs = base.offset
        i = int(offs.searchsorted(np.uint64(offset)))  # as u64: a Python int would convert the column
        if i == offs.size or offs.item(i) != offset:
            return None
        return Block(
            base.keys[i].tobytes(), offset, base.size.item(i), base.length.item(i), base.checksum.item(i),
            base.gen.item(i),
        )  # fmt: skip

    def get(self, offset: int) -> Block | None:
        base, over = self._state
        if offset in over:
            return over[offset]
        if not 0 <= offset < 1 << 64:
            return None
        return self._row(base, offset)

    def put(self, b: Block) -> None:
        """The committed block at ``b.offset`` is ``b`` now (writer only)."""
        if self.get(b.offset) is None:
            self._n += 1
        self._state[1][b.offset] = b
        self._maybe_merge()

    def pop(self, offset: int) -> None:
        """No committed block at ``offset`` any more (writer only)."""
        if self.get(offset) is None:
            return
        self._n -= 1
        base, over = self._state
        if self._row(base, offset) is None:
            del over[offset]  # committed since the last merge: nothing to hide
        else:
            over[offset] = None
        self._maybe_merge()

    def _maybe_merge(self) -> None:
        base, over = self._state
        if len(over) >= max(_MERGE_MIN, len(base) // 8):
            self._merge()

    def _merge(self) -> BlockCols:
        base, over = self._state
        if not over:
            return base
        if len(base):
            changed = np.fromiter(over.keys(), U64, count=len(over))
            pos = np.minimum(base.offset.searchsorted(changed), len(base) - 1)
            keep = np.ones(len(base), bool)
            keep[pos[base.offset[pos] == changed]] = False  # replaced or removed
            base = base.take(keep)
        new = BlockCols.from_rows([b for b in over.values() if b is not None]).by_offset()
        if len(new):
            at = base.offset.searchsorted(new.offset)
            base = BlockCols(
                np.insert(base.keys, at, new.keys, axis=0),
                *(np.insert(getattr(base, f), at, getattr(new, f)) for f in BlockCols.FIELDS),
            )
        self._state = (base, {})
        return base

    def columns(self) -> BlockCols:
        """Every committed block, ordered by offset (writer only: merges the overlay)."""
        return self._merge()
