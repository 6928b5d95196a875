"""A data port that stalls is given up after the transport's timeout, as Unavailable, over plain
TCP (kernel timeouts on a blocking socket) and over TLS (a Python-level timeout: the ssl module
retries reads that a kernel timeout ended, so those alone would wait for ever)."""

from __future__ import annotations

import socket
import ssl
import time

import numpy as np
import pytest

from kvstore.errors import Unavailable
from kvstore.tickets import NO_TICKET
from kvstore.transport.tcp import TcpTransport


@pytest.fixture
def silent_port():
    """A port whose connections are accepted by the kernel and never answered."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=8)
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


def _read(t: TcpTransport, addr: str) -> None:
    t.read(addr, [(b"k" * 16, 1, 0, 10, 0, 1, NO_TICKET)], [np.zeros(10, np.uint8)])


def test_a_silent_plain_port_is_given_up(silent_port):
    t = TcpTransport(timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(Unavailable):
        _read(t, silent_port)
    assert time.monotonic() - start < 5
    t.close()


def test_a_silent_tls_port_is_given_up(silent_port):
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    t = TcpTransport(timeout_s=0.5, ssl_context=ctx, server_name="daemon")
    start = time.monotonic()
    with pytest.raises(Unavailable):
        _read(t, silent_port)
    assert time.monotonic() - start < 5
    t.close()
