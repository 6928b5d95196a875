"""The cache daemon: owns this host's segments, serves their bytes, keeps the index informed.

- DRAM segment: a shared-memory arena (:class:`~kvstore.daemon.arena.ShmArena`) that same-host
  clients map and write directly; it survives a daemon crash and is reattached on restart.
- Data port: framed TCP reads and writes for other hosts (:mod:`kvstore.daemon.dataport`).
- Control API (gRPC): ``Info``, ``GetInventory``, ``Move``, and the metadata service's
  ``Commit`` (a put's blocks become committed: the daemon writes their sealed headers or
  journal records) and ``Invalidate`` (committed blocks dropped by the service), plus health
  checking, plus gRPC reflection. Only the daemon writes headers, sealed with its secret
  (:class:`~kvstore.extent.Sealer`), so its inventory lists exactly the committed, not-dropped
  blocks. The segment operations themselves are :mod:`kvstore.daemon.operations`.
- Registration: on start, and whenever the metadata service answers a heartbeat with "unknown"
  (it restarted, or our lease lapsed), the daemon registers again with a fresh scan of its
  segments (on a thread: the event loop keeps answering), so the index is rebuilt from what the
  daemon really holds.
- Health: NOT_SERVING until registered, while the service has not heard from it for a lease,
  after repeated unexpected failures of the heartbeat loop, and from the start of a drain.
- Drain (:meth:`CacheDaemon.drain`, on SIGTERM): no more puts, its blocks leave the index at
  once, reads already handed out are served until their leases end (bounded), then it stops.
- Metrics: :class:`~kvstore.metrics.DaemonCollector` on ``daemon.metrics_port``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvstore import tickets
from kvstore.config import DaemonConfig, default_host_id
from kvstore.daemon.arena import ShmArena
from kvstore.daemon.dataport import DataPort
from kvstore.daemon.operations import SegmentOps, dram_inventory, inventory_pb
from kvstore.daemon.ssd import SsdSegment
from kvstore.daemon.staging import Staging
from kvstore.errors import PermissionDenied
from kvstore.extent import Sealer
from kvstore.keys import KEY_BYTES
from kvstore.metrics import DAEMON_COUNTERS, DaemonCollector, MetricsHttp
from kvstore.rpc import GRPC_OPTIONS, ServerHealth, add_service
from kvstore.tls import TlsConfig, add_port, aio_channel, check_listen, server_context
from kvstore.v1 import common_pb2, daemon_pb2, meta_pb2, meta_pb2_grpc

log = logging.getLogger("kvstore.daemon")
# A drain waits past its leases while reads without a lease came this recently (within its grace).
_DIRECT_QUIET_S = 0.05

DRAM_SEGMENT = 1
SSD_SEGMENT = 2
# Consecutive unexpected heartbeat-loop failures after which the daemon reports NOT_SERVING.
LOOP_FAILURES_UNHEALTHY = 3


class _Control:
    """The daemon's gRPC control API (statuses by cause through :mod:`kvstore.rpc`)."""

    def __init__(self, daemon: CacheDaemon) -> None:
        self.daemon = daemon
        self.peers = {p.strip() for p in daemon.cfg.control_peers.split(",") if p.strip()}

    def _check(self, context) -> None:  # noqa: ANN001
        """With mutual TLS, only the metadata service's certificate (a common name listed in
        daemon.control_peers) may drive the daemon; in-process calls carry no context."""
        if context is None or self.daemon.tls is None or not self.daemon.tls.enabled:
            return
        names = {cn.decode(errors="replace") for cn in (context.auth_context() or {}).get("x509_common_name", ())}
        if not names & self.peers:
            raise PermissionDenied(
                f"the control API serves only {sorted(self.peers)}, not {sorted(names) or 'anonymous'}"
            )

    async def Info(self, request, context):
        self._check(context)
        return self.daemon.info()

    async def GetInventory(self, request, context):
        self._check(context)
        invs, discarded = await asyncio.to_thread(self.daemon.inventory, request.verify)
        return daemon_pb2.InventoryResponse(inventory=invs, discarded=discarded)

    async def Move(self, request, context):
        self._check(context)
        return await asyncio.to_thread(self.daemon.move, request)

    async def Commit(self, request, context):
        self._check(context)
        return await self.daemon.run(self.daemon.commit, request)

    async def Invalidate(self, request, context):
        self._check(context)
        cleared = await self.daemon.run(self.daemon.invalidate, request.invalidations)
        return daemon_pb2.InvalidateResponse(cleared=cleared)


