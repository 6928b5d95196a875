"""The index's cache policy: which block leaves a full segment, in what order DRAM is demoted
to SSD, and whether a new block is worth storing at all (admission).

Two policies, chosen by ``meta.cache_policy``:

- ``lru``: every stored block is kept until it is the least recently used; a request touches
  its chain tail first, so a chain's tail leaves before its head (a block is worthless without
  its predecessors). What vLLM's prefix cache does.
- ``adaptive`` (the default): the same recency order, plus a per-block access count, and a
  choice, made continuously from what the traffic rewards, between two ways of using them:

  * *recency mode*: as ``lru``;
  * *frequency mode*: the victim is the least-counted of the ``SAMPLE`` least recent evictable
    blocks (sampled LFU, as Redis' LFU and hyperbolic caching evict), and a new block is stored
    only if its count is above that victim's (TinyLFU-style admission): a request's one-time
    tail cannot flush a prefix that many requests share.

  Counts are kept for stored blocks and, in a bounded FIFO history, for blocks seen but not
  stored (``HISTORY_FACTOR`` x the blocks indexed), so that a block seen again soon earns its
  place. They halve every ``AGE_FACTOR`` x the blocks indexed accesses (TinyLFU's reset period
  of 10 x the cache size), lazily, by an epoch stamp, so aging costs nothing up front.

  The mode is chosen by dueling shadow caches (:mod:`kvstore.meta.duel`): each mode in
  miniature replays a hash-sampled part of the keys (about ``SHADOW_BLOCKS`` blocks' worth), and
  the policy moves to the mode whose shadow earns clearly more prefix hits: ``MARGIN`` more,
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

Chain order in both modes: a request's blocks are touched tail first, so among equal counts the
tail is older; a descendant is never counted more than its ancestors (every request that reads
it reads them), so the frequency mode also takes a chain's tail before its head. Admission goes
in chain order too: once a block of a put is declined, the rest of that put is.

Costs: O(1) per touched block (dictionary operations and counter arithmetic), O(``SAMPLE``) per
eviction in frequency mode. Parameters come from the papers named above, not from fitting a
workload: 10 % / 10 x periods (TinyLFU), 64 samples (hyperbolic caching), shadow caches of a few
hundred blocks (set dueling uses 32 sets of a few thousand lines), switches at the 95 %
significance level, and the duel's evidence weighed over four aging periods (the span the
frequency mode's counts are built over; :data:`kvstore.meta.duel.WINDOW_FACTOR`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvstore.meta.duel import AGE_FACTOR, FREQUENCY, HISTORY_FACTOR, MAX_COUNT, MODES, SAMPLE, Duel

if TYPE_CHECKING:
    from kvstore.meta.records import Entry, Replica

POLICIES = ("adaptive", "lru")
HISTORY_MAX = 1 << 20
MIN_POPULATION = 1024
PENDING_MAX = 1 << 16  # queued accesses (keys) that force a drain
_EPOCH_SHIFT = 8


def _count(packed: int, epoch: int) -> int:
    """A count stored as ``epoch << 8 | count``, aged to ``epoch`` (halved once per epoch)."""
    return (packed & MAX_COUNT) >> min(8, epoch - (packed >> _EPOCH_SHIFT))


def _stored(e: Entry, epoch: int) -> int:
    """A stored block's count: aged, but never below 1 (it was read or written once)."""
    return max(1, _count(e.freq, epoch))


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
        # With ``defer`` (the service sets it), accesses are queued and accounted at the next
        # drain(): the service drains right after answering, so a read's accounting is off its
        # critical path. Every other method drains first, and the index tells the policy of a
        # block's arrival or departure before its entries change, so the order of events the
        # policy sees, and so every decision, is the same as without.
        self.defer = False
        self._pending: list[tuple[Sequence[bytes], int]] = []
        self._pending_keys = 0

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

    def access(self, keys: Sequence[bytes], hits: int) -> None:
        if not self.defer:
            self._access(keys, hits)
            return
        self._pending.append((keys, hits))
        self._pending_keys += len(keys)
        if self._pending_keys >= PENDING_MAX:
            self.drain()

    def drain(self) -> None:
        """Accounts the queued accesses, in order."""
        if self._pending:
            pending, self._pending, self._pending_keys = self._pending, [], 0
            for keys, hits in pending:
                self._access(keys, hits)

    def _access(self, keys: Sequence[bytes], hits: int) -> None:
        get = self.entries.get
        epoch = self.epoch
        stamp = epoch << _EPOCH_SHIFT
        hist = self.history
        for k in keys:
            e = get(k)
            if e is not None:
                e.freq = stamp | min(MAX_COUNT, _count(e.freq, epoch) + 1)
            else:
                old = hist.pop(k, None)
                hist[k] = stamp | min(MAX_COUNT, (_count(old, epoch) if old is not None else 0) + 1)
        limit = self._history_limit()
        while len(hist) > limit:
            hist.popitem(last=False)
        self._n += len(keys)
        if self._n >= AGE_FACTOR * self._population():
            self._n = 0
            self.epoch += 1
        self.duel.observe(keys, len(self.entries), hits)

    def created(self, e: Entry) -> None:
        self.drain()
        old = self.history.pop(e.key, None)
        if old is not None:
            e.freq = (self.epoch << _EPOCH_SHIFT) | _count(old, self.epoch)

    def removed(self, e: Entry) -> None:
        self.drain()
        c = _count(e.freq, self.epoch)
        if c:
            self.history[e.key] = (self.epoch << _EPOCH_SHIFT) | c
            if len(self.history) > self._history_limit():
                self.history.popitem(last=False)

    def count(self, key: bytes) -> int:
        self.drain()
        e = self.entries.get(key)
        if e is not None:
            return _count(e.freq, self.epoch)
        old = self.history.get(key)
        return _count(old, self.epoch) if old is not None else 0

    def pick(self, candidates: Iterator[Replica]) -> Replica | None:
        self.drain()
        self.duel.free = False
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

    def admits(self, key: bytes, victim: Replica) -> bool:
        self.drain()
        if not self.frequency_mode:
            return True
        return self.count(key) > _stored(victim.entry, self.epoch)

    def demotion_order(self, candidates: Iterable[Replica], want: int) -> list[Replica]:
        self.drain()
        if not self.frequency_mode:
            return super().demotion_order(candidates, want)
        # Least counted first among the least recent (at least SAMPLE of them), ties oldest first.
        pool: list[Replica] = []
        acc = 0
        for rep in candidates:
            if acc >= want and len(pool) >= SAMPLE:
                break
            pool.append(rep)
            acc += rep.size
        epoch = self.epoch
        pool.sort(key=lambda r: _stored(r.entry, epoch))  # stable: recency breaks ties
        return super().demotion_order(pool, want)

    def check_integrity(self) -> None:
        self.drain()
        assert not any(k in self.entries for k in self.history), "a stored block's count is also in the history"
        assert all(_count(e.freq, self.epoch) <= MAX_COUNT for e in self.entries.values())

    def stats(self) -> dict[str, int]:
        # Read-only, without a drain: the metrics thread calls it while the service runs.
        return {
            "policy_frequency_mode": int(self.frequency_mode),
            "policy_mode_switches": self.mode_switches,
            **{f"policy_{m}_keys": n for m, n in zip(MODES, self.duel.keys_in)},
            "policy_history": len(self.history),
            "policy_epoch": self.epoch,
            **{f"policy_{m}_calibration_permille": round(1000 * k) for m, k in zip(MODES, self.duel.calibration())},
        }


def make_policy(name: str, entries: dict[bytes, Entry]) -> LruPolicy:
    if name == "adaptive":
        return AdaptivePolicy(entries)
    if name == "lru":
        return LruPolicy(entries)
    raise ValueError(f"unknown cache policy {name!r} (one of {', '.join(POLICIES)})")
