"""Reads from the index (:class:`kvstore.meta.index.Index`): leading-run lookups,
leases that pin a run against eviction (a dropped block's extent is freed when its last lease
ends), touches of chains a client served itself, and where each key is per tier. A mixin over
the index's state (``table``, ``segments``, ``daemons``, ``leases``, ``counters``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES, unpack_keys
from kvstore.meta.records import AcquireResult, Tier
from kvstore.meta.table import LIVE

_NONE = np.empty(0, dtype=np.int64)
TOUCH_INTERVAL_WINDOW_S = 60.0


@dataclass(slots=True)
class Lease:
    lease_id: int
    deadline: float
    rows: np.ndarray
    gens: np.ndarray  # the copies read: a row moved to another tier since holds another generation
    asked: int  # keys the Acquire asked (the run and the misses after it)
    ssd: np.ndarray  # per run block: read from SSD (the tier when it was leased)


class Reads:
    """Lookup, Acquire, Release, Touch and per-tier lookups over the block table."""

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
        """Leases the leading run of committed keys: none of their read replicas is evicted or
        freed until the lease is released or expires. A run of 0 takes no lease (lease id 0).
        Blocks served from SSD are queued for promotion to DRAM. Locations are rows.

        The keys are counted as hits and misses when the lease ends (:meth:`release`: as the
        reader loaded them); without a run, as misses now."""
        _, rows, ready = self._find(packed_keys)
        ttl = self._timeout(ttl_s, self.limits.lease_ttl_s, self.limits.max_lease_ttl_s, "lease ttl")
        n = self._run(ready)
        self._access(packed_keys, n)
        self.counters["acquires"] += 1
        if not n:
            self.counters["miss_keys"] += len(rows)
            return AcquireResult(0, 0, _NONE, ttl)
        t = self.table
        run = rows[:n]
        uniq, times = np.unique(run, return_counts=True)
        first = uniq[t.leases[uniq] == 0]
        for ref, c in zip(*np.unique(t.seg[first], return_counts=True)):
            self.segments[int(ref)].leased += int(c)
        t.leases[uniq] += times.astype(np.uint32)
        ssd = self._queue_promotions(run)
        lease_id = next(self._lease_ids)
        deadline = self.clock.now() + ttl
        self.leases[lease_id] = Lease(lease_id, deadline, run, t.gen[run], len(rows), ssd)
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
            self._free_row(row)
            if not seg.leased and not self._current(seg) and seg.ref not in self._leaving:
                del self.segments[seg.ref]  # its daemon was lost; this was the last block held there
        elif t.is_evictable(row):
            t.stamp_one(row)

    def release(self, lease_id: int, corrupt: Iterable[int] = (), unread: int = 0, asked_again: bool = False) -> None:
        """Ends a lease; blocks at the ``corrupt`` run indexes failed their checksum and are dropped
        (unless they moved to another tier meanwhile: the copy read is gone already).

        The read is counted here: the run's first blocks as hits (by tier, and their bytes), its
        last ``unread`` blocks (those the reader did not load) and the keys asked after the run
        as misses, unless the reader asks those again (``asked_again``: that Acquire counts
        them). A lease that expires counts its whole run as hits."""
        lease, bad = self._release_args(lease_id, corrupt, "rows")
        if not 0 <= unread <= len(lease.rows):
            raise InvalidArgument(f"unread: {unread} blocks is outside the leased run of {len(lease.rows)}")
        del self.leases[lease_id]
        t = self.table
        self._count_hits(lease.rows[: len(lease.rows) - unread], lease.ssd[: len(lease.rows) - unread])
        if not asked_again:
            self.counters["miss_keys"] += lease.asked - len(lease.rows) + unread
        rows = lease.rows.tolist()
        partial = []  # (row, copy read or -1): a block with another copy loses only the bad one
        for i in bad:
            row, gen = rows[i], int(lease.gens[i])
            if not t.flags[row] & LIVE:
                continue
            # The copy read: the primary, or a copy (the block was promoted meanwhile).
            copy = next((c for c in t.copies.of(row) if int(t.copies.gen[c]) == gen), -1)
            if int(t.gen[row]) != gen and copy < 0:
                continue  # moved since: the copy read is gone already
            self.counters["corrupt_reported"] += 1
            if t.copy[row]:
                partial.append((row, copy))
            else:
                self._drop(row)
        for row in reversed(rows):  # tail first: the chain's head ends up most recent
            self._unlease(row)
        for row, copy in partial:
            if not t.flags[row] & LIVE:
                continue
            if t.leases[row]:  # still read under other leases: the whole block goes
                self._drop(row)
            elif copy >= 0:
                self._drop_copy(row, copy)
            else:
                self._drop_primary(row)

    def _count_hits(self, rows: np.ndarray, ssd: np.ndarray) -> None:
        """Blocks a reader loaded (rows still allocated: leased, or just found)."""
        self.counters["hit_keys"] += len(rows)
        self.counters["hit_bytes"] += int(self.table.length[rows].sum(dtype=np.uint64))
        self.counters["ssd_hit_keys"] += int(np.count_nonzero(ssd))

    def _access(self, packed: bytes, hits: int) -> None:
        """A read of a chain, for the cache policy (the keys spelled out only where it counts)."""
        if self.policy.name != "lru":
            self.policy.access([packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)], hits)

    def _touch_rows(self, rows: np.ndarray) -> None:
        """Makes a chain's stored, evictable blocks most recent, tail first."""
        rows = rows[::-1]
        rows = rows[rows >= 0]
        self.table.stamp(rows[self.table.evictable(rows)])

    def touch(self, chains: list[bytes], interval_s: float = 0.0, tiers: bytes = b"") -> int:
        """Reads that a client served itself from locations it held (no lease): each packed chain
        counts for the cache policy as an :meth:`acquire` of it would (access counts, recency tail
        first, SSD blocks queued for promotion), and its stored run as hits (a key dropped since
        the read is counted nowhere), by the tier ``tiers`` names per key (a byte per key of the
        chains: 1 DRAM, 2 SSD; empty: each block's tier now). ``interval_s``: how long the client
        let the reads gather (:attr:`touch_interval_s`). Returns how many of the keys are stored."""
        total, found = 0, []
        for i, packed in enumerate(chains):
            _, rows, ready = self._find(packed, f"chains[{i}]")
            total += len(rows)
            if total > self.limits.max_batch_keys:
                raise InvalidArgument(f"chains: over the limit of {self.limits.max_batch_keys} keys in one call")
            found.append((packed, rows, ready))
        read_on = np.frombuffer(tiers, dtype=np.uint8)
        if len(read_on) not in (0, total):
            raise InvalidArgument(f"tiers: {len(read_on)} bytes for {total} keys (one per key, or none)")
        if ((read_on != Tier.DRAM) & (read_on != Tier.SSD)).any():
            raise InvalidArgument(f"tiers: each byte must be {int(Tier.DRAM)} (DRAM) or {int(Tier.SSD)} (SSD)")
        self._note_touch_interval(interval_s)
        stored, at = 0, 0
        for packed, rows, ready in found:
            n = self._run(ready)
            self._access(packed, n)
            ssd = self._queue_promotions(rows[:n])
            if len(read_on):
                ssd = read_on[at : at + n] == Tier.SSD
            at += len(rows)
            self._count_hits(rows[:n], ssd)
            self._touch_rows(rows)
            stored += n
            self.counters["touches"] += 1
            self.counters["touched_keys"] += n
        return stored

    def _note_touch_interval(self, interval_s: float) -> None:
        """Keeps the longest touch interval reported within about the last minute."""
        now = self.clock.now()
        cur, since = self._touch_interval
        if interval_s >= cur or now - since > TOUCH_INTERVAL_WINDOW_S:
            self._touch_interval = (interval_s, now)

    @property
    def touch_interval_s(self) -> float:
        """How late hits of reads from known locations reach the counters: the longest touch
        interval a client reported within about the last minute (0 when none did)."""
        cur, since = self._touch_interval
        return cur if self.clock.now() - since <= 2 * TOUCH_INTERVAL_WINDOW_S else 0.0

    def tiers(self, packed_keys: bytes) -> tuple[bytes, dict[str, tuple[str, bytearray]]]:
        """Where each key is, per tier: a byte per key, a bit per tier that holds a replica of it
        (bit 0 DRAM, bit 1 SSD) if it is committed; and the engines that report holding each
        key in their own caches (the device tier, :mod:`kvstore.meta.engines`)."""
        _, rows, ready = self._find(packed_keys)
        out = np.zeros(len(rows), dtype=np.uint8)
        t = self.table
        at = np.maximum(rows, 0)
        refs = set(t.seg[rows[ready]].tolist())
        if t.copies.count:
            for row in rows[ready].tolist():
                refs.update(int(t.copies.seg[i]) for i in t.copies.of(row))
        for ref in refs:
            tier = self.segments[ref].spec.tier
            if tier in (Tier.DRAM, Tier.SSD):
                out[ready & t.on_segment(at, ref)] |= 1 << (tier - 1)
        return out.tobytes(), self.engine_tier.held(unpack_keys(packed_keys))
