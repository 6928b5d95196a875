"""How the adaptive cache policy (:mod:`kvstore.meta.policy`) chooses its mode: shadow caches,
one per mode, each the mode in miniature, replay a hash-sampled 1 in S of the keys and count
their prefix hits on them, and :class:`Duel` moves the policy to the mode whose shadow clearly
earns more (set dueling, Qureshi et al., ISCA 2007; the regret idea of LeCaR, Vietri et al.,
HotStorage 2018; spatial sampling as in SHARDS, Waldspurger et al., FAST 2015).

A shadow takes a request's sampled keys in chain order and returns its prefix hits; every
shadow touches a request's blocks tail first, as the index does, so a chain's head is the most
recent and a request longer than the shadow keeps its head. Each holds at most ``capacity``
keys, which the duel changes as the index grows or shrinks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

SAMPLE = 64  # blocks a sampled eviction looks at (hyperbolic caching, Redis' LFU)
AGE_FACTOR = 10  # counts halve every AGE_FACTOR x the cache size accesses (TinyLFU)
HISTORY_FACTOR = AGE_FACTOR  # counts of blocks not stored, for HISTORY_FACTOR x the cache size
MAX_COUNT = 255
RECENCY, BALANCED, FREQUENCY = 0, 1, 2
MODES = ("recency", "balanced", "frequency")
SHADOW_BLOCKS = 2048  # sampled blocks a shadow holds (set dueling: 32 sets of a few thousand lines)
MIN_SHADOW = 64
MARGIN = 0.05
SIGNIFICANCE = 2.0  # standard deviations (the two-sided 95 % level)


def sampled(key: bytes, s: int) -> bool:
    """Whether ``key`` is in the 1-in-``s`` hash sample (keys are hashes: their last bytes are
    uniform)."""
    return s == 1 or int.from_bytes(key[-4:], "little") % s == 0


def leading(keys: Sequence[bytes], d: dict) -> int:
    """The leading run of ``keys`` held in ``d``: a shadow's prefix hits (on sampled keys,
    an estimate of the prefix hits of the keys between them)."""
    n = 0
    for k in keys:
        if k not in d:
            break
        n += 1
    return n


class ShadowLru:
    """Tail-first block LRU: the recency mode in miniature."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[bytes, None] = OrderedDict()

    def access(self, keys: Sequence[bytes]) -> int:
        d = self.d
        hits = leading(keys, d)
        for k in reversed(keys):  # tail first: a request longer than the cache keeps its head
            if k in d:
                d.move_to_end(k)
            else:
                d[k] = None
                while len(d) > self.capacity:
                    d.popitem(last=False)
        return hits


