"""Recency in the block table (:class:`kvstore.meta.table.BlockTable`, a mixin over its columns):
every event that makes a block most recently used (committed, touched, released by its last
lease, unpinned) gives it the next value of one counter; the least recently used evictable block
of a segment is the one with the smallest stamp. Eviction takes victims from a per-segment list
of the oldest evictable rows, computed in one vectorised pass and consumed in order: a row whose
stamp changed since, or that stopped being evictable, is skipped. The list stays exact because
stamps only grow: a row that was not among the oldest then is younger than every row on the
list, and a row becomes evictable again only with a new stamp. A row is on a segment where its
primary replica or one of its copies is (:mod:`kvstore.meta.copies`).

Also the row flags, which the table and this mixin share.
"""

from __future__ import annotations

import numpy as np

# Row flags.
LIVE = 1  # in the hash table (a stored or pending block)
READY = 2  # committed: readable
PINNED = 4
WRITTEN = 8  # its daemon may hold it committed: dropping it needs a tombstone
HELD = 16  # kept out of eviction for the duration of one call


_NO_ROWS = np.empty(0, dtype=np.int64)


class Recency:
    """Stamps, evictability and each segment's oldest evictable rows (needs the table's
    ``recent``, ``flags``, ``leases``, ``seg``, ``copy`` columns, ``copies``, ``n_rows``,
    ``_clock`` and ``_oldest``)."""

    # ---- recency ----------------------------------------------------------------------------

    def evictable(self, rows: np.ndarray) -> np.ndarray:
        f = self.flags[rows]
        return ((f & (LIVE | READY | PINNED | HELD)) == (LIVE | READY)) & (self.leases[rows] == 0)

    def is_evictable(self, row: int) -> bool:
        return (int(self.flags[row]) & (LIVE | READY | PINNED | HELD)) == (LIVE | READY) and self.leases[row] == 0

    def stamp(self, rows: np.ndarray) -> None:
        """Makes ``rows`` the most recently used, the last of them most recent."""
        n = len(rows)
        if n:
            self.recent[rows] = np.arange(self._clock + 1, self._clock + 1 + n, dtype=np.uint64)
            self._clock += n

    def stamp_one(self, row: int) -> None:
        self._clock += 1
        self.recent[row] = self._clock

    def oldest(self, seg_ref: int, batch: int = 0) -> int:
        """The least recently used evictable row of segment ``seg_ref``, -1 if none."""
        rows, stamps, pos = self._oldest.get(seg_ref, (_NO_ROWS, _NO_ROWS, 0))
        recent, flags, leases, seg = self.recent, self.flags, self.leases, self.seg
        while True:
            while pos < len(rows):
                r = int(rows[pos])
                if (
                    recent[r] == stamps[pos]
                    and (seg[r] == seg_ref or (self.copy[r] and self.copies.first_on(r, seg_ref) >= 0))
                    and (flags[r] & (LIVE | READY | PINNED | HELD)) == (LIVE | READY)
                    and leases[r] == 0
                ):
                    self._oldest[seg_ref] = (rows, stamps, pos)
                    return r
                pos += 1
            rows, stamps = self._oldest_pass(seg_ref, batch)
            pos = 0
            if not len(rows):
                self._oldest.pop(seg_ref, None)
                return -1

    def oldest_batch(self, seg_ref: int, k: int) -> np.ndarray:
        """The ``k`` least recently used evictable rows of segment ``seg_ref`` (fewer if there
        are not so many), oldest first: the first ``k`` that :meth:`oldest` would give in turn,
        vectorised over the segment's list of oldest rows (which it moves past the rows no
        longer on it, and makes anew, from the whole table, when fewer than ``k`` are left)."""
        for fresh in (False, True):
            if fresh:  # (a pass of the usual size, at least four batches' worth)
                rows, stamps = self._oldest_pass(seg_ref, 0 if 4 * k <= 256 else 4 * k)
                pos = 0
            else:
                rows, stamps, pos = self._oldest.get(seg_ref, (_NO_ROWS, _NO_ROWS, 0))
            # The list is checked from its start in windows that double, until k are found: a
            # victim costs the rows it passes, not the list (which holds thousands).
            found: list[np.ndarray] = []
            n_found, first, at, width = 0, -1, pos, max(4 * k, 64)
            while at < len(rows) and n_found < k:
                r, st = rows[at : at + width], stamps[at : at + width]
                ok = (
                    (self.recent[r] == st)
                    & self.on_segment(r, seg_ref)
                    & ((self.flags[r] & (LIVE | READY | PINNED | HELD)) == (LIVE | READY))
                    & (self.leases[r] == 0)
                )
                good = np.flatnonzero(ok)
                if len(good):
                    first = at + int(good[0]) if first < 0 else first
                    found.append(r[good])
                    n_found += len(good)
                at, width = at + width, 2 * width
            if first >= 0:
                self._oldest[seg_ref] = (rows, stamps, first)
            else:
                self._oldest.pop(seg_ref, None)
            if n_found >= k or fresh:  # a fresh pass short of k: that is every evictable row
                return np.concatenate(found)[:k] if found else _NO_ROWS
        raise AssertionError("unreachable")

    def _oldest_pass(self, seg_ref: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
        n = self.n_rows
        here = self.seg[:n] == seg_ref
        if self.copies.count:  # and the rows with a copy there
            here[self.copies.rows_on(seg_ref)] = True
        ok = here & ((self.flags[:n] & (LIVE | READY | PINNED | HELD)) == (LIVE | READY)) & (self.leases[:n] == 0)
        cand = np.flatnonzero(ok)
        # Enough for many evictions per pass (a pass costs the whole table), few enough to sort
        # and hold (16 bytes each).
        want = batch or max(256, min(len(cand) // 16, 1 << 20))
        st = self.recent[cand]
        if len(cand) > want:
            part = np.argpartition(st, want - 1)[:want]
            cand, st = cand[part], st[part]
        order = np.argsort(st, kind="stable")
        return cand[order], st[order]

    def on_segment(self, rows: np.ndarray, seg_ref: int) -> np.ndarray:
        """Whether each of ``rows`` has a replica (its primary or a copy) on ``seg_ref``."""
        out = self.seg[rows] == seg_ref
        if self.copies.count:
            out |= self.copies.on(rows, seg_ref)
        return out

    def forget_segment(self, seg_ref: int) -> None:
        self._oldest.pop(seg_ref, None)
