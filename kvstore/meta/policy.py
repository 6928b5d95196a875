"""The index's cache policy: which block leaves a full segment, in what order DRAM is demoted
to SSD, and whether a new block is worth storing at all (admission). Its state is columns of
the block table (:mod:`kvstore.meta.table`): a block's access count (``freq``) and second
chance's mark (``again``); its parameters are one :class:`~kvstore.meta.records.PolicyParams`
handed to the index (``IndexLimits.policy``).

Two policies, chosen by ``meta.cache_policy``:

- ``lru``: every stored block is kept until it is the least recently used; a request touches
  its chain tail first, so a chain's tail leaves before its head (a block is worthless without
  its predecessors). What vLLM's prefix cache does.
- ``adaptive`` (the default): the same recency order, plus a per-block access count, and a
  choice, made continuously from what the traffic rewards, between three ways of using them:

  * *recency mode*: as ``lru``;
  * *second-chance mode*: the recency order, but a block read again since it was stored (or
    since its last second chance) is passed over once when it is the least recent: it loses
    its mark and goes to the most recent end (CLOCK's second chance, Corbato 1968, on the LRU
    order; the lazy promotion of Yang et al., HotOS 2023). Blocks a conversation came back to
    outlast one-time tails by up to one more pass through the cache, and every block is still
    stored;
  * *frequency mode*: the victim is the least-counted of the ``sample`` least recent evictable
    blocks (sampled LFU, as Redis' LFU and hyperbolic caching evict), and a new block is stored
    only if its count is above that victim's (TinyLFU-style admission): a request's one-time
    tail cannot flush a prefix that many requests share.

  Counts are kept for stored blocks and, in a bounded FIFO history, for blocks seen but not
  stored (``history_factor`` x the blocks indexed), so that a block seen again soon earns its
  place. They halve every ``age_factor`` x the blocks indexed accesses (TinyLFU's reset period
  of 10 x the cache size), lazily, by an epoch stamp, so aging costs nothing up front.

  The mode is chosen by dueling shadow caches (:mod:`kvstore.meta.duel`): each mode in
  miniature replays a hash-sampled part of the keys (about ``shadow_blocks`` blocks' worth).
  Between recency and second chance, which keep nearly the same blocks, the policy takes the
  one whose shadow earns more by more than the noise of their paired difference. Against
  frequency it moves to the mode whose shadow earns clearly more prefix hits: ``margin`` more,
  and a difference above ``significance`` standard deviations of the sampling noise (the
  conventional two-sided 95 % level), the same hysteresis both ways, so that noise does not
  flip the mode back and forth (every switch costs the blocks the other mode would have kept).
  Each shadow's hits are weighed by what the index itself earned per shadow hit while in that
  mode (:meth:`kvstore.meta.duel.Duel.calibration`): a frequency mode that does not deliver what
  its shadow promised is left and not re-entered on the same promise.
  It starts in recency mode; until the index first needs room (until then no switch has a
  cost) the mode is what the rule for entering frequency mode says at each request, with no
  hysteresis. Recency wins on traffic whose reuse is recent (chat, document QA);
  frequency wins where most blocks are used once and a few prefixes are used by many
  (production conversation traces).

Chain order in every mode: a request's blocks are touched tail first, so among equal counts the
tail is older; a descendant is never counted more than its ancestors (every request that reads
it reads them), so the frequency mode also takes a chain's tail before its head; a read marks a
block and its ancestors together, so second chance passes a chain over tail first too.
Admission goes in chain order too: once a block of a put is declined, the rest of that put is.

The index calls :meth:`Lru.victim` for the row to evict, :meth:`Lru.admits` before the first
eviction a put's block would cause, :meth:`Lru.entering` / :meth:`Lru.leaving` as a block enters
or leaves the table, :meth:`Lru.access` for every read, and :meth:`Lru.demotion_order` to plan
demotions.

Costs: O(1) per touched block (vectorised column updates and counter arithmetic), O(``sample``) per
eviction in frequency mode, O(1) per block read, amortized, for second chance's passes (each
spends a mark a read set). Parameters come from the papers named above, not from fitting a
workload: 10 % / 10 x periods (TinyLFU), 64 samples (hyperbolic caching), shadow caches of a few
hundred blocks (set dueling uses 32 sets of a few thousand lines), switches at the 95 %
significance level, and the duel's evidence weighed over four aging periods (the span the
frequency mode's counts are built over; ``window_factor``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.meta.counts import EPOCH_SHIFT, AdaptiveCounts, aged, until
from kvstore.meta.duel import MAX_COUNT
from kvstore.meta.records import PolicyParams
from kvstore.meta.table import LIVE, BlockTable, words

_SHIFT = np.uint64(EPOCH_SHIFT)
# Least recent rows looked at for a clean drop (a block with a copy elsewhere) in the DRAM of a
# daemon with an SSD: a bound on the search; past it, nothing qualifies.
CLEAN_SCAN = 512
_LOW = np.uint64(MAX_COUNT)


class Lru:
    """``lru``: recency is the table's stamps, kept as the calls come; nothing to defer."""

    name = "lru"

    def __init__(self, table: BlockTable, params: PolicyParams | None = None) -> None:
        self.table = table
        self.params = params or PolicyParams()
        self.defer = False

    def drain(self) -> None:
        """Nothing is deferred."""

    def access(self, keys: Sequence[bytes], hits: int) -> None:
        """Recency is the table's stamps: nothing more to count."""

    def entering(self, key: bytes) -> int:
        """A block is about to enter the table: its ``freq`` column's value."""
        return 0

    def entering_many(self, q: np.ndarray) -> np.ndarray:
        """:meth:`entering` for a batch of keys ((n, 2) words), their ``freq`` values."""
        return np.zeros(len(q), dtype=np.uint64)

    def entered(self, rows: np.ndarray, freqs: list[int] | np.ndarray) -> None:
        """The blocks announced by :meth:`entering` are in the table, at ``rows``; ``freqs``
        is what :meth:`entering` gave for each."""

    def gave_up(self, keys: list[bytes], freqs: list[int]) -> None:
        """The blocks announced by :meth:`entering` (their counts ``freqs``) never entered."""

    def leaving(self, row: int) -> None:
        """``row`` is about to leave the table."""

    def leaving_many(self, rows: np.ndarray, staying: int | None = None) -> None:
        """``rows`` are about to leave the table, in this order; ``staying``: how many blocks
        remain once they and the others leaving with them are gone (default: all but these)."""

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


