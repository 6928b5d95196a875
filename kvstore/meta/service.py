"""The metadata service as a running server: a thin grpc.aio adapter over
:class:`kvstore.meta.index.Index`, its handlers in :mod:`kvstore.meta.servicer`.

A background task expires daemons, put reservations and leases; another plans tier moves, which
each daemon carries out on its own (a slow daemon holds up only its own moves). Both loops
survive any one failure, log it, and turn health NOT_SERVING while they keep failing. The
service exports Prometheus metrics (:mod:`kvstore.metrics`) and gRPC server reflection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvstore.config import MetaConfig
from kvstore.errors import Unavailable
from kvstore.loop_watch import LoopWatch
from kvstore.meta.auth import Authority, Quotas
from kvstore.meta.daemons import DaemonLink
from kvstore.meta.index import (
    Clock,
    Index,
    IndexLimits,
)
from kvstore.meta.lookup_port import LookupPort
from kvstore.meta.servicer import MetaServicer
from kvstore.metrics import MetaCollector, MetricsHttp, rpc_metrics
from kvstore.rpc import GRPC_OPTIONS, ServerHealth, add_service
from kvstore.tls import TlsConfig, add_port, host_of
from kvstore.v1 import common_pb2, meta_pb2

log = logging.getLogger("kvstore.meta")


LOOP_FAILURES_UNHEALTHY = 3


class _Gated:
    """A servicer whose every method first asks ``gate`` (None: no gate)."""

    def __init__(self, servicer: object, gate: Callable[[], str] | None) -> None:
        self._servicer = servicer
        self._gate = gate

    def __getattr__(self, name: str):  # noqa: ANN204
        fn = getattr(self._servicer, name)
        gate = self._gate
        if gate is None or not callable(fn):
            return fn

        def gated(request, context):  # noqa: ANN001, ANN202
            why = gate()
            if why:
                raise Unavailable(why)
            return fn(request, context)

        return gated


class MetaServer:
    """The metadata service as a running gRPC server (plus health checking, reflection, metrics,
    the sweeper and the tier loop)."""

    def __init__(
        self,
        cfg: MetaConfig,
        clock: Clock | None = None,
        registry: CollectorRegistry | None = None,
        tls: TlsConfig | None = None,
        shard: tuple[int, int, int] = (0, 1, 0),
        gate: Callable[[], str] | None = None,
    ) -> None:
        """``shard``: (this shard, of how many, leader epoch) in a sharded cluster
        (:mod:`kvstore.cluster.shard`); ``gate``: asked before every call, an empty answer lets it
        through, anything else refuses it UNAVAILABLE with that reason (a shard whose lease
        lapsed)."""
        self.cfg = cfg
        self.tls = tls
        self.shard, self.shards, self.epoch = shard
        self.gate = gate
        limits = IndexLimits(
            max_batch_keys=cfg.max_batch_keys,
            max_block_bytes=cfg.max_block_bytes,
            put_timeout_s=cfg.put_timeout_s,
            lease_ttl_s=cfg.lease_ttl_s,
            daemon_ttl_s=cfg.daemon_ttl_s,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            dram_high_watermark=cfg.dram_high_watermark,
            dram_low_watermark=cfg.dram_low_watermark,
            cache_policy=cfg.cache_policy,
            engine_ttl_s=cfg.engine_ttl_s,
            max_engines=cfg.max_engines,
            max_engines_per_tenant=cfg.max_engines_per_tenant,
            max_engine_blocks=cfg.max_engine_blocks,
            shard=self.shard,
            shards=self.shards,
        )
        self.index = Index(limits, clock or Clock())
        self.link = DaemonLink(self.index, cfg.daemon_rpc_timeout_s, tls=tls, epoch=self.epoch)
        self.link.gate = gate
        self.registry = registry or CollectorRegistry()
        self.registry.register(MetaCollector(self.index))
        self.loop_watch = LoopWatch(self.registry, "meta")
        self.metrics = MetricsHttp(self.registry)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._sweeper: asyncio.Task | None = None
        self._tierer: asyncio.Task | None = None
        self._moving: dict[str, asyncio.Task] = {}  # daemon id -> its batch of moves in flight
        # Held by each round of the background loops, so that a stop lets the round in
        # progress deliver its tombstones instead of cutting it off mid-way.
        self._round = asyncio.Lock()
        self.health = ServerHealth("kvstore.v1.MetaService")
        self._failing: dict[str, int] = {}  # background loop -> consecutive failures
        self._stopping = False
        self.lookup_port: LookupPort | None = None
        self.authority: Authority | None = None  # identities (meta.auth_file), read at start

    def local_daemon_token(self, daemon_id: str) -> str:
        """The bearer token for a daemon in this process (``kvstore serve``), after start(): with
        identities (meta.auth_file), one minted for ``daemon_id`` that no one outside the process
        knows (:meth:`kvstore.meta.auth.Authority.mint`); without, none is needed ("")."""
        if self.authority is None:
            return ""
        return self.authority.mint(daemon_id, "daemon")

    async def start(self) -> int:
        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        authority = Authority(self.cfg.auth_file, self.cfg.tenant_secret_file) if self.cfg.auth_file else None
        self.authority = authority
        quotas = Quotas(self.cfg.tenant_max_leased_bytes, self.cfg.tenant_max_pinned_bytes)
        servicer = MetaServicer(
            self.index,
            self.link,
            self.cfg.allow_clock_skew,
            self.cfg.data_tickets,
            authority,
            quotas,
            self.cfg.read_ticket_ttl_s,
            (self.shard, self.shards, self.epoch),
        )
        add_service(self.server, meta_pb2, "MetaService", _Gated(servicer, self.gate), self.registry)
        add_service(self.server, health_pb2, "Health", self.health.servicer)
        reflection.enable_server_reflection(
            (
                meta_pb2.DESCRIPTOR.services_by_name["MetaService"].full_name,
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.port = add_port(self.server, self.cfg.listen, self.tls, "meta.listen")
        if self.port == 0:
            raise OSError(f"metadata service cannot listen on {self.cfg.listen}")
        if self.cfg.metrics_port >= 0:
            self.metrics.start(self.cfg.metrics_host, self.cfg.metrics_port)
        await self.server.start()
        if self.cfg.lookup_port >= 0 and authority is None and not (self.tls is not None and self.tls.enabled):
            await self._start_lookup_port(servicer)
        await self.health.start()
        await self.health.set_serving(True)
        self._sweeper = asyncio.create_task(self._loop("sweep", self.cfg.sweep_interval_s, self._sweep_round))
        self._tierer = asyncio.create_task(self._loop("tier", self.cfg.tier_interval_s, self._tier_round))
        self.loop_watch.start()
        log.info("event=meta_started listen=%s port=%d metrics_port=%d", self.cfg.listen, self.port, self.metrics.port)
        return self.port

    async def _start_lookup_port(self, servicer: MetaServicer) -> None:
        """Plain lookups on a socket beside gRPC (kvstore.meta.lookup_port), on the host of
        meta.listen; advertised in every lookup answer."""
        index = self.index
        duration, error = rpc_metrics(self.registry).method("MetaService", "LookupPort")

        def lookup(packed: bytes, per_key: bool) -> tuple[int, list[bool]]:
            hit, exists, _ = index.lookup(packed, per_key=per_key)
            return hit, exists

        host = host_of(self.cfg.listen)
        # Every interface of both families for "::" (as gRPC listens there), else that address.
        bind = None if host in ("", "::") else host
        port = LookupPort(lookup, self.cfg.max_batch_keys, self.gate, observe=duration.observe, error=error)
        try:
            servicer.lookup_port = await port.start(bind, self.cfg.lookup_port)
        except OSError as e:
            log.warning("event=lookup_port_off reason=%r", str(e))  # lookups stay on gRPC
            return
        servicer.lookup_port_id = port.instance
        self.lookup_port = port
        log.info("event=lookup_port_started host=%s port=%d", host, port.port)

    async def _loop(self, name: str, interval: float, body) -> None:  # noqa: ANN001
        """Runs ``body`` every ``interval`` seconds for as long as the server runs: an exception
        is logged and the loop goes on; after LOOP_FAILURES_UNHEALTHY in a row the service
        reports NOT_SERVING until a round succeeds again."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            lag, last = now - last - interval, now
            try:
                async with self._round:
                    await body(lag)
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                n = self._failing[name] = self._failing.get(name, 0) + 1
                log.exception("event=loop_error loop=%s consecutive=%d", name, n)
                if n == LOOP_FAILURES_UNHEALTHY and self.health.serving:
                    log.error("event=unhealthy loop=%s consecutive=%d health=NOT_SERVING", name, n)
                    await self.health.set_serving(False)
                continue
            if self._failing.pop(name, 0) and not self._failing and not self.health.serving and not self._stopping:
                log.info("event=healthy loop=%s health=SERVING", name)
                await self.health.set_serving(True)

    async def _sweep_round(self, lag: float) -> None:
        # The loop did not run for `lag` seconds (a long call, a paused process): heartbeats
        # that came in meanwhile were not handled yet, so the daemons do not lose that time.
        if lag > self.cfg.heartbeat_interval_s:
            self.index.grace(lag)
            log.warning("event=service_stalled seconds=%.3f action=daemon_leases_extended", lag)
        out = self.index.expire(stepwise=True)
        # A lost daemon's blocks leave in steps (none is found meanwhile); a stop does not wait for them.
        while not self._stopping and self.index.drop_step():
            await asyncio.sleep(0)
        if any(out.values()):
            log.info(
                "event=expired daemons=%d puts=%d leases=%d engines=%d",
                out["daemons"], out["puts"], out["leases"], out["engines"],
            )  # fmt: skip
        self.link.prune()
        await self.link.flush()

    async def _tier_round(self, lag: float) -> None:
        """Plans demotions and promotions; each daemon carries out its batch on its own, and a
        daemon with a batch in flight gets no new one until it answers."""
        busy = {did for did, t in self._moving.items() if not t.done()}
        plans = self.index.plan_moves(self.cfg.move_batch_bytes, skip=busy)
        await self.link.flush()  # SSD space freed for the moves
        for did, moves in plans.items():
            self._moving[did] = asyncio.create_task(self._moves(did, moves))
        for did in [d for d, t in self._moving.items() if t.done()]:
            del self._moving[did]

    async def _moves(self, daemon_id: str, moves) -> None:  # noqa: ANN001
        try:
            mark = self.link.mark()
            await self.link.run_moves({daemon_id: moves})
            await self.link.flush(mark)  # demoted DRAM copies
        except Exception:  # noqa: BLE001 - one daemon's batch; the tier loop goes on
            log.exception("event=moves_error daemon=%s", daemon_id)

    async def stop(self, grace: float = 0.5) -> None:
        """Stops serving: health turns NOT_SERVING, the background round in progress and the
        tier moves in flight finish first (their tombstones reach the daemons), then the loops
        end and the server stops."""
        self._stopping = True
        await self.health.stop()
        async with self._round:
            for task in (self._tierer, self._sweeper):
                if task:
                    task.cancel()
        pending = [t for t in self._moving.values() if not t.done()]
        if pending:
            _done, late = await asyncio.wait(pending, timeout=self.cfg.daemon_rpc_timeout_s)
            for t in late:
                t.cancel()
        if self.lookup_port is not None:
            await self.lookup_port.stop()
        if self.server:
            await self.server.stop(grace)
        await self.link.close()
        self.loop_watch.stop()
        self.metrics.stop()

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


__all__ = ["MetaServer", "MetaServicer", "common_pb2", "grpc"]
