"""Races between the metadata service's handlers and its index, driven through the real
servicer and daemon link with in-process daemons (only the daemons' control calls are stand-ins,
recording what the service asks of them): what a handler reads from the index before it awaits
must still be what it acts on after, whatever ran in between."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.errors import Unavailable
from kvstore.extent import ALIGN, HEADER_SIZE, SSD_ALIGN
from kvstore.keys import unpack_keys
from kvstore.meta.daemons import DaemonLink
from kvstore.meta.index import DaemonSpec, Index, IndexLimits, InventoryItem, SegmentSpec, Tier
from kvstore.meta.servicer import MetaServicer
from kvstore.v1 import common_pb2, daemon_pb2, meta_pb2
from kvstore.wire import U8, U64, pack, unpack

BLK = ALIGN - HEADER_SIZE
K = [bytes([i]) * 16 for i in range(1, 30)]


class Control:
    """A daemon's control calls: records commits and moves, and accepts them."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    async def Commit(self, req, ctx):  # noqa: ANN001, ANN201, N802
        keys = unpack_keys(req.keys)
        sums = unpack(req.checksum, U64, "checksum", len(keys))
        self.log += [("commit", self.name, k, c) for k, c in zip(keys, sums)]
        self.log.append(("commit_for", self.name, req.registration))
        return daemon_pb2.CommitResponse(status=pack([0] * len(keys), U8), stored_size=pack([0] * len(keys), U64))

    async def Move(self, req, ctx):  # noqa: ANN001, ANN201, N802
        keys = unpack_keys(req.keys)
        offs = unpack(req.dst_offset, U64, "dst_offset", len(keys))
        self.log += [("move", self.name, k, o) for k, o in zip(keys, offs)]
        return daemon_pb2.MoveResponse(ok=pack([1] * len(keys), U8), stored_size=pack([0] * len(keys), U64))

    async def Invalidate(self, req, ctx):  # noqa: ANN001, ANN201, N802
        return daemon_pb2.InvalidateResponse()


class Local:
    def __init__(self, name: str, log: list) -> None:
        self.daemon_id, self.stopping, self.control = name, False, Control(name, log)


def dram(name: str, host: str, slots: int) -> DaemonSpec:
    return DaemonSpec(name, host, f"{name}:d", f"{name}:c", (SegmentSpec(1, Tier.DRAM, slots * ALIGN, "/dev/shm/x"),))


def service() -> tuple[Index, MetaServicer, list]:
    ix = Index(IndexLimits(cache_policy="lru"))
    ix.register_daemon(dram("D", "h1", 1), {})
    ix.register_daemon(dram("E", "h2", 8), {})
    log: list = []
    link = DaemonLink(ix, 1.0)
    for n in "DE":
        link.attach_local(n, Local(n, log))
    return ix, MetaServicer(ix, link, tickets=False), log


def test_a_commit_asks_the_daemons_for_its_own_blocks_whatever_runs_before_they_are_asked() -> None:
    async def run() -> None:
        ix, sv, log = service()
        p1 = await sv.PutStart(meta_pb2.PutStartRequest(keys=K[0], sizes=pack([BLK], U64), host_id="h1"), None)
        commit = asyncio.ensure_future(
            sv.PutCommit(meta_pb2.PutCommitRequest(put_id=p1.put_id, checksums=pack([111], U64)), None)
        )
        await asyncio.sleep(0)  # the commit has begun; another handler runs before the daemons are asked
        await sv.DrainDaemon(meta_pb2.DrainDaemonRequest(daemon_id="D"), None)  # put1's row is freed
        p2 = await sv.PutStart(meta_pb2.PutStartRequest(keys=K[1], sizes=pack([BLK], U64), host_id="h2"), None)
        r1 = await commit
        assert unpack(r1.status, U8, "status") == [4]  # UNAVAILABLE: its daemon left
        assert not [x for x in log if x[0] == "commit" and x[2] == K[1]]  # put2's block was not committed for it
        r2 = await sv.PutCommit(meta_pb2.PutCommitRequest(put_id=p2.put_id, checksums=pack([222], U64)), None)
        assert unpack(r2.status, U8, "status") == [0]
        assert [x[3] for x in log if x[0] == "commit" and x[2] == K[1]] == [222]
        ix.check_integrity()

    asyncio.run(run())


