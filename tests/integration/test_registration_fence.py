"""Control calls are fenced by the daemon's registration: every Commit, Invalidate and Move the
metadata service makes carries the number of the registration it was made for, and a daemon
that has registered since (a restart, a lapse of its lease) refuses it. Without that a call
queued across the new registration would act on extents the service has handed out again.

A real daemon and service on loopback, in this process; the one stand-in is a gate that holds
the daemon's first Commit on its way in, as a slow network would."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from kvstore import KeySpace, ModelFingerprint
from kvstore.client import KVStoreClient
from kvstore.config import ClientConfig, DaemonConfig, MetaConfig
from kvstore.daemon.control import Control
from kvstore.daemon.server import DRAM_SEGMENT, SSD_SEGMENT, CacheDaemon
from kvstore.daemon.ssd import SsdSegment
from kvstore.errors import KVStoreError
from kvstore.extent import SSD_ALIGN, extent_size
from kvstore.keys import KEY_BYTES
from kvstore.meta.records import Tier
from kvstore.meta.service import MetaServer
from kvstore.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc, meta_pb2, meta_pb2_grpc
from kvstore.wire import U8, U32, U64, pack, unpack

BLOCK = 4096
KEYS = KeySpace(ModelFingerprint("fence-model", "fp16", 1, 1, 128)).block_keys(list(range(16 * 3)))


def payload(i: int) -> np.ndarray:
    return np.full(BLOCK, i + 1, np.uint8)


def stored_keys(daemon: CacheDaemon) -> set[bytes]:
    invs, _ = daemon.inventory(True)
    return {inv.keys[i : i + KEY_BYTES] for inv in invs for i in range(0, len(inv.keys), KEY_BYTES)}


async def start_meta() -> tuple[MetaServer, int]:
    meta = MetaServer(MetaConfig(listen="127.0.0.1:0", heartbeat_interval_s=0.05, daemon_ttl_s=30.0))
    return meta, await meta.start()


async def start_daemon(tmp_path, port: int, name: str, **more) -> CacheDaemon:  # noqa: ANN001, ANN003
    daemon = CacheDaemon(
        DaemonConfig(meta=f"127.0.0.1:{port}", daemon_id=name, data_dir=str(tmp_path / "d"),
                     dram_bytes=1 << 20, shm_dir=str(tmp_path / "shm"), **more)
    )  # fmt: skip
    await daemon.start()
    return daemon


async def until(pred, timeout: float = 15.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout} s")
        await asyncio.sleep(0.02)


async def test_a_commit_delayed_past_a_new_registration_is_refused_and_commits_nothing(tmp_path, monkeypatch):
    held, release = asyncio.Event(), asyncio.Event()
    original = Control.Commit

    async def slow_first_commit(self, request, context):  # noqa: ANN001, ANN202
        if not held.is_set():
            held.set()
            await release.wait()
        return await original(self, request, context)

    monkeypatch.setattr(Control, "Commit", slow_first_commit)
    meta, port = await start_meta()
    daemon = await start_daemon(tmp_path, port, "fence")
    client = KVStoreClient(f"127.0.0.1:{port}", ClientConfig(retries=0))
    try:
        await asyncio.wait_for(daemon.registered.wait(), 30)
        link = daemon.links[0]
        first = link.registration
        assert first and meta.index.daemons["fence"].spec.registration == first

        # The put's Commit is on its way to the daemon when the daemon registers again.
        put = asyncio.create_task(client.put(KEYS[:2], [payload(0), payload(1)]))
        await asyncio.wait_for(held.wait(), 15)
        link.need_register = True  # as after a lapse of its lease
        await until(lambda: daemon.counters["registrations"] == 2 and not link.need_register)
        second = link.registration
        assert second not in (0, first)
        assert meta.index.daemons["fence"].spec.registration == second
        release.set()
        try:
            res = await asyncio.wait_for(put, 30)
        except KVStoreError:
            pass  # the put failed as a whole: also fine
        else:
            assert res.stored == 0, res

        # The late commit changed nothing: no block on the daemon, none in the index.
        assert stored_keys(daemon) == set()
        assert await client.lookup(KEYS[:2]) == 0
        assert daemon.counters["stale_registration_refused"] >= 1

        # Calls made for the current registration are served: the same blocks go in now.
        res = await client.put(KEYS[:2], [payload(0), payload(1)])
        assert res.stored == 2
        out = [np.zeros(BLOCK, np.uint8) for _ in range(2)]
        assert await client.get_into(KEYS[:2], out) == 2
        assert all((o == payload(i)).all() for i, o in enumerate(out))
        assert stored_keys(daemon) == set(KEYS[:2])
    finally:
        release.set()
        await client.close()
        await daemon.stop()
        await meta.stop(0)


async def test_control_calls_for_another_registration_are_refused_and_unchecked_ones_served(tmp_path):
    meta, port = await start_meta()
    await meta.stop(0)  # nobody listens there: the daemon stays unregistered
    daemon = await start_daemon(tmp_path, port, "fence2")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.control_port}") as ch:
            stub = daemon_pb2_grpc.DaemonControlStub(ch)
            # Before its first registration the daemon serves no call for any: each attempt
            # to register makes a number of its own, known to no service yet.
            mine = daemon.links[0].registration
            assert mine
            for other in (mine ^ 1, 12345):
                for call in (
                    stub.Invalidate(daemon_pb2.InvalidateRequest(registration=other), timeout=5),
                    stub.Commit(daemon_pb2.CommitRequest(registration=other), timeout=5),
                    stub.Move(daemon_pb2.MoveRequest(registration=other), timeout=5),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "registration" in err.value.details()
            assert daemon.counters["stale_registration_refused"] == 6
            # A call that names no registration (made by hand) is not checked.
            assert (await stub.Invalidate(daemon_pb2.InvalidateRequest(), timeout=5)).cleared == 0
    finally:
        await daemon.stop()


@pytest.mark.parametrize("cancelled", [False, True], ids=["answered", "caller-gone"])
async def test_a_move_under_way_when_the_daemon_registers_again_stops_and_the_inventory_waits_for_it(
    tmp_path, monkeypatch, cancelled
):
    """A batch of moves that passed its checks is carried out on a thread; when the daemon
    registers again meanwhile (its lease lapsed), the batch stops at its next block and the
    registration takes its inventory only once the batch has ended, so the inventory holds
    exactly what the daemon holds and the service adopts every block the move wrote. Also when
    the caller went away first (its deadline passed): the thread goes on, and so does the wait."""
    entered, go = threading.Event(), threading.Event()
    original = SsdSegment.write

    def held_write(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not entered.is_set():
            entered.set()
            assert go.wait(30)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SsdSegment, "write", held_write)
    meta, port = await start_meta()
    daemon = await start_daemon(tmp_path, port, "fence3", ssd_bytes=1 << 20, ssd_direct_io=False)
    client = KVStoreClient(f"127.0.0.1:{port}", ClientConfig(retries=0))
    try:
        await asyncio.wait_for(daemon.registered.wait(), 30)
        keys = KEYS[:3]
        assert (await client.put(keys, [payload(i) for i in range(3)])).stored == 3
        reps = [meta.index.replicas(k)[0] for k in keys]
        assert all(r.segment.spec.tier == Tier.DRAM for r in reps)
        link = daemon.links[0]
        step = extent_size(BLOCK, SSD_ALIGN)
        req = daemon_pb2.MoveRequest(
            keys=b"".join(keys),
            src_segment=pack([DRAM_SEGMENT] * 3, U32),
            src_offset=pack([r.offset for r in reps], U64),
            dst_segment=pack([SSD_SEGMENT] * 3, U32),
            dst_offset=pack([i * step for i in range(3)], U64),
            length=pack([r.length for r in reps], U64),
            checksum=pack([r.checksum for r in reps], U64),
            src_gen=pack([r.gen for r in reps], U64),
            dst_gen=pack([r.gen + 100 for r in reps], U64),
            registration=link.registration,
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.control_port}") as ch:
            move = asyncio.ensure_future(daemon_pb2_grpc.DaemonControlStub(ch).Move(req, timeout=60))
            await until(entered.is_set)  # the first block's copy is being written
            if cancelled:
                move.cancel()
            link.need_register = True  # as after a lapse of its lease
            await asyncio.sleep(0.5)
            assert daemon.counters["registrations"] == 1  # waiting for the batch
            go.set()
            if cancelled:
                with pytest.raises(asyncio.CancelledError):
                    await move
            else:
                resp = await move
                assert unpack(resp.ok, U8, "ok", 3) == [1, 0, 0]  # stopped at its next block
        await until(lambda: daemon.counters["registrations"] == 2 and not link.need_register)

        # The inventory was taken after the copy: the service knows every block the daemon holds.
        invs, _ = daemon.inventory(True)
        held = {
            (inv.segment_id, inv.keys[i * KEY_BYTES : (i + 1) * KEY_BYTES], off)
            for inv in invs
            for i, off in enumerate(unpack(inv.offset, U64, "offset", len(inv.keys) // KEY_BYTES))
        }
        assert (SSD_SEGMENT, keys[0], 0) in held
        assert not any(seg == SSD_SEGMENT and k in keys[1:] for seg, k, _ in held)
        known = {(r.segment.spec.segment_id, k, r.offset) for k in keys for r in meta.index.replicas(k)}
        assert held == known
        out = [np.zeros(BLOCK, np.uint8) for _ in range(3)]
        assert await client.get_into(keys, out) == 3
        assert all((o == payload(i)).all() for i, o in enumerate(out))
    finally:
        go.set()
        await client.close()
        await daemon.stop()
        await meta.stop(0)


async def test_a_registration_made_in_a_daemons_name_is_undone_by_its_next_heartbeat(tmp_path):
    """Without an auth file any caller may register a daemon id. A stray (or hostile)
    RegisterDaemon in the name of a running daemon, with an empty inventory and a dead data
    address, replaces its registration: its blocks leave the index. The daemon's next
    heartbeat names its own registration, the service answers that it does not know it, and
    the daemon registers again with its inventory: every block is found and read back."""
    meta, port = await start_meta()
    daemon = await start_daemon(tmp_path, port, "fence4")
    client = KVStoreClient(f"127.0.0.1:{port}", ClientConfig(retries=0))
    try:
        await asyncio.wait_for(daemon.registered.wait(), 30)
        assert (await client.put(KEYS[:3], [payload(i) for i in range(3)])).stored == 3
        real = meta.index.daemons["fence4"].spec
        stray = common_pb2.DaemonInfo(
            daemon_id="fence4", host_id=real.host_id, data_addr="127.0.0.1:9", control_addr="127.0.0.1:9",
            segments=[common_pb2.Segment(segment_id=DRAM_SEGMENT, tier=common_pb2.TIER_DRAM, capacity_bytes=1 << 20)],
        )  # fmt: skip
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await meta_pb2_grpc.MetaServiceStub(ch).RegisterDaemon(
                meta_pb2.RegisterDaemonRequest(daemon=stray, registration=777), timeout=5
            )
        assert meta.index.daemons["fence4"].spec.registration == 777
        assert meta.index.lookup(b"".join(KEYS[:3]))[0] == 0  # the stray registration's doing
        # Registered again once the daemon has the service's answer (its inventory adopted).
        await until(lambda: daemon.counters["registrations"] == 2)
        assert meta.index.daemons["fence4"].spec.registration == daemon.links[0].registration
        assert await client.lookup(KEYS[:3]) == 3
        out = [np.zeros(BLOCK, np.uint8) for _ in range(3)]
        assert await client.get_into(KEYS[:3], out) == 3
        assert all((o == payload(i)).all() for i, o in enumerate(out))
    finally:
        await client.close()
        await daemon.stop()
        await meta.stop(0)
