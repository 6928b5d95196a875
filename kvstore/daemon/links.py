"""The daemon's links to the metadata service: one per shard (one in all without a cluster).

Each link registers the daemon with its shard's leader, with the inventory of the blocks in that
shard's arena of each segment (:func:`kvstore.cluster.slots.arena_of`), then heartbeats it,
applies the tombstones that come back, and registers again whenever the leader does not know the
daemon (it restarted, our lease lapsed, or another process leads the shard now). In a cluster the
leader's address comes from Redis (:mod:`kvstore.cluster.coord`) and is looked up again after
every failed call, so a new leader is found within a heartbeat.

Fencing: at each registration the link learns its shard's leader epoch. The daemon refuses
control calls (commit, invalidate, move) of that shard that carry another epoch, and when the
epoch changes the link signs that shard's data-port tickets with a new key, so tickets a stale
leader hands out are refused too (:meth:`kvstore.daemon.server.CacheDaemon.ticket_key_for`).
Each registration also gets a number of its own (:func:`new_registration`, made before its
inventory is taken) that the service puts in every control call it makes for it: a call made
for an earlier registration (queued across a restart of the daemon, or made before its lease
lapsed) is refused, so it cannot write an extent the new registration handed to another block.

Credentials: a service with identities (``meta.auth_file``) that refuses this daemon's first
registration (no ``daemon.token``, one it does not know, or one of another identity) stops the
daemon with an error that names the settings (:meth:`MetaLink.refused`): trying again cannot
help. A daemon that registered before and is refused later (the service was restarted with other
identities) keeps its blocks and tries again, backing off, with an error line each time. A
service that does not answer is waited for, with a warning line now and then that says where.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine
from typing import TYPE_CHECKING

import grpc

from kvstore import tickets
from kvstore.blocks import BlockCols
from kvstore.cluster.slots import arena
from kvstore.daemon.registration import send_registration
from kvstore.errors import KVStoreError, PermissionDenied, Unauthenticated, Unavailable
from kvstore.keys import KEY_BYTES
from kvstore.rpc import GRPC_OPTIONS
from kvstore.tls import aio_channel
from kvstore.v1 import common_pb2, meta_pb2, meta_pb2_grpc

if TYPE_CHECKING:
    from kvstore.daemon.server import CacheDaemon

log = logging.getLogger("kvstore.daemon")

# Consecutive unexpected heartbeat-loop failures after which the daemon reports NOT_SERVING.
LOOP_FAILURES_UNHEALTHY = 3
# While a link is not registered, it tries again this often (a shard's failover waits on it).
RETRY_S = 0.1
# A service that does not answer is logged at once, then every this many seconds while it lasts.
UNREACHABLE_LOG_S = 30.0
# A registered daemon whose credentials are refused later tries again after 1 s, 2 s, ... up to this.
REFUSED_BACKOFF_MAX_S = 30.0
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def shard_inventory(
    cols: list[tuple[int, BlockCols, bool]], sizes: dict[int, tuple[int, int]], shard: int, shards: int
) -> list[common_pb2.Inventory]:
    """The inventory messages of the blocks of ``cols`` (:meth:`CacheDaemon.inventory_columns
    <kvstore.daemon.server.CacheDaemon.inventory_columns>`) whose extents lie in shard
    ``shard``'s arena (``sizes``: segment id -> (capacity, alignment)); without shards, all of
    them. Columns all the way: a mask over the offsets, then the packed arrays."""
    out = []
    for seg_id, blocks, sized in cols:
        if shards > 1:
            cap, align = sizes[seg_id]
            base, span = arena(cap, align, shard, shards)
            blocks = blocks.take((blocks.offset >= base) & (blocks.offset < base + span))
            if not len(blocks):
                continue
        out.append(blocks.to_pb(seg_id, with_size=sized))
    return out


def new_registration() -> int:
    """A registration number: 64 random bits, never 0 (0 marks a call that is not checked)."""
    return secrets.randbits(64) or 1


class MetaLink:
    """Registration with and heartbeats to one shard's leader."""

    def __init__(self, daemon: CacheDaemon, shard: int, shards: int, coord=None) -> None:  # noqa: ANN001
        self.d = daemon
        self.shard = shard
        self.shards = shards
        self.coord = coord  # kvstore.cluster.coord.Coordinator, or None: daemon.meta is the service
        self.addr = "" if coord is not None else daemon.cfg.meta
        self.channel: grpc.aio.Channel | None = None
        self.stub: meta_pb2_grpc.MetaServiceStub | None = None
        self.epoch = 0
        # Data-port tickets and control calls are signed with this link's key, made anew at each
        # registration (register()); until the first, one that no service knows.
        self.ticket_key = tickets.new_key()
        # The number of the registration control calls must be made for (register()); until
        # the first, one that no service knows, so that none is served before it.
        self.registration = new_registration()
        self._serving = 0  # control calls of this shard being carried out (carry_out())
        self._idle = asyncio.Event()
        self._idle.set()
        self.registered = False  # registered with the current leader (and not forgotten since)
        # Whether that leader signs tickets (and control calls) with our key: None until it said.
        self.tickets: bool | None = None
        self.need_register = True
        self.heartbeated = False  # a heartbeat answered since the registration (its tombstones applied)
        self.acked_batch = 0
        self.last_contact = 0.0  # loop time of the last answered heartbeat or registration
        self.lease_ttl = 3.0  # the service's daemon lease, learnt at registration
        self.failures = 0
        self.task: asyncio.Task | None = None
        self.ever_registered = False  # registered at least once since the daemon started
        self._down_since: float | None = None  # loop time of the first failed call in a row
        self._down_logged = 0.0
        self._refusals = 0  # credentials refused in a row (after a first registration)

    async def carry_out(self, work: Coroutine):  # noqa: ANN201
        """Carries out ``work``, a control call of this shard that passed its checks, counted
        as under way until it has ended: a registration waits until none is (see register()).
        A handler cancelled meanwhile (its caller's deadline passed, or it went away) does not
        stop a thread already running its work, so the wait covers that thread too."""
        self._serving += 1
        self._idle.clear()
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait({task})
            raise
        finally:
            self._serving -= 1
            if not self._serving:
                self._idle.set()

    @property
    def ok(self) -> bool:
        """Known to its shard: registered, heard from within a lease, the loop not failing."""
        loop = asyncio.get_running_loop()
        return (
            not self.need_register
            and loop.time() - self.last_contact < self.lease_ttl
            and self.failures < LOOP_FAILURES_UNHEALTHY
        )

    async def _connect(self) -> bool:
        """A stub for the shard's current leader (looked up in Redis in a cluster)."""
        if self.coord is not None:
            try:
                leader = (await self.coord.leaders(self.shards))[self.shard]
            except Unavailable as e:
                log.debug("event=leader_lookup_failed shard=%d error=%s", self.shard, e)
                leader = None
            if leader is None:
                return self.stub is not None
            if leader.epoch != self.epoch and not self.need_register:
                # Another leader now: from here on the shard's control calls are refused (the
                # old leader's included) until we have registered with the new one, so that no
                # block is committed after the inventory we bring it was taken.
                self._forgotten(f"leader epoch {leader.epoch} in Redis, registered with {self.epoch}")
            if leader.addr != self.addr or self.stub is None:
                await self.close()
                self.addr = leader.addr
                self.need_register = True
        if self.stub is None:
            self.channel = aio_channel(self.addr, self.d.tls, GRPC_OPTIONS, token=self.d.cfg.token)
            self.stub = meta_pb2_grpc.MetaServiceStub(self.channel)
        return True

    async def register(self) -> float:
        assert self.stub is not None
        d = self.d
        # A new registration from here on: calls made for the one before (queued across our
        # restart or a lapse of our lease) are refused while the inventory is taken and after,
        # so none can commit, move or drop a block behind the inventory's back, or write an
        # extent this registration hands to another block. The service ends what it planned on
        # the old one as it takes the new.
        self.registration = new_registration()
        await self._idle.wait()  # those already past the check end first (a move: at its next block)
        invs, discarded = await asyncio.to_thread(self._inventory)
        # A key of this registration only: tickets handed out before it (by an earlier leader,
        # or by this service before a restart or before it dropped us) stop serving. The
        # service held the extents of unfinished puts until their write tickets lapsed, but a
        # re-registration rebuilds its view from the inventory and forgets that; with a new
        # key no old write ticket can reach an extent it hands out again. (Clients' remembered
        # read tickets go too: they read those blocks once more through a lease.)
        key = tickets.new_key()
        # One message, or parts on one stream past what a message may carry (kvstore.daemon.registration).
        resp = await send_registration(self.stub, d.info(), invs, key, self.registration)
        if (resp.shards or 1) != self.shards or resp.shard != self.shard:  # 0: a service of before shards
            log.warning(
                "event=wrong_shard daemon=%s addr=%s answered_shard=%d of=%d want_shard=%d of=%d",
                d.daemon_id, self.addr, resp.shard, resp.shards, self.shard, self.shards,
            )  # fmt: skip
            raise Unavailable(
                f"the service at {self.addr} is shard {resp.shard} of {resp.shards}, this link is for shard "
                f"{self.shard} of {self.shards}"
            )
        if resp.epoch != self.epoch:
            # A new leader: control calls of the old one are refused from here on.
            log.info(
                "event=shard_epoch daemon=%s shard=%d epoch=%d was=%d", d.daemon_id, self.shard, resp.epoch, self.epoch
            )
            self.epoch = resp.epoch
            self.acked_batch = 0
        self.ticket_key = key
        self.tickets = resp.tickets
        if not resp.tickets and d.cfg.token and (d.tls is None or not d.tls.enabled):
            log.warning(
                "event=control_unauthenticated daemon=%s shard=%d reason=%r", d.daemon_id, self.shard,
                "the service hands out no tickets and the control channel has no mutual TLS: any peer "
                "that reaches the data or control port may read, write or drop blocks",
            )  # fmt: skip
        # The service signs tickets for our placements (meta.data_tickets): require them.
        d.dataport.require_tickets = resp.tickets
        d.counters["registrations"] += 1
        blocks = sum(len(i.keys) // KEY_BYTES for i in invs)
        log.info(
            "event=registered daemon=%s shard=%d epoch=%d blocks=%d discarded=%d rejected=%d",
            d.daemon_id, self.shard, self.epoch, blocks, discarded, resp.rejected,
        )  # fmt: skip
        self.lease_ttl = max(resp.lease_ttl_ms / 1000.0, 0.01)
        self.last_contact = asyncio.get_running_loop().time()
        self.need_register = False
        self.heartbeated = False
        self.registered = True
        self.ever_registered = True
        return max(resp.heartbeat_interval_ms / 1000.0, 0.01)

    def _inventory(self) -> tuple[list[common_pb2.Inventory], int]:
        """This shard's inventory messages, and the candidates discarded (on a thread: at
        millions of blocks the scan and the packing take seconds)."""
        cols, discarded = self.d.inventory_columns(True)
        return shard_inventory(cols, self.d.segment_sizes(), self.shard, self.shards), discarded

    async def run(self) -> None:
        """Registers, then heartbeats every interval for as long as the daemon runs. Survives
        any failure (logged)."""
        d = self.d
        loop = asyncio.get_running_loop()
        interval = 0.5
        while not d.draining:
            try:
                if not await self._connect():
                    raise Unavailable(f"shard {self.shard} has no leader")
                if self.need_register:
                    interval = await self.register()
                else:
                    assert self.stub is not None
                    resp = await self.stub.Heartbeat(
                        meta_pb2.HeartbeatRequest(
                            daemon_id=d.daemon_id, acked_batch=self.acked_batch, registration=self.registration
                        ),
                        timeout=self._heartbeat_timeout(),
                    )
                    if resp.epoch != self.epoch:
                        self._forgotten(f"epoch {resp.epoch} answered, registered with {self.epoch}")
                        await d.links_changed()
                        continue
                    if resp.invalidations:
                        await d.run(d.invalidate, resp.invalidations)
                    self.acked_batch = resp.batch
                    if not resp.known:
                        self._forgotten("unknown to the service")
                        await d.links_changed()
                        continue
                    self.heartbeated = True
                self.last_contact = loop.time()
                if self.coord is not None and self.shard == 0:
                    await self._announce(interval)
                self.failures = 0
                self._answered()
            except grpc.aio.AioRpcError as e:
                if e.code() not in _REFUSED:
                    # A restarted service answers "unknown" to the next heartbeat; until then,
                    # wait. In a cluster, the next round looks the shard's leader up again.
                    d.counters["heartbeat_failures"] += 1
                    self._unreachable(e.details() or e.code().name)
                else:
                    err = self.refused(e)
                    if not self.ever_registered:
                        log.error(
                            "event=registration_refused daemon=%s shard=%d addr=%s action=stop reason=%r",
                            d.daemon_id, self.shard, self.addr, str(err),
                        )  # fmt: skip
                        d.fail(err)
                        return
                    d.counters["heartbeat_failures"] += 1
                    self._refusals += 1
                    wait = min(REFUSED_BACKOFF_MAX_S, 2.0 ** (self._refusals - 1))
                    log.error(
                        "event=credentials_refused daemon=%s shard=%d addr=%s retry_in_s=%.0f reason=%r",
                        d.daemon_id, self.shard, self.addr, wait, str(err),
                    )  # fmt: skip
                    self._forgotten("credentials refused")
                    await d.links_changed()
                    await asyncio.sleep(wait)
                    continue
            except Unavailable as e:
                d.counters["heartbeat_failures"] += 1
                self._unreachable(str(e))
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                d.counters["heartbeat_failures"] += 1
                self.failures += 1
                log.exception("event=heartbeat_loop_error daemon=%s consecutive=%d", d.daemon_id, self.failures)
            await d.links_changed()
            await asyncio.sleep(RETRY_S if (self.need_register or not self.ok) and self.coord is not None else interval)

    def refused(self, e: grpc.aio.AioRpcError) -> KVStoreError:
        """The service's refusal of this daemon's credentials, as an error that says which
        settings to fix."""
        d = self.d
        did = d.daemon_id
        head = f"the metadata service at {self.addr or 'the shard leader'} refused daemon {did!r} ({e.details()})"
        entry = (
            f"the service has identities (meta.auth_file): list this daemon there as "
            f"`{did}: {{role: daemon, tokens: [<16+ random characters>]}}` and start it with "
            f"daemon.daemon_id={did} and daemon.token=<that token>"
        )
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            has = "daemon.token is not set" if not d.cfg.token else "its daemon.token is not one the service knows"
            return Unauthenticated(f"{head}: {has}; {entry}")
        return PermissionDenied(
            f"{head}: daemon.token must be the token of a daemon identity named as daemon.daemon_id ({did!r}); {entry}"
        )

    def _unreachable(self, why: str) -> None:
        """A call to the service failed for want of an answer: logged at the first failure in
        a row, then every UNREACHABLE_LOG_S, saying where the daemon looks for the service."""
        now = asyncio.get_running_loop().time()
        if self._down_since is None:
            self._down_since, self._down_logged = now, now - UNREACHABLE_LOG_S
        if now - self._down_logged < UNREACHABLE_LOG_S:
            log.debug("event=meta_unreachable daemon=%s shard=%d error=%s", self.d.daemon_id, self.shard, why)
            return
        self._down_logged = now
        where = (
            f"the leader of shard {self.shard} in {self.d.cluster.redis} (cluster.redis)"
            if self.coord is not None and self.d.cluster is not None
            else f"{self.addr} (daemon.meta)"
        )
        log.warning(
            "event=meta_unreachable daemon=%s shard=%d service=%r waited_s=%.1f registered=%s action=retrying error=%r",
            self.d.daemon_id, self.shard, where, now - self._down_since, self.registered, why,
        )  # fmt: skip

    def _answered(self) -> None:
        if self._down_since is not None:
            waited = asyncio.get_running_loop().time() - self._down_since
            if waited >= 1.0:
                log.info("event=meta_reachable daemon=%s shard=%d waited_s=%.1f", self.d.daemon_id, self.shard, waited)
            self._down_since = None
        self._refusals = 0

    async def _announce(self, interval: float) -> None:
        """Membership in Redis (for ``kvstore stat``), refreshed with the first shard's heartbeats."""
        d = self.d
        info = {"role": "daemon", "kind": "daemon", "addr": d.info().data_addr, "host": d.host_id}
        try:
            await self.coord.announce(d.daemon_id, info, max(3 * interval, 2.0))
        except Unavailable:
            pass

    def _heartbeat_timeout(self) -> float:
        """5 s for one service; in a cluster half a daemon lease, so that a leader that hangs
        (paused, cut off) is left for the one Redis names before our lease with it runs out."""
        return 5.0 if self.coord is None else max(0.3, min(5.0, self.lease_ttl / 2))

    def _forgotten(self, why: str) -> None:
        log.info(
            "event=meta_forgot_us daemon=%s shard=%d reason=%r action=reregister", self.d.daemon_id, self.shard, why
        )
        self.need_register = True
        self.registered = False

    async def drain(self) -> tuple[int, int, int] | None:
        """Tells the shard the daemon leaves: (blocks dropped, leases held, wait ms), or None if
        the shard could not be told."""
        if self.stub is None or not self.registered:
            return None
        try:
            resp = await self.stub.DrainDaemon(meta_pb2.DrainDaemonRequest(daemon_id=self.d.daemon_id), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning(
                "event=drain_unannounced daemon=%s shard=%d code=%s effect=blocks_leave_index_at_lease_expiry",
                self.d.daemon_id, self.shard, e.code().name,
            )  # fmt: skip
            return None
        return resp.dropped, resp.leases, resp.lease_wait_ms

    async def close(self) -> None:
        if self.channel is not None:
            ch, self.channel, self.stub = self.channel, None, None
            await ch.close()
