"""The metadata service's calls to daemons: commits, tombstones, tier moves.

The index (:mod:`kvstore.meta.index`) decides; this module carries its decisions to the daemons
and feeds their answers back, so that what a daemon holds and what the index says agree at
every point a client can observe:

- **Commit**: a put becomes visible only after its daemon wrote the block's sealed header
  (DRAM) or journal record (SSD). A daemon that does not answer in time leaves its blocks
  uncommitted (released, never visible).
- **Tombstones**: a committed block dropped from the index is dropped on its daemon before the
  call that dropped it is answered (:meth:`DaemonLink.flush`). Tombstones a daemon could not
  take then go out with its heartbeats until it acknowledges them.
- **Moves**: demotions and promotions, each daemon's batch on its own (one slow daemon does not
  hold up the others' tier moves).

A daemon running in the service's own process (``kvstore serve``) is called directly
(:meth:`DaemonLink.attach_local`), the same requests without the gRPC round trip.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable

import grpc
import numpy as np

from kvstore import tickets
from kvstore.errors import KVStoreError, Unavailable
from kvstore.meta.api import IndexApi
from kvstore.meta.records import CommitStatus, PendingCommit, Tombstone
from kvstore.meta.tiers import Move
from kvstore.rpc import GRPC_OPTIONS
from kvstore.tls import TlsConfig, aio_channel
from kvstore.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc
from kvstore.wire import U8, U32, U64, pack, unpack

log = logging.getLogger("kvstore.meta")


def invalidations_pb(items: Iterable[Tombstone]) -> list[common_pb2.Invalidation]:
    by_seg: dict[int, list[Tombstone]] = {}
    for t in items:
        by_seg.setdefault(t.segment_id, []).append(t)
    return [
        common_pb2.Invalidation(
            segment_id=seg,
            keys=b"".join(t.key for t in ts),
            offset=pack([t.offset for t in ts], U64),
            gen=pack([t.gen for t in ts], U64),
        )
        for seg, ts in by_seg.items()
    ]


_FAILED = (grpc.aio.AioRpcError, KVStoreError, OSError, asyncio.CancelledError)


def _failed(e: BaseException) -> str:
    """Why a call to a daemon failed, for a log line; re-raises a CancelledError that cancels
    this task (service shutdown). Any other CancelledError is the call's own: its channel was
    closed under it (the daemon was forgotten meanwhile), and the call failed like any other,
    so that what it carried (tombstones, a commit) is accounted as not delivered."""
    if isinstance(e, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise e
        return "CANCELLED (channel closed)"
    return e.code().name if isinstance(e, grpc.aio.AioRpcError) else str(e)


class _LocalDaemon:
    """A daemon in this process, called through its own control servicer with the stub's call
    shape (``await local.Commit(request, timeout=...)``)."""

    def __init__(self, daemon) -> None:  # noqa: ANN001 - kvstore.daemon.server.CacheDaemon
        self.d = daemon

    def __getattr__(self, method: str):  # noqa: ANN204
        handler = getattr(self.d.control, method)

        async def call(request, timeout=None, metadata=()):  # noqa: ANN001, ANN202
            if self.d.stopping:
                raise Unavailable(f"daemon {self.d.daemon_id} is stopping")
            return await handler(request, None)

        return call


class DaemonLink:
    """Per-daemon control channels of one metadata service, and what travels over them."""

    def __init__(
        self,
        index: IndexApi,
        rpc_timeout_s: float = 5.0,
        move_timeout_s: float = 120.0,
        tls: TlsConfig | None = None,
        epoch: int = 0,
    ) -> None:
        self.tls = tls
        # Every control call carries the shard and its leader epoch: a daemon refuses those of a
        # leader older than the one it registered with (kvstore.cluster).
        self.shard = index.limits.shard
        self.epoch = epoch
        # Asked before every call to a daemon (kvstore.meta.service.MetaServer's gate): a shard
        # whose lease ran out calls no daemon (the daemon would refuse its epoch anyway).
        self.gate: Callable[[], str] | None = None
        self.index = index
        self.rpc_timeout_s = rpc_timeout_s
        self.move_timeout_s = move_timeout_s
        self._stubs: dict[str, tuple[str, grpc.aio.Channel, daemon_pb2_grpc.DaemonControlStub]] = {}
        self._move_failing: set[str] = set()
        self._invalidate_failing: set[str] = set()
        # Tombstones sent with heartbeats, per daemon: (batch id, items), until acknowledged.
        self._inflight: dict[str, tuple[int, list[Tombstone]]] = {}
        # Tombstones a flush has taken, per daemon: batch id -> items, until its calls end (or
        # the flush is cancelled: then they go back to the index).
        self._flushing: dict[str, dict[int, list[Tombstone]]] = {}
        self._batches = itertools.count(1)
        self._local: dict[str, _LocalDaemon] = {}

    def attach_local(self, daemon_id: str, daemon: object) -> None:
        """Calls ``daemon`` (a :class:`kvstore.daemon.server.CacheDaemon` in this process)
        directly instead of through its control API."""
        self._local[daemon_id] = _LocalDaemon(daemon)

    def _stub(self, daemon_id: str) -> daemon_pb2_grpc.DaemonControlStub | _LocalDaemon | None:
        d = self.index.daemons.get(daemon_id)
        if d is None or (self.gate is not None and self.gate()):
            return None
        local = self._local.get(daemon_id)
        if local is not None:
            return local
        addr = d.spec.control_addr
        cached = self._stubs.get(daemon_id)
        if cached is None or cached[0] != addr:
            if cached is not None:
                asyncio.ensure_future(cached[1].close())
            ch = aio_channel(addr, self.tls, GRPC_OPTIONS)
            cached = self._stubs[daemon_id] = (addr, ch, daemon_pb2_grpc.DaemonControlStub(ch))
        return cached[2]

    def _registration(self, daemon_id: str) -> int:
        """The daemon's registration as the index knows it now, for calls that hold for any
        registration (tombstones: applying one twice is harmless, and those of an earlier one
        are handed to the new one). A call planned on the index's blocks carries the number of
        the registration its blocks belong to instead (each registration is a new Daemon):
        once the daemon has registered again the index has ended those, their extents may be
        another block's, and the daemon refuses the call."""
        d = self.index.daemons.get(daemon_id)
        return d.spec.registration if d is not None else 0

    def _signed(self, daemon_id: str, method: str, request) -> tuple[tuple[str, str], ...]:  # noqa: ANN001
        """Metadata that signs a control call with the daemon's ticket key, so that a daemon
        without mutual TLS obeys this service alone (:func:`kvstore.tickets.sign_control`);
        none where this service hands out no tickets, or for a daemon in this process."""
        d = self.index.daemons.get(daemon_id)
        if d is None or not d.spec.ticket_key or daemon_id in self._local:
            return ()
        body = request.SerializeToString(deterministic=True)
        return tickets.sign_control(d.spec.ticket_key, method, self.shard, body)

    # ---- commits ----------------------------------------------------------------------------

    async def commit(self, pc: PendingCommit) -> dict[int, tuple[int, int]]:
        """Has each daemon commit its blocks of the put. Returns, per placement index, the
        daemon's (CommitStatus, stored extent bytes)."""
        p = pc.places
        groups: dict[str, list[int]] = {}  # daemon id -> segment refs
        for ref, seg in p.segments.items():
            groups.setdefault(seg.daemon.spec.daemon_id, []).append(ref)
        results = await asyncio.gather(
            *(self._commit_one(did, np.flatnonzero(np.isin(p.refs, refs)), pc) for did, refs in groups.items())
        )
        out: dict[int, tuple[int, int]] = {}
        for r in results:
            out.update(r)
        return out

    async def _commit_one(self, daemon_id: str, mine: np.ndarray, pc: PendingCommit) -> dict[int, tuple[int, int]]:
        """The blocks at ``mine`` (positions in ``pc.places``) committed by their daemon, in
        one call, its columns packed whole."""
        p = pc.places
        index = p.index[mine].tolist()
        unavailable = {i: (int(CommitStatus.UNAVAILABLE), 0) for i in index}
        stub = self._stub(daemon_id)
        if stub is None or not index:
            return unavailable
        segs = p.segments
        seg_ids = np.array([segs[ref].spec.segment_id for ref in p.refs[mine].tolist()], dtype="<u4")
        keys = np.frombuffer(p.keys, dtype="V16")[mine].tobytes()
        req = daemon_pb2.CommitRequest(
            shard=self.shard,
            epoch=self.epoch,
            # The registration the blocks were placed on (not the one the index knows by now).
            registration=segs[int(p.refs[mine[0]])].daemon.spec.registration,
            keys=keys,
            segment=seg_ids.tobytes(),
            offset=p.offset[mine].astype("<u8").tobytes(),
            length=p.length[mine].astype("<u8").tobytes(),
            checksum=np.array(pc.checksums, dtype="<u8")[p.index[mine]].tobytes(),
            gen=p.gen[mine].astype("<u8").tobytes(),
        )
        try:
            resp = await stub.Commit(req, timeout=self.rpc_timeout_s, metadata=self._signed(daemon_id, "Commit", req))
            status = unpack(resp.status, U8, "status", len(index))
            stored = unpack(resp.stored_size, U64, "stored_size", len(index))
        except _FAILED as e:
            reason = _failed(e)
            log.warning("event=commit_failed daemon=%s blocks=%d reason=%s", daemon_id, len(index), reason)
            return unavailable
        return unavailable | {i: (st, sz) for i, st, sz in zip(index, status, stored)}

    # ---- tombstones -------------------------------------------------------------------------

    def mark(self) -> dict[str, int]:
        """How many tombstones each daemon has pending now (see :meth:`flush`'s ``since``)."""
        return {d: len(v) for d, v in self.index.tombstones.items()}

    async def flush(self, since: dict[str, int] | None = None) -> set[str]:
        """Delivers pending tombstones and waits for the daemons to apply them. With ``since``
        (a :meth:`mark` taken before an index call), only the daemons that call gave new
        tombstones are contacted, so that one unreachable daemon does not hold up calls that
        never touched it (the background rounds retry it). Returns the daemons that did not
        apply theirs; those are kept for the next round and the daemon's heartbeats."""
        ids = None
        if since is not None:
            ids = [d for d, v in self.index.tombstones.items() if len(v) > since.get(d, 0)]
            if not ids:
                return set()
        taken = self.index.take_tombstones(ids)
        if not taken:
            return set()
        # Known as in flight meanwhile: a daemon registering again before the call ends must
        # have its inventory filtered by them too (requeue), or it would bring back blocks that
        # the late tombstones then drop under the index's feet.
        batches = {}
        for did, items in taken.items():
            batches[did] = b = next(self._batches)
            self._flushing.setdefault(did, {})[b] = items
        try:
            results = await asyncio.gather(*(self._invalidate(did, items) for did, items in taken.items()))
        except BaseException:  # cancelled (the handler's caller went away): nothing is known applied
            results = [False] * len(taken)
            raise
        finally:
            failed = set()
            for (did, items), ok in zip(taken.items(), results):
                mine = self._flushing.get(did, {})
                mine_now = mine.pop(batches[did], None) is not None
                if not mine:
                    self._flushing.pop(did, None)
                if not ok:
                    failed.add(did)
                    if mine_now:  # else requeued meanwhile: back with the index already
                        self.index.return_tombstones(did, items)
        return failed

    async def _invalidate(self, daemon_id: str, items: list[Tombstone]) -> bool:
        stub = self._stub(daemon_id)
        if stub is None:
            return False
        try:
            req = daemon_pb2.InvalidateRequest(
                shard=self.shard,
                epoch=self.epoch,
                registration=self._registration(daemon_id),
                invalidations=invalidations_pb(items),
            )
            await stub.Invalidate(req, timeout=self.rpc_timeout_s, metadata=self._signed(daemon_id, "Invalidate", req))
        except _FAILED as e:
            reason = _failed(e)
            # Once per outage: every round retries until the daemon answers or its lease lapses.
            level = logging.DEBUG if daemon_id in self._invalidate_failing else logging.WARNING
            self._invalidate_failing.add(daemon_id)
            log.log(
                level, "event=invalidate_failed daemon=%s blocks=%d reason=%s action=retry_with_heartbeat",
                daemon_id, len(items), reason,
            )  # fmt: skip
            return False
        self._invalidate_failing.discard(daemon_id)
        return True

    def heartbeat_batch(self, daemon_id: str, acked: int) -> tuple[int, list[Tombstone]]:
        """The tombstones to send with a heartbeat answer: the batch in flight until the daemon
        acknowledges it, then the next one."""
        cur = self._inflight.get(daemon_id)
        if cur is not None and cur[0] == acked:
            del self._inflight[daemon_id]
            cur = None
        if cur is None:
            items = self.index.take_tombstones([daemon_id]).get(daemon_id)
            if not items:
                return 0, []
            cur = self._inflight[daemon_id] = (next(self._batches), items)
        return cur

    def requeue(self, daemon_id: str) -> None:
        """Puts a daemon's tombstones in flight (its unacknowledged heartbeat batch, and what
        flushes are delivering) back with its pending ones: it is registering again, so its
        inventory must be filtered by them, and they go out again (applying one twice is
        harmless: a daemon drops a block only if it is still that generation)."""
        cur = self._inflight.pop(daemon_id, None)
        if cur is not None:
            self.index.return_tombstones(daemon_id, cur[1])
        for items in self._flushing.pop(daemon_id, {}).values():
            self.index.return_tombstones(daemon_id, items)

    # ---- tier moves -------------------------------------------------------------------------

    async def run_moves(self, plans: dict[str, list[Move]]) -> None:
        """Carries out planned moves, each daemon's batch independently, and reports each
        outcome to the index."""
        await asyncio.gather(*(self._run_moves(did, moves) for did, moves in plans.items()))

    async def _run_moves(self, daemon_id: str, moves: list[Move]) -> None:
        # Only the moves the index still has: a daemon lost or registered again since they were
        # planned had them ended, and their targets may hold new blocks by now.
        moves = [mv for mv in moves if mv.move_id in self.index.moves]
        if not moves:
            return
        stub = self._stub(daemon_id)
        if stub is None:
            for mv in moves:
                self.index.finish_move(mv.move_id, False)
            return
        req = daemon_pb2.MoveRequest(
            shard=self.shard,
            epoch=self.epoch,
            registration=moves[0].src.segment.daemon.spec.registration,  # the one they were planned on
            keys=b"".join(mv.src.key for mv in moves),
            src_segment=pack([mv.src.segment.spec.segment_id for mv in moves], U32),
            src_offset=pack([mv.src.offset for mv in moves], U64),
            dst_segment=pack([mv.dst.segment.spec.segment_id for mv in moves], U32),
            dst_offset=pack([mv.dst.offset for mv in moves], U64),
            length=pack([mv.src.length for mv in moves], U64),
            checksum=pack([mv.src.checksum for mv in moves], U64),
            src_gen=pack([mv.src.gen for mv in moves], U64),
            dst_gen=pack([mv.dst.gen for mv in moves], U64),
        )
        try:
            resp = await stub.Move(req, timeout=self.move_timeout_s, metadata=self._signed(daemon_id, "Move", req))
            ok = unpack(resp.ok, U8, "ok", len(moves))
            stored = unpack(resp.stored_size, U64, "stored_size", len(moves))
        except _FAILED as e:
            reason = _failed(e)
            # Once per outage: the tier loop retries every tick until the daemon's lease lapses.
            level = logging.DEBUG if daemon_id in self._move_failing else logging.WARNING
            self._move_failing.add(daemon_id)
            log.log(level, "event=moves_failed daemon=%s count=%d reason=%s", daemon_id, len(moves), reason)
            ok, stored = [0] * len(moves), [0] * len(moves)
        else:
            self._move_failing.discard(daemon_id)
        for mv, good, size in zip(moves, ok, stored):
            self.index.finish_move(mv.move_id, bool(good), size)
        log.debug("event=moves daemon=%s count=%d ok=%d", daemon_id, len(moves), sum(ok))

    # ---- housekeeping -----------------------------------------------------------------------

    def forget(self, daemon_id: str) -> None:
        """Drops what this link keeps for a daemon that left the index (channel, failure
        state); its undelivered tombstones stay with the index for when it comes back."""
        cached = self._stubs.pop(daemon_id, None)
        if cached is not None:
            # Calls in flight end by their own deadlines (and count as failed), not cancelled.
            asyncio.ensure_future(cached[1].close(grace=self.move_timeout_s))
        self._move_failing.discard(daemon_id)
        self._invalidate_failing.discard(daemon_id)
        self.requeue(daemon_id)

    def prune(self) -> None:
        """Forgets the daemons that are no longer in the index (lease lapsed, drained)."""
        known = self.index.daemons
        gone = (set(self._stubs) | self._move_failing | self._invalidate_failing | set(self._inflight)) - set(known)
        for did in gone:
            self.forget(did)

    async def close(self) -> None:
        for _addr, ch, _stub in self._stubs.values():
            await ch.close()
        self._stubs.clear()
