"""The metadata service's handlers for its daemons: registration (the inventory decoded on a
thread when big, adopted in steps so that other calls are served meanwhile, filtered by the
tombstones the daemon may not have applied), heartbeats (which carry tombstone batches until
acknowledged) and drain. A mixin of :class:`kvstore.meta.servicer.MetaServicer`, over its
``index``, ``link``, identity checks and shard."""

from __future__ import annotations

import asyncio
import logging
import math

from kvstore import tickets
from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.keys import KEY_BYTES, unpack_keys
from kvstore.meta.daemons import invalidations_pb
from kvstore.meta.index import SEGMENT_ALIGN, DaemonSpec, InventoryItem, SegmentSpec, Tier
from kvstore.v1 import meta_pb2
from kvstore.wire import U64, unpack

log = logging.getLogger("kvstore.meta")

_TIERS = {int(t) for t in Tier}

# Inventory items adopted per step of a registration (about 0.1 s of the service's loop).
ADOPT_CHUNK = 20_000


def _inventory(request: meta_pb2.RegisterDaemonRequest) -> dict[int, list[InventoryItem]]:
    """A registration's inventory, decoded and checked, oldest generation first per segment."""
    inventory: dict[int, list[InventoryItem]] = {}
    for inv in request.inventory:
        keys = unpack_keys(inv.keys)  # raises InvalidArgument on a partial key
        n = len(keys)
        offs = unpack(inv.offset, U64, "inventory offset", n)
        lens = unpack(inv.length, U64, "inventory length", n)
        sums = unpack(inv.checksum, U64, "inventory checksum", n)
        gens = unpack(inv.gen, U64, "inventory gen", n)
        sizes = unpack(inv.size, U64, "inventory size", n) if inv.size else [0] * n
        items = sorted(zip(gens, keys, offs, lens, sums, sizes))
        inventory.setdefault(inv.segment_id, []).extend(
            InventoryItem(k, o, ln, c, sz, g) for g, k, o, ln, c, sz in items
        )
    return inventory


class DaemonCalls:
    """RegisterDaemon, DrainDaemon and Heartbeat."""

    async def RegisterDaemon(self, request, context):
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
        for inv in request.inventory:
            n = len(inv.keys) // KEY_BYTES
            if n > room.get(inv.segment_id, 0):
                raise InvalidArgument(
                    f"inventory of segment {inv.segment_id}: {n} blocks cannot fit it "
                    f"(at most {room.get(inv.segment_id, 0)}, or the segment is not declared)"
                )
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
        # A big inventory (hundreds of thousands of blocks) is decoded on a thread and adopted
        # in steps, so that heartbeats and requests are served meanwhile.
        big = sum(len(inv.keys) for inv in request.inventory) // KEY_BYTES > ADOPT_CHUNK
        inventory = await asyncio.to_thread(_inventory, request) if big else _inventory(request)
        self.link.requeue(spec.daemon_id)  # tombstones it may not have applied filter its inventory
        steps = self.index.register_daemon_steps(spec, inventory, chunk=ADOPT_CHUNK)
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
            tickets=bool(key),
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
        dropped, held, wait = self.index.drain_daemon(request.daemon_id)
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
