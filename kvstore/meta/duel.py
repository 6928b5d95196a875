"""How the adaptive cache policy (:mod:`kvstore.meta.policy`) chooses its mode: three shadow
caches, one per mode, each the mode in miniature, replay a hash-sampled 1 in S of the keys and count
their prefix hits on them, and :class:`Duel` moves the policy to the mode whose shadow clearly
earns more, each shadow's hits weighed by what the index itself earned per shadow hit in that
mode (:meth:`Duel.calibration`). Set dueling: Qureshi et al., ISCA 2007; the regret idea of
LeCaR: Vietri et al., HotStorage 2018; spatial sampling as in SHARDS: Waldspurger et al., FAST
2015.

A shadow takes a request's sampled keys in chain order and returns its prefix hits; all
shadows touch a request's blocks tail first, as the index does, so a chain's head is the most
recent and a request longer than the shadow keeps its head. Each holds at most ``capacity``
keys, which the duel changes as the index grows or shrinks.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.meta.records import PolicyParams

MAX_COUNT = 255
RECENCY, FREQUENCY, SECOND_CHANCE = 0, 1, 2
MODES = ("recency", "frequency", "second_chance")


def sampled(key: bytes, s: int) -> bool:
    """Whether ``key`` is in the 1-in-``s`` sample: the top bits of a multiplicative
    (Fibonacci) hash of the key's CRC-32 fall below 2**32 / s (threshold sampling, as in
    SHARDS: the sample for 2s is a subset of the sample for s). Keys are hashes by contract,
    but the service cannot check that, and a client that names blocks by counters or puts a
    tenant tag in their last bytes would skew both shadows if the sample were read off the
    key's own bytes (with 16-byte big-endian counters, the last four bytes used before sampled
    every key into shadows sized for 1 in s, and the mode choice went wrong on the trace)."""
    return s == 1 or (zlib.crc32(key) * 0x9E3779B1) & 0xFFFFFFFF < (1 << 32) // s


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


class ShadowSecondChance:
    """Tail-first block LRU whose blocks read again since they came in, or since their last
    second chance, get one more pass when they reach the end: the second-chance mode in
    miniature. As in the index, a request's new blocks are not candidates while it stores them
    (there they are being written) and join the order after the blocks passed over meanwhile
    (there they join it at the commit)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[bytes, bool] = OrderedDict()  # recency order; value: read again

    def access(self, keys: Sequence[bytes]) -> int:
        d = self.d
        hits = leading(keys, d)
        fresh: dict[bytes, None] = {}
        for k in reversed(keys):
            if k in d:
                d[k] = True
                d.move_to_end(k)
                continue
            while len(d) >= self.capacity:
                self._evict(fresh)
            d[k] = False
            fresh[k] = None
        for k in fresh:
            if k in d:
                d.move_to_end(k)
        return hits

    def _evict(self, fresh: dict[bytes, None]) -> None:
        d = self.d
        passed = []
        victim = None
        for v, again in d.items():
            if v in fresh:
                continue
            if not again:
                victim = v
                break
            passed.append(v)
        if victim is None:  # all read again: the least recent goes anyway
            victim = passed.pop(0) if passed else next(iter(d))
        if victim in fresh:
            del fresh[victim]
        del d[victim]
        for v in passed:
            d[v] = False
            d.move_to_end(v)


class ShadowLfu:
    """Counted blocks with admission: the frequency mode in miniature (its own counts, aged every
    ``age_factor`` x its size, history ``history_factor`` x its size)."""

    def __init__(self, capacity: int, params: PolicyParams | None = None) -> None:
        self.capacity = capacity
        self.params = params or PolicyParams()
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
        if self.n >= self.params.age_factor * self.capacity:
            self.n = 0
            for k in counts:
                counts[k] >>= 1
            self._vic = None
            self.history = OrderedDict((k, c >> 1) for k, c in self.history.items() if c > 1)
        return hits

    def _victim(self) -> bytes:
        """The first of the least counted among the ``sample`` least recent."""
        if self._vic is None:
            self._vic = min((v for _, v in zip(range(self.params.sample), self.d)), key=self.counts.__getitem__)
        return self._vic

    def _remember(self, key: bytes, c: int) -> None:
        self.history[key] = c
        while len(self.history) > self.params.history_factor * self.capacity:
            self.history.popitem(last=False)


