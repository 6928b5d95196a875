"""The blocking client around close(): a call on a closed client, and a call in progress in
another thread when it closes, end with a typed error (Unavailable), never an untyped one or a hang."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from kvstore import SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.errors import Unavailable


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
