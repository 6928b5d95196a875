"""The metadata service's RPC handlers: each one checks who is calling (:mod:`kvstore.meta.auth`),
decodes the packed columns, calls the index, carries its decisions to the daemons
(:class:`~kvstore.meta.daemons.DaemonLink`: commits before a put is visible, tombstones before
a removal or an eviction is acknowledged) and encodes the answer, with the data-port tickets of
the placements it hands out (:mod:`kvstore.tickets`). Statuses are chosen by cause in one place
for every server (:mod:`kvstore.rpc`); :mod:`kvstore.meta.service` runs the server around them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from kvstore import tickets
from kvstore.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, Unavailable
from kvstore.keys import KEY_BYTES, unpack_keys
from kvstore.meta.api import IndexApi
from kvstore.meta.auth import OPEN, Authority, Identity, Quotas, require
from kvstore.meta.daemon_calls import DaemonCalls
from kvstore.meta.daemons import DaemonLink
from kvstore.meta.records import CommitStatus
from kvstore.v1 import meta_pb2
from kvstore.wire import U8, U32, U64, daemon_to_pb, leading, pack, places_to_pb, unpack

# A per-tier lookup names at most this many engines (those holding the longest prefixes).
MAX_ENGINES_ANSWERED = 64


log = logging.getLogger("kvstore.meta")


def _flags(data: bytes, what: str, count: int | None = None) -> list[bool]:
    vals = unpack(data, U8, what, count)
    bad = next((v for v in vals if v > 1), None)
    if bad is not None:
        raise InvalidArgument(f"{what}: flags must be 0 or 1, got {bad}")
    return [bool(v) for v in vals]


class MetaServicer(DaemonCalls):
    def __init__(
        self,
        index: IndexApi,
        link: DaemonLink,
        allow_clock_skew: bool = False,
        tickets: bool = True,
        authority: Authority | None = None,
        quotas: Quotas | None = None,
        read_ticket_ttl_s: float = 600.0,
        shard: tuple[int, int, int] = (0, 1, 0),
    ) -> None:
        self.index = index
        self.shard, self.shards, self.epoch = shard
        self.read_ticket_ttl_s = read_ticket_ttl_s
        self.quotas = quotas or Quotas()
        self.link = link
        self.allow_clock_skew = allow_clock_skew
        self.tickets = tickets
        self.authority = authority
        self.lookup_port = 0  # advertised in lookup answers when served (kvstore.meta.lookup_port)
        self.lookup_port_id = 0
        # Who started each put and took each lease (with tenants): only they may end it.
        self._put_owner: dict[int, str] = {}
        self._lease_owner: dict[int, str] = {}
        # A read's cache-policy accounting runs after its answer is on its way (policy: defer).
        self.index.policy.defer = True
        self._drain_due = False

    def _drain_soon(self) -> None:
        if self._drain_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the service's loop: account now
            self.index.policy.drain()
            return
        self._drain_due = True
        loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_due = False
        self.index.policy.drain()

    # ---- identity ---------------------------------------------------------------------------

    def _who(self, context, *roles: str) -> Identity:  # noqa: ANN001
        if self.authority is None:
            return OPEN
        ident = self.authority.identify(context)
        require(ident, *roles)
        return ident

    def _keys(self, packed: bytes, ident: Identity, tenant: str = "") -> bytes:
        """The caller's keys as the index stores them (its own tenant's, or for an admin the
        named tenant's)."""
        if self.authority is None:
            return packed
        if tenant and tenant != ident.name and ident.role != "admin":
            raise PermissionDenied(f"tenant {ident.name!r} may act only on its own blocks, not {tenant!r}'s")
        return self.authority.keys(packed, tenant or ident.name)

    def _own(self, owners: dict[int, str], table: dict, ident: Identity, item_id: int, what: str) -> None:
        """A put or lease of another tenant is as unknown as one that never was."""
        if self.authority is None:
            return
        if len(owners) > 2 * len(table) + 1024:  # forget the ones that ended meanwhile
            for k in [k for k in owners if k not in table]:
                del owners[k]
        if owners.get(item_id) != ident.name and ident.role != "admin":
            raise NotFound(f"{what} {item_id} is unknown (already ended, or not yours)")

    async def PutStart(self, request, context):
        n = len(request.keys) // KEY_BYTES
        sizes = unpack(request.sizes, U64, "sizes", n if len(request.keys) % KEY_BYTES == 0 else None)
        ident = self._who(context, "tenant", "admin")
        mark = self.link.mark()
        started = time.monotonic()
        res = self.index.put_start(
            self._keys(request.keys, ident),
            sizes,
            host_id=request.host_id,
            timeout_s=request.timeout_ms / 1000.0,
            exclude=request.exclude_daemons,
        )
        # Spelled out now: during the flush the put can end (its deadline, its daemon lost) and
        # the index can give its rows to another put; the extents stay this put's (held back
        # until its write tickets lapse).
        places = self.index.places(res.placements)
        # Space freed by eviction is handed out only once its old blocks are gone on their
        # daemons: a restarted service must not find an evicted block again.
        await self.link.flush(mark)
        if len(res.placements) and self.authority is not None:
            self._put_owner[res.put_id] = ident.name
        # The write tickets end with the reservation, counted from when it was made (not from
        # now, after the flush): the index holds an ended put's extents back for as long as
        # tickets so made can be honoured (IndexLimits.write_ticket_grace_s).
        left = max(0.0, res.deadline - (time.monotonic() - started))
        return meta_pb2.PutStartResponse(
            put_id=res.put_id,
            status=pack(res.status, U8),
            placements=places_to_pb(places, tickets.WRITE, left, keys=self.authority is not None),
            deadline_unix_ms=int((time.time() + left) * 1000),
        )

    async def PutCommit(self, request, context):
        self._own(self._put_owner, self.index.puts, self._who(context, "tenant", "admin"), request.put_id, "put")
        sums = unpack(request.checksums, U64, "checksums")
        written = _flags(request.written, "written") if request.written else None
        pc = self.index.put_commit_begin(request.put_id, sums, written)  # drops only unwritten blocks
        commit = asyncio.ensure_future(self.link.commit(pc))
        try:
            outcome = await asyncio.shield(commit)
        except asyncio.CancelledError:
            # The caller went away (its deadline) while the daemons commit: the put has left the
            # reservation table, so it is ended when they answer, or its blocks would stay
            # "being written" and their extents held for as long as their daemon lives.
            commit.add_done_callback(lambda done: self._end_commit(pc, done))
            raise
        mark = self.link.mark()
        committed, status = self.index.put_commit_end(pc, outcome)
        await self.link.flush(mark)
        return meta_pb2.PutCommitResponse(committed=committed, status=pack(status, U8))

    def _end_commit(self, pc, done: asyncio.Future) -> None:  # noqa: ANN001 - records.PendingCommit
        """The second half of a commit whose caller went away (see :meth:`PutCommit`): the
        daemons' answers, or none (every block unavailable: dropped, with tombstones for what a
        daemon may hold) if asking them failed. Tombstones go out with the next sweep."""
        if done.cancelled() or done.exception() is not None:
            outcome = {i: (int(CommitStatus.UNAVAILABLE), 0) for i in range(len(pc.status))}
        else:
            outcome = done.result()
        self.index.put_commit_end(pc, outcome)

    async def PutAbort(self, request, context):
        self._own(self._put_owner, self.index.puts, self._who(context, "tenant", "admin"), request.put_id, "put")
        mark = self.link.mark()
        released = self.index.put_abort(request.put_id)
        await self.link.flush(mark)
        return meta_pb2.PutAbortResponse(released=released)

    def Lookup(self, request, context):
        ident = self._who(context, "tenant", "admin")
        keys = self._keys(request.keys, ident)
        hit, exists, locs = self.index.lookup(keys, per_key=request.per_key, with_locations=request.with_locations)
        resp = meta_pb2.LookupResponse(
            hit_count=hit,
            lookup_port=self.lookup_port,
            lookup_port_id=self.lookup_port_id,
            exists=pack(exists, U8) if request.per_key else b"",
            locations=(
                places_to_pb(self.index.places(locs), keys=self.authority is not None)
                if request.with_locations
                else None
            ),
        )
        if request.per_tier:
            tiers, engines = self.index.tiers(keys)
            resp.tiers = tiers
            mine = f"{ident.name}\0" if self.authority is not None else ""
            # A tenant sees its own engines only; those that hold the longest prefixes first.
            ours = [(eid[len(mine) :], url, held) for eid, (url, held) in engines.items() if eid.startswith(mine)]
            ours.sort(key=lambda e: -leading(e[2]))
            for eid, url, held in ours[:MAX_ENGINES_ANSWERED]:
                resp.engines.add(engine_id=eid, url=url, held=bytes(held))
        return resp

    def ReportEngineBlocks(self, request, context):
        ident = self._who(context, "tenant", "admin")
        if not request.engine_id or len(request.engine_id) > 256 or "\0" in request.engine_id:
            raise InvalidArgument("engine_id: 1 to 256 characters, without NUL")
        # Engines are named within their tenant, and report that tenant's keys.
        eid = f"{ident.name}\0{request.engine_id}" if self.authority is not None else request.engine_id
        held = self.index.report_engine(
            eid,
            request.url,
            self._keys(request.added, ident) if request.added else b"",
            self._keys(request.removed, ident) if request.removed else b"",
            reset=request.reset,
            ttl_s=request.ttl_ms / 1000.0,
            leave=request.leave,
            owner=ident.name if self.authority is not None else "",
        )
        ttl = request.ttl_ms or int(self.index.limits.engine_ttl_s * 1000)
        return meta_pb2.ReportEngineBlocksResponse(held=held, ttl_ms=ttl)

    # Each message of the stream is answered as a Lookup (kvstore.rpc._wrap_each).
    LookupStream = Lookup

    def Acquire(self, request, context):
        ident = self._who(context, "tenant", "admin")
        res = self.index.acquire(self._keys(request.keys, ident), ttl_s=request.ttl_ms / 1000.0)
        locs = self.index.places(res.locations)
        if res.lease_id and self.quotas.max_leased:
            nbytes = int(locs.length.sum())
            fits, held = self.quotas.leases.fits(ident.name, nbytes, self.index.leases.__contains__)
            if not fits:
                self.index.release(res.lease_id, unread=res.hit_count)  # nothing was read: misses
                raise ResourceExhausted(
                    f"tenant {ident.name!r} holds {held} bytes in read leases; {nbytes} more would pass its quota of "
                    f"{self.quotas.max_leased} (meta.tenant_max_leased_bytes): release leases first"
                )
            self.quotas.leases.add(res.lease_id, ident.name, nbytes)
        if res.lease_id and self.authority is not None:
            self._lease_owner[res.lease_id] = ident.name
        self._drain_soon()
        return meta_pb2.AcquireResponse(
            hit_count=res.hit_count,
            lease_id=res.lease_id,
            locations=places_to_pb(
                locs, tickets.READ, max(res.ttl, self.read_ticket_ttl_s), keys=self.authority is not None
            ),
            ttl_ms=int(res.ttl * 1000),
        )

    async def Release(self, request, context):
        ident = self._who(context, "tenant", "admin")
        self._own(self._lease_owner, self.index.leases, ident, request.lease_id, "lease")
        mark = self.link.mark()
        self.index.release(
            request.lease_id, unpack(request.corrupt, U32, "corrupt"), request.unread, request.asked_again
        )
        self.quotas.leases.drop(request.lease_id)
        await self.link.flush(mark)
        return meta_pb2.ReleaseResponse(released=True)

    def Touch(self, request, context):
        ident = self._who(context, "tenant", "admin")
        if len(request.chains) > self.index.limits.max_batch_keys:
            raise InvalidArgument(
                f"chains: {len(request.chains)} chains is over the limit of {self.index.limits.max_batch_keys}"
            )
        chains = [self._keys(c, ident) for c in request.chains]
        stored = self.index.touch(chains, request.interval_ms / 1000.0, request.tiers)
        self._drain_soon()
        return meta_pb2.TouchResponse(stored=stored)

    async def Remove(self, request, context):
        mark = self.link.mark()
        ident = self._who(context, "tenant", "admin")
        n = self.index.remove(self._keys(request.keys, ident, request.tenant))
        failed = await self.link.flush(mark)
        if failed:
            raise Unavailable(
                f"{n} blocks left the index, but daemon(s) {', '.join(sorted(failed))} did not confirm dropping "
                "them; they are told again with every heartbeat (until then a restart of this service could "
                "bring them back)"
            )
        return meta_pb2.CountResponse(count=n)

    def Pin(self, request, context):
        ident = self._who(context, "tenant", "admin")
        keys = self._keys(request.keys, ident, request.tenant)
        if not self.quotas.max_pinned:
            return meta_pb2.CountResponse(count=self.index.pin(keys, True))
        tenant = request.tenant or ident.name
        new = self.index.pin_candidates(keys)
        fits, held = self.quotas.pins.fits(tenant, sum(new.values()), self._pinned)
        if not fits:
            raise ResourceExhausted(
                f"tenant {tenant!r} pins {held} bytes; {sum(new.values())} more would pass its quota of "
                f"{self.quotas.max_pinned} (meta.tenant_max_pinned_bytes)"
            )
        n = self.index.pin(keys, True)
        for k, nbytes in new.items():
            self.quotas.pins.add(k, tenant, nbytes)
        return meta_pb2.CountResponse(count=n)

    def _pinned(self, key: bytes) -> bool:
        return self.index.is_pinned(key)

    def Unpin(self, request, context):
        keys = self._keys(request.keys, self._who(context, "tenant", "admin"), request.tenant)
        n = self.index.pin(keys, False)
        if self.quotas.pins.items and len(keys) % KEY_BYTES == 0:
            for k in unpack_keys(keys):
                self.quotas.pins.drop(k)
        return meta_pb2.CountResponse(count=n)

    def Stats(self, request, context):
        self._who(context, "admin")
        idx = self.index
        now = idx.clock.now()
        resp = meta_pb2.StatsResponse(
            keys=len(idx),
            pending_puts=len(idx.puts),
            active_leases=len(idx.leases),
            touch_interval_ms=round(idx.touch_interval_s * 1000),
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
        for k, v in idx.engine_tier.counters.items():
            resp.counters[k] = v
        resp.counters["engines"] = len(idx.engine_tier)
        resp.counters["engine_blocks"] = sum(len(e.keys) for e in idx.engine_tier.engines.values())
        return resp

    async def AdvanceClock(self, request, context):
        self._who(context, "admin")
        if not self.allow_clock_skew:
            raise PermissionDenied("AdvanceClock is off: start the service with meta.allow_clock_skew=true")
        if not math.isfinite(request.seconds) or request.seconds < 0:
            raise InvalidArgument(f"seconds must be a finite, non-negative number, got {request.seconds}")
        now = self.index.clock.advance(request.seconds)
        self.index.expire()
        await self.link.flush()
        return meta_pb2.AdvanceClockResponse(now=now)


# Consecutive failures of a background loop after which the service reports NOT_SERVING.