class Duel:
    """The mode choice. Shadows replay 1 in ``s`` keys (s = blocks indexed / ``shadow_blocks``,
    changed when that doubles or falls to a quarter, and the shadows start over), each sized to
    what 1 in ``s`` of the index holds; their prefix hits decay with a half-life of ``window_factor`` x
    a shadow's size in sampled accesses (four of the periods the policy's counts age over).

    The mode starts as recency (plain LRU). Until the index first needs room (the policy is
    asked for a victim), all modes have stored the same blocks (demotion may have moved
    different ones to SSD), so a switch costs nothing and the mode is simply what the rule for
    entering frequency mode says at each request, without hysteresis. The index leaves that
    free phase in the mode it is in, so the rule stays the full one: a frequency mode entered
    on less (the rule was once any lead, and a tie kept the mode) sticks, because leaving it
    then takes recency's margin. From then on the mode moves only on evidence: between
    recency and second chance past the noise of their paired difference, to and from
    frequency also past the margin, both ways (see :meth:`decide` and :meth:`choose`)."""

    def __init__(self, params: PolicyParams | None = None) -> None:
        self.params = params or PolicyParams()
        self.mode = RECENCY
        # The recency family's member the policy uses when not in frequency mode (RECENCY or
        # SECOND_CHANCE; see decide()).
        self.variant = RECENCY
        self.switches = 0
        self.free = True  # no victim asked for yet: a switch costs nothing
        self.keys_in = [0, 0, 0]  # keys accessed in each mode
        self._reset(1)

    def _reset(self, s: int) -> None:
        self.s = s
        low = self.params.min_shadow
        self.shadows = (ShadowLru(low), ShadowLfu(low, self.params), ShadowSecondChance(low))
        self.hits = [0.0, 0.0, 0.0]  # per mode, the shadow's decayed prefix hits
        # Calibration, per mode, over the requests served in that mode: the index's own decayed
        # prefix hits on the sampled keys, and the mode's shadow's (see calibration()).
        self.real = [0.0, 0.0, 0.0]
        self.shadowed = [0.0, 0.0, 0.0]
        # The decayed sum of squared per-request differences between the second-chance and the
        # recency shadow's hits: the variance of their paired difference (see decide()).
        self.paired = 0.0

    def observe(self, keys: Sequence[bytes], indexed: int, held: int) -> None:
        """A request's keys, with ``indexed`` blocks in the index, which held the first ``held``."""
        self.keys_in[self.mode] += len(keys)
        want = max(1, indexed // self.params.shadow_blocks)
        # Up when the index doubles, down when it is a quarter: an index whose size hovers at
        # a boundary does not start its shadows over at every request.
        if want >= 2 * self.s or 4 * want <= self.s:
            self._reset(want)
        s = self.s
        size = max(self.params.min_shadow, indexed // s)
        taken = [sampled(k, s) for k in keys]
        sample = [k for k, t in zip(keys, taken) if t]
        if not sample:
            return
        real = sum(taken[:held])  # the index's prefix hits on the sampled keys
        decay = 0.5 ** (len(sample) / (self.params.window_factor * size))
        hits, cal_real, cal_shadow = self.hits, self.real, self.shadowed
        got = [0, 0, 0]
        for i, shadow in enumerate(self.shadows):
            shadow.capacity = size
            got[i] = shadow.access(sample)
            hits[i] = hits[i] * decay + got[i]
            cal_real[i] *= decay
            cal_shadow[i] *= decay
        self.paired = self.paired * decay + (got[SECOND_CHANCE] - got[RECENCY]) ** 2
        if not self.free:  # before the first eviction the index is what neither mode would be
            cal_real[self.mode] += real
            cal_shadow[self.mode] += got[self.mode]
        self.decide()

    def decide(self) -> None:
        """Chooses the mode from the shadows' hits, calibrated (see :meth:`calibration`), in two
        steps. First the recency family's member: second chance or plain recency, whichever
        shadow earns more by more than ``significance`` standard deviations of their paired
        difference. The two see the same sampled requests and keep nearly the same blocks, so
        the noise of their difference is that of the requests where they differ (the decayed
        sum of squared per-request differences), far below the Poisson noise of either count,
        and the switch between them needs no margin: they differ only in the order in which
        blocks that were read again leave, so a switch throws away nothing the other would
        have kept for long. Then frequency against that member, as :meth:`choose` says. A mode
        fixed by the parameters (``fixed_mode``, for measurements) is kept whatever the shadows say."""
        if self.params.fixed_mode:
            fixed = MODES.index(self.params.fixed_mode)
            if self.mode != fixed:
                self.mode = fixed
                self.switches += 1
            return
        k = self.calibration()
        hits = self.hits
        rec, sc = k[RECENCY] * hits[RECENCY], k[SECOND_CHANCE] * hits[SECOND_CHANCE]
        noise = self.params.significance * max(k[RECENCY], k[SECOND_CHANCE]) * math.sqrt(self.paired)
        if self.variant == RECENCY and sc - rec > noise:
            self.variant = SECOND_CHANCE
        elif self.variant == SECOND_CHANCE and rec - sc > noise:
            self.variant = RECENCY
        v = self.variant
        self.choose(
            k[v] * hits[v], k[FREQUENCY] * hits[FREQUENCY], k[v] ** 2 * hits[v] + k[FREQUENCY] ** 2 * hits[FREQUENCY]
        )

    def calibration(self) -> tuple[float, float, float]:
        """What the index earns per hit of each mode's shadow: its own prefix hits on the sampled
        keys over the shadow's, on the requests it served in that mode (decayed as the shadows'
        hits are). A shadow is the mode in miniature, not the mode: sampling keys from chains
        biases all of them (on the trace at 1 in 4, each shadow counts about a fifth fewer hits
        than the index earns), and the frequency shadow, which keeps its own counts, can
        promise more than the index in frequency mode delivers (a trace with two tenants at 30k
        blocks: 10 % more hits than recency's shadow, while the index in frequency mode fell
        below LRU). The duel compares the calibrated estimates, so a mode that does not deliver
        what its shadow promised is left, and not re-entered on the same promise. The other
        modes' ratios are capped at recency's: the calibration only ever takes back a promise,
        it never makes one (an index in frequency mode that beats its shadow is no evidence
        against recency, whose shadow replays it exactly; letting it raise the estimate made
        the mode flip more often on chat at 1k blocks, where frequency mode never pays).

        Each ratio starts from a prior worth ``prior_hits`` shadow hits: 1 for recency's (its shadow
        replays exactly what the index does in recency mode, less the sampling), recency's for
        the others (the same sampling). With no evidence of its own a mode keeps the prior,
        and as the evidence decays, when the index stays in another mode, the ratio drifts
        back to it: the mode gets tried again."""
        prior = self.params.prior_hits
        k_rec = (self.real[RECENCY] + prior) / (self.shadowed[RECENCY] + prior)

        def capped(m: int) -> float:
            return min(k_rec, (self.real[m] + k_rec * prior) / (self.shadowed[m] + prior))

        return k_rec, capped(FREQUENCY), capped(SECOND_CHANCE)

    def choose(self, lru: float, lfu: float, var: float | None = None) -> None:
        """Switches between the recency family (its member :attr:`variant`) and frequency mode
        only on evidence, given each side's calibrated shadow hits (``lru``, ``lfu``; see
        :meth:`decide`): into frequency mode (which declines blocks) when its shadow earns
        ``margin`` more than the family's, back when the family's earns ``margin`` more than
        frequency's, and either switch needs a difference above ``significance`` standard
        deviations of the counting noise (hit counts of sampled keys: about Poisson, so
        sqrt(lfu + lru) for their difference, or sqrt(``var``) for counts that were weighed).
        A difference the noise or the margin explains changes nothing: each switch costs the
        blocks the new mode would not have kept. While the switch is free (see the class), the
        mode is what the rule for entering frequency mode says now: no hysteresis, and the
        family unless the evidence is there."""
        d = lfu - lru
        margin = self.params.margin
        noise = self.params.significance * math.sqrt(lfu + lru if var is None else var)
        enter = d > noise and lfu > lru * (1 + margin)
        if self.free or self.mode != FREQUENCY:
            freq = enter
        else:  # frequency mode stays unless the family clearly earns more
            freq = not (-d > noise and lru > lfu * (1 + margin))
        mode = FREQUENCY if freq else self.variant
        if mode != self.mode:
            self.mode = mode
            self.switches += 1