class ShadowArc:
    """The balanced mode in miniature, as the index runs it: ARC (Megiddo and Modha, FAST 2003)
    in one recency order. T1 holds blocks seen once, T2 blocks seen again (while stored, or while
    remembered as ghosts); the victim is T1's least recent while T1 holds more than the target
    ``p``, else T2's (among the SAMPLE least recent, else the least recent of all); T2's blocks
    that the search for T1's passes go back to T1 at the most recent end; a request for a ghost
    of T1 raises ``p``, one for a ghost of T2 lowers it. The ghosts hold at most ``capacity``
    keys, the oldest leaving first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[bytes, bool] = OrderedDict()  # recency order -> in T2
        self.t2 = 0
        self.ghosts: OrderedDict[bytes, bool] = OrderedDict()
        self.ghosts_t2 = 0
        self.p = 0.0

    def __len__(self) -> int:
        return len(self.d)

    def _evict(self) -> None:
        d = self.d
        from_t2 = len(d) - self.t2 <= self.p
        victim = None
        if from_t2:
            for _, k in zip(range(SAMPLE), d):
                if d[k]:
                    victim = k
                    break
        else:
            passed = []
            for k, t2 in d.items():
                if not t2:
                    victim = k
                    break
                passed.append(k)
            for k in passed:
                del d[k]
                d[k] = False
            self.t2 -= len(passed)
        if victim is None:
            victim = next(iter(d))
        t2 = d.pop(victim)
        self.t2 -= t2
        self.ghosts[victim] = t2
        self.ghosts_t2 += t2
        while len(self.ghosts) > self.capacity:
            self.ghosts_t2 -= self.ghosts.popitem(last=False)[1]

    def _access(self, k: bytes) -> None:
        d = self.d
        t2 = d.get(k)
        if t2 is not None:
            if not t2:
                d[k] = True
                self.t2 += 1
            d.move_to_end(k)
            return
        again = self.ghosts.pop(k, None)
        if again is not None:
            b2 = self.ghosts_t2
            b1 = len(self.ghosts) + 1 - b2
            if again:
                self.p = max(0.0, self.p - max(b1 / b2, 1.0))
                self.ghosts_t2 -= 1
            else:
                self.p = min(float(self.capacity), self.p + max(b2 / b1, 1.0))
        while len(d) >= self.capacity:
            self._evict()
        d[k] = again is not None
        self.t2 += again is not None

    def access(self, keys: Sequence[bytes]) -> int:
        hits = leading(keys, self.d)
        for k in reversed(keys):
            self._access(k)
        return hits


class ShadowLfu:
    """Counted blocks with admission: the frequency mode in miniature (its own counts, aged every
    AGE_FACTOR x its size, history HISTORY_FACTOR x its size)."""

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
        hits = leading(keys, d)
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


class Duel:
    """The mode choice. Shadows replay 1 in ``s`` keys (s = blocks indexed / SHADOW_BLOCKS,
    changed when that doubles or halves, and the shadows start over), each sized to what 1 in
    ``s`` of the index holds; their prefix hits decay with a half-life of AGE_FACTOR x a
    shadow's size in sampled accesses (the window the policy's counts age over).

    The mode starts as recency (plain LRU, what the index did before it had a policy to choose)
    and follows the shadows freely until the first eviction: before it, every mode has stored
    the same blocks, so a switch costs nothing. From then on it moves only on evidence (see
    :meth:`choose`)."""

    def __init__(self) -> None:
        self.mode = RECENCY
        self.switches = 0
        self.keys_in = [0, 0, 0]  # keys accessed in each mode
        self.free = True  # no eviction yet: a switch costs nothing
        self._reset(1)

    def _reset(self, s: int) -> None:
        self.s = s
        self.shadows = (ShadowLru(MIN_SHADOW), ShadowArc(MIN_SHADOW), ShadowLfu(MIN_SHADOW))
        # Per mode, the shadow's decayed prefix hits; per pair of modes (a < b, at a + b - 1),
        # the decayed sum of squares of their per-request differences (the pair's noise).
        self.hits = [0.0, 0.0, 0.0]
        self.var = [0.0, 0.0, 0.0]

    def observe(self, keys: Sequence[bytes], indexed: int) -> None:
        """A request's keys, with ``indexed`` blocks in the index."""
        self.keys_in[self.mode] += len(keys)
        want = max(1, indexed // SHADOW_BLOCKS)
        if want >= 2 * self.s or 2 * want <= self.s:
            self._reset(want)
        s = self.s
        size = max(MIN_SHADOW, indexed // s)
        sample = [k for k in keys if sampled(k, s)]
        if not sample:
            return
        decay = 0.5 ** (len(sample) / (AGE_FACTOR * size))
        hits, var = self.hits, self.var
        got = []
        for i, shadow in enumerate(self.shadows):
            shadow.capacity = size
            got.append(shadow.access(sample))
            hits[i] = hits[i] * decay + got[i]
        d2 = decay * decay
        var[0] = var[0] * d2 + (got[0] - got[1]) ** 2
        var[1] = var[1] * d2 + (got[0] - got[2]) ** 2
        var[2] = var[2] * d2 + (got[1] - got[2]) ** 2
        self.choose(hits, var)

    def choose(self, hits: Sequence[float], var: Sequence[float]) -> None:
        """Moves, only on evidence, to the mode whose shadow earns the most hits among those
        that earn clearly more than the current mode's: a difference above SIGNIFICANCE standard
        deviations of its noise, and, into or out of frequency mode (which declines blocks, and
        so changes what is stored the most), MARGIN more as well, the same hysteresis both ways.
        A difference the noise or the margin explains changes nothing: each switch costs the
        blocks the new mode would not have kept. Before the first eviction, the most hits win.

        The test is paired, over requests: the shadows replay the same keys, so most of their
        hits are common, and a request's prefix hits come and go together (a chain is hit or
        missed as a run). The noise of a decayed difference is then the square root of the
        decayed sum of the squared per-request differences (``var``), not of the hit counts:
        smaller where the modes agree on most requests, larger where a few long chains make
        the difference."""
        cur = self.mode
        base = hits[cur]
        best, best_h = cur, base
        for m, h in enumerate(hits):
            if m == cur or h <= best_h:
                continue
            margin = MARGIN if FREQUENCY in (m, cur) else 0.0
            clear = h - base > SIGNIFICANCE * math.sqrt(var[m + cur - 1]) and h > base * (1 + margin)
            if self.free or clear:
                best, best_h = m, h
        if best != cur:
            self.mode = best
            self.switches += 1
