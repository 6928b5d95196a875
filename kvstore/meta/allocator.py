"""Extent allocation inside one segment, run by the metadata service.

Free space is a set of disjoint ranges, indexed three ways: by start and by end (to coalesce
neighbours on free in O(1)) and by exact size (so the common case, KV blocks of one layout
being freed and re-allocated at one size, is an O(1) reuse). A request that no exact bucket
serves takes the smallest larger free range (the number of distinct sizes stays small), so
fragmentation is bounded without a tree. All sizes are multiples of ``extent.ALIGN``.
"""

from __future__ import annotations

import numpy as np

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

    def alloc_run(self, size: int, n: int) -> np.ndarray | None:
        """Offsets of ``n`` new extents of ``size`` bytes each, as ``n`` calls of :meth:`alloc`
        would place them (exact-size ranges first, then best fit, carving each range from its
        start), or None (nothing allocated) if they do not all fit. Costs the ranges used, not
        the extents."""
        if size <= 0 or size % self.align:
            raise ValueError(f"extent size must be a positive multiple of {self.align}, got {size}")
        if n * size > self.free:
            return None
        exact = list(self._by_size.get(size, ()))[:n]
        # Smallest first, each size's ranges in the order alloc() would take them.
        bigger = [(s, st) for s in sorted(s for s in self._by_size if s > size) for st in list(self._by_size[s])]
        if len(exact) + sum(s // size for s, _ in bigger) < n:
            return None
        out = [np.array(exact, dtype=np.int64)]
        for st in exact:
            self._remove(st)
        need = n - len(exact)
        for s, st in bigger:  # smallest first: best fit, as alloc() picks a range each time
            if not need:
                break
            k = min(need, s // size)
            self._remove(st)
            if s > k * size:
                self._add(st + k * size, s - k * size)
            out.append(st + size * np.arange(k, dtype=np.int64))
            need -= k
        self.used += n * size
        return np.concatenate(out)

    @classmethod
    def with_used(
        cls, capacity: int, extents: list[tuple[int, int]] | np.ndarray, align: int = ALIGN, base: int = 0
    ) -> tuple[Allocator, np.ndarray]:
        """An allocator whose ``extents`` (start, size; a list of pairs or an (n, 2) array) are in
        use (index rebuild from an inventory).

        Returns it and, per extent, whether it was accepted (a bool array): an extent that is
        misaligned, out of range or overlaps an earlier accepted one (in start order) is refused.
        Vectorised: an inventory of millions of extents costs a sort, and a walk of its extents
        in Python only where some overlap.
        """
        alloc = cls(0, align, base)
        alloc.capacity = capacity - capacity % align
        end = base + alloc.capacity
        ext = np.asarray(extents, dtype=np.int64).reshape(-1, 2)
        starts, sizes = ext[:, 0], ext[:, 1]
        # (An inventory usually comes in extent order already: then there is nothing to sort.)
        ordered = len(starts) < 2 or bool((starts[1:] >= starts[:-1]).all())
        order = np.arange(len(starts)) if ordered else np.argsort(starts, kind="stable")
        s, z = (starts, sizes) if ordered else (starts[order], sizes[order])
        ok = (s >= base) & (z > 0) & (s % align == 0) & (z % align == 0) & (s + z <= end)
        i = np.flatnonzero(ok)
        # Overlaps among the valid ones: a start before the previous valid extent's end.
        if len(i) > 1 and (s[i[1:]] < (s[i[:-1]] + z[i[:-1]])).any():
            cursor = base
            for j in i.tolist():  # accept in start order, each past the last accepted one's end
                if s[j] < cursor:
                    ok[j] = False
                else:
                    cursor = int(s[j] + z[j])
            i = np.flatnonzero(ok)
        s, z = s[i], z[i]
        accepted = np.zeros(len(ext), dtype=bool)
        accepted[order[i]] = True
        alloc.used = int(z.sum())
        # The free ranges: the gaps before, between and after the accepted extents.
        lo = np.concatenate(([base], s + z))
        hi = np.concatenate((s, [end]))
        for a, b in zip(lo[hi > lo].tolist(), hi[hi > lo].tolist()):
            alloc._add(a, b - a)
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
