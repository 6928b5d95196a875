"""Lookups on the long-lived stream (MetaService.LookupStream) with a real service: the same
answers as unary lookups, pipelined callers each get their own answer, and bad input ends the
stream with a typed error while the client carries on."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from kvstore import KeySpace, KVStoreClient, ModelFingerprint
from kvstore.errors import InvalidArgument
from kvstore.v1 import meta_pb2, meta_pb2_grpc

KS = KeySpace(ModelFingerprint("stream-model", "bf16", 2, 2, 64))


def chain(n: int, start: int = 0) -> list[bytes]:
    return KS.block_keys(np.arange(start, start + 16 * n))


def test_streamed_lookups_answer_as_unary_ones_and_in_order(store):
    async def go() -> None:
        keys = chain(40)
        async with KVStoreClient(store.meta_addr) as c:
            await c.put(keys[:25], [np.full(4096, i, np.uint8) for i in range(25)])
            unary = meta_pb2_grpc.MetaServiceStub(c._channel)
            for n in (1, 10, 25, 40):
                want = (await unary.Lookup(meta_pb2.LookupRequest(keys=b"".join(keys[:n])))).hit_count
                assert await c.lookup(keys[:n]) == want == min(n, 25)
            assert await c.exists(keys[20:30]) == [True] * 5 + [False] * 5
            # 200 lookups in flight at once, each with its own answer (a prefix of its own length).
            lens = [int(x) for x in np.random.default_rng(0).integers(1, 41, 200)]
            got = await asyncio.gather(*(c.lookup(keys[:n]) for n in lens))
            assert got == [min(n, 25) for n in lens]
            s = await c.stats()
            assert s.counters["lookups"] >= 205

    asyncio.run(go())


def test_bad_input_ends_the_stream_with_a_typed_error_and_the_client_carries_on(store):
    with grpc.insecure_channel(store.meta_addr) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        reqs = iter([meta_pb2.LookupRequest(keys=b"k" * 16), meta_pb2.LookupRequest(keys=b"x" * 17)])
        answers = stub.LookupStream(reqs, timeout=10)
        assert next(answers).hit_count == 0
        with pytest.raises(grpc.RpcError) as e:
            next(answers)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "multiple of 16" in e.value.details()

    async def go() -> None:
        async with KVStoreClient(store.meta_addr) as c:
            with pytest.raises(InvalidArgument):
                await c.lookup([])
            assert await c.lookup(chain(3)) == 0

    asyncio.run(go())


def test_a_request_the_service_refuses_fails_only_its_own_caller(cluster):
    """The service takes batches of at most 100 keys: a lookup of 150 is refused on the stream, and
    the lookups pipelined with it on the same stream still get their answers."""
    cluster.start_meta("meta.max_batch_keys=100")
    cluster.start_daemon()
    keys = chain(150)

    async def go() -> None:
        async with KVStoreClient(cluster.meta_addr) as c:
            await c.put(keys[:30], [np.full(1024, i, np.uint8) for i in range(30)])
            for _ in range(5):
                calls = [c.lookup(keys[:n]) for n in (10, 20, 40)]
                calls.insert(1, c.lookup(keys))
                got = await asyncio.gather(*calls, return_exceptions=True)
                assert isinstance(got[1], InvalidArgument) and "over the limit of 100" in str(got[1])
                assert got[:1] + got[2:] == [10, 20, 30]

    asyncio.run(go())
