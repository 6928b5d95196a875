"""The index's cache policy: which block leaves a full segment, in what order DRAM is demoted
to SSD, and whether a new block is worth storing at all (admission).

Two policies, chosen by ``meta.cache_policy``:

- ``lru``: every stored block is kept until it is the least recently used; a request touches
  its chain tail first, so a chain's tail leaves before its head (a block is worthless without
  its predecessors). What vLLM's prefix cache does.
- ``adaptive`` (the default): the same recency order, plus a per-block access count and a
  "seen again" mark, and a choice, made continuously from what the traffic rewards, among three
  ways of using them:

  * *recency mode*: as ``lru``;
  * *balanced mode*: ARC (Megiddo and Modha, FAST 2003) over the index's blocks: a block seen
    once (ARC's T1) and a block read again while stored or stored again while remembered as a
    ghost (T2) are kept in one recency order; the victim is the least recent block of T1 while T1 holds
    more than the target ``p``, else the least recent of T2; evicted blocks are remembered as
    ghosts (at most as many as the blocks indexed), and a request for a ghost of T1 raises
    ``p`` (recency would have kept it), one for a ghost of T2 lowers it. Every block is
    admitted. One recency order serves both lists, so T2's blocks that the search for T1's
    victim passes go back to T1 at its most recent end (see :meth:`AdaptivePolicy._replace`):
    a block read again gets another pass where recency would drop it, and is kept over newer
    blocks seen once while T1 is over its target, but a T2 older than all of T1 is not held
    as ARC would hold it (a hot set under a stream of blocks used once is the frequency mode's).
  * *frequency mode*: the victim is the least-counted of the ``SAMPLE`` least recent evictable
    blocks (sampled LFU, as Redis' LFU and hyperbolic caching evict), and a new block is stored
    only if its count is above that victim's (TinyLFU-style admission): a request's one-time
    tail cannot flush a prefix that many requests share.

  Counts, marks, ghosts and ``p`` are kept in every mode, so a switch starts from what the
  traffic has shown. Counts are kept for stored blocks and, in a bounded FIFO history, for
  blocks seen but not stored (``HISTORY_FACTOR`` x the blocks indexed), so that a block seen
  again soon earns its place. They halve every ``AGE_FACTOR`` x the blocks indexed accesses
  (TinyLFU's reset period of 10 x the cache size), lazily, by an epoch stamp, so aging costs
  nothing up front.

  The mode is chosen by dueling shadow caches (:mod:`kvstore.meta.duel`): each mode in
  miniature replays a hash-sampled part of the keys, and the policy moves to the mode whose
  shadow earns clearly more prefix hits than the current one's (a paired significance test over
  requests, plus a margin for switches into or out of frequency mode). It starts in recency
  mode and switches freely until the first eviction. Recency wins on traffic whose reuse is recent (chat,
  document QA); frequency where most blocks are used once and a few prefixes are used by many
  (production conversation traces at a small capacity); balanced in between (the same traces
  at a larger one).

Chain order in every mode: a request's blocks are touched tail first, so among equal counts or
marks the tail is older; a descendant is never counted more than its ancestors (every request
that reads it reads them), nor seen again without them, so the frequency and balanced modes
also take a chain's tail before its head. Admission goes in chain order too: once a block of a
put is declined, the rest of that put is.

Costs: O(1) per touched block (dictionary operations and counter arithmetic), O(``SAMPLE``) per
eviction in the frequency mode, O(1) amortized per eviction in the balanced mode. Parameters
come from the papers named above, not from fitting a workload: 10 % / 10 x periods (TinyLFU), 64
samples (hyperbolic caching), ARC's own adaptation of ``p`` (no parameter), shadow caches of
about 2,000 sampled blocks (set dueling uses 32 sets of a few thousand lines), and switches at
the 95 % significance level.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvstore.meta.duel import AGE_FACTOR, BALANCED, FREQUENCY, HISTORY_FACTOR, MAX_COUNT, MODES, RECENCY, SAMPLE, Duel

if TYPE_CHECKING:
    from kvstore.meta.records import Entry, Replica

POLICIES = ("adaptive", "lru")
HISTORY_MAX = 1 << 20
MIN_POPULATION = 1024
PENDING_MAX = 1 << 16  # queued accesses (keys) that force a drain
# A stored block's policy word (Entry.freq): epoch << 9 | seen-again mark << 8 | count.
_SEEN_AGAIN = 1 << 8
_EPOCH_SHIFT = 9


def _count(packed: int, epoch: int) -> int:
    """A count stored as ``epoch << 9 | ... | count``, aged to ``epoch`` (halved once per epoch)."""
    return (packed & MAX_COUNT) >> min(8, epoch - (packed >> _EPOCH_SHIFT))


def _stored(e: Entry, epoch: int) -> int:
    """A stored block's count: aged, but never below 1 (it was read or written once)."""
    return max(1, _count(e.freq, epoch))


