"""A put spanning shards whose commit gets no answer from one shard gives that shard's reservation
back (PutAbort to that shard, for its put id), as a single service's client does: otherwise the
retry is told its blocks are being written (skipped) by the put it gave up. The shards' gRPC
calls are replaced by a recorder (what is tested is which calls the client makes); the shards'
own handling of an abort after a begun commit is tested on real services
(tests/integration/test_faults.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from kvstore.client.shards import ShardedMeta
from kvstore.errors import Timeout
from kvstore.v1 import common_pb2, meta_pb2


async def test_a_shard_whose_commit_fails_gets_an_abort_and_the_others_do_not():
    sm = ShardedMeta("redis://127.0.0.1:1", "c", None, "", 1.0)
    sm._puts[7] = (time.monotonic(), [(0, 100, np.array([0, 1])), (1, 200, np.array([2]))])
    calls = []

    async def call(shard, method, request, timeout=None):  # noqa: ANN001, ANN202
        calls.append((shard, method, request.put_id))
        if method == "PutCommit" and shard == 1:
            raise Timeout("shard 1 did not answer")
        if method == "PutCommit":
            return meta_pb2.PutCommitResponse(committed=2, status=bytes([common_pb2.COMMIT_OK] * 2))
        return meta_pb2.PutAbortResponse(released=1)

    sm.call = call
    req = meta_pb2.PutCommitRequest(put_id=7, checksums=np.arange(3, dtype="<u8").tobytes(), written=bytes([1, 1, 1]))
    resp = await sm.PutCommit(req)
    assert resp.committed == 2
    assert list(resp.status) == [common_pb2.COMMIT_OK, common_pb2.COMMIT_OK, common_pb2.COMMIT_NOT_WRITTEN]
    await asyncio.gather(*list(sm._tasks))
    assert (1, "PutAbort", 200) in calls
    assert [c for c in calls if c[1] == "PutAbort"] == [(1, "PutAbort", 200)]
