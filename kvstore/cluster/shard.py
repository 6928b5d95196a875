"""One metadata process of a sharded cluster: a standby until it holds its shard's leader lease
in Redis (:mod:`kvstore.cluster.coord`), then that shard's metadata service, until the lease is
lost, then a standby again.

- Standby: listens nowhere; tries to take the lease every ``cluster.standby_poll_s``, or sooner:
  at the moment the holder's lease runs out unless renewed (Redis' ``PTTL``).
- Leader: serves :class:`kvstore.meta.service.MetaServer` for its shard, with an empty index
  that the daemons fill by registering with their inventories (they find the new leader in Redis
  and register within a heartbeat interval), so every block a daemon still holds is indexed
  again: failover loses nothing a daemon holds. Puts that were in flight at the old leader are
  unknown here: their commits are refused (NOT_FOUND) and the writers put again.
- The lease is renewed every third of ``cluster.leader_ttl_s``. The service answers a call only
  while the lease it last renewed has not run out by its own clock (monotonic time goes on while
  a process is paused), so a leader that was paused, or cut off from Redis, past its lease
  refuses everything (UNAVAILABLE) before a standby can have taken over; and when it hears from
  Redis that someone else holds the lease, it stops serving and becomes a standby. A call that
  was already inside it when the lease ran out still reaches no daemon: each control call carries
  the epoch, and daemons refuse an epoch older than the one they registered with.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from kvstore.cluster.coord import Coordinator, Leader
from kvstore.config import Config
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.tls import check_listen

log = logging.getLogger("kvstore.cluster")

# A leader trusts its lease for this share of it, measured from before the call that took or
# renewed it (so clock rate differences between hosts stay on the safe side).
LEASE_SAFETY = 0.9


class ShardNode:
    def __init__(self, cfg: Config, node_id: str = "") -> None:
        self.cfg = cfg
        cl = cfg.cluster
        self.shard = cl.shard
        self.shards = cl.shards
        self.ttl = cl.leader_ttl_s
        self.node = node_id or f"meta-{socket.gethostname()}-{os.getpid()}"
        self.addr = cl.advertise or cfg.meta.listen
        # The address goes to Redis before the port is bound (a standby binds only when it
        # leads, and each term anew): an ephemeral port would be published as port 0, or
        # differ from the one it advertises.
        for what, addr in (("meta.listen", cfg.meta.listen), ("cluster.advertise", cl.advertise)):
            port = addr.rpartition(":")[2] if addr else "1"
            if not port.isdigit() or int(port) == 0:
                raise InvalidArgument(
                    f"cluster: a shard process needs a fixed port in {what}, not {addr!r} "
                    "(its address is published before it binds)"
                )
        self.coord = Coordinator(cl.redis, cl.name, timeout_s=max(0.2, self.ttl / 4))
        self.leader: Leader | None = None
        self.server = None  # kvstore.meta.service.MetaServer while leading
        self._valid_until = 0.0  # monotonic end of the lease as last renewed
        self._stop = asyncio.Event()
        self.elected = asyncio.Event()
        self.terms = 0
        self._announced = ("", 0.0)  # role, monotonic time of the last announcement

    # ---- the gate of every call --------------------------------------------------------------

    def _gate(self) -> str:
        if time.monotonic() < self._valid_until:
            return ""
        return (
            f"shard {self.shard}: this process's leader lease ran out (epoch {self.leader.epoch if self.leader else 0})"
        )

    # ---- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Stands by, leads, stands by again, until :meth:`stop`."""
        check_listen(self.cfg.meta.listen, self.cfg.tls, "meta.listen")  # a refusal ends the process
        await self.coord.slot_map(self.shards)  # made by the first shard process; checked by the rest
        try:
            while not self._stop.is_set():
                await self._announce("standby")
                t0 = time.monotonic()
                try:
                    epoch = await self.coord.acquire(self.shard, self.node, self.addr, self.ttl)
                except Unavailable as e:
                    log.warning("event=coordination_unavailable shard=%d error=%s", self.shard, e)
                    epoch = 0
                if not epoch:
                    # Try again when the holder's lease would run out (unless it renews it), or
                    # at the next poll, whichever comes first: a dead leader is replaced at once.
                    try:
                        left = await self.coord.lease_left(self.shard)
                    except Unavailable:
                        left = self.cfg.cluster.standby_poll_s
                    await self._sleep(min(self.cfg.cluster.standby_poll_s, left + 0.005))
                    continue
                self._valid_until = t0 + self.ttl * LEASE_SAFETY
                self.leader = Leader(self.node, self.addr, epoch)
                await self._lead()
        finally:
            await self.coord.close()

    async def _lead(self) -> None:
        from kvstore.meta.service import MetaServer

        assert self.leader is not None
        self.terms += 1
        server = MetaServer(
            self.cfg.meta, tls=self.cfg.tls, shard=(self.shard, self.shards, self.leader.epoch), gate=self._gate
        )
        try:
            await server.start()
        except Exception:
            log.exception("event=shard_start_failed shard=%d", self.shard)
            await self._resign()
            await self._sleep(self.ttl)
            return
        self.server = server
        log.info(
            "event=shard_leader shard=%d of=%d epoch=%d node=%s addr=%s",
            self.shard, self.shards, self.leader.epoch, self.node, self.addr,
        )  # fmt: skip
        self.elected.set()
        try:
            await self._renew_loop()
        finally:
            self.elected.clear()
            self.server = None
            await server.stop(0)
            if self._stop.is_set():
                await self._resign()

    async def _renew_loop(self) -> None:
        assert self.leader is not None
        while not self._stop.is_set():
            await self._announce("leader")
            await self._sleep(self.ttl / 3)
            if self._stop.is_set():
                return
            t0 = time.monotonic()
            try:
                held = await self.coord.renew(self.shard, self.leader, self.ttl)
            except Unavailable as e:
                # Redis away: keep the lease we have until it runs out (the gate then refuses
                # calls); if Redis comes back with our lease still there, we go on leading.
                log.warning("event=lease_renew_failed shard=%d epoch=%d error=%s", self.shard, self.leader.epoch, e)
                continue
            if not held:
                log.warning("event=shard_deposed shard=%d epoch=%d action=standby", self.shard, self.leader.epoch)
                self._valid_until = 0.0
                return
            self._valid_until = t0 + self.ttl * LEASE_SAFETY

    async def _resign(self) -> None:
        if self.leader is None:
            return
        try:
            await self.coord.resign(self.shard, self.leader)
        except Unavailable:
            pass
        self._valid_until = 0.0

    async def _announce(self, role: str) -> None:
        """Membership in Redis: on a change of role, else at most every half lease (a standby
        loops every poll, and need not write every time)."""
        now = time.monotonic()
        if self._announced[0] == role and now - self._announced[1] < self.ttl / 2:
            return
        self._announced = (role, now)
        info = {
            "role": role,
            "kind": "meta",
            "shard": self.shard,
            "addr": self.addr,
            "host": socket.gethostname(),
            "epoch": self.leader.epoch if self.leader and role == "leader" else 0,
        }
        if role == "leader" and self.server is not None and self.server.metrics.port:
            info["metrics_port"] = self.server.metrics.port  # where to scrape the shard while it leads
        try:
            await self.coord.announce(self.node, info, max(3 * self.ttl, 2.0))
        except Unavailable:
            pass

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def stop(self) -> None:
        """Ends :meth:`run`: a leader gives its lease up, so a standby takes over at once."""
        self._stop.set()
