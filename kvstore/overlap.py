"""Which of many overlapping extents a scan keeps: the newest claims its range first.

The rule (:func:`kvstore.extent.scan`): take the extents newest first (higher generation first,
then lower offset); each is kept unless it overlaps one already kept. Done one extent at a time
against a sorted list of claimed ranges, that is quadratic in the worst case and a few
microseconds of Python per extent. :func:`newest_wins` gives the same answer vectorised:

- an extent that overlaps no other one in the set is kept, and decides nothing else: it leaves;
- the others are split by priority into a newer and an older half; the newer half is resolved
  first (recursively), every extent of the older half that overlaps one kept there is dropped,
  and what is left of the older half is resolved in turn. No extent of the newer half depends on
  the older one, and an extent of the older half is blocked only by a kept one, so this is the
  rule exactly.

Each level is a few sorts and binary searches: O(n log^2 n) at worst, and on a real arena, where
only the stale headers left inside newer extents overlap anything, one pass that keeps nearly all.
"""

from __future__ import annotations

import bisect

import numpy as np

_SMALL = 48  # at most this many extents: resolved one by one


def newest_wins(start: np.ndarray, end: np.ndarray, gen: np.ndarray) -> np.ndarray:
    """Which extents ``[start, end)`` (non-empty, starts distinct) are kept when the newest
    (highest ``gen``, then lowest start) claims its range first: a boolean mask."""
    start = np.asarray(start, np.uint64)
    end = np.asarray(end, np.uint64)
    gen = np.asarray(gen, np.uint64)
    if start.size == 0:
        return np.zeros(0, bool)
    keep = _isolated(start, end)  # most of them, found in one pass over ranges in offset order
    rest = np.flatnonzero(~keep)
    if rest.size:
        prio = rest[np.lexsort((start[rest], ~gen[rest]))]  # ~gen: highest generation first
        keep[prio[_resolve(start[prio], end[prio])]] = True
    return keep


def _isolated(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Which of the ranges overlap no other one of them."""
    ordered = s.size < 2 or bool((s[1:] > s[:-1]).all())  # a scan's candidates come in offset order
    order = None if ordered else np.argsort(s, kind="stable")
    ss, es = (s, e) if order is None else (s[order], e[order])
    hit = np.zeros(s.size, bool)
    hit[:-1] |= ss[1:] < es[:-1]  # the next range starts inside this one
    hit[1:] |= np.maximum.accumulate(es)[:-1] > ss[1:]  # some earlier range runs into this one
    if order is None:
        return ~hit
    out = np.empty(s.size, bool)
    out[order] = ~hit
    return out


def _blocked(s: np.ndarray, e: np.ndarray, ks: np.ndarray, ke: np.ndarray) -> np.ndarray:
    """Which ranges overlap one of the disjoint ranges ``[ks, ke)``."""
    if ks.size == 0:
        return np.zeros(s.size, bool)
    order = np.argsort(ks)
    ks, ke = ks[order], ke[order]  # disjoint: the ends are in order too
    p = np.searchsorted(ks, e, "left") - 1  # the last kept range starting before this one ends
    return (p >= 0) & (ke[np.maximum(p, 0)] > s)


def _one_by_one(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    keep = np.zeros(s.size, bool)
    taken: list[tuple[int, int]] = []
    for i, (lo, hi) in enumerate(zip(s.tolist(), e.tolist())):
        j = bisect.bisect_left(taken, (lo, hi))
        if (j > 0 and taken[j - 1][1] > lo) or (j < len(taken) and taken[j][0] < hi):
            continue
        taken.insert(j, (lo, hi))
        keep[i] = True
    return keep


def _resolve(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """The kept ranges of ``[s, e)``, given in priority order (best first): their indices."""
    if s.size <= _SMALL:
        return np.flatnonzero(_one_by_one(s, e))
    alone = _isolated(s, e)
    rest = np.flatnonzero(~alone)
    kept = [np.flatnonzero(alone)]
    if rest.size:
        newer, older = rest[: rest.size // 2], rest[rest.size // 2 :]
        kn = newer[_resolve(s[newer], e[newer])]
        kept.append(kn)
        older = older[~_blocked(s[older], e[older], s[kn], e[kn])]
        kept.append(older[_resolve(s[older], e[older])])
    return np.concatenate(kept)
