"""Nothing stalls the heartbeats: background loops survive injected failures (logged, health
NOT_SERVING while they keep failing, SERVING again after), a daemon with a multi-GiB arena
scans and re-registers without the service's view of its liveness ever lapsing, and a service
that itself stood still (SIGSTOP past the daemon lease) does not count that time against the
daemons."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import DaemonConfig, MetaConfig
from kvstore.daemon.server import CacheDaemon
from kvstore.meta.service import MetaServer
from kvstore.v1 import daemon_pb2, daemon_pb2_grpc
from tests.conftest import wait_until
from tests.integration.test_health import _free_port, _status
from tests.integration.test_observability import scrape, value

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _until(pred, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout} s")


async def _pair(tmp_path):  # noqa: ANN001, ANN202
    port = _free_port()
    meta = MetaServer(MetaConfig(listen=f"127.0.0.1:{port}", heartbeat_interval_s=0.05, daemon_ttl_s=1.0,
                                 sweep_interval_s=0.02, tier_interval_s=0.02))  # fmt: skip
    await meta.start()
    daemon = CacheDaemon(
        DaemonConfig(meta=f"127.0.0.1:{port}", daemon_id="loops", data_dir=str(tmp_path / "d"),
                     dram_bytes=1 << 20, shm_dir=str(tmp_path / "shm"))
    )  # fmt: skip
    await daemon.start()
    await asyncio.wait_for(daemon.registered.wait(), 15)
    return meta, daemon, f"127.0.0.1:{port}", f"127.0.0.1:{daemon.control_port}"


async def test_service_loops_survive_injected_failures_and_flip_health(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    meta, daemon, maddr, _ = await _pair(tmp_path)
    try:
        await _until(lambda: _ok(_status(maddr), SERVING))
        for name, attr in (("sweep", "expire"), ("tier", "plan_moves")):
            real = getattr(meta.index, attr)
            calls = {"n": 0}

            def boom(*a, _real=real, _calls=calls, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
                _calls["n"] += 1
                raise RuntimeError(f"injected failure #{_calls['n']}")

            setattr(meta.index, attr, boom)
            await _until(lambda: _ok(_status(maddr), NOT_SERVING))
            hb = meta.index.daemons["loops"].last_heartbeat
            await asyncio.sleep(0.2)
            # Heartbeats go on while the loop fails; the daemon is not dropped.
            assert meta.index.daemons["loops"].last_heartbeat > hb
            setattr(meta.index, attr, real)
            await _until(lambda: _ok(_status(maddr), SERVING))
            n = calls["n"]
            await asyncio.sleep(0.1)
            assert calls["n"] == n  # the real one runs again
            assert f"event=loop_error loop={name}" in caplog.text
            assert f"event=unhealthy loop={name}" in caplog.text
            assert "RuntimeError: injected failure #1" in caplog.text
        assert meta.index.counters["daemons_lost"] == 0
    finally:
        await meta.stop()
        await daemon.stop()


async def test_daemon_heartbeat_loop_survives_injected_failures(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    meta, daemon, _, ctl = await _pair(tmp_path)
    try:
        await _until(lambda: _ok(_status(ctl), SERVING))
        real = daemon.links[0].stub
        fails = {"left": 5}

        class Flaky:
            def __getattr__(self, name):  # noqa: ANN001, ANN204
                method = getattr(real, name)

                def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
                    if name == "Heartbeat" and fails["left"] > 0:
                        fails["left"] -= 1
                        raise RuntimeError("injected heartbeat failure")
                    return method(*a, **k)

                return call

        daemon.links[0].stub = Flaky()
        await _until(lambda: _ok(_status(ctl), NOT_SERVING))
        await _until(lambda: _ok(_status(ctl), SERVING))
        assert fails["left"] == 0
        assert "event=heartbeat_loop_error" in caplog.text and "injected heartbeat failure" in caplog.text
        assert daemon.counters["heartbeat_failures"] >= 5
        assert "loops" in meta.index.daemons and meta.index.counters["daemons_lost"] == 0
    finally:
        await meta.stop()
        await daemon.stop()


async def _ok(coro, want) -> bool:  # noqa: ANN001
    return (await coro) == want


def _shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


@pytest.mark.skipif(_shm_free() < 3 << 30, reason="needs 3 GiB free in /dev/shm for a 2.5 GiB DRAM segment")
def test_big_arena_scans_and_reregisters_without_lapsing(cluster):
    """A 2.5 GiB arena holding 1.9 GiB of blocks: inventory scans with checksums run while the
    service keeps hearing the daemon; after a service restart both daemons re-register (one
    with 30720 blocks, adopted in steps) and neither is dropped."""
    meta = cluster.start_meta()
    big = cluster.start_daemon(dram="2560MiB", name="big")
    small = cluster.start_daemon(name="small")
    fp = ModelFingerprint("stall", "float16", 2, 2, 64, 16)
    n = 30720  # above the service's adoption step (20000): registered in two steps
    keys = KeySpace(fp).block_keys(list(range(n * 16)))
    block = 64 << 10
    buf = np.arange(block, dtype=np.uint8)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        for i in range(0, len(keys), 1024):
            assert c.put(keys[i : i + 1024], [buf] * 1024).stored == 1024
        ttl = 1.5  # tests.conftest.FAST
        ages: list[float] = []
        done = threading.Event()

        def scans() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{big.info['control_port']}") as ch:
                stub = daemon_pb2_grpc.DaemonControlStub(ch)
                for _ in range(3):
                    r = stub.GetInventory(daemon_pb2.InventoryRequest(verify=True), timeout=60)
                    assert sum(len(i.keys) for i in r.inventory) == n * 16
            done.set()

        t = threading.Thread(target=scans)
        t.start()
        while not done.is_set():
            s = c.stats()
            ages += [d.last_heartbeat_age_s for d in s.daemons]
            assert all(d.alive for d in s.daemons) and len(s.daemons) == 2
            time.sleep(0.05)
        t.join()
        assert max(ages) < ttl, max(ages)
        lost = c.stats().counters["daemons_lost"]
        assert lost == 0
    addr = cluster.meta_addr
    meta.kill()
    cluster.procs.remove(meta)
    cluster.start_meta(listen=addr)
    with SyncKVStoreClient(addr) as c:
        wait_until(lambda: len(c.stats().daemons) == 2 and c.stats().keys == n, timeout=30)
        t_end = time.monotonic() + 2 * ttl
        while time.monotonic() < t_end:
            s = c.stats()
            assert len(s.daemons) == 2 and all(d.alive for d in s.daemons)
            time.sleep(0.05)
        assert c.stats().counters["daemons_lost"] == 0
    assert small.child.alive() and big.child.alive()


def test_a_paused_service_does_not_drop_its_daemons(cluster):
    meta = cluster.start_meta("meta.metrics_port=0")
    d = cluster.start_daemon("daemon.metrics_port=0")
    regs = value(scrape(d.info["metrics_port"]), "kvstore_daemon_registrations_total")
    assert regs == 1
    meta.p.send_signal(signal.SIGSTOP)
    time.sleep(2.5)  # past the daemon lease (1.5 s)
    meta.p.send_signal(signal.SIGCONT)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        time.sleep(0.5)
        s = c.stats()
        assert s.counters["daemons_lost"] == 0
        assert s.counters["stall_grace"] >= 1
        assert [x.alive for x in s.daemons] == [True]
    assert value(scrape(d.info["metrics_port"]), "kvstore_daemon_registrations_total") == 1
