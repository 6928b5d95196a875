"""Daemon membership in the index: registration with inventory adoption, heartbeats, loss and
drain, and the tombstones owed to each daemon. Part of :class:`kvstore.meta.index.Index` (a mixin
over its state: ``daemons``, ``entries``, ``tombstones``, ``moves``, ``leases``, ``counters``).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable

from kvstore.cluster.slots import arena
from kvstore.extent import extent_size
from kvstore.keys import KEY_BYTES
from kvstore.meta.allocator import Allocator
from kvstore.meta.records import (
    SEGMENT_ALIGN,
    Daemon,
    DaemonSpec,
    Entry,
    InventoryItem,
    Lease,
    Replica,
    Segment,
    SegmentSpec,
    Tombstone,
)

# Tombstones kept for daemons that could not take them yet (unreachable or gone); past this the
# oldest are dropped (a warning is counted), so a daemon that never returns cannot grow memory.
MAX_TOMBSTONES = 1 << 20


class Tombstones:
    """What daemons must forget, kept per daemon until delivered (a mixin over ``tombstones``,
    ``_n_tombstones``, ``daemons`` and ``counters``; shared with the compact index)."""

    def _tombstone_item(self, daemon_id: str, t: Tombstone) -> None:
        self.tombstones.setdefault(daemon_id, []).append(t)
        self._n_tombstones += 1
        self.counters["tombstones"] += 1
        if self._n_tombstones > MAX_TOMBSTONES:
            did = max(self.tombstones, key=lambda d: len(self.tombstones[d]))
            drop = len(self.tombstones[did]) // 2 or 1
            del self.tombstones[did][:drop]
            self._n_tombstones -= drop
            self.counters["tombstones_dropped"] += drop

    def take_tombstones(self, daemon_ids: Iterable[str] | None = None) -> dict[str, list[Tombstone]]:
        """Hands over the undelivered tombstones (of the given daemons, default all known
        daemons). The caller delivers them and gives back what it could not
        (:meth:`return_tombstones`)."""
        ids = [d for d in (self.daemons if daemon_ids is None else daemon_ids) if self.tombstones.get(d)]
        out = {d: self.tombstones.pop(d) for d in ids}
        self._n_tombstones -= sum(len(v) for v in out.values())
        return out

    def return_tombstones(self, daemon_id: str, items: list[Tombstone]) -> None:
        """Tombstones that could not be delivered, kept for the daemon's next heartbeat."""
        if items:
            self.tombstones.setdefault(daemon_id, [])[:0] = items
            self._n_tombstones += len(items)