class Adaptive(AdaptiveCounts, Lru):
    """``adaptive`` (see the module docstring)."""

    name = "adaptive"

    def __init__(self, table: BlockTable, params: PolicyParams | None = None) -> None:
        super().__init__(table, params)
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

    def entering_many(self, q: np.ndarray) -> np.ndarray:
        """Counts out of the history for the keys that are in it (a chunk's worth of lookups;
        none at all while the history is empty, as after a restart)."""
        out = np.zeros(len(q), dtype=np.uint64)
        self._entering += len(q)
        if self.history:
            packed = np.ascontiguousarray(q, dtype="<u8").tobytes()
            for i in range(len(q)):
                k = packed[16 * i : 16 * i + 16]
                if k in self.history:
                    out[i] = self._from_history(k)
        return out

    def entered(self, rows: np.ndarray, freqs: list[int] | np.ndarray) -> None:
        self._entering = 0
        self.table.freq[rows] = freqs

    def gave_up(self, keys: list[bytes], freqs: list[int]) -> None:
        for k, f in zip(keys, freqs):  # one at a time, in placement order
            self._to_history(k, f)
            self._entering -= 1
        self._entering = 0

    def leaving(self, row: int) -> None:
        self._to_history(self.table.key(row), int(self.table.freq[row]))

    def leaving_many(self, rows: np.ndarray, staying: int | None = None) -> None:
        """As :meth:`leaving` for each, in order, but only the last rows whose counts the
        history can keep once they are gone are written to it (the others would be pushed out
        by them): a daemon's whole segment leaving costs what the history holds, not its rows
        (``staying``: the blocks left once the daemon's are all gone, where they go in parts)."""
        self.drain()
        t = self.table
        p = self.params
        left = t.live - len(rows) if staying is None else staying
        after = max(p.min_population, left + self._entering)
        keep = min(len(rows), p.history_max, int(p.history_factor * after))
        rows = rows[len(rows) - keep :]
        counts = _aged(t.freq[rows], self.epoch)
        rows, counts = rows[counts > 0], counts[counts > 0]
        packed = t.keys(rows)
        stamp = self.epoch << EPOCH_SHIFT
        for i, c in enumerate(counts.tolist()):
            self.history[packed[16 * i : 16 * i + 16]] = stamp | c
        limit = self._history_limit()
        while len(self.history) > limit:
            self.history.popitem(last=False)

    def count(self, key: bytes) -> int:
        self.drain()
        row = int(self.table.find(words(key))[0])
        return aged(int(self.table.freq[row]), self.epoch) if row >= 0 else self._history_count(key)

    def victim(self, seg_ref: int, clean: bool = False) -> int:
        if clean:
            oldest = clean_rows(self.table, seg_ref)
        else:  # the least recent alone (a scalar walk: most evictions need no more)
            first = self.table.oldest(seg_ref)
            oldest = np.array([first] if first >= 0 else [], dtype=np.int64)
        if not len(oldest):
            return -1  # nothing evictable: the policy's state is not asked
        self.drain()
        self.duel.free = False
        if clean:  # the mode's choice among the few that qualify (no second chance given)
            if self.frequency_mode:
                rows = oldest[: self.params.sample]
                return int(rows[int(np.argmin(np.maximum(_aged(self.table.freq[rows], self.epoch), 1)))])
            if self.second_chance_mode:
                fresh = oldest[self.table.again[oldest] != self._spell]
                return int(fresh[0] if len(fresh) else oldest[0])
            return int(oldest[0])
        if self.second_chance_mode:
            return self._second_chance(seg_ref)
        if not self.frequency_mode:
            return int(oldest[0])
        rows = self.table.oldest_batch(seg_ref, self.params.sample)
        counts = np.maximum(_aged(self.table.freq[rows], self.epoch), np.uint64(1))
        return int(rows[int(np.argmin(counts))])  # the first least counted: the oldest of them

    def _second_chance(self, seg_ref: int) -> int:
        """CLOCK's second chance on the recency order, as ``AdaptivePolicy._second_chance``: the
        least recent row not marked in this spell; those passed over lose the mark and become
        the most recent, in their order. Walked ``sample`` rows at a time, the rows passed over made
        most recent as each batch is walked: the same order as after the walk, and the same
        victim when every row is marked (the first passed over, least recent again by then)."""
        t = self.table
        spell = self._spell
        while True:
            rows = t.oldest_batch(seg_ref, self.params.sample)
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
        # Among the least recent (at least ``sample`` of them): least counted first (frequency), or
        # not read again first (second chance); ties oldest first.
        pool = _oldest_worth(t, seg_ref, want, self.params.sample).tolist()
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


POLICIES = {"adaptive": Adaptive, "lru": Lru}  # meta.cache_policy
