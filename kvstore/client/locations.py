"""What a client remembers of where blocks are, so that it can read a known block without
asking the metadata service first.

Every location a client is handed (an Acquire's, or its own put's once committed) is kept here,
least recently used first out, up to ``client.location_cache`` entries. A read from a remembered
location takes no lease, so it must detect a block that moved on meanwhile (evicted, removed,
demoted, its extent reused by another block):

- shared memory: the extent's header must name the block (key, generation, length, checksum)
  before the copy and still after it, and the copy must match the checksum. A daemon clears a
  header before it frees or reuses an extent (invalidation on eviction and removal, writers
  before they write), so a copy that raced with reuse fails one of the three checks;
- the data port: the daemon serves an entry only if the extent holds that generation of the key,
  and the client checks the checksum of what arrived; where the cluster requires tickets, a
  remembered read ticket is used only until its expiry.

A read that fails any check is a miss for that block: the location is forgotten and the rest of
the request takes the leased path. Nothing here can return bytes that are not the block's.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple

from kvstore import tickets
from kvstore.wire import Placement

# A remembered read ticket is used only while it has at least this long to run.
TICKET_MARGIN_S = 2.0


class Known(NamedTuple):
    place: Placement
    # Wall-clock second until which the data port may be asked for it with this entry's
    # ticket: inf without tickets, a read ticket's expiry, 0 for a write ticket (shared memory
    # only).
    tcp_until: float


def tcp_until(place: Placement, read: bool) -> float:
    """Until when ``place`` may be read over the data port (see :class:`Known`)."""
    if place.ticket == tickets.NO_TICKET:
        return float("inf")
    if not read:
        return 0.0
    return tickets.TICKET.unpack(place.ticket)[1] - TICKET_MARGIN_S


class LocationCache:
    """Key -> the location it was last seen at; bounded, least recently used out. Thread-safe
    (the sync client reads known blocks in its callers' threads)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[bytes, Known] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # blocks read from remembered locations
        self.stale = 0  # remembered locations that no longer held their block

    def __len__(self) -> int:
        return len(self._d)

    def remember(self, keys: Sequence[bytes], places: Sequence[Placement], read: bool) -> None:
        """Locations of ``keys`` as the service handed them out (``read``: with read tickets)."""
        if self.capacity <= 0:
            return
        d = self._d
        known = [Known(p, tcp_until(p, read)) for p in places]
        with self._lock:
            for k, kn in zip(keys, known):
                d[k] = kn
                d.move_to_end(k)
            while len(d) > self.capacity:
                d.popitem(last=False)

    def run(self, keys: Sequence[bytes], shm_ok) -> list[Placement]:  # noqa: ANN001 - callable(Placement) -> bool
        """The leading run of ``keys`` with a remembered location that can be read now: through
        shared memory (``shm_ok``, asked once per segment message), or over the data port while
        its ticket allows."""
        d = self._d
        with self._lock:
            out = list(map(d.get, keys))
            try:
                out = out[: out.index(None)]
            except ValueError:
                pass
            deque(map(d.move_to_end, keys[: len(out)]), maxlen=0)
        places = [known.place for known in out]
        segments = {id(p.segment): p for p in places}
        refused = {s for s, p in segments.items() if not shm_ok(p)}
        if not refused:
            return places
        now = time.time()
        for i, known in enumerate(out):
            if id(known.place.segment) in refused and known.tcp_until <= now:
                return places[:i]
        return places

    def forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._d.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
