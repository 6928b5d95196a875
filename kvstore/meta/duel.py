"""How the adaptive cache policy (:mod:`kvstore.meta.policy`) chooses its mode: two shadow caches,
one per mode, each the mode in miniature, replay a hash-sampled 1 in S of the keys and count
their prefix hits on them, and :class:`Duel` moves the policy to the mode whose shadow clearly
earns more (set dueling, Qureshi et al., ISCA 2007; the regret idea of LeCaR, Vietri et al.,
HotStorage 2018; spatial sampling as in SHARDS, Waldspurger et al., FAST 2015).

A shadow takes a request's sampled keys in chain order and returns its prefix hits; both
shadows touch a request's blocks tail first, as the index does, so a chain's head is the most
recent and a request longer than the shadow keeps its head. Each holds at most ``capacity``
keys, which the duel changes as the index grows or shrinks.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from collections.abc import Sequence

SAMPLE = 64  # blocks a sampled eviction looks at (hyperbolic caching, Redis' LFU)
AGE_FACTOR = 10  # counts halve every AGE_FACTOR x the cache size accesses (TinyLFU)
HISTORY_FACTOR = AGE_FACTOR  # counts of blocks not stored, for HISTORY_FACTOR x the cache size
MAX_COUNT = 255
RECENCY, FREQUENCY = 0, 1
MODES = ("recency", "frequency")
SHADOW_BLOCKS = 2048  # sampled blocks a shadow holds (set dueling: 32 sets of a few thousand lines)
MIN_SHADOW = 64
MARGIN = 0.05
SIGNIFICANCE = 2.0  # standard deviations (the two-sided 95 % level)


def sampled(key: bytes, s: int) -> bool:
    """Whether ``key`` is in the 1-in-``s`` hash sample: a CRC-32 of the whole key, spread by a
    multiplicative (Fibonacci) hash. Keys are usually hashes already, but a client may name
    blocks any way it likes (sequential numbers, a tenant prefix): taking a key's own bytes as
    the sample would then pick the same chain positions in every request and skew both shadows
    (on the trace with sequential keys, by enough to choose the wrong mode)."""
    return s == 1 or ((((zlib.crc32(key) * 0x9E3779B1) & 0xFFFFFFFF) >> 8) % s) == 0


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

    The mode starts as recency (plain LRU) and follows the shadows freely until the index first
    needs room (the policy is asked for a victim): before that, both modes have stored the same
    blocks, so a switch costs nothing and needs no margin. It still needs evidence: the index
    leaves the free phase in whatever mode it is in then, and a frequency mode entered on noise
    (a shadow one hit ahead, or tied) would then cost what the margin makes it slow to undo.
    From then on it moves only on evidence and past the margin (see :meth:`choose`)."""

    def __init__(self) -> None:
        self.mode = RECENCY
        self.switches = 0
        self.free = True  # no victim asked for yet: a switch costs nothing
        self.keys_in = [0, 0]  # keys accessed in each mode
        self._reset(1)

    def _reset(self, s: int) -> None:
        self.s = s
        self.shadows = (ShadowLru(MIN_SHADOW), ShadowLfu(MIN_SHADOW))
        self.hits = [0.0, 0.0]  # per mode, the shadow's decayed prefix hits

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
        hits = self.hits
        for i, shadow in enumerate(self.shadows):
            shadow.capacity = size
            hits[i] = hits[i] * decay + shadow.access(sample)
        self.choose(hits[RECENCY], hits[FREQUENCY])

    def choose(self, lru: float, lfu: float) -> None:
        """Switches mode only on evidence: into frequency mode (which declines blocks) when its
        shadow earns MARGIN more than recency's, back when recency's earns MARGIN more than
        frequency's, and either switch needs a difference above SIGNIFICANCE standard deviations
        of the counting noise (hit counts of sampled keys: about Poisson, so sqrt(lfu + lru) for
        their difference). A difference the noise or the margin explains changes nothing: each
        switch costs the blocks the new mode would not have kept. While the switch is free (see
        the class), frequency mode needs a significant lead, no margin, and recency, the mode
        that is never below LRU, is the default."""
        d = lfu - lru
        noise = SIGNIFICANCE * math.sqrt(lfu + lru)
        if self.free:
            mode = FREQUENCY if d > noise else RECENCY
        elif self.mode == FREQUENCY:  # stays unless recency clearly earns more
            mode = RECENCY if -d > noise and lru > lfu * (1 + MARGIN) else FREQUENCY
        else:
            mode = FREQUENCY if d > noise and lfu > lru * (1 + MARGIN) else RECENCY
        if mode != self.mode:
            self.mode = mode
            self.switches += 1
