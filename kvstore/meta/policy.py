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

  The mode is chosen by *dueling* (Qureshi et al., ISCA 2007; the regret idea of LeCaR,
  Vietri et al., HotStorage 2018): two shadow caches, one per mode, replay a hash-sampled 1 in S
  of the keys (spatial sampling as in SHARDS, Waldspurger et al., FAST 2015; S = blocks indexed /
  ``SHADOW_BLOCKS``, so each shadow holds about ``SHADOW_BLOCKS`` blocks) and count their prefix
  hits on those keys, decayed with a half-life of ``AGE_FACTOR`` x a shadow's size in sampled
  accesses (the window the counts age over). Frequency mode, which declines blocks, is entered
  when its shadow earns ``MARGIN`` more than recency's and left when recency's earns ``MARGIN``
  more than its own (the same hysteresis both ways: a switch costs as much in either
  direction); either switch also needs the difference to pass ``SIGNIFICANCE`` standard
  deviations of the sampling noise (the conventional two-sided 95 % level), so that noise does
  not flip the mode back and forth (every switch costs the blocks the other mode would have
  kept). Recency wins
  on traffic whose reuse is recent (chat, document QA); frequency wins where most blocks are used
  once and a few prefixes are used by many (production conversation traces).

Chain order in both modes: a request's blocks are touched tail first, so among equal counts the
tail is older; a descendant is never counted more than its ancestors (every request that reads
it reads them), so the frequency mode also takes a chain's tail before its head. Admission goes
in chain order too: once a block of a put is declined, the rest of that put is.

Costs: O(1) per touched block (dictionary operations and counter arithmetic), O(``SAMPLE``) per
eviction in frequency mode. Parameters come from the papers named above, not from fitting a
workload: 10 % / 10 x periods (TinyLFU), 64 samples (hyperbolic caching), shadow caches of a few
hundred blocks (set dueling uses 32 sets of a few thousand lines), and switches at the 95 %
significance level.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.meta.records import Entry, Replica

POLICIES = ("adaptive", "lru")
SAMPLE = 64
AGE_FACTOR = 10
HISTORY_FACTOR = AGE_FACTOR
HISTORY_MAX = 1 << 20
MIN_POPULATION = 1024
SHADOW_BLOCKS = 2048
MIN_SHADOW = 64
MARGIN = 0.05
SIGNIFICANCE = 2.0  # standard deviations (the two-sided 95 % level)
MAX_COUNT = 255
PENDING_MAX = 1 << 16  # queued accesses (keys) that force a drain
_EPOCH_SHIFT = 8


def _count(packed: int, epoch: int) -> int:
    """A count stored as ``epoch << 8 | count``, aged to ``epoch`` (halved once per epoch)."""
    return (packed & MAX_COUNT) >> min(8, epoch - (packed >> _EPOCH_SHIFT))


def _stored(e: Entry, epoch: int) -> int:
    """A stored block's count: aged, but never below 1 (it was read or written once)."""
    return max(1, _count(e.freq, epoch))


def _sample_of(key: bytes, s: int) -> bool:
    return s == 1 or int.from_bytes(key[-4:], "little") % s == 0


def _leading(keys: Sequence[bytes], d: dict) -> int:
    """The leading run of ``keys`` held in ``d``: a shadow's prefix hits (on sampled keys,
    an estimate of the prefix hits of the keys between them)."""
    n = 0
    for k in keys:
        if k not in d:
            break
        n += 1
    return n


class _ShadowLru:
    """Tail-first block LRU over sampled keys: the recency mode in miniature."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[bytes, None] = OrderedDict()

    def access(self, keys: Sequence[bytes]) -> int:
        d = self.d
        hits = _leading(keys, d)
        for k in keys:
            if k not in d:
                d[k] = None
                while len(d) > self.capacity:
                    d.popitem(last=False)
        for k in reversed(keys):
            if k in d:
                d.move_to_end(k)
        return hits


class _ShadowLfu:
    """Counted blocks with admission over sampled keys: the frequency mode in miniature (its
    own counts, aged every AGE_FACTOR x its size, history HISTORY_FACTOR x its size)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[bytes, None] = OrderedDict()  # recency order, tail first
        self.counts: dict[bytes, int] = {}
        self.history: OrderedDict[bytes, int] = OrderedDict()
        self.n = 0
        # The victim while neither the order nor a count changed: a run of declined blocks
        # (a cold scan) costs one sample, not one per block.
        self._vic: bytes | None = None

    def access(self, keys: Sequence[bytes]) -> int:
        d, counts = self.d, self.counts
        hits = _leading(keys, d)
        for k in reversed(keys):
            if k in d:
                counts[k] = min(MAX_COUNT, counts[k] + 1)
                d.move_to_end(k)
                self._vic = None
                continue
            c = self.history.pop(k, 0) + 1
            while len(d) > self.capacity - 1:
                victim = self._victim()
                if c <= counts[victim] and len(d) == self.capacity:
                    break
                del d[victim]
                self._vic = None
                self._remember(victim, counts.pop(victim))
            if len(d) >= self.capacity:
                self._remember(k, c)  # not admitted
                continue
            d[k] = None
            counts[k] = c
            self._vic = None
        self.n += len(keys)
        if self.n >= AGE_FACTOR * self.capacity:
            self.n = 0
            for k in counts:
                counts[k] >>= 1
            self._vic = None
            self.history = OrderedDict((k, c >> 1) for k, c in self.history.items() if c > 1)
        return hits

    def _victim(self) -> bytes:
        """The first of the least counted among the SAMPLE least recent."""
        if self._vic is None:
            self._vic = min((v for _, v in zip(range(SAMPLE), self.d)), key=self.counts.__getitem__)
        return self._vic

    def _remember(self, key: bytes, c: int) -> None:
        self.history[key] = c
        while len(self.history) > HISTORY_FACTOR * self.capacity:
            self.history.popitem(last=False)


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


