"""The compact index's cache policies, over the block table's columns: which row leaves a full
segment, in what order DRAM is demoted to SSD, and whether a new block is stored at all.

- ``lru`` (:class:`TableLru`): a segment's least recently used evictable row is its victim, every
  block is admitted (the table's recency stamps, :mod:`kvstore.meta.table`).
- ``adaptive`` (:class:`TableAdaptive`): the object index's adaptive policy
  (:mod:`kvstore.meta.policy`, where the modes, their duel and their parameters are described),
  with a stored block's access count and second-chance mark kept in the table's ``freq`` and
  ``again`` columns instead of on an entry. The counts' aging, the history of blocks not stored,
  the duel and the deferral of accesses are the same code (:class:`AdaptiveCounts`), and every
  decision is the object index's: the tests replay random operation sequences on both indexes
  and compare every answer.

The index calls :meth:`victim` for the row to evict, :meth:`admits` before the first eviction a
put's block would cause, :meth:`entering` / :meth:`leaving` as a block enters or leaves the
table, :meth:`access` for every read, and :meth:`demotion_order` to plan demotions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.meta.counts import EPOCH_SHIFT, AdaptiveCounts, aged, until
from kvstore.meta.duel import MAX_COUNT, SAMPLE
from kvstore.meta.table import LIVE, BlockTable, words

_SHIFT = np.uint64(EPOCH_SHIFT)
# Least recent rows looked at for a clean drop (a block with a copy elsewhere) in the DRAM of a
# daemon with an SSD: a bound on the search, as the object index's; past it, nothing qualifies.
CLEAN_SCAN = 512
_LOW = np.uint64(MAX_COUNT)


class TableLru:
    """``lru`` on the block table: recency is kept as the calls come, nothing to defer."""

    name = "lru"

    def __init__(self, table: BlockTable) -> None:
        self.table = table
        self.defer = False

    def drain(self) -> None:
        """Nothing is deferred."""

    def access(self, keys: Sequence[bytes], hits: int) -> None:
        """Recency is the table's stamps: nothing more to count."""

    def entering(self, key: bytes) -> int:
        """A block is about to enter the table: its ``freq`` column's value."""
        return 0

    def entered(self, rows: np.ndarray, freqs: list[int]) -> None:
        """The blocks announced by :meth:`entering` are in the table, at ``rows``; ``freqs``
        is what :meth:`entering` gave for each."""

    def gave_up(self, keys: list[bytes], freqs: list[int]) -> None:
        """The blocks announced by :meth:`entering` (their counts ``freqs``) never entered."""

    def leaving(self, row: int) -> None:
        """``row`` is about to leave the table."""

    def victim(self, seg_ref: int, clean: bool = False) -> int:
        """The row to evict from segment ``seg_ref`` (-1: none is evictable); ``clean``: only a
        row with a copy elsewhere (:func:`clean_rows`)."""
        if clean:
            rows = clean_rows(self.table, seg_ref)
            return int(rows[0]) if len(rows) else -1
        return self.table.oldest(seg_ref)

    def admits(self, key: bytes, victim: int) -> bool:
        """Whether storing ``key`` is worth evicting ``victim``."""
        return True

    def demotion_order(self, seg_ref: int, want: int) -> list[int]:
        """Rows of the segment to demote, first first, until their extents add up to ``want``."""
        return until(_oldest_worth(self.table, seg_ref, want).tolist(), self._size, want)

    def _size(self, row: int) -> int:
        return int(self.table.size[row])

    def stats(self) -> dict[str, int]:
        return {}

    def check_integrity(self) -> None:
        """Nothing of its own to check."""


def clean_rows(t: BlockTable, seg_ref: int) -> np.ndarray:
    """Among the :data:`CLEAN_SCAN` least recently used evictable rows of segment ``seg_ref``
    (whose primary replica is there), those with a copy elsewhere, oldest first."""
    rows = t.oldest_batch(seg_ref, CLEAN_SCAN)
    return rows[(t.copy[rows] != 0) & (t.seg[rows] == seg_ref)]


def _oldest_worth(t: BlockTable, seg_ref: int, want: int, at_least: int = 1) -> np.ndarray:
    """The segment's least recently used evictable rows, oldest first: as many as it takes for
    their extents to add up to ``want`` bytes, and at least ``at_least`` of them (or all)."""
    k = max(at_least, 64)
    while True:
        rows = t.oldest_batch(seg_ref, k)
        if len(rows) < k:
            return rows
        acc = np.cumsum(t.size[rows])
        enough = np.flatnonzero(acc >= want)
        if len(enough) and max(int(enough[0]) + 1, at_least) <= k:
            return rows[: max(int(enough[0]) + 1, at_least)]
        k *= 4


def _aged(freq: np.ndarray, epoch: int) -> np.ndarray:
    """Packed counts (``epoch << 8 | count``) aged to ``epoch``: :func:`kvstore.meta.counts.aged`
    over a column."""
    shift = np.minimum(np.uint64(8), np.uint64(epoch) - (freq >> _SHIFT))
    return (freq & _LOW) >> shift


