"""The cache daemon: owns this host's segments, serves their bytes, keeps the index informed.

- DRAM segment: a shared-memory arena (:class:`~kvstore.daemon.arena.ShmArena`) that same-host
  clients map and write directly; it survives a daemon crash and is reattached on restart.
- Data port: framed TCP reads and writes for other hosts (:mod:`kvstore.daemon.dataport`).
- Control API (gRPC, :mod:`kvstore.daemon.control`): ``Info``, ``GetInventory``, ``Move``, and
  the metadata service's ``Commit`` (a put's blocks become committed: the daemon writes their
  sealed headers or journal records) and ``Invalidate`` (committed blocks dropped by the
  service), plus health checking, plus gRPC reflection. Only the daemon writes headers, sealed
  with its secret (:class:`~kvstore.extent.Sealer`), so its inventory lists exactly the
  committed, not-dropped blocks. The segment operations themselves are
  :mod:`kvstore.daemon.operations`.
- Registration: on start, and whenever the metadata service answers a heartbeat with "unknown"
  (it restarted, or our lease lapsed), the daemon registers again with a fresh scan of its
  segments (on a thread: the event loop keeps answering), so the index is rebuilt from what the
  daemon really holds. Each registration has a number (:mod:`kvstore.daemon.links`) that the
  service's control calls carry: calls made for an earlier one are refused, and those already
  under way end (a batch of moves at its next block) before the scan, so that none acts behind
  the inventory's back or on an extent the new registration handed to another block.
- Health: NOT_SERVING until registered, while the service has not heard from it for a lease,
  after repeated unexpected failures of the heartbeat loop, and from the start of a drain.
- Drain (:meth:`CacheDaemon.drain`, on SIGTERM): no more puts, its blocks leave the index at
  once, reads already handed out are served until their leases end (bounded), then it stops.
- Metrics: :class:`~kvstore.metrics.DaemonCollector` on ``daemon.metrics_port``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvstore.blocks import BlockCols
from kvstore.cluster.slots import arena_of
from kvstore.config import ClusterConfig, DaemonConfig, default_host_id
from kvstore.daemon.arena import ShmArena, remove_files
from kvstore.daemon.control import Control
from kvstore.daemon.dataport import DataPort
from kvstore.daemon.links import MetaLink
from kvstore.daemon.operations import SegmentOps
from kvstore.daemon.shm import kept, write_owner
from kvstore.daemon.ssd import SsdSegment
from kvstore.daemon.staging import Staging
from kvstore.errors import Expired, InvalidArgument, KVStoreError, Unavailable
from kvstore.extent import Sealer, scan
from kvstore.meta.records import SEGMENT_ALIGN, Tier
from kvstore.metrics import DAEMON_COUNTERS, DaemonCollector, MetricsHttp
from kvstore.rpc import GRPC_OPTIONS, ServerHealth, add_service
from kvstore.tls import TlsConfig, add_port, check_listen, server_context
from kvstore.v1 import common_pb2, daemon_pb2

log = logging.getLogger("kvstore.daemon")
# A drain waits past its leases while reads without a lease came this recently (within its grace).
_DIRECT_QUIET_S = 0.05

DRAM_SEGMENT = 1
SSD_SEGMENT = 2


class CacheDaemon:
    def __init__(
        self,
        cfg: DaemonConfig,
        registry: CollectorRegistry | None = None,
        tls: TlsConfig | None = None,
        cluster: ClusterConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.tls = tls
        check_listen(f"{cfg.host}:{cfg.data_port}", tls, "daemon.host (data port)")
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
        self._ssd_recovered: tuple[int, int] | None = None  # (blocks, discarded) at start-up
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
        # Which daemon (and data directory) its shared memory belongs to, for `kvstore shm list`.
        try:
            write_owner(self.dram.path, self.daemon_id, data_dir, self.staging.path if self.staging else "")
        except OSError as e:  # only a record: the daemon runs without it
            log.warning("event=shm_owner_unwritten daemon=%s path=%s error=%r", self.daemon_id, self.dram.path, str(e))
        self.dataport = DataPort(
            cfg.host,
            cfg.data_port,
            lambda: self.segments,
            self.sealer,
            max_connections=cfg.data_max_connections,
            idle_timeout_s=cfg.data_idle_timeout_s,
            max_block_bytes=cfg.max_block_bytes,
            ssl_context=server_context(tls) if tls is not None and tls.enabled else None,
            ticket_key=self.ticket_key_for,
            ticket_skew_s=cfg.ticket_skew_s,
            staging=self.staging,
            one_ticket_key=self.one_ticket_key,
        )
        self.control = Control(self)  # served over gRPC; called directly by an in-process service
        self.control_port = 0
        self._server: grpc.aio.Server | None = None
        # One link to the metadata service (daemon.meta), or one per shard of a cluster
        # (cluster.redis; made at start, when the slot map is read).
        self.cluster = cluster
        self._coord = None
        self.links: list[MetaLink] = [MetaLink(self, 0, 1)]
        self._hb_tasks: list[asyncio.Task] = []
        self.registered = asyncio.Event()  # every shard knows this daemon (first registration)
        # What stopped it from registering for good (credentials refused, kvstore.daemon.links).
        self.fatal: KVStoreError | None = None
        self._failed = asyncio.Event()
        self.stopping = False
        self.draining = False
        self.health = ServerHealth("kvstore.v1.DaemonControl")
        self.counters = dict.fromkeys((name for name, _doc in DAEMON_COUNTERS), 0)
        # What the service has it do to its segments (commit, invalidate, move).
        self.ops = SegmentOps(
            self.segments,
            self.sealer,
            self.counters,
            on_commit=self.dataport.spend,
            require_stamp=self.cfg.require_write_stamp,
        )
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
            self._ssd_recovered = (len(blocks), discarded)

    def inventory_columns(self, verify: bool = True) -> tuple[list[tuple[int, BlockCols, bool]], int]:
        """Each segment's committed blocks as columns, oldest first: (segment id, blocks, whether
        its inventory message carries extent sizes), and how many candidates were discarded (the
        DRAM scan's now, the SSD recovery's at start-up)."""
        found, discarded = scan(self.dram.array, self.sealer, verify=verify)
        cols = [(DRAM_SEGMENT, found, False)]
        if self.ssd is not None:
            cols.append((SSD_SEGMENT, self.ssd.inventory(), True))
            if self._ssd_recovered is not None:
                discarded += self._ssd_recovered[1]
        return cols, discarded

    def inventory(self, verify: bool = True) -> tuple[list[common_pb2.Inventory], int]:
        """:meth:`inventory_columns` as inventory messages (one per segment)."""
        cols, discarded = self.inventory_columns(verify)
        return [blocks.to_pb(seg, with_size=sized) for seg, blocks, sized in cols], discarded

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
        cl = self.cluster
        if cl is not None and cl.redis:
            from kvstore.cluster.coord import Coordinator

            self._coord = Coordinator(cl.redis, cl.name, timeout_s=max(0.2, cl.leader_ttl_s / 4))
            shards = (await self._coord.slot_map()).shards
            self.links = [MetaLink(self, k, shards, self._coord) for k in range(shards)]
        log.info(
            "event=daemon_started daemon=%s data_port=%d control_port=%d metrics_port=%d dram_bytes=%d reattached=%s",
            self.daemon_id, self.dataport.port, self.control_port, self.metrics.port, self.dram.size,
            self.dram.reattached,
        )  # fmt: skip
        self._hb_tasks = [asyncio.create_task(link.run()) for link in self.links]

    def segment_sizes(self) -> dict[int, tuple[int, int]]:
        """Segment id -> (capacity, allocation alignment): what shard arenas are cut from."""
        out = {DRAM_SEGMENT: (self.dram.size, SEGMENT_ALIGN[Tier.DRAM])}
        if self.ssd is not None:
            out[SSD_SEGMENT] = (self.ssd.size, SEGMENT_ALIGN[Tier.SSD])
        return out

    def ticket_key_for(self, segment_id: int, offset: int) -> bytes:
        """The key the tickets for this extent are signed with: its shard's (empty: no shard
        has it)."""
        if len(self.links) == 1:
            return self.links[0].ticket_key
        cap, align = self.segment_sizes().get(segment_id, (0, 1))
        k = arena_of(offset, cap, align, len(self.links))
        return self.links[k].ticket_key if k >= 0 and self.links[k].registered else b""

    def one_ticket_key(self) -> bytes | None:
        """The key of every extent's tickets when one metadata shard hands them all out (None
        with several shards: ticket_key_for tells them apart)."""
        return self.links[0].ticket_key if len(self.links) == 1 else None

    def check_epoch(self, shard: int, epoch: int, registration: int = 0) -> None:
        """A control call of shard ``shard``'s leader at ``epoch``, made for ``registration``:
        refused unless that is the leader this daemon registered with (a stale leader changes
        nothing) and, where the call names one (the service always does; 0: a call made by
        hand), this daemon's current registration with it (a call made before the daemon
        registered again, queued across its restart or a lapse of its lease, changes nothing)."""
        link = self.links[shard] if 0 <= shard < len(self.links) else None
        if link is None:
            raise InvalidArgument(f"shard {shard}: this daemon knows shards 0..{len(self.links) - 1}")
        # In a cluster, also while the shard has a new leader we have not registered with yet:
        # the inventory we bring it must not miss a block committed meanwhile.
        if epoch != link.epoch or (link.coord is not None and link.need_register):
            self.counters["stale_epoch_refused"] += 1
            raise Expired(
                f"shard {shard}: epoch {epoch} is not the leader this daemon registered with (epoch {link.epoch})"
            )
        if registration and registration != link.registration:
            self.counters["stale_registration_refused"] += 1
            raise Expired(
                f"shard {shard}: the call was made for registration {registration:#x} of this daemon, "
                f"not its current one (it has registered since, or not yet)"
            )

    def fail(self, err: KVStoreError) -> None:
        """A link cannot register, and trying again cannot help: :meth:`until_registered` raises
        ``err`` (the command stops with it)."""
        if self.fatal is None:
            self.fatal = err
        self._failed.set()

    async def until_registered(self, timeout: float) -> None:
        """Waits until every shard knows this daemon; raises what stopped it from registering
        (:meth:`fail`), or Unavailable when no service answered within ``timeout`` seconds."""
        waits = {asyncio.ensure_future(self.registered.wait()), asyncio.ensure_future(self._failed.wait())}
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if self.fatal is not None:
            raise self.fatal
        if not self.registered.is_set():
            where = f"cluster.redis={self.cluster.redis}" if self._coord is not None else f"daemon.meta={self.cfg.meta}"
            raise Unavailable(
                f"daemon {self.daemon_id!r} did not register within {timeout:g} s: no metadata service answered "
                f"({where}; the log's event=meta_unreachable lines say why)"
            )

    @property
    def registered_everywhere(self) -> bool:
        return all(link.registered for link in self.links)

    async def links_changed(self) -> None:
        """Health, shared-memory serving and ``registered`` follow the links: SERVING while every
        shard knows this daemon (registered, heard from within a lease, its loop not failing)."""
        if self.draining:
            return
        if any(link.need_register for link in self.links):
            self.dram.unserve()  # our blocks are not all indexed until we register again
        elif all(link.ok and link.heartbeated for link in self.links):
            # Known to every shard, and what they refused of our inventory invalidated (that
            # came with the heartbeats): reads without a lease may come.
            self.dram.serve()
        serving = all(link.ok for link in self.links)
        if serving != self.health.serving:
            log.log(
                logging.INFO if serving else logging.WARNING,
                "event=health daemon=%s status=%s", self.daemon_id, "SERVING" if serving else "NOT_SERVING",
            )  # fmt: skip
            await self.health.set_serving(serving)
        if self.registered_everywhere:
            self.registered.set()  # after health: ready before anyone waiting on `registered` looks

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
        for task in self._hb_tasks:
            task.cancel()
        deadline = t0 + self.cfg.drain_timeout_s
        leases = 0
        told = [link for link in self.links if link.registered]
        first = True
        while told:
            answers = await asyncio.gather(*(link.drain() for link in told))
            told = [link for link, a in zip(told, answers) if a is not None and a[1] > 0]
            leases = sum(a[1] for a in answers if a is not None)
            if first:
                first = False
                log.info(
                    "event=draining daemon=%s blocks_left_index=%d leases=%d lease_wait_s=%.3f",
                    self.daemon_id, sum(a[0] for a in answers if a is not None), leases,
                    max((a[2] for a in answers if a is not None), default=0) / 1000,
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
        for task in self._hb_tasks:
            task.cancel()

        async def server_stop() -> None:
            if self._server:
                await self._server.stop(0.2)
            for link in self.links:
                await link.close()
            if self._coord is not None:
                await self._coord.close()

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
        self._leave_shm()

    def _leave_shm(self) -> None:
        """After a stop: the DRAM segment stays for a warm restart (said in the log, with how to
        remove it), unless the daemon retires (``--retire``, after a drain) or the segment was
        made by this run and never registered (nothing can have been stored in it). Mappings
        clients still hold stay valid; the memory is freed when they let go."""
        path = self.dram.path
        if self.draining and self.cfg.remove_segment_on_drain:
            remove_files(path)
            log.info("event=segment_removed daemon=%s path=%s", self.daemon_id, path)
        elif not self.dram.reattached and not any(link.ever_registered for link in self.links):
            remove_files(path)
            log.info("event=segment_removed daemon=%s path=%s reason=never_registered", self.daemon_id, path)
        elif os.path.exists(path):
            log.info("event=shm_kept daemon=%s %s", self.daemon_id, kept(path, self.cfg.shm_dir))
