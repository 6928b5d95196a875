"""Health that tells the truth, observed through the gRPC health client: a daemon is
NOT_SERVING until the metadata service knows it, SERVING once registered, and both servers
turn NOT_SERVING when they stop (a watcher sees it before the stream ends)."""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.config import DaemonConfig, MetaConfig
from kvstore.daemon.server import CacheDaemon
from kvstore.meta.service import MetaServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _status(addr: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(addr) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return resp.status


async def _until(addr: str, want: int, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await _status(addr) == want:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{addr} did not report {want} within {timeout} s")


async def test_daemon_is_not_serving_until_registered_and_both_turn_not_serving_on_stop(tmp_path):
    port = _free_port()
    daemon = CacheDaemon(
        DaemonConfig(meta=f"127.0.0.1:{port}", daemon_id="health", data_dir=str(tmp_path / "d"),
                     dram_bytes=1 << 20, shm_dir=str(tmp_path / "shm"))
    )  # fmt: skip
    await daemon.start()  # no metadata service yet
    ctl = f"127.0.0.1:{daemon.control_port}"
    meta = None
    try:
        assert await _status(ctl) == NOT_SERVING
        assert await _status(ctl, "kvstore.v1.DaemonControl") == NOT_SERVING
        await asyncio.sleep(0.3)
        assert await _status(ctl) == NOT_SERVING  # still nobody to register with
        meta = MetaServer(MetaConfig(listen=f"127.0.0.1:{port}", heartbeat_interval_s=0.05))
        await meta.start()
        maddr = f"127.0.0.1:{port}"
        assert await _status(maddr) == SERVING
        await asyncio.wait_for(daemon.registered.wait(), 15)
        await _until(ctl, SERVING)
        assert await _status(ctl, "kvstore.v1.DaemonControl") == SERVING

        # A watcher of each server sees NOT_SERVING when it stops.
        async def watch(addr: str) -> list[int]:
            seen: list[int] = []
            async with grpc.aio.insecure_channel(addr) as ch:
                call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=15)
                try:
                    async for resp in call:
                        seen.append(resp.status)
                        if resp.status == NOT_SERVING:
                            break
                except grpc.aio.AioRpcError:
                    pass
            return seen

        w_daemon = asyncio.create_task(watch(ctl))
        w_meta = asyncio.create_task(watch(maddr))
        await asyncio.sleep(0.2)
        await daemon.stop()
        daemon = None
        await meta.stop(0.5)
        meta = None
        seen_d, seen_m = await asyncio.gather(w_daemon, w_meta)
        assert seen_d[0] == SERVING and NOT_SERVING in seen_d, seen_d
        assert seen_m[0] == SERVING and NOT_SERVING in seen_m, seen_m
    finally:
        if daemon is not None:
            await daemon.stop()
        if meta is not None:
            await meta.stop(0)