class CacheDaemon:
    def __init__(
        self, cfg: DaemonConfig, registry: CollectorRegistry | None = None, tls: TlsConfig | None = None
    ) -> None:
        self.cfg = cfg
        self.tls = tls
        check_listen(f"{cfg.host}:{cfg.data_port}", tls, "daemon.host (data port)")
        data_dir = Path(cfg.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.daemon_id = cfg.daemon_id or self._stable_id(data_dir)
        self.host_id = cfg.host_id or default_host_id()
        self.sealer = Sealer.load_or_create(data_dir / "daemon.secret")
        # Data-port tickets are signed with this key by the service (it learns it at registration);
        # a new one at every start, so tickets of an earlier run do not serve.
        self.ticket_key = tickets.new_key()
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
        self.staging: Staging | None = None
        if self.ssd is not None and cfg.staging_bytes > 0 and cfg.staging_slices > 0:
            self.staging = Staging(
                Path(cfg.shm_dir) / f"kvstore-{self.daemon_id}-staging",
                cfg.staging_slices,
                cfg.staging_bytes // cfg.staging_slices,
            )
        self.dataport = DataPort(
            cfg.host,
            cfg.data_port,
            lambda: self.segments,
            self.sealer,
            max_connections=cfg.data_max_connections,
            idle_timeout_s=cfg.data_idle_timeout_s,
            max_block_bytes=cfg.max_block_bytes,
            ssl_context=server_context(tls) if tls is not None and tls.enabled else None,
            ticket_key=self.ticket_key,
            ticket_skew_s=cfg.ticket_skew_s,
            staging=self.staging,
        )
        self.control = _Control(self)  # served over gRPC; called directly by an in-process service
        self.control_port = 0
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: meta_pb2_grpc.MetaServiceStub | None = None
        self._hb_task: asyncio.Task | None = None
        self.registered = asyncio.Event()
        self._acked_batch = 0
        self.stopping = False
        self.draining = False
        self.health = ServerHealth("kvstore.v1.DaemonControl")
        self._last_contact = 0.0  # loop time of the last answered heartbeat or registration
        self._lease_ttl = 3.0  # the service's daemon lease, learnt at registration
        self.counters = dict.fromkeys((name for name, _doc in DAEMON_COUNTERS), 0)
        # What the service has it do to its segments (commit, invalidate, move).
        self.ops = SegmentOps(self.segments, self.sealer, self.counters)
        self.commit, self.invalidate, self.move = self.ops.commit, self.ops.invalidate, self.ops.move
        self.registry = registry or CollectorRegistry()
        self.registry.register(DaemonCollector(self))
        self.metrics = MetricsHttp(self.registry)

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
        inv, discarded = dram_inventory(DRAM_SEGMENT, self.dram, self.sealer, verify)
        invs = [inv]
        if self.ssd is not None:
            invs.append(inventory_pb(SSD_SEGMENT, self.ssd.inventory(), with_size=True))
            if self._ssd_recovered is not None:
                discarded += self._ssd_recovered[1]
        return invs, discarded

    async def run(self, fn, *args):  # noqa: ANN001, ANN201
        """Runs a control operation: inline when it touches DRAM only (a few header writes),
        on a thread when an SSD segment may need journal appends and fsyncs."""
        if self.ssd is None:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    async def start(self) -> None:
        await asyncio.to_thread(self.recover)
        self.dataport.start()
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        add_service(self._server, daemon_pb2, "DaemonControl", self.control, self.registry)
        add_service(self._server, health_pb2, "Health", self.health.servicer)
        reflection.enable_server_reflection(
            (daemon_pb2.DESCRIPTOR.services_by_name["DaemonControl"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME),
            self._server,
        )  # fmt: skip
        self.control_port = add_port(self._server, f"{self.cfg.host}:{self.cfg.control_port}", self.tls, "daemon.host")
        if self.cfg.metrics_port >= 0:
            self.metrics.start(self.cfg.metrics_host, self.cfg.metrics_port)
        await self._server.start()
        # NOT_SERVING until the metadata service knows this daemon (see _heartbeat_loop).
        await self.health.start()
        self._channel = aio_channel(self.cfg.meta, self.tls, GRPC_OPTIONS, token=self.cfg.token)
        self._stub = meta_pb2_grpc.MetaServiceStub(self._channel)
        log.info(
            "event=daemon_started daemon=%s data_port=%d control_port=%d metrics_port=%d dram_bytes=%d reattached=%s",
            self.daemon_id, self.dataport.port, self.control_port, self.metrics.port, self.dram.size,
            self.dram.reattached,
        )  # fmt: skip
        self._hb_task = asyncio.create_task(self._heartbeat_loop())

    async def _register(self) -> float:
        assert self._stub is not None
        invs, discarded = await asyncio.to_thread(self.inventory, True)
        resp = await self._stub.RegisterDaemon(
            meta_pb2.RegisterDaemonRequest(daemon=self.info(), inventory=invs, ticket_key=self.ticket_key), timeout=30
        )
        # The service signs tickets for our placements (meta.data_tickets): require them.
        self.dataport.require_tickets = resp.tickets
        self.counters["registrations"] += 1
        blocks = sum(len(i.keys) // KEY_BYTES for i in invs)
        log.info(
            "event=registered daemon=%s blocks=%d discarded=%d rejected=%d",
            self.daemon_id,
            blocks,
            discarded,
            resp.rejected,
        )
        self._lease_ttl = max(resp.lease_ttl_ms / 1000.0, 0.01)
        self._last_contact = asyncio.get_running_loop().time()
        if not self.draining:
            await self.health.set_serving(True)  # ready before anyone waiting on `registered` looks
        self.registered.set()
        return max(resp.heartbeat_interval_ms / 1000.0, 0.01)

    async def _heartbeat_loop(self) -> None:
        """Registers, then heartbeats every interval for as long as the daemon runs. Survives
        any failure (logged); health follows whether the service currently knows this daemon."""
        assert self._stub is not None
        loop = asyncio.get_running_loop()
        interval = 0.5
        need_register = True
        failures = 0
        while not self.draining:
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
                        self.dram.unserve()  # our blocks are not indexed until we register again
                        if self.health.serving:
                            await self.health.set_serving(False)
                        continue
                    if not self.draining:
                        # Known to the service, and what it refused of our inventory invalidated
                        # (that came with this heartbeat): reads without a lease may come.
                        self.dram.serve()
                self._last_contact = loop.time()
                failures = 0
            except grpc.aio.AioRpcError as e:
                # A restarted service answers "unknown" to the next heartbeat; until then, wait.
                self.counters["heartbeat_failures"] += 1
                log.debug("event=meta_unreachable code=%s", e.code().name)
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                self.counters["heartbeat_failures"] += 1
                failures += 1
                log.exception("event=heartbeat_loop_error daemon=%s consecutive=%d", self.daemon_id, failures)
            # SERVING while the service knows us: registered, heard from within a lease, and the
            # loop not failing over and over.
            serving = (
                not need_register
                and not self.draining
                and loop.time() - self._last_contact < self._lease_ttl
                and failures < LOOP_FAILURES_UNHEALTHY
            )
            if serving != self.health.serving:
                log.log(
                    logging.INFO if serving else logging.WARNING,
                    "event=health daemon=%s status=%s", self.daemon_id, "SERVING" if serving else "NOT_SERVING",
                )  # fmt: skip
                await self.health.set_serving(serving)
            await asyncio.sleep(interval)

    async def drain(self) -> None:
        """Leaves the pool on purpose (SIGTERM): health NOT_SERVING, no more puts (the service
        drops this daemon and its blocks from the index at once), reads already handed out are
        served until their leases end or ``daemon.drain_timeout_s``, then the daemon stops."""
        if self.draining:
            return
        self.draining = True
        # Clients reading without a lease get misses from here on: the arena stops being served
        # (its lock goes; a shared-memory get checks it once, as it starts), and the data port
        # answers such reads as mismatches once the grace has passed (a get's requests that
        # were under way complete).
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        grace = min(self.cfg.drain_direct_grace_s, self.cfg.drain_timeout_s)
        self.dataport.direct_until = time.monotonic() + grace
        self.dram.unserve()
        await self.health.set_serving(False)
        if self._hb_task:
            self._hb_task.cancel()
        deadline = t0 + self.cfg.drain_timeout_s
        leases = 0
        if self._stub is not None and self.registered.is_set():
            first = True
            while True:
                try:
                    resp = await self._stub.DrainDaemon(
                        meta_pb2.DrainDaemonRequest(daemon_id=self.daemon_id), timeout=5
                    )
                except grpc.aio.AioRpcError as e:
                    log.warning(
                        "event=drain_unannounced daemon=%s code=%s effect=blocks_leave_index_at_lease_expiry",
                        self.daemon_id, e.code().name,
                    )  # fmt: skip
                    break
                leases = resp.leases
                if first:
                    first = False
                    log.info(
                        "event=draining daemon=%s blocks_left_index=%d leases=%d lease_wait_s=%.3f",
                        self.daemon_id, resp.dropped, resp.leases, resp.lease_wait_ms / 1000,
                    )  # fmt: skip
                if leases == 0 or loop.time() >= deadline:
                    break
                await asyncio.sleep(0.05)
        # Data-port requests in progress finish, and so do gets without a lease still reading
        # within the grace (bounded by the same deadline).
        while loop.time() < deadline and (self.dataport.active > 0 or self._direct_reading()):
            await asyncio.sleep(0.02)
        log.info("event=drained daemon=%s seconds=%.3f leases_left=%d", self.daemon_id, loop.time() - t0, leases)
        await self.stop()
        if self.cfg.remove_segment_on_drain:
            # Mappings clients still hold stay valid; the memory is freed when they let go.
            Path(self.dram.path).unlink(missing_ok=True)
            log.info("event=segment_removed daemon=%s path=%s", self.daemon_id, self.dram.path)

    def _direct_reading(self) -> bool:
        now = time.monotonic()
        return now <= self.dataport.direct_until and now - self.dataport.last_direct < _DIRECT_QUIET_S

    async def stop(self) -> None:
        """Stops every part, each even if another failed (and logs what failed). Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        try:
            await self.health.stop()
        except Exception:  # noqa: BLE001
            log.exception("event=stop_failed part=health")
        if self._hb_task:
            self._hb_task.cancel()

        async def server_stop() -> None:
            if self._server:
                await self._server.stop(0.2)
            if self._channel:
                await self._channel.close()

        parts = [
            ("dataport", self.dataport.stop),
            ("grpc", server_stop),
            ("metrics", self.metrics.stop),
            ("dram", self.dram.close),
        ]
        if self.staging is not None:
            parts.append(("staging", self.staging.close))
        if self.ssd is not None:
            parts.append(("ssd", self.ssd.close))
        for name, step in parts:
            try:
                r = step()
                if asyncio.iscoroutine(r):
                    await r
            except Exception:  # noqa: BLE001 - stop the rest regardless
                log.exception("event=stop_failed part=%s", name)
