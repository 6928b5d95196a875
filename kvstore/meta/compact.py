"""The compact index: the block life cycle of :class:`kvstore.meta.index.Index` over a columnar
:class:`kvstore.meta.table.BlockTable`, for indexes of hundreds of millions of blocks.

Same contract and same answers as the object index with ``cache_policy="lru"`` (the tests replay
random operation sequences on both): puts in two phases with chain-ordered placement and
eviction, leading-run lookups, leases that pin a run against eviction and free a dropped
block's extent when the last one ends, removal, pinning, touches, expiry, daemon registration
with inventory adoption, daemon loss, and tombstones. Pure state as the object index: no I/O,
time from an injected :class:`Clock`, every method validates first and changes nothing when it
raises.

Where it differs, by design:

- Per block there is a row of fixed-width columns and a hash slot (:mod:`kvstore.meta.table`),
  not an entry, a replica, a location row and four container entries; batch operations
  (lookup, acquire, touch, commit) are vectorised over the batch.
- A block has one replica. Moves between tiers (demotion, promotion) and the adaptive policy are
  not part of it yet: a segment's least recently used block is its victim, on any tier.
- Locations come back as rows of the table; :meth:`location_rows` packs them as the wire's
  location rows in one call, :meth:`locations` spells them out.

As there, a registration naming a generation at or past ``GEN_LIMIT`` is refused whole, the
generation counter never passes ``GEN_MAX`` (:mod:`kvstore.meta.records`), and the extents of a
put that ends uncommitted are held back until its write tickets lapse (:mod:`.quarantine`).
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvstore.cluster.slots import arena
from kvstore.errors import Internal, InvalidArgument, NotFound
from kvstore.extent import extent_size
from kvstore.keys import KEY_BYTES
from kvstore.meta.allocator import Allocator
from kvstore.meta.checks import Checks
from kvstore.meta.compact_writes import CompactWrites, Put
from kvstore.meta.membership import Tombstones
from kvstore.meta.quarantine import Quarantine
from kvstore.meta.records import (
    COUNTERS,
    GEN_MAX,
    SEGMENT_ALIGN,
    AcquireResult,
    Clock,
    Daemon,
    DaemonSpec,
    IndexLimits,
    InventoryItem,
    Segment,
    Tier,
    Tombstone,
    expired,
)
from kvstore.meta.table import LIVE, PINNED, READY, WRITTEN, BlockTable, words

_ROWS = np.dtype([("ref", "<u4"), ("res", "<u4"), ("off", "<u8"), ("len", "<u8"), ("csum", "<u8"), ("gen", "<u8")])
_NONE = np.empty(0, dtype=np.int64)


class Location(NamedTuple):
    """A block's replica, spelled out."""

    segment: Segment
    offset: int
    size: int
    length: int
    checksum: int
    gen: int
    key: bytes


@dataclass(slots=True)
class _Lease:
    lease_id: int
    deadline: float
    rows: np.ndarray


