"""A block's further replicas, in columns beside the block table (:mod:`kvstore.meta.table`).

A row of the table holds a block's *primary* replica: the copy readers get, in the highest tier
that holds it. Further copies of the same block, committed on the same daemon in a lower tier,
are rows of this store: its segment, extent, size and generation (the payload's length and
checksum are the block's, in the table). The table's ``copy`` column names a row's first copy
(0: none, else its index + 1) and each copy names the next the same way, so a block may have
any number of them; the index keeps at most one today: the clean SSD copy of a block that was
promoted to DRAM, or that a daemon's inventory reports on both tiers (:mod:`kvstore.meta.compact`).

Copies are few next to the blocks (only blocks in DRAM with an SSD copy have one), so they live
here rather than as columns of every row: a row pays 4 bytes for the link, a copy 40.
"""

from __future__ import annotations

import numpy as np

_COLUMNS = (("row", np.int64), ("seg", np.uint32), ("off", np.uint64), ("size", np.uint64),
            ("gen", np.uint64), ("next", np.uint32))  # fmt: skip


class Copies:
    """The copies of the table's rows (see the module docstring). Pure state, no locking."""

    def __init__(self, link: np.ndarray, cap: int = 64) -> None:
        """``link``: the table's ``copy`` column (handed again by :meth:`relink` when the table
        grows it)."""
        self.link = link
        self.cap = cap
        for name, t in _COLUMNS:
            setattr(self, name, np.zeros(cap, dtype=t))
        self.used = 0  # slots ever used; the free ones are on _free
        self._free: list[int] = []
        self.count = 0

    def relink(self, link: np.ndarray) -> None:
        self.link = link

    def add(self, row: int, seg: int, off: int, size: int, gen: int) -> int:
        """A copy of ``row`` (first in its chain); returns its index."""
        if self._free:
            i = self._free.pop()
        else:
            if self.used == self.cap:
                self.cap *= 2
                for name, _ in _COLUMNS:
                    setattr(self, name, np.resize(getattr(self, name), self.cap))
            i = self.used
            self.used += 1
        self.row[i], self.seg[i], self.off[i], self.size[i], self.gen[i] = row, seg, off, size, gen
        self.next[i] = self.link[row]
        self.link[row] = i + 1
        self.count += 1
        return i

    def of(self, row: int) -> list[int]:
        """The copies of ``row``, first first."""
        out = []
        c = int(self.link[row])
        while c:
            out.append(c - 1)
            c = int(self.next[c - 1])
        return out

    def remove(self, i: int) -> None:
        """Unlinks copy ``i`` from its row's chain and frees its slot."""
        row = int(self.row[i])
        c = int(self.link[row])
        if c == i + 1:
            self.link[row] = self.next[i]
        else:
            while c:
                if int(self.next[c - 1]) == i + 1:
                    self.next[c - 1] = self.next[i]
                    break
                c = int(self.next[c - 1])
        self.row[i] = -1
        self.next[i] = 0
        self._free.append(i)
        self.count -= 1

    def on(self, rows: np.ndarray, seg_ref: int) -> np.ndarray:
        """Whether each of ``rows`` has a copy on segment ``seg_ref``."""
        out = np.zeros(len(rows), dtype=bool)
        c = self.link[rows].astype(np.int64)
        while True:
            has = c > 0
            if not has.any():
                return out
            i = c[has] - 1
            out[has] |= self.seg[i] == seg_ref
            c[has] = self.next[i]

    def rows_on(self, seg_ref: int) -> np.ndarray:
        """The rows with a copy on segment ``seg_ref``."""
        n = self.used
        return self.row[:n][(self.seg[:n] == seg_ref) & (self.row[:n] >= 0)]

    def first_on(self, row: int, seg_ref: int) -> int:
        """The index of ``row``'s copy on ``seg_ref``, -1 if none."""
        for i in self.of(row):
            if int(self.seg[i]) == seg_ref:
                return i
        return -1

    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name, _ in _COLUMNS)

    def check_integrity(self, n_rows: int) -> None:
        n = self.used
        live = np.flatnonzero(self.row[:n] >= 0)
        assert len(live) == self.count, f"copies {len(live)} != {self.count}"
        seen = 0
        for row in np.flatnonzero(self.link[:n_rows]).tolist():
            for i in self.of(row):
                assert int(self.row[i]) == row, f"copy {i} is linked from row {row} but names {int(self.row[i])}"
                seen += 1
        assert seen == self.count, f"copies linked {seen} != {self.count}"
