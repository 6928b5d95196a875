"""The metadata service's handlers for its daemons: registration (the inventory in one message,
or streamed in parts when it passes a message's limit; decoded into columns on a thread when
big, adopted in vectorised steps so that other calls are served meanwhile, filtered by the
tombstones the daemon may not have applied), heartbeats (which carry tombstone batches until
acknowledged) and drain. A mixin of :class:`kvstore.meta.servicer.MetaServicer`, over its
``index``, ``link``, identity checks and shard."""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np

from kvstore import tickets
from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.keys import KEY_BYTES
from kvstore.meta.daemons import invalidations_pb
from kvstore.meta.inventory import decode
from kvstore.meta.membership import ADOPT_CHUNK
from kvstore.meta.records import SEGMENT_ALIGN, DaemonSpec, SegmentSpec, Tier
from kvstore.rpc import BadRequest
from kvstore.v1 import common_pb2, meta_pb2

log = logging.getLogger("kvstore.meta")

_TIERS = {int(t) for t in Tier}


def _inventory(invs: list[common_pb2.Inventory]) -> dict[int, np.ndarray]:
    """Inventory messages as columns per segment (:func:`kvstore.meta.inventory.decode`),
    oldest generation first; a segment named in several has its parts joined."""
    parts: dict[int, list[np.ndarray]] = {}
    for inv in invs:
        cols = {"offset": inv.offset, "length": inv.length, "checksum": inv.checksum, "gen": inv.gen, "size": inv.size}
        parts.setdefault(inv.segment_id, []).append(decode(inv.segment_id, inv.keys, cols))
    out = {}
    for sid, ps in parts.items():
        a = ps[0] if len(ps) == 1 else np.concatenate(ps)
        out[sid] = a if len(ps) == 1 else a[np.argsort(a["gen"], kind="stable")]
    return out


def _joined(parts: list[dict[int, np.ndarray]]) -> dict[int, np.ndarray]:
    """A streamed inventory's parts joined per segment, oldest generation first."""
    out = {}
    for sid in {sid for p in parts for sid in p}:
        a = np.concatenate([p[sid] for p in parts if sid in p])
        out[sid] = a[np.argsort(a["gen"], kind="stable")]
    return out


