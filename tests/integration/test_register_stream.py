"""RegisterDaemonStream on a real service over loopback gRPC: an inventory sent in parts (as a
daemon whose inventory passes a message's limit sends it) is adopted as the same inventory in
one RegisterDaemon would be; a stream whose later message names the daemon again, whose parts
together pass a segment's room, that carries an unparsable message, or that is empty, is
refused INVALID_ARGUMENT with nothing registered."""

from __future__ import annotations

import random

import grpc
import numpy as np
import pytest

from kvstore.config import MetaConfig
from kvstore.extent import ALIGN, HEADER_SIZE
from kvstore.meta.service import MetaServer
from kvstore.v1 import common_pb2, meta_pb2, meta_pb2_grpc

BLK = ALIGN - HEADER_SIZE
SLOTS = 5000


def info(daemon_id: str) -> common_pb2.DaemonInfo:
    return common_pb2.DaemonInfo(
        daemon_id=daemon_id, host_id="h1", data_addr="127.0.0.1:9", control_addr="127.0.0.1:9",
        segments=[common_pb2.Segment(segment_id=1, tier=common_pb2.TIER_DRAM, capacity_bytes=SLOTS * ALIGN)],
    )  # fmt: skip


def part(keys: list[bytes], first_slot: int) -> common_pb2.Inventory:
    n = len(keys)
    u64 = lambda v: np.asarray(v, dtype="<u8").tobytes()  # noqa: E731
    return common_pb2.Inventory(
        segment_id=1, keys=b"".join(keys), offset=u64((np.arange(n) + first_slot) * ALIGN),
        length=u64([BLK] * n), checksum=u64([7] * n), gen=u64(np.arange(n) + 1000 + first_slot),
    )  # fmt: skip


async def test_an_inventory_in_parts_is_adopted_whole_and_bad_streams_are_refused() -> None:
    meta = MetaServer(MetaConfig(listen="127.0.0.1:0", heartbeat_interval_s=0.05, daemon_ttl_s=30.0))
    port = await meta.start()
    rnd = random.Random(3)
    keys = [rnd.getrandbits(128).to_bytes(16, "little") for _ in range(3000)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)

            async def stream(*msgs):  # noqa: ANN002, ANN202
                async def gen():  # noqa: ANN202
                    for m in msgs:
                        yield m

                return await stub.RegisterDaemonStream(gen(), timeout=30)

            first = meta_pb2.RegisterDaemonRequest(daemon=info("s1"), inventory=[part(keys[:1000], 0)], registration=5)
            resp = await stream(
                first,
                meta_pb2.RegisterDaemonRequest(inventory=[part(keys[1000:2000], 1000)]),
                meta_pb2.RegisterDaemonRequest(inventory=[part(keys[2000:], 2000)]),
            )
            assert resp.rejected == 0
            assert meta.index.lookup(b"".join(keys))[0] == 3000
            assert meta.index.daemons["s1"].spec.registration == 5
            locs = meta.index.locations(meta.index.lookup(b"".join(keys[1500:1503]), with_locations=True)[2])
            assert [x.offset for x in locs] == [1500 * ALIGN, 1501 * ALIGN, 1502 * ALIGN]
            meta.index.check_integrity()

            bad = [
                (first, meta_pb2.RegisterDaemonRequest(daemon=info("s2"))),  # names the daemon again
                (
                    meta_pb2.RegisterDaemonRequest(daemon=info("s2"), inventory=[part(keys[:3000], 0)]),
                    meta_pb2.RegisterDaemonRequest(inventory=[part(keys[:3000], 0)]),  # 6000 > 5000 slots
                ),
                (),
            ]
            for msgs in bad:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stream(*msgs)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "s2" not in meta.index.daemons
            # An unparsable message in the stream.
            raw = ch.stream_unary(
                "/kvstore.v1.MetaService/RegisterDaemonStream",
                request_serializer=lambda b: b,
                response_deserializer=meta_pb2.RegisterDaemonResponse.FromString,
            )

            async def junk():  # noqa: ANN202
                yield meta_pb2.RegisterDaemonRequest(daemon=info("s3")).SerializeToString()
                yield b"\xff\xff\xff"

            with pytest.raises(grpc.aio.AioRpcError) as e:
                await raw(junk(), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "s3" not in meta.index.daemons
            assert meta.index.lookup(b"".join(keys))[0] == 3000  # the first registration stands
    finally:
        await meta.stop(0)


async def test_a_daemon_sends_a_big_inventory_in_parts_and_each_part_is_a_slice() -> None:
    from kvstore.daemon.registration import send_registration, split_inventory

    rnd = random.Random(4)
    keys = [rnd.getrandbits(128).to_bytes(16, "little") for _ in range(2500)]
    invs = [part(keys[:1500], 0), part(keys[1500:], 1500)]
    parts = split_inventory(invs, part_bytes=20_000)
    assert len(parts) > 5 and all(p for p in parts)
    joined = {c: b"".join(getattr(i, c) for p in parts for i in p) for c in ("keys", "offset", "gen")}
    assert joined == {c: b"".join(getattr(i, c) for i in invs) for c in ("keys", "offset", "gen")}
    meta = MetaServer(MetaConfig(listen="127.0.0.1:0", heartbeat_interval_s=0.05, daemon_ttl_s=30.0))
    port = await meta.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)
            resp = await send_registration(stub, info("p1"), invs, b"", 9, part_bytes=20_000)
            assert resp.rejected == 0 and meta.index.lookup(b"".join(keys))[0] == 2500
            resp = await send_registration(stub, info("p2"), [], b"", 10, part_bytes=20_000)  # small: unary
            assert resp.rejected == 0 and "p2" in meta.index.daemons
    finally:
        await meta.stop(0)


async def test_a_service_without_streamed_registration_gets_one_message() -> None:
    from kvstore.daemon.registration import send_registration

    calls = []

    class OldStub:
        async def RegisterDaemonStream(self, messages, timeout):  # noqa: ANN001, N802
            async for _ in messages:
                pass
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")

        async def RegisterDaemon(self, req, timeout):  # noqa: ANN001, N802
            calls.append(req)
            return meta_pb2.RegisterDaemonResponse(rejected=0)

    keys = [bytes([i]) * 16 for i in range(50)]
    resp = await send_registration(OldStub(), info("o1"), [part(keys, 0)], b"", 3, part_bytes=500)
    assert resp.rejected == 0 and len(calls) == 1 and calls[0].inventory[0].keys == b"".join(keys)
