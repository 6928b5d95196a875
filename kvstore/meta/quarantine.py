"""Extents held back from their allocator after the index freed them, until write tickets for
them can no longer be honoured.

A put's write tickets (:mod:`kvstore.tickets`) stay valid on the daemon until their expiry plus
``tickets.SKEW_S``, whatever becomes of the put. When a put ends without its blocks committed
(aborted, past its deadline, blocks not written or refused by the daemon), its extents would be
free at once, and another put could get the same bytes, at the same offset or overlapping it: a
late or replayed write with the old ticket would then land in the new block. So those extents
stay allocated (counted in the segment's used bytes, never free, never a replica) until
:data:`~kvstore.meta.records.WRITE_TICKET_GRACE_S` past the put's deadline, on the index's clock.

Kept in a heap by release time, so that releasing costs what is released. An extent of a segment
whose daemon was lost or drained goes with the segment (its daemon's space is forgotten whole);
its entry is skipped when it comes up. Nothing here outlives the process: a restarted service
rebuilds from the daemons' inventories, which hold committed blocks only.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from kvstore.meta.records import Segment


class Quarantine:
    """(release time, extent) of extents freed while write tickets for them may be honoured."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        # (release at, sequence, segment, offset, size): the sequence keeps the order of equal
        # release times (and of their releases) as they were held, and segments uncompared.
        self._heap: list[tuple[float, int, Segment, int, int]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, seg: Segment, offset: int, size: int, until: float) -> None:
        """Keeps the extent (allocated in ``seg``) from the allocator until ``until``."""
        seg.quarantined += size
        heapq.heappush(self._heap, (until, next(self._seq), seg, offset, size))

    def release(self, now: float, current: Callable[[Segment], bool]) -> int:
        """Returns to their allocators the extents whose time passed; those of segments that are
        no longer ``current`` (their daemon was lost) are dropped. Returns the bytes released."""
        heap = self._heap
        released = 0
        while heap and heap[0][0] < now:
            _, _, seg, offset, size = heapq.heappop(heap)
            if current(seg):
                seg.quarantined -= size
                seg.alloc.release(offset, size)
                released += size
        return released

    def extents(self, current: Callable[[Segment], bool]) -> Iterator[tuple[Segment, int, int]]:
        """(segment, offset, size) of every extent held in a current segment (for integrity checks)."""
        for _, _, seg, offset, size in self._heap:
            if current(seg):
                yield seg, offset, size
