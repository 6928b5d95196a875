"""A block's replicas in the index (:class:`kvstore.meta.index.Index`, a mixin over its ``table``,
``segments`` and tombstones): the primary replica a row holds and the further copies beside it
(:mod:`kvstore.meta.copies`): adding a clean copy, dropping one, dropping the primary so that a
copy takes its place, eviction of one replica, and replicas spelled out as :class:`Location`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvstore.keys import KEY_BYTES
from kvstore.meta.records import ROW, Places, Segment, Tombstone
from kvstore.meta.table import LIVE, PINNED, READY, words


class Location(NamedTuple):
    """A block's replica, spelled out: what the service's answers are made of
    (:meth:`kvstore.meta.index.Index.locations`; answers and commits pack :meth:`Replicas.places`, columns)."""

    segment: Segment
    offset: int
    size: int
    length: int
    checksum: int
    gen: int
    key: bytes

    @property
    def row(self) -> bytes:
        """The wire's location row (:data:`kvstore.meta.records.ROW`)."""
        return ROW.pack(self.segment.ref, 0, self.offset, self.length, self.checksum, self.gen)


class Replicas:
    """Replica bookkeeping over the block table."""

    def places(self, rows: np.ndarray) -> Places:
        """The primary replicas of ``rows``, spelled out in columns now (copies of the table's)."""
        t = self.table
        refs = t.seg[rows]
        return Places(
            np.arange(len(rows)), refs, t.off[rows], t.size[rows], t.length[rows], t.csum[rows], t.gen[rows],
            t.keys(rows), {ref: self.segments[ref] for ref in np.unique(refs).tolist()},
        )  # fmt: skip

    def _free_row(self, row: int) -> None:
        """An unlinked row with no lease left goes back to the table, the extents of its copies
        (tombstoned when it was dropped) to their allocators, where their daemon is still known."""
        t = self.table
        for i in t.copies.of(row):
            seg = self.segments.get(int(t.copies.seg[i]))
            if seg is not None and self._current(seg):
                seg.alloc.release(int(t.copies.off[i]), int(t.copies.size[i]))
            t.copies.remove(i)
        t.free(row)

    # ---- replicas ---------------------------------------------------------------------------

    def _add_copy(self, row: int, seg: Segment, offset: int, size: int, gen: int) -> None:
        """``row``'s block is also committed at ``offset`` of ``seg`` (a lower tier of its daemon)."""
        t = self.table
        t.copies.add(row, seg.ref, offset, size, gen)
        seg.blocks += 1
        if t.flags[row] & PINNED:
            seg.pinned += 1

    def _drop_copy(self, row: int, i: int) -> None:
        """Drops copy ``i`` of an unleased ``row``: tombstoned, its extent freed; the block stays."""
        if self._lost_row(row):  # a lost daemon's block (its copies are there too): it goes whole
            self._drop(row)
            return
        t = self.table
        seg = self.segments[int(t.copies.seg[i])]
        self._tombstone_item(
            seg.daemon.spec.daemon_id,
            Tombstone(seg.spec.segment_id, t.key(row), int(t.copies.off[i]), int(t.copies.gen[i])),
        )
        seg.alloc.release(int(t.copies.off[i]), int(t.copies.size[i]))
        seg.blocks -= 1
        if t.flags[row] & PINNED:
            seg.pinned -= 1
        t.copies.remove(i)

    def _drop_primary(self, row: int) -> None:
        """Drops the primary replica of an unleased ``row`` that has a copy: the copy becomes its
        primary (what readers get from then on); the block stays, with its recency and count."""
        if self._lost_row(row):
            self._drop(row)
            return
        t = self.table
        i = t.copies.of(row)[0]
        seg = self.segments[int(t.seg[row])]
        self._tombstone_item(
            seg.daemon.spec.daemon_id, Tombstone(seg.spec.segment_id, t.key(row), int(t.off[row]), int(t.gen[row]))
        )
        seg.alloc.release(int(t.off[row]), int(t.size[row]))
        seg.blocks -= 1
        if t.flags[row] & PINNED:
            seg.pinned -= 1
        t.seg[row], t.off[row], t.size[row], t.gen[row] = (
            t.copies.seg[i],
            t.copies.off[i],
            t.copies.size[i],
            t.copies.gen[i],
        )
        t.copies.remove(i)  # (its segment's block and pin counts now count the primary)

    def _evict(self, row: int, seg: Segment) -> None:
        """Makes room in ``seg`` by dropping ``row``'s replica there: the whole block if that is
        its only one, else just that replica (a clean drop: the block is still held)."""
        t = self.table
        if not t.copy[row]:
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += int(t.length[row])
            self._drop(row)
            return
        self.counters["dropped_clean"] += 1
        if int(t.seg[row]) == seg.ref:
            self._drop_primary(row)
        else:
            self._drop_copy(row, t.copies.first_on(row, seg.ref))

    # ---- introspection ----------------------------------------------------------------------

    def keys(self) -> list[bytes]:
        """The keys of the committed blocks (a walk of the whole table: for tools and tests)."""
        t = self.table
        n = t.n_rows
        rows = np.flatnonzero((t.flags[:n] & (LIVE | READY)) == (LIVE | READY))
        if self._leaving:  # a lost daemon's not yet dropped
            rows = rows[~np.isin(t.seg[rows], list(self._leaving))]
        packed = t.keys(rows)
        return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]

    def replicas(self, key: bytes) -> list[Location]:
        """Every replica of a committed block, its primary first (none if it is not stored)."""
        t = self.table
        row = int(self._settle(t.find(words(key)))[0])
        if row < 0 or not t.flags[row] & READY:
            return []
        primary = self.locations([row])[0]
        c = t.copies
        return [primary] + [
            primary._replace(
                segment=self.segments[int(c.seg[i])], offset=int(c.off[i]), size=int(c.size[i]), gen=int(c.gen[i])
            )
            for i in c.of(row)
        ]
