"""The index's cache policy: which block leaves a full segment, in what order DRAM is demoted
to SSD, and whether a new block is worth storing at all (admission).

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
  * *frequency mode*: the victim is the least-counted of the ``SAMPLE`` least recent evictable
    blocks (sampled LFU, as Redis' LFU and hyperbolic caching evict), and a new block is stored
    only if its count is above that victim's (TinyLFU-style admission): a request's one-time
    tail cannot flush a prefix that many requests share.

  Counts are kept for stored blocks and, in a bounded FIFO history, for blocks seen but not
  stored (``HISTORY_FACTOR`` x the blocks indexed), so that a block seen again soon earns its
  place. They halve every ``AGE_FACTOR`` x the blocks indexed accesses (TinyLFU's reset period
  of 10 x the cache size), lazily, by an epoch stamp, so aging costs nothing up front.

  The mode is chosen by dueling shadow caches (:mod:`kvstore.meta.duel`): each mode in
  miniature replays a hash-sampled part of the keys (about ``SHADOW_BLOCKS`` blocks' worth).
  Between recency and second chance, which keep nearly the same blocks, the policy takes the
  one whose shadow earns more by more than the noise of their paired difference. Against
  frequency it moves to the mode whose shadow earns clearly more prefix hits: ``MARGIN`` more,
  and a difference above ``SIGNIFICANCE`` standard deviations of the sampling noise (the
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

Costs: O(1) per touched block (dictionary operations and counter arithmetic), O(``SAMPLE``) per
eviction in frequency mode, O(1) per block read, amortized, for second chance's passes (each
spends a mark a read set). Parameters come from the papers named above, not from fitting a
workload: 10 % / 10 x periods (TinyLFU), 64 samples (hyperbolic caching), shadow caches of a few
hundred blocks (set dueling uses 32 sets of a few thousand lines), switches at the 95 %
significance level, and the duel's evidence weighed over four aging periods (the span the
frequency mode's counts are built over; :data:`kvstore.meta.duel.WINDOW_FACTOR`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvstore.meta.counts import EPOCH_SHIFT, AdaptiveCounts, aged, until
from kvstore.meta.duel import MAX_COUNT, SAMPLE

if TYPE_CHECKING:
    from kvstore.meta.records import Entry, Replica

POLICIES = ("adaptive", "lru")


def _stored(e: Entry, epoch: int) -> int:
    """A stored block's count: aged, but never below 1 (it was read or written once)."""
    return max(1, aged(e.freq, epoch))


class LruPolicy:
    """``lru``: recency only, every block admitted."""

    name = "lru"

    def __init__(self, entries: dict[bytes, Entry]) -> None:
        self.entries = entries
        self.defer = False  # nothing to defer here (AdaptivePolicy)

    @property
    def frequency_mode(self) -> bool:
        return False

    def access(self, keys: Sequence[bytes], hits: int) -> None:
        """A read of ``keys`` (a request's chain, hits and misses), of which the index held the
        first ``hits``."""

    def drain(self) -> None:
        """Accounts accesses queued by ``defer`` (none here)."""

    def created(self, e: Entry) -> None:
        """``e`` entered the index."""

    def removed(self, e: Entry) -> None:
        """``e`` left the index."""

    def count(self, key: bytes) -> int:
        return 0

    def pick(self, candidates: Iterator[Replica]) -> Replica | None:
        """The victim among eligible replicas given least recent first."""
        return next(candidates, None)

    def admits(self, key: bytes, victim: Replica) -> bool:
        """Whether storing ``key`` is worth evicting ``victim``."""
        return True

    def demotion_order(self, candidates: Iterable[Replica], want: int) -> list[Replica]:
        """Replicas to demote first, from eligible ones given least recent first, until their
        extents add up to ``want`` bytes."""
        return until(candidates, lambda rep: rep.size, want)

    def stats(self) -> dict[str, int]:
        return {}

    def check_integrity(self) -> None:
        """Asserts the policy's own accounting against the index's entries."""


