"""Leader leases and fencing epochs in a real Redis (kvstore.cluster.coord), and a shard process
that loses Redis: it stops answering when its lease runs out, and steps down when Redis comes
back without it (kvstore.cluster.shard)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest

from kvstore.cluster.coord import Coordinator
from kvstore.cluster.shard import ShardNode
from kvstore.config import load_config
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.procs import free_port, start_listening
from kvstore.v1 import meta_pb2, meta_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def _redis(port: int):  # noqa: ANN202
    return start_listening(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        port,
        "redis",
        timeout=15,
        stdout=subprocess.DEVNULL,
    )


@pytest.fixture
def redis_port():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    child = _redis(port)
    yield port
    child.stop()


async def test_lease_epochs_only_grow_and_only_the_holder_renews(redis_port):
    c = Coordinator(f"redis://127.0.0.1:{redis_port}", "t")
    try:
        e1 = await c.acquire(0, "a", "h:1", 1.0)
        assert e1 > 0
        assert await c.acquire(0, "b", "h:2", 1.0) == 0  # held
        (lead,) = await c.leaders(1)
        assert (lead.node, lead.addr, lead.epoch) == ("a", "h:1", e1)
        assert await c.renew(0, lead, 1.0)
        assert 0.5 < await c.lease_left(0) <= 1.0
        impostor = type(lead)("b", "h:2", e1)
        assert not await c.renew(0, impostor, 1.0)
        await c.resign(0, impostor)  # not the holder: nothing happens
        assert (await c.leaders(1))[0] == lead
        await c.resign(0, lead)
        assert await c.leaders(1) == [None] and await c.lease_left(0) == 0
        e2 = await c.acquire(0, "b", "h:2", 1.0)
        assert e2 > e1
        await asyncio.sleep(1.1)  # lapses without renewal
        assert not await c.renew(0, (await c.leaders(1))[0] or impostor, 1.0)
        assert await c.acquire(0, "a", "h:1", 1.0) > e2
    finally:
        await c.close()


async def test_slot_map_is_made_once_and_checked(redis_port):
    c = Coordinator(f"redis://127.0.0.1:{redis_port}", "t2")
    try:
        with pytest.raises(Unavailable, match="no slot map"):
            await c.slot_map()
        assert (await c.slot_map(3)).shards == 3
        assert (await c.slot_map()).shards == 3
        with pytest.raises(InvalidArgument, match="has 3 shards"):
            await c.slot_map(2)
    finally:
        await c.close()


async def test_unreachable_redis_is_a_typed_error():
    c = Coordinator(f"redis://127.0.0.1:{free_port()}", "t3", timeout_s=0.3)
    try:
        with pytest.raises(Unavailable, match="cluster coordination"):
            await c.leaders(1)
    finally:
        await c.close()


async def test_a_leader_that_loses_redis_stops_answering_then_steps_down(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    rport = free_port()
    redis = _redis(rport)
    listen = f"127.0.0.1:{free_port()}"
    cfg = load_config(
        None,
        [
            f"cluster.redis=redis://127.0.0.1:{rport}",
            "cluster.name=t4",
            "cluster.leader_ttl_s=1.0",
            f"meta.listen={listen}",
        ],
    )
    node = ShardNode(cfg)
    run = asyncio.create_task(node.run())
    ch = grpc.aio.insecure_channel(listen)
    stub = meta_pb2_grpc.MetaServiceStub(ch)
    try:
        await asyncio.wait_for(node.elected.wait(), 10)
        first = node.leader.epoch
        assert (await stub.Lookup(meta_pb2.LookupRequest(keys=bytes(16)), timeout=2)).hit_count == 0
        redis.kill()  # Redis gone: the lease cannot be renewed
        await asyncio.sleep(1.2)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Lookup(meta_pb2.LookupRequest(keys=bytes(16)), timeout=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "lease ran out" in e.value.details()
        redis = _redis(rport)  # back, empty: someone else may take the lease now
        async with asyncio.timeout(15):
            while not (node.elected.is_set() and node.leader.epoch != first):
                await asyncio.sleep(0.05)
        assert node.terms == 2  # it stepped down and was elected again, with a new epoch
        assert (await stub.Lookup(meta_pb2.LookupRequest(keys=bytes(16)), timeout=2)).hit_count == 0
    finally:
        node.stop()
        await asyncio.wait_for(run, 10)
        await ch.close()
        redis.stop()


def test_a_shard_process_refuses_an_ephemeral_port():
    """Its address is published to Redis before it binds (and a standby binds only when it
    leads): port 0 would be published as such, and nothing could reach the leader."""
    from kvstore.errors import InvalidArgument

    for sets in (
        ["meta.listen=127.0.0.1:0"],
        ["meta.listen=127.0.0.1:00"],
        ["meta.listen=127.0.0.1:7100", "cluster.advertise=10.0.0.1:0"],
        ["meta.listen=0.0.0.0:0", "cluster.advertise=10.0.0.1:7100"],
    ):
        cfg = load_config(None, ["cluster.redis=redis://127.0.0.1:1", *sets])
        with pytest.raises(InvalidArgument, match="fixed port"):
            ShardNode(cfg)
    assert ShardNode(load_config(None, ["cluster.redis=redis://127.0.0.1:1", "meta.listen=127.0.0.1:7100"])).addr
