"""The cache daemon: owns this host's segments, serves their bytes, keeps the index informed.

- DRAM segment: a shared-memory arena (:class:`~kvstore.daemon.arena.ShmArena`) that same-host
  clients map and write directly; it survives a daemon crash and is reattached on restart.
- Data port: framed TCP reads and writes for other hosts (:mod:`kvstore.daemon.dataport`).
- Control API (gRPC): ``Info``, ``GetInventory``, ``Move``, and the metadata service's
  ``Commit`` (a put's blocks become committed: the daemon writes their sealed headers or
  journal records) and ``Invalidate`` (committed blocks dropped by the service), plus health
  checking. Only the daemon writes headers, sealed with its secret (:class:`~kvstore.extent.Sealer`),
  so its inventory lists exactly the committed, not-dropped blocks.
- Registration: on start, and whenever the metadata service answers a heartbeat with "unknown"
  (it restarted, or our lease lapsed), the daemon registers again with a fresh scan of its
  segments, so the index is rebuilt from what the daemon really holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from kvstore.config import DaemonConfig, default_host_id
from kvstore.daemon.arena import ShmArena
from kvstore.daemon.dataport import DataPort
from kvstore.daemon.ssd import SsdSegment
from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.extent import HEADER_SIZE, Sealer, checksum, extent_size, scan
from kvstore.keys import KEY_BYTES, unpack_keys
from kvstore.rpc import GRPC_OPTIONS, add_service
from kvstore.v1 import common_pb2, daemon_pb2, meta_pb2, meta_pb2_grpc
from kvstore.wire import U8, U32, U64, pack, unpack

log = logging.getLogger("kvstore.daemon")

DRAM_SEGMENT = 1
SSD_SEGMENT = 2


def _inventory(
    segment_id: int, arena: ShmArena, sealer: Sealer, verify: bool = True
) -> tuple[common_pb2.Inventory, int]:
    found, discarded = scan(arena.array, sealer, verify=verify)
    return (
        common_pb2.Inventory(
            segment_id=segment_id,
            keys=b"".join(h.key for h in found),
            offset=pack([h.offset for h in found], U64),
            length=pack([h.length for h in found], U64),
            checksum=pack([h.checksum for h in found], U64),
            gen=pack([h.gen for h in found], U64),
        ),
        discarded,
    )


class _Control:
    """The daemon's gRPC control API (statuses by cause through :mod:`kvstore.rpc`)."""

    def __init__(self, daemon: CacheDaemon) -> None:
        self.daemon = daemon

    async def Info(self, request, context):
        return self.daemon.info()

    async def GetInventory(self, request, context):
        invs, discarded = await asyncio.to_thread(self.daemon.inventory, request.verify)
        return daemon_pb2.InventoryResponse(inventory=invs, discarded=discarded)

    async def Move(self, request, context):
        return await asyncio.to_thread(self.daemon.move, request)

    async def Commit(self, request, context):
        return await self.daemon.run(self.daemon.commit, request)

    async def Invalidate(self, request, context):
        cleared = await self.daemon.run(self.daemon.invalidate, request.invalidations)
        return daemon_pb2.InvalidateResponse(cleared=cleared)


class CacheDaemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        data_dir = Path(cfg.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.daemon_id = cfg.daemon_id or self._stable_id(data_dir)
        self.host_id = cfg.host_id or default_host_id()
        self.sealer = Sealer.load_or_create(data_dir / "daemon.secret")
        shm_path = Path(cfg.shm_dir) / f"kvstore-{self.daemon_id}-dram"
        self.dram = ShmArena(shm_path, cfg.dram_bytes, create=True)
        self.segments: dict[int, ShmArena | SsdSegment] = {DRAM_SEGMENT: self.dram}
        self.ssd: SsdSegment | None = None
        self.recovery_seconds = 0.0
        self._ssd_recovered: tuple[list, int] | None = None
        if cfg.ssd_bytes > 0:
            self.ssd = SsdSegment(
                cfg.ssd_dir or data_dir / "ssd",
                SSD_SEGMENT,
                cfg.ssd_bytes,
                direct_io=cfg.ssd_direct_io,
                durability=cfg.ssd_durability,
                compress_policy=cfg.ssd_compress,
                sealer=self.sealer,
            )
            self.segments[SSD_SEGMENT] = self.ssd
        self.dataport = DataPort(cfg.host, cfg.data_port, lambda: self.segments, self.sealer)
        self.control = _Control(self)  # served over gRPC; called directly by an in-process service
        self.control_port = 0
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: meta_pb2_grpc.MetaServiceStub | None = None
        self._hb_task: asyncio.Task | None = None
        self.registered = asyncio.Event()
        self.registrations = 0
        self._acked_batch = 0
        self.stopping = False
        self._health: health.aio.HealthServicer | None = None

    @staticmethod
    def _stable_id(data_dir: Path) -> str:
        p = data_dir / "daemon.id"
        if p.exists():
            return p.read_text().strip()
        did = uuid.uuid4().hex[:12]
        p.write_text(did + "\n")
        return did

    def info(self) -> common_pb2.DaemonInfo:
        segs = [
            common_pb2.Segment(
                segment_id=DRAM_SEGMENT,
                tier=common_pb2.TIER_DRAM,
                capacity_bytes=self.dram.size,
                shm_path=self.dram.path,
            )
        ]
        if self.ssd is not None:
            segs.append(
                common_pb2.Segment(segment_id=SSD_SEGMENT, tier=common_pb2.TIER_SSD, capacity_bytes=self.ssd.size)
            )
        return common_pb2.DaemonInfo(
            daemon_id=self.daemon_id,
            host_id=self.host_id,
            data_addr=f"{self.cfg.host}:{self.dataport.port}",
            control_addr=f"{self.cfg.host}:{self.control_port}",
            segments=segs,
        )

    def recover(self) -> None:
        """Start-up recovery of the SSD segment: journal replay, header and checksum checks."""
        if self.ssd is not None:
            t = time.perf_counter()
            blocks, discarded = self.ssd.recover(verify=self.cfg.ssd_verify_on_start)
            self.recovery_seconds = time.perf_counter() - t
            log.info(
                "event=ssd_recovered daemon=%s blocks=%d discarded=%d seconds=%.3f",
                self.daemon_id, len(blocks), discarded, self.recovery_seconds,
            )  # fmt: skip
            self._ssd_recovered = (blocks, discarded)

    def inventory(self, verify: bool = True) -> tuple[list[common_pb2.Inventory], int]:
        inv, discarded = _inventory(DRAM_SEGMENT, self.dram, self.sealer, verify)
        invs = [inv]
        if self.ssd is not None:
            blocks = self.ssd.inventory()
            invs.append(
                common_pb2.Inventory(
                    segment_id=SSD_SEGMENT,
                    keys=b"".join(b.key for b in blocks),
                    offset=pack([b.offset for b in blocks], U64),
                    length=pack([b.length for b in blocks], U64),
                    checksum=pack([b.checksum for b in blocks], U64),
                    gen=pack([b.gen for b in blocks], U64),
                    size=pack([b.size for b in blocks], U64),
                )
            )
            if self._ssd_recovered is not None:
                discarded += self._ssd_recovered[1]
        return invs, discarded

    async def run(self, fn, *args):  # noqa: ANN001, ANN201
        """Runs a control operation: inline when it touches DRAM only (a few header writes),
        on a thread when an SSD segment may need journal appends and fsyncs."""
        if self.ssd is None:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def move(self, req: daemon_pb2.MoveRequest) -> daemon_pb2.MoveResponse:
        """Copies blocks between segments; a source that fails its check (key, generation,
        checksum) is not copied. The copy is written committed, with its own generation."""
        keys = unpack_keys(req.keys)
        n = len(keys)
        cols = (
            unpack(req.src_segment, U32, "src_segment", n),
            unpack(req.src_offset, U64, "src_offset", n),
            unpack(req.dst_segment, U32, "dst_segment", n),
            unpack(req.dst_offset, U64, "dst_offset", n),
            unpack(req.length, U64, "length", n),
            unpack(req.checksum, U64, "checksum", n),
            unpack(req.src_gen, U64, "src_gen", n),
            unpack(req.dst_gen, U64, "dst_gen", n),
        )
        ok, stored = [], []
        for key, ss, so, ds, do, length, csum, sgen, dgen in zip(keys, *cols):
            src, dst = self.segments.get(ss), self.segments.get(ds)
            size = 0
            try:
                if isinstance(src, ShmArena) and isinstance(dst, SsdSegment):
                    h = self.sealer.parse(src.view, so) if 0 <= so <= src.size - HEADER_SIZE else None
                    if h is not None and h.key == key and h.gen == sgen and h.length == length:
                        payload = src.array[so + HEADER_SIZE : so + HEADER_SIZE + length]
                        if checksum(payload) == csum:
                            size = dst.write(do, key, payload, csum, dgen)
                            if dst.commit(do, key, dgen) is None:
                                size = 0
                elif isinstance(src, SsdSegment) and isinstance(dst, ShmArena):
                    if 0 <= do and do + HEADER_SIZE + length <= dst.size:
                        dst.clear_header(do)
                        out = dst.array[do + HEADER_SIZE : do + HEADER_SIZE + length]
                        status, _ = src.read(so, key, length, out=out, gen=sgen)
                        if status.ok and dst.commit(self.sealer, do, key, length, csum, dgen):
                            size = extent_size(length)
            except (OSError, ValueError, ResourceExhausted) as e:
                log.warning("event=move_failed key=%s reason=%r", key.hex(), str(e))
            ok.append(int(size > 0))
            stored.append(size)
        return daemon_pb2.MoveResponse(ok=pack(ok, U8), stored_size=pack(stored, U64))

    def commit(self, req: daemon_pb2.CommitRequest) -> daemon_pb2.CommitResponse:
        """Makes written blocks committed: a sealed header in DRAM (the writer moved only the
        payload), a journal record on SSD (the data port wrote it pending)."""
        keys = unpack_keys(req.keys)
        n = len(keys)
        segs = unpack(req.segment, U32, "segment", n)
        offs = unpack(req.offset, U64, "offset", n)
        lens = unpack(req.length, U64, "length", n)
        sums = unpack(req.checksum, U64, "checksum", n)
        gens = unpack(req.gen, U64, "gen", n)
        status, stored = [], []
        for key, seg_id, off, length, csum, gen in zip(keys, segs, offs, lens, sums, gens):
            seg = self.segments.get(seg_id)
            st, size = common_pb2.COMMIT_MISMATCH, 0
            try:
                if isinstance(seg, ShmArena):
                    if seg.commit(self.sealer, off, key, length, csum, gen):
                        st, size = common_pb2.COMMIT_OK, extent_size(length)
                elif isinstance(seg, SsdSegment):
                    b = seg.commit(off, key, gen)
                    if b is not None and b.checksum == csum and b.length == length:
                        st, size = common_pb2.COMMIT_OK, b.size
            except ResourceExhausted as e:
                log.warning("event=commit_no_space key=%s reason=%r", key.hex(), e.message)
                st = common_pb2.COMMIT_NO_SPACE
            except OSError as e:
                log.warning("event=commit_failed key=%s reason=%r", key.hex(), str(e))
                st = common_pb2.COMMIT_UNAVAILABLE
            status.append(st)
            stored.append(size)
        return daemon_pb2.CommitResponse(status=pack(status, U8), stored_size=pack(stored, U64))

    def invalidate(self, invalidations) -> int:  # noqa: ANN001
        """Drops committed blocks the service dropped, each only if it is still that generation."""
        cleared = 0
        for inv in invalidations:
            seg = self.segments.get(inv.segment_id)
            keys = unpack_keys(inv.keys) if inv.keys else []
            offs = unpack(inv.offset, U64, "offset", len(keys))
            gens = unpack(inv.gen, U64, "gen", len(keys))
            if seg is None:
                raise InvalidArgument(f"invalidation names unknown segment {inv.segment_id}")
            for key, off, gen in zip(keys, offs, gens):
                if isinstance(seg, ShmArena):
                    cleared += seg.invalidate(self.sealer, off, key, gen)
                else:
                    cleared += seg.invalidate(off, key, gen)
        return cleared

    async def start(self) -> None:
        await asyncio.to_thread(self.recover)
        self.dataport.start()
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        add_service(self._server, daemon_pb2, "DaemonControl", self.control)
        hs = self._health = health.aio.HealthServicer()
        add_service(self._server, health_pb2, "Health", hs)
        self.control_port = self._server.add_insecure_port(f"{self.cfg.host}:{self.cfg.control_port}")
        await self._server.start()
        # NOT_SERVING until the metadata service knows this daemon (see _register).
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._channel = grpc.aio.insecure_channel(self.cfg.meta, options=GRPC_OPTIONS)
        self._stub = meta_pb2_grpc.MetaServiceStub(self._channel)
        log.info(
            "event=daemon_started daemon=%s data_port=%d control_port=%d dram_bytes=%d reattached=%s",
            self.daemon_id, self.dataport.port, self.control_port, self.dram.size, self.dram.reattached,
        )  # fmt: skip
        self._hb_task = asyncio.create_task(self._heartbeat_loop())

    async def _set_health(self, status: int) -> None:
        if self._health is not None:
            for name in ("", "kvstore.v1.DaemonControl"):
                await self._health.set(name, status)

    async def _register(self) -> float:
        assert self._stub is not None
        invs, discarded = await asyncio.to_thread(self.inventory, True)
        resp = await self._stub.RegisterDaemon(
            meta_pb2.RegisterDaemonRequest(daemon=self.info(), inventory=invs), timeout=30
        )
        self.registrations += 1
        blocks = sum(len(i.keys) // KEY_BYTES for i in invs)
        log.info(
            "event=registered daemon=%s blocks=%d discarded=%d rejected=%d",
            self.daemon_id,
            blocks,
            discarded,
            resp.rejected,
        )
        self.registered.set()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return max(resp.heartbeat_interval_ms / 1000.0, 0.01)

    async def _heartbeat_loop(self) -> None:
        assert self._stub is not None
        interval = 0.5
        need_register = True
        while True:
            try:
                if need_register:
                    interval = await self._register()
                    need_register = False
                else:
                    resp = await self._stub.Heartbeat(
                        meta_pb2.HeartbeatRequest(daemon_id=self.daemon_id, acked_batch=self._acked_batch), timeout=5
                    )
                    if resp.invalidations:
                        await self.run(self.invalidate, resp.invalidations)
                    self._acked_batch = resp.batch
                    if not resp.known:
                        log.info("event=meta_forgot_us daemon=%s action=reregister", self.daemon_id)
                        need_register = True
                        continue
            except grpc.aio.AioRpcError as e:
                # A restarted service answers "unknown" to the next heartbeat; until then, wait.
                log.debug("event=meta_unreachable code=%s", e.code().name)
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                log.exception("event=heartbeat_loop_error daemon=%s", self.daemon_id)
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        """Stops every part, each even if another failed (and logs what failed)."""
        self.stopping = True
        try:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        except Exception:  # noqa: BLE001
            log.exception("event=stop_failed part=health")
        if self._hb_task:
            self._hb_task.cancel()

        async def server_stop() -> None:
            if self._server:
                await self._server.stop(0.2)
            if self._channel:
                await self._channel.close()

        parts = [("dataport", self.dataport.stop), ("grpc", server_stop), ("dram", self.dram.close)]
        if self.ssd is not None:
            parts.append(("ssd", self.ssd.close))
        for name, step in parts:
            try:
                r = step()
                if asyncio.iscoroutine(r):
                    await r
            except Exception:  # noqa: BLE001 - stop the rest regardless
                log.exception("event=stop_failed part=%s", name)