class DaemonCalls:
    """RegisterDaemon (and RegisterDaemonStream), DrainDaemon and Heartbeat."""

    async def RegisterDaemon(self, request, context):
        spec, room = self._daemon_spec(request, context)
        self._count_inventory(request.inventory, room, {})
        # A big inventory (hundreds of thousands of blocks) is decoded on a thread and adopted
        # in steps, so that heartbeats and requests are served meanwhile.
        big = sum(len(inv.keys) for inv in request.inventory) // KEY_BYTES > ADOPT_CHUNK
        inventory = await asyncio.to_thread(_inventory, request.inventory) if big else _inventory(request.inventory)
        return await self._register(spec, inventory)

    async def RegisterDaemonStream(self, requests, context):
        """A registration whose inventory comes in several messages: the first as RegisterDaemon's,
        the others with parts of the inventory only; each part is checked against the room of
        its segment (all parts together) and decoded on a thread as it arrives."""
        spec = None
        room: dict[int, int] = {}
        seen: dict[int, int] = {}
        parts: list[dict[int, np.ndarray]] = []
        async for request in requests:
            if isinstance(request, BadRequest):
                raise InvalidArgument(request.reason)
            if spec is None:
                spec, room = self._daemon_spec(request, context)
            elif request.HasField("daemon") or request.ticket_key or request.registration:
                raise InvalidArgument("RegisterDaemonStream: only the first message names the daemon")
            self._count_inventory(request.inventory, room, seen)
            if request.inventory:
                parts.append(await asyncio.to_thread(_inventory, request.inventory))
        if spec is None:
            raise InvalidArgument("RegisterDaemonStream: no message")
        inventory = await asyncio.to_thread(_joined, parts)  # (millions of rows: off the loop)
        return await self._register(spec, inventory)

    def _daemon_spec(self, request: meta_pb2.RegisterDaemonRequest, context) -> tuple[DaemonSpec, dict[int, int]]:  # noqa: ANN001
        """The registering daemon, checked (identity, ticket key, tiers), and the most blocks each
        of its segments can hold."""
        info = request.daemon
        ident = self._who(context, "daemon")
        if self.authority is not None and info.daemon_id != ident.name:
            raise PermissionDenied(f"daemon {ident.name!r} may register only under its own id, not {info.daemon_id!r}")
        if request.ticket_key and len(request.ticket_key) != tickets.KEY_BYTES:
            raise InvalidArgument(f"ticket_key must be {tickets.KEY_BYTES} bytes, got {len(request.ticket_key)}")
        key = request.ticket_key if self.tickets else b""
        for s in info.segments:
            if s.tier not in _TIERS and s.tier != 0:
                raise InvalidArgument(f"segment {s.segment_id}: unknown tier {s.tier} (DRAM=1, SSD=2)")
        # An inventory is bounded by what its segment can hold before anything is decoded: every
        # block takes at least one alignment unit of the segment.
        room = {s.segment_id: s.capacity_bytes // SEGMENT_ALIGN[Tier(s.tier or Tier.DRAM)] for s in info.segments}
        spec = DaemonSpec(
            info.daemon_id,
            info.host_id,
            info.data_addr,
            info.control_addr,
            tuple(
                SegmentSpec(s.segment_id, Tier(s.tier or Tier.DRAM), s.capacity_bytes, s.shm_path)
                for s in info.segments
            ),
            key,
            request.registration,
        )
        return spec, room

    @staticmethod
    def _count_inventory(invs, room: dict[int, int], seen: dict[int, int]) -> None:  # noqa: ANN001
        """Refuses inventory parts that, with those ``seen`` before, name more blocks than their
        segment can hold (or name a segment the daemon did not declare)."""
        for inv in invs:
            n = seen.get(inv.segment_id, 0) + len(inv.keys) // KEY_BYTES
            if n > room.get(inv.segment_id, 0):
                raise InvalidArgument(
                    f"inventory of segment {inv.segment_id}: {n} blocks cannot fit it "
                    f"(at most {room.get(inv.segment_id, 0)}, or the segment is not declared)"
                )
            seen[inv.segment_id] = n

    async def _register(self, spec: DaemonSpec, inventory: dict[int, np.ndarray]) -> meta_pb2.RegisterDaemonResponse:
        """Adopts the inventory in steps (the loop serves other calls between them)."""
        # The reservations of a big inventory are planned on a thread (sorting millions of
        # extents); adoption then goes in steps on the loop.
        big = sum(len(v) for v in inventory.values()) > ADOPT_CHUNK
        plan = (await asyncio.to_thread(self.index.plan_registration, spec, inventory)) if big else None
        self.link.requeue(spec.daemon_id)  # tombstones it may not have applied filter its inventory
        steps = self.index.register_daemon_steps(spec, inventory, chunk=ADOPT_CHUNK, plan=plan)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                rejected = done.value
                break
            await asyncio.sleep(0)
        adopted = sum(len(v) for v in inventory.values()) - rejected
        log.info("event=daemon_registered daemon=%s blocks=%d rejected=%d", spec.daemon_id, adopted, rejected)
        lim = self.index.limits
        return meta_pb2.RegisterDaemonResponse(
            heartbeat_interval_ms=int(lim.heartbeat_interval_s * 1000),
            lease_ttl_ms=int(lim.daemon_ttl_s * 1000),
            rejected=rejected,
            tickets=bool(spec.ticket_key),
            shard=self.shard,
            shards=self.shards,
            epoch=self.epoch,
        )

    async def DrainDaemon(self, request, context):
        ident = self._who(context, "daemon", "admin")
        if ident.role == "daemon" and self.authority is not None and request.daemon_id != ident.name:
            raise PermissionDenied(f"daemon {ident.name!r} may drain only itself")
        if not request.daemon_id:
            raise InvalidArgument("daemon_id is empty")
        dropped, held, wait = self.index.drain_daemon(request.daemon_id, stepwise=True)
        while self.index.drop_step():  # its blocks leave in steps; none is found meanwhile
            await asyncio.sleep(0)
        if dropped:
            self.link.forget(request.daemon_id)
            log.info("event=daemon_drained daemon=%s blocks=%d leases=%d", request.daemon_id, dropped, held)
        return meta_pb2.DrainDaemonResponse(
            dropped=dropped, leases=held, lease_wait_ms=min(math.ceil(wait * 1000), 2**32 - 1)
        )

    def Heartbeat(self, request, context):
        ident = self._who(context, "daemon")
        if self.authority is not None and request.daemon_id != ident.name:
            raise PermissionDenied(f"daemon {ident.name!r} may heartbeat only for itself")
        known = self.index.heartbeat(request.daemon_id, request.registration)
        if not known:
            return meta_pb2.HeartbeatResponse(known=False, epoch=self.epoch)
        batch, items = self.link.heartbeat_batch(request.daemon_id, request.acked_batch)
        return meta_pb2.HeartbeatResponse(
            known=True, invalidations=invalidations_pb(items), batch=batch, epoch=self.epoch
        )
