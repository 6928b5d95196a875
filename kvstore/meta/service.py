"""The metadata service: a thin grpc.aio adapter over :class:`kvstore.meta.index.Index`.

Each handler decodes the packed columns, calls the index, encodes the answer. A
:class:`~kvstore.errors.KVStoreError` raised anywhere becomes its gRPC status in one place
(:func:`_handler`). A background task expires daemons, put reservations and leases.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.config import MetaConfig
from kvstore.errors import KVStoreError, PermissionDenied
from kvstore.keys import unpack_keys
from kvstore.meta.index import (
    Clock,
    DaemonSpec,
    Index,
    IndexLimits,
    InventoryItem,
    SegmentSpec,
    Tier,
)
from kvstore.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc, meta_pb2, meta_pb2_grpc
from kvstore.wire import U8, U32, U64, daemon_to_pb, locations_to_pb, pack, unpack

log = logging.getLogger("kvstore.meta")

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.so_reuseport", 0),
]


def _handler(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except KVStoreError as e:
            log.info("rpc=%s error=%s reason=%r", fn.__name__, type(e).__name__, e.message)
            await context.abort(e.code, e.message)

    return wrapper


class MetaServicer(meta_pb2_grpc.MetaServiceServicer):
    def __init__(self, index: Index, allow_clock_skew: bool = False) -> None:
        self.index = index
        self.allow_clock_skew = allow_clock_skew

    @_handler
    def RegisterDaemon(self, request, context):
        info = request.daemon
        spec = DaemonSpec(
            info.daemon_id,
            info.host_id,
            info.data_addr,
            info.control_addr,
            tuple(
                SegmentSpec(s.segment_id, Tier(s.tier or Tier.DRAM), s.capacity_bytes, s.shm_path)
                for s in info.segments
            ),
        )
        inventory: dict[int, list[InventoryItem]] = {}
        for inv in request.inventory:
            keys = unpack_keys(inv.keys)  # raises InvalidArgument on a partial key
            n = len(keys)
            offs = unpack(inv.offset, U64, "inventory offset", n)
            lens = unpack(inv.length, U64, "inventory length", n)
            sums = unpack(inv.checksum, U64, "inventory checksum", n)
            seqs = unpack(inv.seq, U64, "inventory seq", n) if inv.seq else list(range(n))
            sizes = unpack(inv.size, U64, "inventory size", n) if inv.size else [0] * n
            items = sorted(zip(seqs, keys, offs, lens, sums, sizes))
            inventory.setdefault(inv.segment_id, []).extend(
                InventoryItem(k, o, ln, c, sz) for _, k, o, ln, c, sz in items
            )
        rejected = self.index.register_daemon(spec, inventory)
        adopted = sum(len(v) for v in inventory.values()) - rejected
        log.info("event=daemon_registered daemon=%s blocks=%d rejected=%d", spec.daemon_id, adopted, rejected)
        lim = self.index.limits
        return meta_pb2.RegisterDaemonResponse(
            heartbeat_interval_ms=int(lim.heartbeat_interval_s * 1000),
            lease_ttl_ms=int(lim.daemon_ttl_s * 1000),
            rejected=rejected,
        )

    @_handler
    def Heartbeat(self, request, context):
        known, inv = self.index.heartbeat(request.daemon_id)
        by_seg: dict[int, tuple[list[bytes], list[int]]] = {}
        for seg, key, off in inv:
            ks, offs = by_seg.setdefault(seg, ([], []))
            ks.append(key)
            offs.append(off)
        return meta_pb2.HeartbeatResponse(
            known=known,
            invalidations=[
                meta_pb2.Invalidation(segment_id=s, keys=b"".join(ks), offset=pack(offs, U64))
                for s, (ks, offs) in by_seg.items()
            ],
        )

    @_handler
    def PutStart(self, request, context):
        n = len(request.keys) // 16
        sizes = unpack(request.sizes, U64, "sizes", n if len(request.keys) % 16 == 0 else None)
        res = self.index.put_start(
            request.keys,
            sizes,
            host_id=request.host_id,
            timeout_s=request.timeout_ms / 1000.0,
            exclude=request.exclude_daemons,
        )
        return meta_pb2.PutStartResponse(
            put_id=res.put_id,
            status=pack(res.status, U8),
            placements=locations_to_pb(res.placements),
            deadline_unix_ms=int((time.time() + res.deadline) * 1000),
        )

    @_handler
    def PutCommit(self, request, context):
        sums = unpack(request.checksums, U64, "checksums")
        written = [bool(x) for x in unpack(request.written, U8, "written")] if request.written else None
        return meta_pb2.PutCommitResponse(committed=self.index.put_commit(request.put_id, sums, written))

    @_handler
    def PutAbort(self, request, context):
        return meta_pb2.PutAbortResponse(released=self.index.put_abort(request.put_id))

    @_handler
    def Lookup(self, request, context):
        hit, exists, locs = self.index.lookup(
            request.keys, per_key=request.per_key, with_locations=request.with_locations
        )
        return meta_pb2.LookupResponse(
            hit_count=hit,
            exists=pack(exists, U8) if request.per_key else b"",
            locations=locations_to_pb(locs) if request.with_locations else None,
        )

    @_handler
    def Acquire(self, request, context):
        res = self.index.acquire(request.keys, ttl_s=request.ttl_ms / 1000.0)
        return meta_pb2.AcquireResponse(
            hit_count=res.hit_count,
            lease_id=res.lease_id,
            locations=locations_to_pb(res.locations),
            ttl_ms=int(res.ttl * 1000),
        )

    @_handler
    def Release(self, request, context):
        self.index.release(request.lease_id, unpack(request.corrupt, U32, "corrupt"))
        return meta_pb2.ReleaseResponse(released=True)

    @_handler
    def Remove(self, request, context):
        return meta_pb2.CountResponse(count=self.index.remove(request.keys))

    @_handler
    def Pin(self, request, context):
        return meta_pb2.CountResponse(count=self.index.pin(request.keys, True))

    @_handler
    def Unpin(self, request, context):
        return meta_pb2.CountResponse(count=self.index.pin(request.keys, False))

    @_handler
    def Stats(self, request, context):
        idx = self.index
        now = idx.clock.now()
        resp = meta_pb2.StatsResponse(
            keys=len(idx.entries),
            pending_puts=len(idx.puts),
            active_leases=len(idx.leases),
        )
        for d in idx.daemons.values():
            resp.daemons.append(
                meta_pb2.DaemonStats(
                    info=daemon_to_pb(d.spec), alive=d.deadline >= now, last_heartbeat_age_s=now - d.last_heartbeat
                )
            )
            for seg in d.segments.values():
                resp.segments.append(
                    meta_pb2.SegmentStats(
                        daemon_id=d.spec.daemon_id,
                        segment_id=seg.spec.segment_id,
                        tier=int(seg.spec.tier),
                        capacity_bytes=seg.alloc.capacity,
                        used_bytes=seg.alloc.used,
                        blocks=seg.blocks,
                        pinned_blocks=seg.pinned,
                        leased_blocks=seg.leased,
                    )
                )
        for k, v in idx.counters.items():
            resp.counters[k] = v
        return resp

    @_handler
    def AdvanceClock(self, request, context):
        if not self.allow_clock_skew:
            raise PermissionDenied("AdvanceClock is off: start the service with meta.allow_clock_skew=true")
        now = self.index.clock.advance(request.seconds)
        self.index.expire()
        return meta_pb2.AdvanceClockResponse(now=now)


class MetaServer:
    """The metadata service as a running gRPC server (plus health checking and the sweeper)."""

    def __init__(self, cfg: MetaConfig, clock: Clock | None = None) -> None:
        self.cfg = cfg
        limits = IndexLimits(
            max_batch_keys=cfg.max_batch_keys,
            max_block_bytes=cfg.max_block_bytes,
            put_timeout_s=cfg.put_timeout_s,
            lease_ttl_s=cfg.lease_ttl_s,
            daemon_ttl_s=cfg.daemon_ttl_s,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            dram_high_watermark=cfg.dram_high_watermark,
            dram_low_watermark=cfg.dram_low_watermark,
        )
        self.index = Index(limits, clock or Clock())
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._sweeper: asyncio.Task | None = None
        self._tierer: asyncio.Task | None = None
        self._move_failing: set[str] = set()
        self._daemon_stubs: dict[str, tuple[str, grpc.aio.Channel, daemon_pb2_grpc.DaemonControlStub]] = {}

    async def start(self) -> int:
        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        meta_pb2_grpc.add_MetaServiceServicer_to_server(
            MetaServicer(self.index, self.cfg.allow_clock_skew), self.server
        )
        hs = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self.server)
        self.port = self.server.add_insecure_port(self.cfg.listen)
        if self.port == 0:
            raise OSError(f"metadata service cannot listen on {self.cfg.listen}")
        await self.server.start()
        for name in ("", "kvstore.v1.MetaService"):
            r = hs.set(name, health_pb2.HealthCheckResponse.SERVING)
            if asyncio.iscoroutine(r):
                await r
        self._sweeper = asyncio.create_task(self._sweep())
        self._tierer = asyncio.create_task(self._tier_loop())
        log.info("event=meta_started listen=%s port=%d", self.cfg.listen, self.port)
        return self.port

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval_s)
            out = self.index.expire()
            if any(out.values()):
                log.info("event=expired daemons=%d puts=%d leases=%d", out["daemons"], out["puts"], out["leases"])

    def _daemon_stub(self, daemon_id: str, addr: str) -> daemon_pb2_grpc.DaemonControlStub:
        cached = self._daemon_stubs.get(daemon_id)
        if cached is None or cached[0] != addr:
            ch = grpc.aio.insecure_channel(addr, options=GRPC_OPTIONS)
            cached = self._daemon_stubs[daemon_id] = (addr, ch, daemon_pb2_grpc.DaemonControlStub(ch))
        return cached[2]

    async def _tier_loop(self) -> None:
        """Plans demotions and promotions and has each daemon carry out its own."""
        while True:
            await asyncio.sleep(self.cfg.tier_interval_s)
            try:
                plans = self.index.plan_moves(self.cfg.move_batch_bytes)
                if plans:
                    await asyncio.gather(*(self._run_moves(did, moves) for did, moves in plans.items()))
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                log.exception("event=tier_loop_error")

    async def _run_moves(self, daemon_id: str, moves: list) -> None:
        d = self.index.daemons.get(daemon_id)
        if d is None:
            for mv in moves:
                self.index.finish_move(mv.move_id, False)
            return
        req = daemon_pb2.MoveRequest(
            keys=b"".join(mv.src.entry.key for mv in moves),
            src_segment=pack([mv.src.segment.spec.segment_id for mv in moves], U32),
            src_offset=pack([mv.src.offset for mv in moves], U64),
            dst_segment=pack([mv.dst.segment.spec.segment_id for mv in moves], U32),
            dst_offset=pack([mv.dst.offset for mv in moves], U64),
            length=pack([mv.src.length for mv in moves], U64),
            checksum=pack([mv.src.checksum for mv in moves], U64),
        )
        try:
            resp = await self._daemon_stub(daemon_id, d.spec.control_addr).Move(req, timeout=120)
            ok = unpack(resp.ok, U8, "ok", len(moves))
            stored = unpack(resp.stored_size, U64, "stored_size", len(moves))
        except (grpc.aio.AioRpcError, KVStoreError) as e:
            # Once per outage: the tier loop retries every tick until the daemon's lease lapses.
            level = logging.DEBUG if daemon_id in self._move_failing else logging.WARNING
            self._move_failing.add(daemon_id)
            reason = e.code().name if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.log(level, "event=moves_failed daemon=%s count=%d reason=%s", daemon_id, len(moves), reason)
            ok, stored = [0] * len(moves), [0] * len(moves)
        else:
            self._move_failing.discard(daemon_id)
        for mv, good, size in zip(moves, ok, stored):
            self.index.finish_move(mv.move_id, bool(good), size)
        log.debug("event=moves daemon=%s count=%d ok=%d", daemon_id, len(moves), sum(ok))

    async def stop(self, grace: float = 0.5) -> None:
        if self._tierer:
            self._tierer.cancel()
        for _addr, ch, _stub in self._daemon_stubs.values():
            await ch.close()
        if self._sweeper:
            self._sweeper.cancel()
        if self.server:
            await self.server.stop(grace)

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


__all__ = ["MetaServer", "MetaServicer", "common_pb2"]
