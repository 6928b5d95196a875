"""The client's side of a sharded cluster: a stand-in for the metadata service's stub that sends
each call to the shards owning its keys, in parallel, and combines their answers, so that the
rest of the client (reads, writes, lookups) does not know there are shards.

- The slot map and each shard's leader come from Redis (:mod:`kvstore.cluster.coord`); a call
  that finds its shard's leader gone (UNAVAILABLE: the process died, or its lease ran out) looks
  the leader up again and is sent again until ``client.rpc_timeout_s``, so a failover costs
  callers a delay, not an error, when it is shorter than that.
- Lookups and leases: the leading hit count of a chain is its first miss over all shards; the
  locations of the hits are merged in key order (each shard numbers its own segments, so the
  rows' segment references are renumbered); concurrent lookups to a shard share one message on
  its leader's lookup stream (:mod:`kvstore.client.fanout`). A read gets at most ``ATTEMPT_S``
  per try, so that a leader that hangs is left for the next one.
- Puts and leases that span shards get one id here, standing for the shards' own ids; a commit,
  abort or release is split back by it. A put whose shard changed leader meanwhile is unknown to
  the new one: its blocks there come back NOT_WRITTEN and the writer puts them again. One
  shard's refusal does not lose what the others did: their leases and reservations go back.
- A chain's blocks spread over shards, so "admit the chain in order" and "evict the tail first"
  hold within each shard's part of the chain.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import grpc
import numpy as np

from kvstore.client.fanout import Coalescer, leading, merge_locations
from kvstore.client.streams import LookupStream
from kvstore.cluster.coord import Coordinator
from kvstore.errors import InvalidArgument, NotFound, Timeout, Unavailable, from_rpc_error
from kvstore.keys import KEY_BYTES
from kvstore.rpc import GRPC_OPTIONS
from kvstore.tls import TlsConfig, aio_channel
from kvstore.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from kvstore.wire import U32, pack, unpack

log = logging.getLogger("kvstore.client")

_RETRY_S = 0.1
# Per try of a call that may be sent again (reads): about a leader lease, so that a leader that
# hangs is left for the next one in time.
ATTEMPT_S = 2.0
_IDEMPOTENT = frozenset({"Lookup", "Acquire", "Touch", "Stats", "Release", "Remove"})
# Multi-shard puts and leases remembered at most this long (their deadlines are shorter).
_FORGET_S = 900.0


def cluster_url(meta: str) -> tuple[str, str] | None:
    """``(redis URL, cluster name)`` when ``client.meta`` names a cluster
    (``redis://host:port[/db][#name]`` or ``sentinel://host:port,.../master[/db][#name]``)."""
    if not meta.startswith(("redis://", "sentinel://")):
        return None
    url, _, name = meta.partition("#")
    return url, name or "kvstore"


class ShardedMeta:
    """Stands in for ``MetaServiceStub`` over the shards of a cluster (see the module text)."""

    def __init__(self, url: str, cluster: str, tls: TlsConfig | None, token: str, timeout_s: float) -> None:
        self.coord = Coordinator(url, cluster, timeout_s=min(1.0, timeout_s))
        self.tls = tls
        self.token = token
        self.timeout_s = timeout_s
        self.smap = None
        self._stubs: dict[int, tuple[str, grpc.aio.Channel, meta_pb2_grpc.MetaServiceStub]] = {}
        self._ids = itertools.count(1)
        # Spanning puts and leases: our id -> (created, [(shard, its id, global rows)]).
        self._puts: dict[int, tuple[float, list[tuple[int, int, np.ndarray]]]] = {}
        # Our lease id -> (when, (the chain's hit count, [(shard, its lease id, the run positions it holds)])).
        self._leases: dict[int, tuple[float, tuple[int, list[tuple[int, int, np.ndarray]]]]] = {}
        self._lookups: dict[int, Coalescer] = {}
        self._streams: dict[int, tuple[Any, LookupStream]] = {}
        self._redis_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._refreshed = 0.0

    # ---- routing ------------------------------------------------------------------------------

    async def _map(self):  # noqa: ANN202
        if self.smap is None:
            async with self._redis_lock:  # one read for all the calls that need it at once
                if self.smap is None:
                    self.smap = await self.coord.slot_map()
        return self.smap

    async def _refresh(self) -> None:
        """Every shard's leader read again from Redis: once for all the calls that ask at once."""
        smap = await self._map()
        async with self._redis_lock:
            if time.monotonic() - self._refreshed < _RETRY_S / 2:
                return
            try:
                leaders = await self.coord.leaders(smap.shards)
            except Unavailable:
                leaders = [None] * smap.shards
            for shard, leader in enumerate(leaders):
                cached = self._stubs.get(shard)
                if leader is None:
                    continue
                if cached is None or cached[0] != leader.addr:
                    if cached is not None:  # calls still on it may finish
                        self._later(cached[1].close(grace=self.timeout_s))
                    ch = aio_channel(leader.addr, self.tls, GRPC_OPTIONS, token=self.token)
                    self._stubs[shard] = (leader.addr, ch, meta_pb2_grpc.MetaServiceStub(ch))
            self._refreshed = time.monotonic()

    async def _stub(self, shard: int, fresh: bool) -> meta_pb2_grpc.MetaServiceStub | None:
        if fresh or shard not in self._stubs:
            await self._refresh()
        cached = self._stubs.get(shard)
        return cached[2] if cached is not None else None

    async def call(self, shard: int, method: str, request: Any, timeout: float | None = None) -> Any:
        """One shard's answer, its leader looked up again (and the call sent again) while the
        shard is unavailable, until ``timeout``. A call that may be sent twice (a read) gets at
        most ``ATTEMPT_S`` per try, so that a leader that hangs (paused, cut off) costs a retry
        at the next leader, not the whole deadline. Errors are kvstore.errors classes."""
        deadline = time.monotonic() + (timeout or self.timeout_s)
        fresh = False
        again = method in _IDEMPOTENT
        while True:
            stub = await self._stub(shard, fresh)
            left = deadline - time.monotonic()
            why = f"shard {shard} has no leader"
            if stub is not None and left > 0:
                try:
                    return await getattr(stub, method)(request, timeout=min(left, ATTEMPT_S) if again else left)
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                    retry = code == grpc.StatusCode.UNAVAILABLE or (
                        again and code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline - time.monotonic() > _RETRY_S
                    )
                    if not retry:
                        raise from_rpc_error(e) from None
                    why = e.details() or code.name
                except asyncio.CancelledError:
                    # The call's channel was closed under it (its shard has a new leader), not
                    # this task cancelled: try again at the new one.
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise
                    why = "the shard's leader changed during the call"
            if time.monotonic() + _RETRY_S >= deadline:
                raise Unavailable(f"{method}: metadata shard {shard}: {why}")
            fresh = True
            await asyncio.sleep(_RETRY_S)

    async def _gather(self, method: str, reqs: list[tuple[int, Any]], timeout: float | None) -> list[Any]:
        """Each shard's answer or its error (every call runs to its end: one shard's error
        must not lose what the others did)."""
        return list(await asyncio.gather(*(self.call(s, method, r, timeout) for s, r in reqs), return_exceptions=True))

    async def _fan(self, method: str, requests: dict[int, Any], timeout: float | None) -> dict[int, Any]:
        """Each shard's answer; the first error once all have ended (for calls whose partial
        effects need no undoing)."""
        shards = list(requests)
        answers = await self._gather(method, [(s, requests[s]) for s in shards], timeout)
        for a in answers:
            if isinstance(a, BaseException):
                raise a
        return dict(zip(shards, answers))

    def _later(self, coro: Any) -> None:
        """Runs ``coro`` in the background (kept until it ends; ``close`` waits for it)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release_later(self, leases: list[tuple[int, int, int]]) -> None:
        """Gives back (shard, lease id, run length) leases of which nothing was read: the
        shard counts their runs as misses."""
        if leases:
            reqs = [(s, meta_pb2.ReleaseRequest(lease_id=lid, unread=n)) for s, lid, n in leases]
            self._later(self._gather("Release", reqs, None))

    async def _split(self, packed: bytes) -> dict[int, np.ndarray]:
        return (await self._map()).split(packed)

    @staticmethod
    def _sub(packed: bytes, pos: np.ndarray) -> bytes:
        n = len(packed) // KEY_BYTES
        if len(pos) == n:
            return packed
        return np.frombuffer(packed, dtype=np.uint8).reshape(n, KEY_BYTES)[pos].tobytes()

    def _remember(self, table: dict, parts: list) -> int:
        now = time.monotonic()
        if len(table) > 4096:
            for k in [k for k, (t, _) in table.items() if now - t > _FORGET_S]:
                del table[k]
        key = next(self._ids)
        table[key] = (now, parts)
        return key

    # ---- reads --------------------------------------------------------------------------------

    async def _chain(self, method: str, request: Any, make: Any, timeout: float | None, located: bool = True) -> tuple:
        """Sends ``make(keys)`` for each shard's part of ``request.keys``; returns (the split, the
        answers, the merged leading hit count, the merged locations of the hits or None). If a
        shard fails, the leases the others took are given back before its error is raised."""
        n = len(request.keys) // KEY_BYTES
        split = await self._split(request.keys)
        shards = list(split)
        res = await self._gather(method, [(s, make(self._sub(request.keys, split[s]))) for s in shards], timeout)
        answers = {s: a for s, a in zip(shards, res) if not isinstance(a, BaseException)}
        errors = [a for a in res if isinstance(a, BaseException)]
        if errors:
            self._release_later([(s, a.lease_id, a.hit_count) for s, a in answers.items() if getattr(a, "lease_id", 0)])
            raise errors[0]
        hit = min((leading(split[s], a.hit_count, n) for s, a in answers.items()), default=0)
        locations = None
        if hit and located:
            parts = [(a.locations, [int(p) for p in split[s][: a.hit_count] if p < hit]) for s, a in answers.items()]
            locations = merge_locations(parts, hit, request.keys)
        return split, answers, hit, locations

    async def Lookup(self, request: meta_pb2.LookupRequest, timeout: float | None = None) -> meta_pb2.LookupResponse:
        if not request.with_locations and not request.per_tier:
            return await self._coalesced(request, timeout)
        split, answers, hit, locations = await self._chain(
            "Lookup",
            request,
            lambda keys: meta_pb2.LookupRequest(
                keys=keys, per_key=request.per_key, with_locations=request.with_locations, per_tier=request.per_tier
            ),
            timeout,
            request.with_locations,
        )
        n = len(request.keys) // KEY_BYTES
        out = meta_pb2.LookupResponse(hit_count=hit)
        if request.per_key:
            exists = np.zeros(n, dtype=np.uint8)
            for s, a in answers.items():
                exists[split[s]] = np.frombuffer(a.exists, dtype=np.uint8)
            out.exists = exists.tobytes()
        if request.per_tier:  # per-key answers put back in key order; an engine's from every shard
            tiers = np.zeros(n, dtype=np.uint8)
            engines: dict[str, tuple[str, np.ndarray]] = {}
            for s, a in answers.items():
                tiers[split[s]] = np.frombuffer(a.tiers, dtype=np.uint8)
                for e in a.engines:
                    row = engines.setdefault(e.engine_id, (e.url, np.zeros(n, dtype=np.uint8)))[1]
                    row[split[s]] = np.frombuffer(e.held, dtype=np.uint8)
            out.tiers = tiers.tobytes()
            for eid, (url, held) in engines.items():
                out.engines.add(engine_id=eid, url=url, held=held.tobytes())
        if request.with_locations and locations is not None:
            out.locations.CopyFrom(locations)
        return out

    async def _coalesced(self, request: meta_pb2.LookupRequest, timeout: float | None) -> meta_pb2.LookupResponse:
        """A lookup through each shard's :class:`Coalescer`: the per-key answers of the shards,
        and the leading hit count as their first miss."""
        n = len(request.keys) // KEY_BYTES
        split = await self._split(request.keys)
        shards = list(split)
        answers = await asyncio.gather(
            *(self._coalescer(s).exists(self._sub(request.keys, split[s]), timeout) for s in shards)
        )
        exists = np.zeros(n, dtype=np.uint8)
        for s, bits in zip(shards, answers):
            exists[split[s]] = bits
        misses = np.flatnonzero(exists == 0)
        out = meta_pb2.LookupResponse(hit_count=int(misses[0]) if len(misses) else n)
        if request.per_key:
            out.exists = exists.tobytes()
        return out

    async def lookup_on_stream(
        self, shard: int, request: meta_pb2.LookupRequest, timeout: float | None
    ) -> meta_pb2.LookupResponse:
        """A lookup on the shard leader's lookup stream (kvstore.client.streams: a stream pays a
        call's set-up once, a unary call every time), or a unary call (with the failover
        retries of :meth:`call`) when the stream cannot answer within ``ATTEMPT_S``."""
        stub = await self._stub(shard, False)
        if stub is None:
            return await self.call(shard, "Lookup", request, timeout)
        cur = self._streams.get(shard)
        if cur is None or cur[0] is not stub:
            if cur is not None:  # the shard has a new leader: its waiting callers are asked again
                self._later(cur[1].close())
            unary = lambda r: self.call(shard, "Lookup", r, None)  # noqa: E731
            cur = self._streams[shard] = (stub, LookupStream(stub, unary, ATTEMPT_S))
        try:
            return await cur[1].ask(request)
        except Unavailable:  # no answer in time (a hung leader), or the client closing
            return await self.call(shard, "Lookup", request, timeout)

    def _coalescer(self, shard: int) -> Coalescer:
        c = self._lookups.get(shard)
        if c is None:
            c = self._lookups[shard] = Coalescer(self, shard)
        return c

    async def Acquire(self, request: meta_pb2.AcquireRequest, timeout: float | None = None) -> meta_pb2.AcquireResponse:
        split, answers, hit, locations = await self._chain(
            "Acquire",
            request,
            lambda keys: meta_pb2.AcquireRequest(keys=keys, ttl_ms=request.ttl_ms, host_id=request.host_id),
            timeout,
        )
        leases, idle = [], []
        for s, a in answers.items():
            rows = split[s][: a.hit_count]
            if a.lease_id:
                # A shard whose hits all lie past the chain's first miss holds nothing the
                # reader will copy: its lease goes back now (the reader releases only ours).
                (leases if len(rows) and rows[0] < hit else idle).append((s, a.lease_id, rows))
        self._release_later([(s, lid, len(rows)) for s, lid, rows in idle])
        out = meta_pb2.AcquireResponse(hit_count=hit, ttl_ms=min((a.ttl_ms for a in answers.values()), default=0))
        if leases:
            out.lease_id = self._remember(self._leases, (hit, leases))
        if locations is not None:
            out.locations.CopyFrom(locations)
        return out

    async def Release(self, request: meta_pb2.ReleaseRequest, timeout: float | None = None) -> meta_pb2.ReleaseResponse:
        entry = self._leases.pop(request.lease_id, None)
        if entry is None:
            return meta_pb2.ReleaseResponse(released=False)
        corrupt = set(unpack(request.corrupt, U32, "corrupt"))
        hit, parts = entry[1]
        # Each shard's unread blocks: those past the chain's loaded run (its hits past the chain's
        # first miss among them).
        loaded = hit - min(request.unread, hit)
        reqs = {}
        for s, lease_id, rows in parts:
            local = [j for j, g in enumerate(rows) if int(g) in corrupt]
            reqs[s] = meta_pb2.ReleaseRequest(
                lease_id=lease_id,
                corrupt=pack(local, U32),
                unread=int(np.count_nonzero(rows >= loaded)),
                asked_again=request.asked_again,
            )
        answers = await self._gather("Release", list(reqs.items()), timeout)
        return meta_pb2.ReleaseResponse(released=all(not isinstance(a, BaseException) and a.released for a in answers))

    async def Touch(self, request: meta_pb2.TouchRequest, timeout: float | None = None) -> meta_pb2.TouchResponse:
        per: dict[int, list[bytes]] = {}
        tiers: dict[int, list[bytes]] = {}
        read_on = np.frombuffer(request.tiers, dtype=np.uint8)
        at = 0
        for chain in request.chains:
            n = len(chain) // KEY_BYTES
            for s, pos in (await self._split(chain)).items():
                per.setdefault(s, []).append(self._sub(chain, pos))
                if len(read_on):
                    tiers.setdefault(s, []).append(read_on[at : at + n][pos].tobytes())
            at += n
        reqs = {
            s: meta_pb2.TouchRequest(chains=c, interval_ms=request.interval_ms, tiers=b"".join(tiers.get(s, ())))
            for s, c in per.items()
        }
        answers = await self._fan("Touch", reqs, timeout)
        return meta_pb2.TouchResponse(stored=sum(a.stored for a in answers.values()))

    # ---- writes -------------------------------------------------------------------------------

    async def PutStart(
        self, request: meta_pb2.PutStartRequest, timeout: float | None = None
    ) -> meta_pb2.PutStartResponse:
        n = len(request.keys) // KEY_BYTES
        sizes = np.frombuffer(request.sizes, dtype="<u8")
        split = await self._split(request.keys)
        reqs = {
            s: meta_pb2.PutStartRequest(
                keys=self._sub(request.keys, pos),
                sizes=sizes[pos].tobytes() if len(sizes) == n else request.sizes,
                chain=request.chain,
                host_id=request.host_id,
                timeout_ms=request.timeout_ms,
                exclude_daemons=request.exclude_daemons,
            )
            for s, pos in split.items()
        }
        answers = await self._gather("PutStart", list(reqs.items()), timeout)
        hard = [a for a in answers if isinstance(a, BaseException) and not isinstance(a, (Unavailable, Timeout))]
        if hard:  # refused (bad input, no quota...): the other shards' reservations go back
            self._later(
                self._gather(
                    "PutAbort",
                    [(s, meta_pb2.PutAbortRequest(put_id=a.put_id)) for (s, _r), a in zip(reqs.items(), answers)
                     if not isinstance(a, BaseException) and a.put_id],
                    None,
                )
            )  # fmt: skip
            raise hard[0]
        status = np.full(n, 3, dtype=np.uint8)  # a shard that could not be reached: no space there
        puts, started = [], []
        for (s, _r), a in zip(reqs.items(), answers):
            if isinstance(a, BaseException):
                log.info("event=shard_call_failed shard=%d method=PutStart reason=%r", s, str(a))
                continue
            local = np.frombuffer(a.status, dtype=np.uint8)
            status[split[s]] = local
            started.append((s, a))
        alloc_pos = np.flatnonzero(status == 0)
        order = {int(p): k for k, p in enumerate(alloc_pos)}  # global key -> placement row
        parts = []
        for s, a in started:
            local = np.frombuffer(a.status, dtype=np.uint8)
            mine = split[s][local == 0]
            rows = np.asarray([order[int(p)] for p in mine], dtype=np.int64)
            if a.put_id:
                puts.append((s, a.put_id, rows))
            parts.append((a.placements, rows.tolist()))
        out = meta_pb2.PutStartResponse(
            status=status.tobytes(),
            deadline_unix_ms=min((a.deadline_unix_ms for _s, a in started if a.deadline_unix_ms), default=0),
        )
        if puts:
            out.put_id = self._remember(self._puts, puts)
        if len(alloc_pos):
            asked = self._sub(request.keys, alloc_pos)
            out.placements.CopyFrom(merge_locations(parts, len(alloc_pos), asked))
        if not started and reqs:
            raise Unavailable("put: no metadata shard of its keys could be reached")
        return out

    async def PutCommit(
        self, request: meta_pb2.PutCommitRequest, timeout: float | None = None
    ) -> meta_pb2.PutCommitResponse:
        entry = self._puts.get(request.put_id)
        if entry is None:
            raise NotFound(f"put {request.put_id} is unknown (already ended)")
        parts = entry[1]
        total = sum(len(rows) for _s, _p, rows in parts)
        sums = np.frombuffer(request.checksums, dtype="<u8") if len(request.checksums) % 8 == 0 else ()
        written = np.frombuffer(request.written, dtype=np.uint8)
        if len(sums) != total or len(written) != total:
            raise InvalidArgument(
                f"put {request.put_id}: {len(sums)} checksums and {len(written)} written flags for {total} placements"
            )
        del self._puts[request.put_id]
        reqs = [
            (
                s,
                meta_pb2.PutCommitRequest(
                    put_id=put_id, checksums=sums[rows].tobytes(), written=written[rows].tobytes()
                ),
            )
            for s, put_id, rows in parts
        ]
        answers = await self._gather("PutCommit", reqs, timeout)
        # A shard that failed the commit (it lost the put to a new leader, or did not answer)
        # stored none of its blocks that the writer can count on: NOT_WRITTEN, so that the writer
        # puts them again (a block that did commit is then skipped as stored) without holding it
        # against their daemon.
        status = np.full(total, common_pb2.COMMIT_NOT_WRITTEN, dtype=np.uint8)
        committed = 0
        # Its reservation goes back now (as a single service's does, kvstore.client.writes), or
        # the retry would be told its blocks are being written (skipped) by the put it gave up;
        # a shard that began the commit no longer holds the put, and the abort changes nothing.
        failed = [
            (s, meta_pb2.PutAbortRequest(put_id=p))
            for (s, p, _r), a in zip(parts, answers)
            if isinstance(a, BaseException)
        ]
        if failed:
            self._later(self._gather("PutAbort", failed, None))
        for (s, _p, rows), a in zip(parts, answers):
            if isinstance(a, BaseException):
                log.info("event=shard_call_failed shard=%d method=PutCommit reason=%r", s, str(a))
                continue
            committed += a.committed
            status[rows] = np.frombuffer(a.status, dtype=np.uint8) if a.status else common_pb2.COMMIT_OK
        return meta_pb2.PutCommitResponse(committed=committed, status=status.tobytes())

    async def PutAbort(
        self, request: meta_pb2.PutAbortRequest, timeout: float | None = None
    ) -> meta_pb2.PutAbortResponse:
        entry = self._puts.pop(request.put_id, None)
        if entry is None:
            return meta_pb2.PutAbortResponse()
        answers = await self._gather(
            "PutAbort", [(s, meta_pb2.PutAbortRequest(put_id=p)) for s, p, _rows in entry[1]], timeout
        )
        return meta_pb2.PutAbortResponse(released=sum(a.released for a in answers if not isinstance(a, BaseException)))

    # ---- management ---------------------------------------------------------------------------

    async def _keys_call(
        self, method: str, request: meta_pb2.KeysRequest, timeout: float | None
    ) -> meta_pb2.CountResponse:
        split = await self._split(request.keys)
        reqs = {
            s: meta_pb2.KeysRequest(keys=self._sub(request.keys, pos), tenant=request.tenant)
            for s, pos in split.items()
        }
        answers = await self._fan(method, reqs, timeout) if reqs else {}
        return meta_pb2.CountResponse(count=sum(a.count for a in answers.values()))

    async def ReportEngineBlocks(
        self, request: meta_pb2.ReportEngineBlocksRequest, timeout: float | None = None
    ) -> meta_pb2.ReportEngineBlocksResponse:
        """Every shard gets the report (so that each keeps the engine's holdings alive), with the
        added and removed keys it owns."""
        smap = await self._map()
        added = smap.split(request.added) if request.added else {}
        removed = smap.split(request.removed) if request.removed else {}
        reqs = {}
        for s in range(smap.shards):
            r = meta_pb2.ReportEngineBlocksRequest()
            r.CopyFrom(request)
            r.added = self._sub(request.added, added[s]) if s in added else b""
            r.removed = self._sub(request.removed, removed[s]) if s in removed else b""
            reqs[s] = r
        answers = await self._fan("ReportEngineBlocks", reqs, timeout)
        ttl = min((a.ttl_ms for a in answers.values()), default=request.ttl_ms)
        return meta_pb2.ReportEngineBlocksResponse(held=sum(a.held for a in answers.values()), ttl_ms=ttl)

    async def Remove(self, request: meta_pb2.KeysRequest, timeout: float | None = None) -> meta_pb2.CountResponse:
        return await self._keys_call("Remove", request, timeout)

    async def Pin(self, request: meta_pb2.KeysRequest, timeout: float | None = None) -> meta_pb2.CountResponse:
        return await self._keys_call("Pin", request, timeout)

    async def Unpin(self, request: meta_pb2.KeysRequest, timeout: float | None = None) -> meta_pb2.CountResponse:
        return await self._keys_call("Unpin", request, timeout)

    async def shard_stats(self, timeout: float | None = None) -> dict[int, meta_pb2.StatsResponse | None]:
        smap = await self._map()
        reqs = [(s, meta_pb2.StatsRequest()) for s in range(smap.shards)]
        answers = await self._gather("Stats", reqs, timeout)
        return {s: None if isinstance(a, BaseException) else a for s, a in zip(range(smap.shards), answers)}

    async def Stats(self, request: meta_pb2.StatsRequest, timeout: float | None = None) -> meta_pb2.StatsResponse:
        """The shards' stats added up: a daemon once, a segment's arenas as one segment."""
        per = await self.shard_stats(timeout)
        if any(a is None for a in per.values()):
            missing = [s for s, a in per.items() if a is None]
            raise Unavailable(f"stats: metadata shards {missing} could not be reached")
        out = meta_pb2.StatsResponse()
        daemons, segments = {}, {}
        for a in per.values():
            for d in a.daemons:
                seen = daemons.get(d.info.daemon_id)
                if seen is None or (d.alive and not seen.alive):
                    daemons[d.info.daemon_id] = d
            for seg in a.segments:
                k = (seg.daemon_id, seg.segment_id)
                if k not in segments:
                    segments[k] = meta_pb2.SegmentStats()
                    segments[k].CopyFrom(seg)
                    continue
                acc = segments[k]
                for f in ("capacity_bytes", "used_bytes", "blocks", "pinned_blocks", "leased_blocks"):
                    setattr(acc, f, getattr(acc, f) + getattr(seg, f))
            for name, v in a.counters.items():
                out.counters[name] = out.counters.get(name, 0) + v
            out.keys += a.keys
            out.pending_puts += a.pending_puts
            out.active_leases += a.active_leases
            out.touch_interval_ms = max(out.touch_interval_ms, a.touch_interval_ms)
        out.daemons.extend(daemons.values())
        out.segments.extend(segments.values())
        return out

    async def state(self) -> dict:
        smap = await self._map()
        leaders = await self.coord.leaders(smap.shards)
        per = await self.shard_stats(min(self.timeout_s, 3.0))
        slots = np.bincount(smap.owners, minlength=smap.shards)
        shards = []
        for k in range(smap.shards):
            lead, st = leaders[k], per.get(k)
            row: dict = {"shard": k, "slots": int(slots[k])}
            if lead is not None:
                row.update(leader=lead.node, addr=lead.addr, epoch=lead.epoch)
            if st is not None:
                row.update(keys=st.keys, daemons=sum(1 for d in st.daemons if d.alive))
            shards.append(row)
        return {
            "name": self.coord.prefix,
            "redis": self.coord.url,
            "shards": shards,
            "members": await self.coord.members(),
        }

    async def AdvanceClock(self, request: meta_pb2.AdvanceClockRequest, timeout: float | None = None) -> Any:
        smap = await self._map()
        answers = await self._fan("AdvanceClock", dict.fromkeys(range(smap.shards), request), timeout)
        return answers[0]

    async def close(self) -> None:
        for _stub, stream in self._streams.values():
            await stream.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for _addr, ch, _stub in self._stubs.values():
            await ch.close()
        self._stubs.clear()
        await self.coord.close()
