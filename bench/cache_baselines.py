"""Baseline cache policies for ``bench/policy.py``, written independently of the metadata
index so that the index is compared with the policies as their authors describe them.

Every policy holds at most ``capacity`` blocks (block ids are ints; equal ids, equal blocks)
and sees each request as a serving engine's connector makes it: the leading run of cached
blocks is the prefix hit, then every block of the request is accessed in chain order (a cached
one is a hit for the policy, a missing one is inserted). ``request(ids)`` returns the prefix
hit count. ``inserted`` counts insertions.

- ``LRU``: plain block LRU, blocks touched in request order.
- ``TailFirstLRU``: LRU whose request touches its blocks tail first, so that a chain's head is
  the most recent and its tail goes first: what vLLM's prefix cache does when it frees a
  finished request's blocks in reverse order (vLLM ``KVCacheManager`` / ``FreeKVCacheBlockQueue``,
  the "automatic prefix caching" design document).
- ``S3FIFO``: Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023: a
  small FIFO (10 % of the capacity) that new blocks enter, a main FIFO with reinsertion
  (frequency counters capped at 3), and a ghost FIFO of evicted ids as long as the main queue;
  a block leaving the small queue moves to main if it was accessed there, else to the ghost;
  a ghost hit is inserted into main.
- ``ARC``: Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003
  (the REPLACE / case I-IV algorithm of its Figure 4, with T1, T2, B1, B2 and the target p).

The offline optimum (Belady's MIN with bypass) is ``bench.policy.optimal_hits``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class Policy:
    name = ""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 block, got {capacity}")
        self.capacity = capacity
        self.inserted = 0

    def __contains__(self, b: int) -> bool:
        raise NotImplementedError

    def access(self, ids: Sequence[int]) -> None:
        raise NotImplementedError

    def request(self, ids: Sequence[int]) -> int:
        h = 0
        for b in ids:
            if b not in self:
                break
            h += 1
        self.access(ids)
        return h

    def __len__(self) -> int:
        raise NotImplementedError


class LRU(Policy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.cache: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, b: int) -> bool:
        return b in self.cache

    def __len__(self) -> int:
        return len(self.cache)

    def _touch(self, b: int) -> None:
        cache = self.cache
        if b in cache:
            cache.move_to_end(b)
            return
        if len(cache) >= self.capacity:
            cache.popitem(last=False)
        cache[b] = None
        self.inserted += 1

    def access(self, ids: Sequence[int]) -> None:
        for b in ids:
            self._touch(b)


class TailFirstLRU(LRU):
    name = "tail_first_lru"

    def access(self, ids: Sequence[int]) -> None:
        # Insert missing blocks in chain order (an insertion must not evict its own chain's
        # head), then touch the request tail first so that its head is the most recent.
        for b in ids:
            if b not in self.cache:
                self._touch(b)
        for b in reversed(ids):
            self.cache.move_to_end(b) if b in self.cache else None


class S3FIFO(Policy):
    name = "s3fifo"
    SMALL_SHARE = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small_cap = max(1, int(capacity * self.SMALL_SHARE))
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    def __contains__(self, b: int) -> bool:
        return b in self.freq

    def __len__(self) -> int:
        return len(self.freq)

    def _ghost_add(self, b: int) -> None:
        self.ghost[b] = None
        while len(self.ghost) > max(1, self.capacity - self.small_cap):
            self.ghost.popitem(last=False)

    def _evict(self) -> None:
        while True:
            if len(self.small) >= self.small_cap or not self.main:
                b, _ = self.small.popitem(last=False)
                if self.freq[b] > 0:  # accessed while probationary: promoted
                    self.freq[b] = 0
                    self.main[b] = None
                    continue
                del self.freq[b]
                self._ghost_add(b)
                return
            b, _ = self.main.popitem(last=False)
            f = self.freq[b]
            if f > 0:
                self.freq[b] = f - 1
                self.main[b] = None
                continue
            del self.freq[b]
            return

    def access(self, ids: Sequence[int]) -> None:
        for b in ids:
            f = self.freq.get(b)
            if f is not None:
                self.freq[b] = min(f + 1, self.MAX_FREQ)
                continue
            while len(self.freq) >= self.capacity:
                self._evict()
            if b in self.ghost:  # evicted from the small queue before: a second chance in main
                del self.ghost[b]
                self.main[b] = None
            else:
                self.small[b] = None
            self.freq[b] = 0
            self.inserted += 1


class ARC(Policy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, b: int) -> bool:
        return b in self.t1 or b in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            b, _ = self.t1.popitem(last=False)
            self.b1[b] = None
        else:
            b, _ = self.t2.popitem(last=False)
            self.b2[b] = None

    def _access(self, x: int) -> None:
        c = self.capacity
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        if x in t1:  # case I
            del t1[x]
            t2[x] = None
            return
        if x in t2:
            t2.move_to_end(x)
            return
        self.inserted += 1
        if x in b1:  # case II
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
            self._replace(False)
            del b1[x]
            t2[x] = None
            return
        if x in b2:  # case III
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            self._replace(True)
            del b2[x]
            t2[x] = None
            return
        # case IV
        l1 = len(t1) + len(b1)
        if l1 == c:
            if len(t1) < c:
                b1.popitem(last=False)
                self._replace(False)
            else:
                t1.popitem(last=False)
        elif l1 < c:
            total = l1 + len(t2) + len(b2)
            if total >= c:
                if total == 2 * c:
                    b2.popitem(last=False)
                self._replace(False)
        t1[x] = None

    def access(self, ids: Sequence[int]) -> None:
        for b in ids:
            self._access(b)


BASELINES: dict[str, type[Policy]] = {p.name: p for p in (LRU, TailFirstLRU, S3FIFO, ARC)}


def replay(policy: Policy, requests: Sequence[Sequence[int]]) -> dict:
    hits = 0
    for ids in requests:
        hits += policy.request(ids)
    return {"hits": hits, "inserted": policy.inserted}