class AdaptivePolicy(AdaptiveCounts, LruPolicy):
    """``adaptive``: see the module docstring."""

    name = "adaptive"

    def __init__(self, entries: dict[bytes, Entry]) -> None:
        super().__init__(entries)
        self._init_counts()

    def _population(self) -> int:
        return len(self.entries)

    def _bump(self, keys: Sequence[bytes], stamp: int, spell: int) -> Iterator[bytes]:
        """Counts an access of the stored ``keys`` (marking them in a spell); yields the others."""
        get = self.entries.get
        epoch = stamp >> EPOCH_SHIFT
        for k in keys:
            e = get(k)
            if e is not None:
                e.freq = stamp | min(MAX_COUNT, aged(e.freq, epoch) + 1)
                if spell:
                    e.again = spell
            else:
                yield k

    def created(self, e: Entry) -> None:
        freq = self._from_history(e.key)
        if freq:
            e.freq = freq

    def removed(self, e: Entry) -> None:
        self._to_history(e.key, e.freq)

    def count(self, key: bytes) -> int:
        self.drain()
        e = self.entries.get(key)
        return aged(e.freq, self.epoch) if e is not None else self._history_count(key)

    def pick(self, candidates: Iterator[Replica]) -> Replica | None:
        self.drain()
        self.duel.free = False
        if self.second_chance_mode:
            return self._second_chance(candidates)
        if not self.frequency_mode:
            return next(candidates, None)
        best = None
        best_c = MAX_COUNT + 1
        epoch = self.epoch
        for _, rep in zip(range(SAMPLE), candidates):
            c = _stored(rep.entry, epoch)
            if c < best_c:
                best, best_c = rep, c
        return best

    def _second_chance(self, candidates: Iterator[Replica]) -> Replica | None:
        """CLOCK's second chance on the recency order: the least recent block not read again
        (in this spell of second-chance mode) since it was stored or since its last second
        chance; those passed over lose the mark and go to the most recent end of their
        segment's order, in their order. If every candidate was read again, the least recent
        goes (after the others are passed over).

        The walk has no bound, as CLOCK's hand has none: each block passed over spends a mark
        that a read set, so the walks cost O(1) per block read, amortized, and one walk is at
        most as long as the run of blocks read since they were last passed over at the least
        recent end (every block of a segment, once, if all of it was read again between two
        evictions: about half a second per million blocks); marks are set only in this mode, and
        a new spell of it starts with none, so no walk crosses marks left from before. Chain
        order holds: a read marks a block and its predecessors together and touches the
        predecessors last, so a block reaches the end after its descendants, and a descendant
        passed over earlier is either unmarked (found first) or was read again (and so were its
        predecessors, after it). Predecessors left less recent than a descendant passed over are
        still marked, which is what keeps them; as the spell ends, :meth:`_end_spell` puts them
        after it."""
        passed: list[Replica] = []
        victim = None
        spell = self._spell
        for rep in candidates:
            if rep.entry.again != spell:
                victim = rep
                break
            passed.append(rep)
        first = 0
        if victim is None and passed:
            victim, first = passed[0], 1
        for rep in passed[first:]:  # after the walk: the candidates iterate the segment's order
            rep.entry.again = 0
            rep.segment.lru.move_to_end(rep.entry.key)
        return victim

    def _end_spell(self) -> None:
        """Puts chain order back in the recency order as a spell of second-chance mode ends.

        Within a spell, a block passed over goes to the most recent end without its
        predecessors, which may so stay less recent than it: their marks (a read marks a block
        and its predecessors together, and a predecessor's mark is spent only by its own pass,
        which puts it after the block) keep them from going first. Outside the spell marks count
        for nothing, so every block still marked goes to the most recent end now, in its order:
        each is then more recent than any block it precedes in a chain. One walk of the orders
        of the segments that hold a marked block, at most once per spell: spells end only when
        the duel changes mode."""
        spell = self._spell
        segments = {rep.segment for e in self.entries.values() if e.again == spell for rep in e.replicas}
        for seg in segments:
            lru = seg.lru
            for key in [k for k, rep in lru.items() if rep.entry.again == spell]:
                lru.move_to_end(key)

    def admits(self, key: bytes, victim: Replica) -> bool:
        self.drain()
        if not self.frequency_mode:
            return True
        return self.count(key) > _stored(victim.entry, self.epoch)

    def demotion_order(self, candidates: Iterable[Replica], want: int) -> list[Replica]:
        self.drain()
        if not self.frequency_mode and not self.second_chance_mode:
            return super().demotion_order(candidates, want)
        # Among the least recent (at least SAMPLE of them): least counted first (frequency), or
        # not read again first (second chance); ties oldest first.
        pool: list[Replica] = []
        acc = 0
        for rep in candidates:
            if acc >= want and len(pool) >= SAMPLE:
                break
            pool.append(rep)
            acc += rep.size
        if self.second_chance_mode:  # blocks not read again first, stable: recency breaks ties
            spell = self._spell
            pool.sort(key=lambda r: r.entry.again == spell)
        else:
            epoch = self.epoch
            pool.sort(key=lambda r: _stored(r.entry, epoch))  # stable: recency breaks ties
        return super().demotion_order(pool, want)

    def check_integrity(self) -> None:
        self.drain()
        assert not any(k in self.entries for k in self.history), "a stored block's count is also in the history"
        assert all(aged(e.freq, self.epoch) <= MAX_COUNT for e in self.entries.values())
        assert all(0 <= e.again <= self._spell for e in self.entries.values()), "a mark of a spell yet to come"


def make_policy(name: str, entries: dict[bytes, Entry]) -> LruPolicy:
    if name == "adaptive":
        return AdaptivePolicy(entries)
    if name == "lru":
        return LruPolicy(entries)
    raise ValueError(f"unknown cache policy {name!r} (one of {', '.join(POLICIES)})")