class DaemonLife(Tombstones):
    """A daemon's life in an index, as both indexes keep it: registration driven in one go,
    heartbeats, drain, stalls of the service itself (a mixin over ``daemons``, ``leases``,
    ``engine_tier``, ``clock``, ``limits`` and ``counters``, and each index's ``_adopt``,
    ``_drop_daemon`` and ``_leased_on``)."""

    def register_daemon(self, spec: DaemonSpec, inventory: dict[int, list[InventoryItem]]) -> int:
        """(Re)registers a daemon and adopts its inventory as ready replicas, in one go.

        Whatever the index held for this daemon before is dropped first: the daemon's word on
        what its segments hold wins. Returns how many inventory items were refused (overlap,
        out of range, a key already stored on another daemon, generation 0, a length or checksum
        past 64 bits). An item whose generation is past the range the index hands out
        (``GEN_LIMIT``, :mod:`kvstore.meta.records`) refuses the whole registration.
        """
        steps = self.register_daemon_steps(spec, inventory, chunk=0)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def register_daemon_steps(
        self, spec: DaemonSpec, inventory: dict[int, list[InventoryItem]], chunk: int = 20_000
    ) -> Generator[None, None, int]:
        """:meth:`register_daemon` in steps of ``chunk`` inventory items (0: one step), so that
        a caller can serve other requests between them (a big inventory takes seconds). The
        daemon is known from the first step, with every extent of its inventory reserved, but
        takes no puts or moves until the last; its lease is renewed at every step. A second
        registration of the same daemon meanwhile supersedes this one (which then stops).
        Bad input raises at the first step, having changed nothing. Each index adopts an item
        its own way (``_adopt``), oldest first: recency order."""
        self._daemon_args(spec, inventory)
        if spec.daemon_id in self.daemons:
            self._drop_daemon(spec.daemon_id)
        now = self.clock.now()
        daemon = Daemon(spec, now + self.limits.daemon_ttl_s, now, adopting=True)
        self.daemons[spec.daemon_id] = daemon
        rejected = 0
        # Blocks dropped while the daemon could not be told stay dropped (their tombstones
        # are still pending, and go out with its next heartbeat).
        dead = {(t.segment_id, t.key, t.offset, t.gen) for t in self.tombstones.get(spec.daemon_id, ())}
        # Every segment with its inventory's extents reserved first; DRAM first, so that an
        # entry's DRAM replica is its first.
        plan = []
        for sspec in sorted(spec.segments, key=lambda s: int(s.tier)):
            align = SEGMENT_ALIGN[sspec.tier]
            items = inventory.get(sspec.segment_id, [])
            sizes = [it.size or extent_size(it.length, align) for it in items]
            base, span = arena(sspec.capacity, align, self.limits.shard, self.limits.shards)
            alloc, accepted = Allocator.with_used(span, [(it.offset, sz) for it, sz in zip(items, sizes)], align, base)
            seg = self._new_segment(daemon, sspec, alloc)
            daemon.segments[sspec.segment_id] = seg
            plan.append((sspec, seg, alloc, items, sizes, accepted))
        done = 0
        for sspec, seg, alloc, items, sizes, accepted in plan:
            for it, size, ok in zip(items, sizes, accepted):
                done += 1
                if chunk and done % chunk == 0:
                    yield
                    if self.daemons.get(spec.daemon_id) is not daemon:
                        return rejected  # superseded, or dropped meanwhile
                    daemon.deadline = self.clock.now() + self.limits.daemon_ttl_s
                self._last_gen = max(self._last_gen, it.gen)
                # A 16-byte key and values that fit the location row's 64-bit fields.
                good = len(it.key) == KEY_BYTES and all(0 <= v < 1 << 64 for v in (it.length, it.checksum, it.gen))
                tomb = (sspec.segment_id, it.key, it.offset, it.gen) in dead
                if not ok or not good or tomb or not it.gen or not self._adopt(daemon, seg, it, size):
                    if ok:
                        alloc.release(it.offset, size)
                    rejected += 1
                    if ok and good and it.gen and not tomb:
                        # Refused though its extent is its own (a clash with what the index
                        # holds): the daemon must drop it too, or a reader that remembers its
                        # location would still find it there (kvstore.client.locations).
                        self._tombstone_item(spec.daemon_id, Tombstone(sspec.segment_id, it.key, it.offset, it.gen))
        daemon.adopting = False
        return rejected

    def _new_segment(self, daemon: Daemon, sspec: SegmentSpec, alloc: Allocator) -> Segment:
        return Segment(daemon, sspec, next(self._segment_refs), alloc)

    def heartbeat(self, daemon_id: str, registration: int = 0) -> bool:
        """Extends a daemon's liveness. False if the daemon is unknown (it must register), or
        known under another registration than the one it heartbeats for (a registration made
        in its name replaced its own: it must register again, inventory and all); a
        ``registration`` of 0 is not checked."""
        d = self.daemons.get(daemon_id)
        if d is None:
            return False
        if registration and d.spec.registration and registration != d.spec.registration:
            return False
        now = self.clock.now()
        d.last_heartbeat = now
        d.deadline = now + self.limits.daemon_ttl_s
        return True

    def drain_daemon(self, daemon_id: str) -> tuple[int, int, float]:
        """A daemon leaving on purpose: it takes no more puts and its blocks leave the index
        now. Returns (blocks dropped, read leases on its blocks still held, seconds until the
        last of them runs out), so that the daemon keeps serving what was handed out. It may
        be called again (dropping nothing) to follow the leases."""
        d = self.daemons.get(daemon_id)
        blocks = 0
        if d is not None:
            blocks = sum(seg.blocks for seg in d.segments.values())
            self._drop_daemon(daemon_id)
            self.counters["daemons_drained"] += 1
        now = self.clock.now()
        held, wait = 0, 0.0
        for lease in self.leases.values():
            if self._leased_on(lease, daemon_id):
                held += 1
                wait = max(wait, lease.deadline - now)
        return blocks, held, wait

    def grace(self, seconds: float) -> None:
        """The service itself did not run for ``seconds`` (a long call, a paused process):
        heartbeats that arrived in that time could not be handled, so no daemon's lease counts
        that time against it."""
        for d in self.daemons.values():
            d.deadline += seconds
        for e in self.engine_tier.engines.values():
            e.deadline += seconds
        self.counters["stall_grace"] += 1


class Membership(DaemonLife):
    """Daemons joining, living, leaving; what they must forget."""

    def _tombstone(self, rep: Replica) -> None:
        seg = rep.segment
        self._tombstone_item(
            seg.daemon.spec.daemon_id, Tombstone(seg.spec.segment_id, rep.entry.key, rep.offset, rep.gen)
        )

    # ---- daemons ----------------------------------------------------------------------------

    def _adopt(self, daemon: Daemon, seg: Segment, it: InventoryItem, size: int) -> bool:
        """Adopts one inventory item as a ready replica; False (nothing changed) if it clashes
        with what the index holds: a block being written, one on this tier already, on another
        daemon, or of another length."""
        e = self.entries.get(it.key)
        if e is not None and (
            not e.complete
            or e.on(seg.spec.tier) is not None
            or any(r.segment.daemon is not daemon for r in e.replicas)
            or e.replica.length != it.length  # type: ignore[union-attr]
        ):
            return False
        if e is None:
            e = Entry(it.key, 0)
            self.policy.created(e)  # before the entries change (policy: defer)
            self.entries[it.key] = e
        rep = self._add_replica(e, seg, it.offset, size, it.length, it.gen)
        e.complete = True
        self._make_ready(rep, it.checksum)
        return True

    def _drop_daemon(self, daemon_id: str) -> None:
        """Forgets a daemon and its replicas (ready and reserved: puts in flight on it commit
        nothing there; entries keep their position in put.entries) and the extents held back
        there (:mod:`kvstore.meta.quarantine`). Costs the daemon's own blocks, not the index's."""
        d = self.daemons.pop(daemon_id)
        for mid in [m for m, mv in self.moves.items() if mv.src.segment.daemon is d]:
            self.finish_move(mid, False)
        for seg in d.segments.values():
            # In extent order (a set has none of its own): the cache policy's history takes
            # their counts in that order, on both indexes.
            for r in sorted(seg.replicas, key=lambda r: r.offset):
                self._drop_replica(r, free=False)
            seg.quarantined = 0  # its entries in the quarantine are skipped when they come up

    def _leased_on(self, lease: Lease, daemon_id: str) -> bool:
        return any(r.segment.daemon.spec.daemon_id == daemon_id for r in lease.replicas)
