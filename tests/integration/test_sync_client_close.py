"""Clients around close(). The blocking client: a call on a closed client, and a call in progress
in another thread when it closes, end with a typed error (Unavailable), never an untyped one or a
hang. Both clients, in a process of their own: closed after puts, lookups (on the lookup port, or
the lookup stream with and without a bearer token, one of them refused by the service) and gets,
they leave no task pending and nothing on stderr (no task destroyed pending, no resource warning)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO
from test_tenants import TOK, auth_file

from kvstore import SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.errors import Unavailable

# Run as `python -c CLIENT META sync|async TOKEN PORT`: every kind of call, then close.
CLIENT = """
import asyncio, gc, sys
import numpy as np
from kvstore import KVStoreClient, SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.errors import InvalidArgument

meta, mode, token, port = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
cfg = ClientConfig(token=token, lookup_port=port, retries=0)
keys = [bytes([i % 256, i // 256]) * 8 for i in range(150)]  # 150: over the service's batch limit
blocks = [np.full(4096, i, np.uint8) for i in range(8)]
out = [np.empty_like(b) for b in blocks]

if mode == "sync":
    c = SyncKVStoreClient(meta, cfg)
    c.put(keys[:8], blocks)
    for _ in range(3):
        assert c.lookup(keys[:8]) == 8 and c.exists(keys[:4]) == [True] * 4
    assert c.get_into(keys[:8], out) == 8 and c.get_into(keys[:8], out) == 8
    try:
        c.lookup(keys)  # refused by the service: on the lookup stream, it ends the stream
    except InvalidArgument:
        pass
    assert c.lookup(keys[:8]) == 8
    c.close()
else:
    async def main():
        async with KVStoreClient(meta, cfg) as c:
            await c.put(keys[:8], blocks)
            for _ in range(3):
                assert await c.lookup(keys[:8]) == 8 and await c.exists(keys[:4]) == [True] * 4
            assert await c.get_into(keys[:8], out) == 8 and await c.get_into(keys[:8], out) == 8
            try:
                await c.lookup(keys)
            except InvalidArgument:
                pass
            assert await c.lookup(keys[:8]) == 8
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not left, f"tasks left pending by close: {left}"
    asyncio.run(main())
gc.collect()
print("closed")
"""


def _quiet_close(meta: str, mode: str, token: str = "", port: bool = True) -> None:
    r = subprocess.run(
        [sys.executable, "-W", "default", "-c", CLIENT, meta, mode, token, "1" if port else "0"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "closed", r.stderr[-3000:]
    assert r.stderr == "", f"{mode} client, token={bool(token)}, lookup port={port}:\n{r.stderr[-3000:]}"


def test_calls_after_close_are_unavailable(store):
    c = SyncKVStoreClient(store.meta_addr)
    assert c.lookup([b"k" * 16]) == 0
    c.close()
    c.close()  # twice is fine
    with pytest.raises(Unavailable, match="closed"):
        c.lookup([b"k" * 16])
    with pytest.raises(Unavailable, match="closed"):
        c.get_into([b"k" * 16], [bytearray(8)])


def test_a_call_in_progress_when_the_client_closes_ends_typed(cluster):
    meta = cluster.start_meta()
    c = SyncKVStoreClient(cluster.meta_addr, ClientConfig(rpc_timeout_s=60, retries=0))
    assert c.lookup([b"k" * 16]) == 0
    meta.p.send_signal(signal.SIGSTOP)  # the service stops answering: the next call waits
    try:
        out: list = []

        def call() -> None:
            try:
                out.append(c.stats())
            except Exception as e:  # noqa: BLE001 - asserted below
                out.append(e)

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.5)
        c.close()
        t.join(10)
        assert not t.is_alive(), "the call hung after close()"
        assert isinstance(out[0], Unavailable), out
    finally:
        meta.p.send_signal(signal.SIGCONT)


def test_clients_close_quietly(cluster):
    cluster.start_meta("meta.max_batch_keys=100")
    cluster.start_daemon()
    for mode in ("sync", "async"):
        for port in (True, False):  # the service offers its lookup port; False: lookups on the stream
            _quiet_close(cluster.meta_addr, mode, port=port)


def test_clients_with_a_token_close_quietly(cluster, tmp_path):
    """With a bearer token the lookup stream goes through the channel's interceptor (and the
    service offers no lookup port); a lookup the service refuses ends that stream before close."""
    cluster.start_meta(f"meta.auth_file={auth_file(tmp_path / 'auth.yaml', 'a', 'node')}", "meta.max_batch_keys=100")
    cluster.start_daemon(f"daemon.token={TOK['node']}", name="node")
    for mode in ("sync", "async"):
        _quiet_close(cluster.meta_addr, mode, token=TOK["a"])