class TableAdaptive(AdaptiveCounts, TableLru):
    """``adaptive`` on the block table (see the module docstring)."""

    name = "adaptive"

    def __init__(self, table: BlockTable) -> None:
        super().__init__(table)
        self._init_counts()
        self._entering = 0  # blocks a put has placed but not yet added to the table

    def _population(self) -> int:
        return self.table.live + self._entering

    def _bump(self, keys: Sequence[bytes], stamp: int, spell: int) -> list[bytes]:
        t = self.table
        rows = t.find(words(b"".join(keys)))
        here = rows >= 0
        if here.any():
            rows, times = np.unique(rows[here], return_counts=True)
            counts = np.minimum(_aged(t.freq[rows], stamp >> EPOCH_SHIFT) + times.astype(np.uint64), _LOW)
            t.freq[rows] = np.uint64(stamp) | counts
            if spell:
                t.again[rows] = spell
        return [k for k, h in zip(keys, here.tolist()) if not h]

    def _stored(self, row: int) -> int:
        """A stored block's count: aged, but never below 1 (it was read or written once)."""
        return max(1, aged(int(self.table.freq[row]), self.epoch))

    def entering(self, key: bytes) -> int:
        freq = self._from_history(key)
        self._entering += 1
        return freq

    def entered(self, rows: np.ndarray, freqs: list[int]) -> None:
        self._entering = 0
        self.table.freq[rows] = freqs

    def gave_up(self, keys: list[bytes], freqs: list[int]) -> None:
        for k, f in zip(keys, freqs):  # one at a time, as the object index drops its entries
            self._to_history(k, f)
            self._entering -= 1
        self._entering = 0

    def leaving(self, row: int) -> None:
        self._to_history(self.table.key(row), int(self.table.freq[row]))

    def count(self, key: bytes) -> int:
        self.drain()
        row = int(self.table.find(words(key))[0])
        return aged(int(self.table.freq[row]), self.epoch) if row >= 0 else self._history_count(key)

    def victim(self, seg_ref: int, clean: bool = False) -> int:
        oldest = clean_rows(self.table, seg_ref) if clean else self.table.oldest_batch(seg_ref, 1)
        if not len(oldest):
            return -1  # nothing evictable: not asked, as the object index does not ask its policy
        self.drain()
        self.duel.free = False
        if clean:  # the mode's choice among the few that qualify (no second chance given)
            if self.frequency_mode:
                rows = oldest[:SAMPLE]
                return int(rows[int(np.argmin(np.maximum(_aged(self.table.freq[rows], self.epoch), 1)))])
            if self.second_chance_mode:
                fresh = oldest[self.table.again[oldest] != self._spell]
                return int(fresh[0] if len(fresh) else oldest[0])
            return int(oldest[0])
        if self.second_chance_mode:
            return self._second_chance(seg_ref)
        if not self.frequency_mode:
            return int(oldest[0])
        rows = self.table.oldest_batch(seg_ref, SAMPLE)
        counts = np.maximum(_aged(self.table.freq[rows], self.epoch), np.uint64(1))
        return int(rows[int(np.argmin(counts))])  # the first least counted: the oldest of them

    def _second_chance(self, seg_ref: int) -> int:
        """CLOCK's second chance on the recency order, as ``AdaptivePolicy._second_chance``: the
        least recent row not marked in this spell; those passed over lose the mark and become
        the most recent, in their order. Walked SAMPLE rows at a time, the rows passed over made
        most recent as each batch is walked: the same order as after the walk, and the same
        victim when every row is marked (the first passed over, least recent again by then)."""
        t = self.table
        spell = self._spell
        while True:
            rows = t.oldest_batch(seg_ref, SAMPLE)
            if not len(rows):
                return -1
            marked = t.again[rows] == spell
            n = len(rows) if marked.all() else int(np.argmin(marked))
            passed = rows[:n]
            t.again[passed] = 0
            t.stamp(passed)
            if n < len(rows):
                return int(rows[n])

    def _end_spell(self) -> None:
        """As ``AdaptivePolicy._end_spell``: the evictable rows still marked become the most
        recent, in their order, so that chain order holds in the recency order again."""
        t = self.table
        n = t.n_rows
        rows = np.flatnonzero((t.again[:n] == self._spell) & ((t.flags[:n] & LIVE) != 0))
        rows = rows[t.evictable(rows)]
        t.stamp(rows[np.argsort(t.recent[rows], kind="stable")])

    def admits(self, key: bytes, victim: int) -> bool:
        self.drain()
        if not self.frequency_mode:
            return True
        return self.count(key) > self._stored(victim)

    def demotion_order(self, seg_ref: int, want: int) -> list[int]:
        self.drain()
        t = self.table
        if not self.frequency_mode and not self.second_chance_mode:
            return super().demotion_order(seg_ref, want)
        # Among the least recent (at least SAMPLE of them): least counted first (frequency), or
        # not read again first (second chance); ties oldest first.
        pool = _oldest_worth(t, seg_ref, want, SAMPLE).tolist()
        if self.second_chance_mode:
            spell = self._spell
            pool.sort(key=lambda r: int(t.again[r]) == spell)
        else:
            pool.sort(key=self._stored)
        return until(pool, self._size, want)

    def check_integrity(self) -> None:
        self.drain()
        t = self.table
        assert not self._entering, "blocks announced as entering were never added"
        n = t.n_rows
        live = (t.flags[:n] & LIVE) != 0
        assert not any(int(t.find(words(k))[0]) >= 0 for k in self.history), (
            "a stored block's count is also in the history"
        )
        assert (_aged(t.freq[:n][live], self.epoch) <= MAX_COUNT).all()
        assert (t.again[:n][live] <= self._spell).all(), "a mark of a spell yet to come"
