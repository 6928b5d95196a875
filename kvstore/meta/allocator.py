"""Extent allocation inside one segment, run by the metadata service.

Free space is a set of disjoint ranges, indexed three ways: by start and by end (to coalesce
neighbours on free in O(1)) and by exact size (so the common case, KV blocks of one layout
being freed and re-allocated at one size, is an O(1) reuse). A request that no exact bucket
serves takes the smallest larger free range (the number of distinct sizes stays small), so
fragmentation is bounded without a tree. All sizes are multiples of ``extent.ALIGN``.
"""

from __future__ import annotations

from kvstore.extent import ALIGN


class Allocator:
    """Allocates ``align``-aligned extents in ``[base, base + capacity)`` (a metadata shard's
    arena of a segment, :mod:`kvstore.cluster.slots`; the whole segment for a service alone).
    Not thread-safe (single event loop)."""

    __slots__ = ("capacity", "base", "used", "align", "_by_start", "_by_end", "_by_size")

    def __init__(self, capacity: int, align: int = ALIGN, base: int = 0) -> None:
        self.align = align
        self.base = base
        self.capacity = capacity - capacity % align
        self.used = 0
        self._by_start: dict[int, int] = {}  # start -> size
        self._by_end: dict[int, int] = {}  # end -> start
        self._by_size: dict[int, set[int]] = {}  # size -> starts
        if self.capacity > 0:
            self._add(base, self.capacity)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def _add(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        self._by_size.setdefault(size, set()).add(start)

    def _remove(self, start: int) -> int:
        size = self._by_start.pop(start)
        del self._by_end[start + size]
        bucket = self._by_size[size]
        bucket.discard(start)
        if not bucket:
            del self._by_size[size]
        return size

    def alloc(self, size: int) -> int | None:
        """Offset of a new extent of ``size`` bytes, or None if no free range is large enough."""
        if size <= 0 or size % self.align:
            raise ValueError(f"extent size must be a positive multiple of {self.align}, got {size}")
        bucket = self._by_size.get(size)
        if bucket:
            start = next(iter(bucket))
            self._remove(start)
            self.used += size
            return start
        best = None
        for s in self._by_size:
            if s > size and (best is None or s < best):
                best = s
        if best is None:
            return None
        start = next(iter(self._by_size[best]))
        self._remove(start)
        self._add(start + size, best - size)
        self.used += size
        return start

    @classmethod
    def with_used(
        cls, capacity: int, extents: list[tuple[int, int]], align: int = ALIGN, base: int = 0
    ) -> tuple[Allocator, list[bool]]:
        """An allocator whose ``extents`` (start, size) are in use (index rebuild from an inventory).

        Returns it and, per extent, whether it was accepted: an extent that is misaligned, out of
        range or overlaps an earlier accepted one is refused.
        """
        alloc = cls(0, align, base)
        alloc.capacity = capacity - capacity % align
        end = base + alloc.capacity
        accepted = [False] * len(extents)
        cursor = base
        for i in sorted(range(len(extents)), key=lambda j: extents[j][0]):
            start, size = extents[i]
            if start < cursor or size <= 0 or start % align or size % align or start + size > end:
                continue
            if start > cursor:
                alloc._add(cursor, start - cursor)
            cursor = start + size
            alloc.used += size
            accepted[i] = True
        if cursor < end:
            alloc._add(cursor, end - cursor)
        return alloc, accepted

    def release(self, start: int, size: int) -> None:
        """Returns an extent; merges it with free neighbours."""
        self.used -= size
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            start_size = self._remove(prev_start)
            start, size = prev_start, size + start_size
        nxt = self._by_start.get(start + size)
        if nxt is not None:
            size += self._remove(start + size)
        self._add(start, size)

    def check_integrity(self) -> None:
        """Asserts the accounting equation: free ranges are disjoint and sum to capacity - used."""
        total = 0
        last_end = -1
        for start in sorted(self._by_start):
            size = self._by_start[start]
            assert start >= last_end, f"free ranges overlap at {start}"
            assert start != last_end, f"free ranges not coalesced at {start}"
            assert self._by_end[start + size] == start
            assert start in self._by_size[size]
            total += size
            last_end = start + size
        assert total == self.capacity - self.used, f"free {total} != capacity {self.capacity} - used {self.used}"

    def check_disjoint(self, extents: list[tuple[int, int]]) -> None:
        """Asserts that ``extents`` (start, size), what the caller holds allocated here, lie in
        the arena and overlap neither each other nor a free range (none freed twice, none both
        held and free)."""
        spans = sorted([(s, n, "held") for s, n in extents] + [(s, n, "free") for s, n in self._by_start.items()])
        end, what = self.base, "arena start"
        for start, size, kind in spans:
            assert start >= end, f"{kind} extent at {start} overlaps the {what} ending at {end}"
            end, what = start + size, f"{kind} extent at {start}"
        assert end <= self.base + self.capacity, f"{what} ends at {end}, past the arena's end"