def test_a_commit_whose_daemon_leaves_before_it_is_asked_ends_every_block() -> None:
    async def run() -> None:
        ix, sv, _ = service()
        p1 = await sv.PutStart(
            meta_pb2.PutStartRequest(keys=K[2] + K[3], sizes=pack([BLK, BLK], U64), host_id="h1"), None
        )
        commit = asyncio.ensure_future(
            sv.PutCommit(meta_pb2.PutCommitRequest(put_id=p1.put_id, checksums=pack([1, 2], U64)), None)
        )
        await asyncio.sleep(0)
        await sv.DrainDaemon(meta_pb2.DrainDaemonRequest(daemon_id="D"), None)
        r = await commit  # no untyped error
        assert unpack(r.status, U8, "status") == [4, 0]
        assert ix.put_start(K[3], [BLK]).status == [1]  # stored: not left "being written"
        ix.check_integrity()

    asyncio.run(run())


def test_a_commit_planned_before_its_daemon_registers_again_is_made_for_the_old_registration() -> None:
    """The daemon refuses a call made for a registration it has left (kvstore.daemon.links): a
    commit whose blocks were placed before the daemon registered again must name the
    registration they were placed on, not the one the index knows by the time it is sent."""

    async def run() -> None:
        log: list = []
        ix = Index(IndexLimits(cache_policy="lru"))
        spec = DaemonSpec("D", "h1", "D:d", "D:c", dram("D", "h1", 4).segments, registration=111)
        ix.register_daemon(spec, {})
        link = DaemonLink(ix, 1.0)
        link.attach_local("D", Local("D", log))
        sv = MetaServicer(ix, link, tickets=False)
        p = await sv.PutStart(meta_pb2.PutStartRequest(keys=K[0], sizes=pack([BLK], U64), host_id="h1"), None)
        commit = asyncio.ensure_future(
            sv.PutCommit(meta_pb2.PutCommitRequest(put_id=p.put_id, checksums=pack([5], U64)), None)
        )
        await asyncio.sleep(0)  # the commit has begun, its daemon not asked yet
        ix.register_daemon(DaemonSpec("D", "h1", "D:d", "D:c", spec.segments, registration=222), {})
        await commit
        assert [x[2] for x in log if x[0] == "commit_for"] in ([], [111])  # never the new one
        ix.check_integrity()

    asyncio.run(run())


def test_moves_ended_by_a_new_registration_are_not_sent_to_it() -> None:
    log: list = []
    segs = (SegmentSpec(1, Tier.DRAM, 8 * ALIGN, "/dev/shm/d1"), SegmentSpec(2, Tier.SSD, 16 * SSD_ALIGN, "/data/d1"))
    spec = DaemonSpec("d1", "h1", "d1:data", "d1:ctl", segs)
    ix = Index(IndexLimits(cache_policy="lru", dram_high_watermark=0.5, dram_low_watermark=0.25))
    ix.register_daemon(spec, {})
    link = DaemonLink(ix, 1.0)
    link.attach_local("d1", Local("d1", log))
    p = ix.put_start(b"".join(K[:5]), [BLK] * 5)
    ix.put_commit(p.put_id, [7] * 5)
    held = ix.locations(ix.lookup(b"".join(K[:5]), with_locations=True)[2])
    plans = ix.plan_moves()  # the service plans a batch, then awaits its tombstones' delivery ...
    assert len(plans["d1"]) == 3
    # ... meanwhile the daemon registers again (its DRAM kept): the moves end, their targets free.
    ix.register_daemon(spec, {1: [InventoryItem(x.key, x.offset, x.length, x.checksum, x.size, x.gen) for x in held]})
    p = ix.put_start(b"".join(K[5:8]), [BLK] * 3)  # fills DRAM
    ix.put_commit(p.put_id, [8] * 3)
    p = ix.put_start(K[20], [BLK])  # goes to SSD, where a target of the old batch was
    ix.put_commit(p.put_id, [9])
    asyncio.run(link.run_moves(plans))
    assert not [x for x in log if x[0] == "move"]  # nothing of the old batch reaches the daemon
    ix.check_integrity()