class AdaptivePolicy(LruPolicy):
    """``adaptive``: see the module docstring."""

    name = "adaptive"

    def __init__(self, entries: dict[bytes, Entry]) -> None:
        super().__init__(entries)
        self.epoch = 0
        self._n = 0
        self.history: OrderedDict[bytes, int] = OrderedDict()
        self._reset_shadows(1)
        self.mode_switches = 0
        self._mode = False
        # With ``defer`` (the service sets it), accesses are queued and accounted at the next
        # drain(): the service drains right after answering, so a read's accounting is off its
        # critical path. Every other method drains first, and the index tells the policy of a
        # block's arrival or departure before its entries change, so the order of events the
        # policy sees, and so every decision, is the same as without.
        self.defer = False
        self._pending: list[Sequence[bytes]] = []
        self._pending_keys = 0

    def _reset_shadows(self, s: int) -> None:
        # Keys are sampled 1 in s (s = blocks indexed / SHADOW_BLOCKS, changed when that
        # doubles or halves, and the shadows start over); each shadow holds what 1 in s of
        # the index holds, following its size.
        self._s = s
        self._lru = _ShadowLru(MIN_SHADOW)
        self._lfu = _ShadowLfu(MIN_SHADOW)
        self._hits_lru = self._hits_lfu = 0.0

    @property
    def frequency_mode(self) -> bool:
        return self._mode  # as of the last drain

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
        self._duel(keys)

    def _duel(self, keys: Sequence[bytes]) -> None:
        n = len(self.entries)
        want = max(1, n // SHADOW_BLOCKS)
        if want >= 2 * self._s or 2 * want <= self._s:
            self._reset_shadows(want)
        s = self._s
        size = max(MIN_SHADOW, n // s)
        self._lru.capacity = self._lfu.capacity = size
        sampled = [k for k in keys if _sample_of(k, s)]
        if not sampled:
            return
        decay = 0.5 ** (len(sampled) / (AGE_FACTOR * size))
        self._hits_lfu = self._hits_lfu * decay + self._lfu.access(sampled)
        self._hits_lru = self._hits_lru * decay + self._lru.access(sampled)
        self._choose(self._hits_lfu, self._hits_lru)

    def _choose(self, lfu: float, lru: float) -> None:
        """Switches mode only on evidence: into frequency mode (which declines blocks) when its
        shadow earns MARGIN more than recency's, back when recency's earns MARGIN more than
        frequency's, and either switch needs a difference above SIGNIFICANCE standard deviations
        of the counting noise (hit counts of sampled keys: about Poisson, so sqrt(lfu + lru) for
        their difference). A difference the noise or the margin explains changes nothing: each
        switch costs the blocks the new mode would not have kept."""
        d = lfu - lru
        noise = SIGNIFICANCE * math.sqrt(lfu + lru)
        if self._mode:
            mode = -d <= noise or lru <= lfu * (1 + MARGIN)  # stays unless recency clearly earns more
        else:
            mode = d > noise and lfu > lru * (1 + MARGIN)
        if mode != self._mode:
            self._mode = mode
            self.mode_switches += 1

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
        if not self._mode:
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
        if not self._mode:
            return True
        return self.count(key) > _stored(victim.entry, self.epoch)

    def demotion_order(self, candidates: Iterable[Replica], want: int) -> list[Replica]:
        self.drain()
        if not self._mode:
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

    def stats(self) -> dict[str, int]:
        # Read-only, without a drain: the metrics thread calls it while the service runs.
        return {
            "policy_frequency_mode": int(self._mode),
            "policy_mode_switches": self.mode_switches,
            "policy_history": len(self.history),
            "policy_epoch": self.epoch,
        }


def make_policy(name: str, entries: dict[bytes, Entry]) -> LruPolicy:
    if name == "adaptive":
        return AdaptivePolicy(entries)
    if name == "lru":
        return LruPolicy(entries)
    raise ValueError(f"unknown cache policy {name!r} (one of {', '.join(POLICIES)})")