class CompactIndex(Checks, Tombstones, CompactWrites):
    """The index's block state in columns. See the module docstring for what it covers."""

    def __init__(self, limits: IndexLimits | None = None, clock: Clock | None = None, rows: int = 1024) -> None:
        self.limits = limits or IndexLimits()
        if self.limits.cache_policy != "lru":
            raise InvalidArgument(
                f"the compact index evicts least recently used first, not {self.limits.cache_policy!r}"
            )
        self.clock = clock or Clock()
        self.table = BlockTable(rows)
        self.daemons: dict[str, Daemon] = {}
        self.segments: dict[int, Segment] = {}  # by ref; a lost daemon's stay while leases hold rows there
        self.puts: dict[int, Put] = {}
        self.leases: dict[int, _Lease] = {}
        base = random.getrandbits(62)
        self._put_ids = itertools.count(base)
        self._lease_ids = itertools.count(base)
        self._segment_refs = itertools.count(1)
        self._last_gen = 0
        self.tombstones: dict[str, list[Tombstone]] = {}
        self._n_tombstones = 0
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._put_deadlines: list[tuple[float, int]] = []
        self._lease_deadlines: list[tuple[float, int]] = []
        # Extents of puts that ended uncommitted, until their write tickets lapse.
        self._quarantine = Quarantine()

    def _gens_left(self, n: int) -> int:
        """The first of ``n`` fresh generations; raises (having changed nothing) unless they fit
        in 64 bits (see ``Index._gens_left``)."""
        first = max(self._last_gen + 1, time.time_ns())
        if first + n - 1 > GEN_MAX:
            raise Internal(f"generation counter exhausted: {n} more would pass 2**64 - 1 (last {self._last_gen})")
        return first

    def _gens(self, n: int) -> np.ndarray:
        first = self._gens_left(n)
        self._last_gen = first + n - 1
        return np.arange(first, first + n, dtype=np.uint64)

    def _current(self, seg: Segment) -> bool:
        """Whether ``seg`` is a segment of a daemon the index knows now (not of a lost one)."""
        return self.daemons.get(seg.daemon.spec.daemon_id) is seg.daemon

    def _find(self, packed: bytes, what: str = "keys") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The keys' words, their rows (-1: not stored) and whether each is committed."""
        self._count_keys(packed, what)
        q = words(packed)
        return q, *self.table.find_ready(q)

    @staticmethod
    def _run(ready: np.ndarray) -> int:
        """The leading run of committed blocks."""
        return len(ready) if ready.all() else int(np.argmin(ready))

    # ---- locations --------------------------------------------------------------------------

    def locations(self, rows: Iterable[int]) -> list[Location]:
        t = self.table
        return [
            Location(
                self.segments[int(t.seg[r])],
                int(t.off[r]),
                int(t.size[r]),
                int(t.length[r]),
                int(t.csum[r]),
                int(t.gen[r]),
                t.key(r),
            )  # fmt: skip
            for r in rows
        ]

    def location_rows(self, rows: np.ndarray) -> bytes:
        """``rows`` as the wire's packed location rows (:data:`kvstore.meta.records.ROW`)."""
        t = self.table
        out = np.zeros(len(rows), dtype=_ROWS)
        out["ref"], out["off"], out["len"] = t.seg[rows], t.off[rows], t.length[rows]
        out["csum"], out["gen"] = t.csum[rows], t.gen[rows]
        return out.tobytes()

    # ---- dropping ---------------------------------------------------------------------------

    def _drop(self, row: int, free: bool = True, hold_until: float | None = None) -> None:
        """A block leaves the index; its extent is freed now or when its last lease ends, or
        (``hold_until``: a put's reservation whose write tickets are still good) at that time
        (``free=False``, its daemon was lost: the space goes with the daemon). A block its
        daemon may hold committed leaves a tombstone."""
        t = self.table
        f = int(t.flags[row])
        if not f & LIVE:
            return
        seg = self.segments[int(t.seg[row])]
        t.unlink(row)
        t.flags[row] &= 0xFF ^ PINNED
        seg.blocks -= 1
        if f & PINNED:
            seg.pinned -= 1
        if free and f & (READY | WRITTEN):
            self._tombstone_item(
                seg.daemon.spec.daemon_id, Tombstone(seg.spec.segment_id, t.key(row), int(t.off[row]), int(t.gen[row]))
            )
        if t.leases[row] == 0:
            if free and hold_until is None:
                seg.alloc.release(int(t.off[row]), int(t.size[row]))
            elif free:
                self._quarantine.hold(seg, int(t.off[row]), int(t.size[row]), hold_until)
            t.free(row)

    # ---- reads ------------------------------------------------------------------------------

    def lookup(
        self, packed_keys: bytes, per_key: bool = False, with_locations: bool = False
    ) -> tuple[int, list[bool], np.ndarray]:
        """Leading hit count (and per-key existence, and the run's rows). No side effects
        (counters aside)."""
        _, rows, ready = self._find(packed_keys)
        n = self._run(ready)
        self.counters["lookups"] += 1
        self.counters["lookup_keys"] += len(rows)
        self.counters["lookup_hit_keys"] += n
        exists: list[bool] = ready.tolist() if per_key else []
        return n, exists, rows[:n] if with_locations else _NONE

    def acquire(self, packed_keys: bytes, ttl_s: float = 0.0) -> AcquireResult:
        """Leases the leading run of committed keys (see ``Index.acquire``); locations are rows."""
        _, rows, ready = self._find(packed_keys)
        ttl = self._timeout(ttl_s, self.limits.lease_ttl_s, self.limits.max_lease_ttl_s, "lease ttl")
        n = self._run(ready)
        self.counters["acquires"] += 1
        self.counters["hit_keys"] += n
        self.counters["miss_keys"] += len(rows) - n
        if not n:
            return AcquireResult(0, 0, _NONE, ttl)
        t = self.table
        run = rows[:n]
        uniq, times = np.unique(run, return_counts=True)
        first = uniq[t.leases[uniq] == 0]
        for ref, c in zip(*np.unique(t.seg[first], return_counts=True)):
            self.segments[int(ref)].leased += int(c)
        t.leases[uniq] += times.astype(np.uint32)
        self.counters["hit_bytes"] += int(t.length[run].sum(dtype=np.uint64))
        for ref in np.unique(t.seg[run]).tolist():
            if self.segments[ref].spec.tier != Tier.DRAM:
                self.counters["ssd_hit_keys"] += int((t.seg[run] == ref).sum())
        lease_id = next(self._lease_ids)
        deadline = self.clock.now() + ttl
        self.leases[lease_id] = _Lease(lease_id, deadline, run)
        heapq.heappush(self._lease_deadlines, (deadline, lease_id))
        return AcquireResult(n, lease_id, run.copy(), ttl)

    def _unlease(self, row: int) -> None:
        t = self.table
        t.leases[row] -= 1
        if t.leases[row]:
            return
        seg = self.segments[int(t.seg[row])]
        seg.leased -= 1
        if not t.flags[row] & LIVE:
            seg.alloc.release(int(t.off[row]), int(t.size[row]))
            t.free(row)
            if not seg.leased and self.daemons.get(seg.daemon.spec.daemon_id) is not seg.daemon:
                del self.segments[seg.ref]  # its daemon was lost; this was the last block held there
        elif t.is_evictable(row):
            t.stamp_one(row)

    def release(self, lease_id: int, corrupt: Iterable[int] = ()) -> None:
        """Ends a lease; blocks at the ``corrupt`` run indexes failed their checksum and are dropped."""
        lease = self.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id} is unknown (already released or expired)")
        bad = sorted(set(corrupt))
        for i in bad:
            if not 0 <= i < len(lease.rows):
                raise InvalidArgument(f"corrupt index {i} is outside the leased run of {len(lease.rows)}")
        del self.leases[lease_id]
        rows = lease.rows.tolist()
        for i in bad:
            if self.table.flags[rows[i]] & LIVE:
                self.counters["corrupt_reported"] += 1
                self._drop(rows[i])
        for row in reversed(rows):  # tail first: the chain's head ends up most recent
            self._unlease(row)

    def _touch_rows(self, rows: np.ndarray) -> None:
        """Makes a chain's stored, evictable blocks most recent, tail first."""
        rows = rows[::-1]
        rows = rows[rows >= 0]
        self.table.stamp(rows[self.table.evictable(rows)])

    def touch(self, chains: list[bytes]) -> int:
        """Reads a client served itself (see ``Index.touch``). Returns how many keys are stored."""
        total, found = 0, []
        for i, packed in enumerate(chains):
            _, rows, ready = self._find(packed, f"chains[{i}]")
            total += len(rows)
            if total > self.limits.max_batch_keys:
                raise InvalidArgument(f"chains: over the limit of {self.limits.max_batch_keys} keys in one call")
            found.append((rows, ready))
        stored = 0
        for rows, ready in found:
            n = self._run(ready)
            self._touch_rows(rows)
            stored += n
            self.counters["touches"] += 1
            self.counters["touched_keys"] += n
        return stored

    # ---- management -------------------------------------------------------------------------

    def remove(self, packed_keys: bytes) -> int:
        rows = self._find(packed_keys)[1].tolist()
        n = 0
        for row in rows:
            if row >= 0 and self.table.flags[row] & READY:
                self._drop(row)
                n += 1
        self.counters["removed"] += n
        return n

    def pin(self, packed_keys: bytes, pinned: bool = True) -> int:
        t = self.table
        n = 0
        for row in self._find(packed_keys)[1].tolist():
            if row < 0 or not t.flags[row] & READY or bool(t.flags[row] & PINNED) == pinned:
                continue
            seg = self.segments[int(t.seg[row])]
            if pinned:
                t.flags[row] |= PINNED
                seg.pinned += 1
            else:
                t.flags[row] &= 0xFF ^ PINNED
                seg.pinned -= 1
                if t.is_evictable(row):
                    t.stamp_one(row)
            n += 1
        return n

    # ---- daemons ----------------------------------------------------------------------------

    def register_daemon(self, spec: DaemonSpec, inventory: dict[int, list[InventoryItem]]) -> int:
        """(Re)registers a daemon and adopts its inventory as committed blocks, oldest first;
        returns how many items were refused (see ``Index.register_daemon``; a key stored
        anywhere already is refused, as a block has one replica here)."""
        self._daemon_args(spec, inventory)
        if spec.daemon_id in self.daemons:
            self._drop_daemon(spec.daemon_id)
        now = self.clock.now()
        daemon = Daemon(spec, now + self.limits.daemon_ttl_s, now)
        self.daemons[spec.daemon_id] = daemon
        dead = {(x.segment_id, x.key, x.offset, x.gen) for x in self.tombstones.get(spec.daemon_id, ())}
        t = self.table
        rejected = 0
        for sspec in sorted(spec.segments, key=lambda s: int(s.tier)):
            align = SEGMENT_ALIGN[sspec.tier]
            items = inventory.get(sspec.segment_id, [])
            sizes = [it.size or extent_size(it.length, align) for it in items]
            base, span = arena(sspec.capacity, align, self.limits.shard, self.limits.shards)
            alloc, accepted = Allocator.with_used(span, [(it.offset, sz) for it, sz in zip(items, sizes)], align, base)
            seg = Segment(daemon, sspec, next(self._segment_refs), alloc)
            daemon.segments[sspec.segment_id] = seg
            self.segments[seg.ref] = seg
            for it, size, ok in zip(items, sizes, accepted):
                self._last_gen = max(self._last_gen, it.gen)
                # A 16-byte key and values that fit their 64-bit columns (the wire's widths).
                good = len(it.key) == KEY_BYTES and all(0 <= v < 1 << 64 for v in (it.length, it.checksum, it.gen))
                clash = good and t.find(words(it.key))[0] >= 0
                tomb = (sspec.segment_id, it.key, it.offset, it.gen) in dead
                if not ok or not good or clash or tomb or not it.gen:
                    if ok:
                        alloc.release(it.offset, size)
                    rejected += 1
                    if ok and good and it.gen and not tomb:
                        self._tombstone_item(spec.daemon_id, Tombstone(sspec.segment_id, it.key, it.offset, it.gen))
                    continue
                row = t.add(words(it.key))
                t.seg[row], t.off[row], t.size[row], t.length[row] = seg.ref, it.offset, size, it.length
                t.csum[row], t.gen[row] = it.checksum, it.gen
                t.flags[row] |= WRITTEN
                t.set_ready(row)
                t.stamp(row)
                seg.blocks += 1
        return rejected

    def heartbeat(self, daemon_id: str) -> bool:
        d = self.daemons.get(daemon_id)
        if d is None:
            return False
        now = self.clock.now()
        d.last_heartbeat = now
        d.deadline = now + self.limits.daemon_ttl_s
        return True

    def _drop_daemon(self, daemon_id: str) -> None:
        d = self.daemons.pop(daemon_id)
        t = self.table
        for seg in d.segments.values():
            n = t.n_rows
            mine = np.flatnonzero(((t.flags[:n] & LIVE) != 0) & (t.seg[:n] == seg.ref))
            for row in mine.tolist():
                self._drop(row, free=False)
            seg.quarantined = 0  # its entries in the quarantine are skipped when they come up
            t.forget_segment(seg.ref)
            if not seg.leased:
                del self.segments[seg.ref]

    # ---- time -------------------------------------------------------------------------------

    def expire(self) -> dict[str, int]:
        """Reclaims what outlived its deadline: daemons, put reservations, leases; frees the
        extents of ended puts whose write tickets lapsed."""
        now = self.clock.now()
        out = {"daemons": 0, "puts": 0, "leases": 0}
        for did in [d for d, st in self.daemons.items() if st.deadline < now]:
            self._drop_daemon(did)
            out["daemons"] += 1
        for pid in expired(self._put_deadlines, self.puts, now):
            self.put_abort(pid)
            out["puts"] += 1
        for lid in expired(self._lease_deadlines, self.leases, now):
            self.release(lid)
            out["leases"] += 1
        self._quarantine.release(now, self._current)
        self.counters["daemons_lost"] += out["daemons"]
        self.counters["expired_puts"] += out["puts"]
        self.counters["expired_leases"] += out["leases"]
        return out

    # ---- introspection ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Asserts the accounting, as ``Index.check_integrity`` does for the object index."""
        t = self.table
        t.check_integrity()
        n = t.n_rows
        live = (t.flags[:n] & LIVE) != 0
        held = (~live) & (t.leases[:n] > 0)
        quarantined: dict[int, list[tuple[int, int]]] = {}
        for seg, offset, size in self._quarantine.extents(self._current):
            quarantined.setdefault(seg.ref, []).append((offset, size))
        for ref, seg in self.segments.items():
            on = t.seg[:n] == ref
            if self._current(seg):
                seg.alloc.check_integrity()
                q = quarantined.get(ref, [])
                assert seg.quarantined == sum(size for _, size in q), f"segment {ref}: quarantined {seg.quarantined}"
                used = int(t.size[:n][on & (live | held)].sum(dtype=np.uint64))
                assert seg.alloc.used == used + seg.quarantined, (
                    f"segment {ref}: allocator used {seg.alloc.used} != blocks {used} + quarantined {seg.quarantined}"
                )
                mine = np.flatnonzero(on & (live | held))
                seg.alloc.check_disjoint(list(zip(t.off[mine].tolist(), t.size[mine].tolist())) + q)
            assert seg.blocks == int((on & live).sum()), f"segment {ref}: block count {seg.blocks}"
            assert seg.pinned == int((on & live & ((t.flags[:n] & PINNED) != 0)).sum()), f"segment {ref}: pinned"
            assert seg.leased == int((on & (t.leases[:n] > 0)).sum()), f"segment {ref}: leased {seg.leased}"