class Unreachable(Control):
    """A daemon whose Invalidate call hangs until ``gone`` is set, then fails (it was killed)."""

    def __init__(self, name: str, log: list, gone: asyncio.Event) -> None:
        super().__init__(name, log)
        self.gone = gone

    async def Invalidate(self, req, ctx):  # noqa: ANN001, ANN201, N802
        self.log.append(("invalidate", self.name, unpack_keys(req.invalidations[0].keys)))
        await self.gone.wait()
        raise Unavailable("daemon killed")


def test_a_daemon_registering_again_while_its_tombstones_are_in_flight_does_not_bring_their_blocks_back() -> None:
    # The daemon was killed before the tombstone of a dropped block reached it; a flush is still
    # delivering it when the restarted daemon registers with that block in its inventory. The
    # block stays dropped: adopted, it would be dropped by the daemon once the tombstone arrives
    # while the index goes on handing it out (a miss reported as damage, a prefix cut short).
    async def run() -> None:
        limits = IndexLimits(cache_policy="lru")
        ix = Index(limits)
        spec = dram("D", "h1", 8)
        ix.register_daemon(spec, {})
        p = ix.put_start(K[0] + K[1], [BLK, BLK])
        ix.put_commit(p.put_id, [5, 6])
        held = ix.locations(ix.lookup(K[0] + K[1], with_locations=True)[2])
        gone, log = asyncio.Event(), []
        link = DaemonLink(ix, 1.0)
        daemon = Local("D", log)
        daemon.control = Unreachable("D", log, gone)
        link.attach_local("D", daemon)
        sv = MetaServicer(ix, link, tickets=False)
        assert ix.remove(K[0]) == 1  # its tombstone is owed to D
        flush = asyncio.ensure_future(link.flush())
        await asyncio.sleep(0.01)
        assert log == [("invalidate", "D", [K[0]])] and not ix.tombstones.get("D")  # taken, in flight
        inv = common_pb2.Inventory(
            segment_id=1,
            keys=b"".join(x.key for x in held),
            offset=pack([x.offset for x in held], U64),
            length=pack([x.length for x in held], U64),
            checksum=pack([x.checksum for x in held], U64),
            gen=pack([x.gen for x in held], U64),
        )
        info = common_pb2.DaemonInfo(
            daemon_id="D", host_id="h1", data_addr="D:d", control_addr="D:c",
            segments=[common_pb2.Segment(segment_id=1, tier=1, capacity_bytes=8 * ALIGN, shm_path="/dev/shm/x")],
        )  # fmt: skip
        r = await sv.RegisterDaemon(meta_pb2.RegisterDaemonRequest(daemon=info, inventory=[inv]), None)
        assert r.rejected == 1
        gone.set()
        await flush
        # K[0] stays dropped (its tombstone goes out again, once the daemon answers); K[1] is back.
        assert ix.lookup(K[0] + K[1], per_key=True)[1] == [False, True]
        assert [(t.key, t.gen) for t in ix.tombstones["D"]] == [(K[0], held[0].gen)]
        ix.check_integrity()

    asyncio.run(run())


def test_a_cancelled_flush_gives_its_tombstones_back() -> None:
    # A handler whose caller went away is cancelled while its flush waits on a daemon: the
    # tombstones it took go back to the index (to go out with the next flush or heartbeat),
    # not into a batch nobody will finish.
    async def run() -> None:
        ix = Index(IndexLimits(cache_policy="lru"))
        ix.register_daemon(dram("D", "h1", 8), {})
        p = ix.put_start(K[0], [BLK])
        ix.put_commit(p.put_id, [5])
        gone, log = asyncio.Event(), []
        link = DaemonLink(ix, 1.0)
        daemon = Local("D", log)
        daemon.control = Unreachable("D", log, gone)
        link.attach_local("D", daemon)
        assert ix.remove(K[0]) == 1
        flush = asyncio.ensure_future(link.flush())
        await asyncio.sleep(0.01)
        assert not ix.tombstones.get("D")  # taken, in flight
        flush.cancel()
        with pytest.raises(asyncio.CancelledError):
            await flush
        assert [t.key for t in ix.tombstones["D"]] == [K[0]] and not link._flushing

    asyncio.run(run())