def seen_again(e: Entry) -> bool:
    """Whether ``e`` is in the balanced mode's T2: read while stored, or stored again while
    remembered as a ghost (and not passed over since by a search for T1's victim)."""
    return bool(e.freq & _SEEN_AGAIN)


class LruPolicy:
    """``lru``: recency only, every block admitted."""

    name = "lru"

    def __init__(self, entries: dict[bytes, Entry]) -> None:
        self.entries = entries
        self.defer = False  # nothing to defer here (AdaptivePolicy)

    @property
    def frequency_mode(self) -> bool:
        return False

    def access(self, keys: Sequence[bytes]) -> None:
        """A read of ``keys`` (a request's chain, hits and misses)."""

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
        out: list[Replica] = []
        acc = 0
        for rep in candidates:
            if acc >= want:
                break
            out.append(rep)
            acc += rep.size
        return out

    def stats(self) -> dict[str, int]:
        return {}

    def check_integrity(self) -> None:
        """Asserts the policy's own accounting against the index's entries."""


class AdaptivePolicy(LruPolicy):
    """``adaptive``: see the module docstring."""

    name = "adaptive"

    def __init__(self, entries: dict[bytes, Entry]) -> None:
        super().__init__(entries)
        self.epoch = 0
        self._n = 0
        self.history: OrderedDict[bytes, int] = OrderedDict()
        self.duel = Duel()
        # The balanced mode's state (ARC over the index): T1's target size, how many blocks
        # are seen again (T2; the others are T1), and the ghosts (key -> was in T2).
        self.p = 0.0
        self.seen_again = 0
        self.ghosts: OrderedDict[bytes, bool] = OrderedDict()
        self._ghosts_seen_again = 0
        # With ``defer`` (the service sets it), accesses are queued and accounted at the next
        # drain(): the service drains right after answering, so a read's accounting is off its
        # critical path. Every other method drains first, and the index tells the policy of a
        # block's arrival or departure before its entries change, so the order of events the
        # policy sees, and so every decision, is the same as without.
        self.defer = False
        self._pending: list[Sequence[bytes]] = []
        self._pending_keys = 0

    @property
    def mode(self) -> str:
        return MODES[self.duel.mode]  # as of the last drain

    @property
    def frequency_mode(self) -> bool:
        return self.duel.mode == FREQUENCY

    @property
    def mode_switches(self) -> int:
        return self.duel.switches

    def _population(self) -> int:
        return max(MIN_POPULATION, len(self.entries))

    def _history_limit(self) -> int:
        return min(HISTORY_MAX, HISTORY_FACTOR * self._population())

    def access(self, keys: Sequence[bytes]) -> None:
        if not self.defer:
            self._access(keys)
            return
        self._pending.append(keys)
        self._pending_keys += len(keys)
        if self._pending_keys >= PENDING_MAX:
            self.drain()

    def drain(self) -> None:
        """Accounts the queued accesses, in order."""
        if self._pending:
            pending, self._pending, self._pending_keys = self._pending, [], 0
            for keys in pending:
                self._access(keys)

    def _access(self, keys: Sequence[bytes]) -> None:
        get = self.entries.get
        epoch = self.epoch
        stamp = epoch << _EPOCH_SHIFT
        hist = self.history
        ghosts = self.ghosts
        for k in keys:
            e = get(k)
            if e is not None:
                if not e.freq & _SEEN_AGAIN:
                    self.seen_again += 1
                e.freq = stamp | _SEEN_AGAIN | min(MAX_COUNT, _count(e.freq, epoch) + 1)
            else:
                # A history word carries the mark for a ghost asked for again: stored again, the
                # block goes to T2, as in ARC.
                old = hist.pop(k, None)
                c = min(MAX_COUNT, (_count(old, epoch) if old is not None else 0) + 1)
                again = old is not None and old & _SEEN_AGAIN
                if k in ghosts:
                    self._ghost_hit(k)
                    again = True
                hist[k] = stamp | (_SEEN_AGAIN if again else 0) | c
        limit = self._history_limit()
        while len(hist) > limit:
            hist.popitem(last=False)
        self._n += len(keys)
        if self._n >= AGE_FACTOR * self._population():
            self._n = 0
            self.epoch += 1
        self.duel.observe(keys, len(self.entries))

    def _ghost_hit(self, key: bytes) -> None:
        """ARC's adaptation: a block asked for again after it left T1 says T1 should be larger,
        one that left T2 says T2 should; the step is the other ghost list's size over this one's
        (at least 1)."""
        b2 = self._ghosts_seen_again
        b1 = len(self.ghosts) - b2
        if self.ghosts.pop(key):
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))
            self._ghosts_seen_again -= 1
        else:
            self.p = min(float(self._population()), self.p + max(b2 / b1, 1.0))

    def created(self, e: Entry) -> None:
        self.drain()
        epoch = self.epoch
        old = self.history.pop(e.key, None)
        c = _count(old, epoch) if old is not None else 0
        again = old is not None and bool(old & _SEEN_AGAIN)
        if e.key in self.ghosts:  # stored again without a read first (a put of a block it evicted)
            self._ghost_hit(e.key)
            again = True
        if again:
            self.seen_again += 1
            e.freq = (epoch << _EPOCH_SHIFT) | _SEEN_AGAIN | c
        else:
            e.freq = (epoch << _EPOCH_SHIFT) | c

    def removed(self, e: Entry) -> None:
        self.drain()
        again = bool(e.freq & _SEEN_AGAIN)
        self.seen_again -= again
        c = _count(e.freq, self.epoch)
        if c:
            self.history[e.key] = (self.epoch << _EPOCH_SHIFT) | c
            if len(self.history) > self._history_limit():
                self.history.popitem(last=False)
        ghosts = self.ghosts
        if e.key in ghosts:
            self._ghosts_seen_again -= ghosts.pop(e.key)
        ghosts[e.key] = again
        self._ghosts_seen_again += again
        while len(ghosts) > max(MIN_POPULATION, len(self.entries) - 1):  # as many as stay indexed
            self._ghosts_seen_again -= ghosts.popitem(last=False)[1]

    def count(self, key: bytes) -> int:
        self.drain()
        e = self.entries.get(key)
        if e is not None:
            return _count(e.freq, self.epoch)
        old = self.history.get(key)
        return _count(old, self.epoch) if old is not None else 0

    def _evict_seen_again(self) -> bool:
        """The balanced mode's REPLACE: whether the victim should come from T2 (T1 is within its
        target ``p``, or empty)."""
        t1 = len(self.entries) - self.seen_again
        return t1 <= 0 or t1 <= self.p

    def pick(self, candidates: Iterator[Replica]) -> Replica | None:
        self.drain()
        self.duel.free = False
        if self.duel.mode == RECENCY:
            return next(candidates, None)
        if self.duel.mode == BALANCED:
            return self._replace(candidates)
        best = None
        best_c = MAX_COUNT + 1
        epoch = self.epoch
        for _, rep in zip(range(SAMPLE), candidates):
            c = _stored(rep.entry, epoch)
            if c < best_c:
                best, best_c = rep, c
        return best

    def _replace(self, candidates: Iterator[Replica]) -> Replica | None:
        """The balanced mode's victim: the least recent block of T1 while T1 is over its target
        (else of T2), found in the one recency order of the candidates.

        T2's blocks that the search for T1's passes over go back to T1, at its most recent end,
        least recent first (as a segmented LRU's protected segment overflows into its
        probationary one): they would otherwise gather where the search starts, and every
        search would pass them again. So the search costs O(1) amortized: a block is passed
        over once per mark, and a mark is set by an access. The search for T2's block, which
        moves nothing, looks at SAMPLE blocks at most, then takes the least recent of all.
        """
        from_t2 = self._evict_seen_again()
        first = None
        passed: list[Replica] = []
        victim = None
        for rep in candidates if not from_t2 else (r for _, r in zip(range(SAMPLE), candidates)):
            if bool(rep.entry.freq & _SEEN_AGAIN) == from_t2:
                victim = rep
                break
            first = first or rep
            if not from_t2:
                passed.append(rep)
        for rep in passed:
            e = rep.entry
            e.freq &= ~_SEEN_AGAIN
            self.seen_again -= 1
            rep.segment.lru.move_to_end(e.key)
        return victim or first

    def admits(self, key: bytes, victim: Replica) -> bool:
        self.drain()
        if self.duel.mode != FREQUENCY:
            return True
        return self.count(key) > _stored(victim.entry, self.epoch)

    def demotion_order(self, candidates: Iterable[Replica], want: int) -> list[Replica]:
        self.drain()
        if self.duel.mode == RECENCY:
            return super().demotion_order(candidates, want)
        # Among the least recent (at least SAMPLE of them): least counted first (frequency), or
        # the list REPLACE would take from first (balanced); ties oldest first.
        pool: list[Replica] = []
        acc = 0
        for rep in candidates:
            if acc >= want and len(pool) >= SAMPLE:
                break
            pool.append(rep)
            acc += rep.size
        if self.duel.mode == BALANCED:
            other = 0 if self._evict_seen_again() else _SEEN_AGAIN
            pool.sort(key=lambda r: r.entry.freq & _SEEN_AGAIN == other)  # stable: recency breaks ties
        else:
            epoch = self.epoch
            pool.sort(key=lambda r: _stored(r.entry, epoch))
        return super().demotion_order(pool, want)

    def check_integrity(self) -> None:
        self.drain()
        marked = sum(1 for e in self.entries.values() if e.freq & _SEEN_AGAIN)
        assert self.seen_again == marked, f"seen-again count {self.seen_again} != {marked} marked blocks"
        assert self.p >= 0.0, f"ARC target {self.p} below 0"
        assert len(self.ghosts) <= self._population(), f"{len(self.ghosts)} ghosts over {self._population()}"
        assert self._ghosts_seen_again == sum(self.ghosts.values()), "ghost list sizes"
        assert not any(k in self.entries for k in self.ghosts), "a stored block is also a ghost"

    def stats(self) -> dict[str, int]:
        # Read-only, without a drain: the metrics thread calls it while the service runs.
        return {
            "policy_mode": self.duel.mode,
            "policy_frequency_mode": int(self.duel.mode == FREQUENCY),
            "policy_mode_switches": self.mode_switches,
            **{f"policy_{m}_keys": n for m, n in zip(MODES, self.duel.keys_in)},
            "policy_history": len(self.history),
            "policy_ghosts": len(self.ghosts),
            "policy_epoch": self.epoch,
        }


def make_policy(name: str, entries: dict[bytes, Entry]) -> LruPolicy:
    if name == "adaptive":
        return AdaptivePolicy(entries)
    if name == "lru":
        return LruPolicy(entries)
    raise ValueError(f"unknown cache policy {name!r} (one of {', '.join(POLICIES)})")
