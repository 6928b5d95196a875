"""Mutual TLS with real processes: a metadata service and a daemon (separate processes) with
certificates from ``kvstore certs``; clients with the right certificate store and read over
TCP and shared memory; a client without a certificate, with one from another CA, or speaking
plaintext is refused (gRPC and data port); plaintext servers refuse non-loopback addresses."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys

import grpc
import numpy as np
import pytest

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.certs import make
from kvstore.config import ClientConfig
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.tls import TlsConfig, check_listen, is_loopback
from kvstore.transport.frames import MAGIC, REQ_HEAD, RESP_HEAD, VERSION, FrameStatus, Op

KS = KeySpace(ModelFingerprint("tls", "bf16", 2, 2, 64))
KEYS = KS.block_keys(np.arange(128))
DATA = [np.random.default_rng(i).integers(0, 256, 70_000, dtype=np.uint8) for i in range(len(KEYS))]


def tls_of(d, name: str) -> TlsConfig:  # noqa: ANN001
    return TlsConfig(ca=str(d / "ca.pem"), cert=str(d / f"{name}.pem"), key=str(d / f"{name}.key"))


def sets(t: TlsConfig) -> list[str]:
    return [f"tls.ca={t.ca}", f"tls.cert={t.cert}", f"tls.key={t.key}"]


@pytest.fixture
def secured(cluster, tmp_path):  # noqa: ANN001
    certs = tmp_path / "certs"
    make(certs, ("meta", "daemon", "client"))
    make(tmp_path / "other", ("client",))  # another CA
    cluster.start_meta(*sets(tls_of(certs, "meta")))
    cluster.start_daemon(*sets(tls_of(certs, "daemon")))
    cluster.certs = certs
    cluster.other = tmp_path / "other"
    return cluster


def data_addr(cluster, tls: TlsConfig) -> tuple[str, int]:  # noqa: ANN001
    with SyncKVStoreClient(cluster.meta_addr, tls=tls) as c:
        addr = c.stats().daemons[0].info.data_addr
    host, _, port = addr.rpartition(":")
    return host, int(port)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_client_with_a_certificate_stores_and_reads(secured, transport):
    t = tls_of(secured.certs, "client")
    with SyncKVStoreClient(secured.meta_addr, ClientConfig(transport=transport), tls=t) as c:
        assert c.put(KEYS, DATA).stored == len(KEYS)
        out = [np.zeros_like(b) for b in DATA]
        assert c.get_into(KEYS, out) == len(KEYS)
        assert all(np.array_equal(a, b) for a, b in zip(out, DATA))


def test_grpc_without_a_valid_certificate_is_refused(secured):
    for bad in (None, tls_of(secured.other, "client")):
        with pytest.raises(KVStoreError):
            with SyncKVStoreClient(secured.meta_addr, ClientConfig(rpc_timeout_s=3, retries=0), tls=bad) as c:
                c.stats()


def test_the_data_port_refuses_plaintext_and_foreign_certificates(secured):
    good = tls_of(secured.certs, "client")
    addr = data_addr(secured, good)
    ping = REQ_HEAD.pack(MAGIC, VERSION, Op.PING, 0, 1, 0)
    # Plaintext: the daemon expects a TLS handshake and closes.
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(ping)
        s.settimeout(10)
        try:
            reply = s.recv(RESP_HEAD.size)
        except ConnectionError:
            reply = b""
        assert not reply.startswith(MAGIC), "a plaintext frame was served"
    # A certificate from another CA, and none at all: the handshake fails.
    other = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    other.load_verify_locations(good.ca)
    other.load_cert_chain(str(secured.other / "client.pem"), str(secured.other / "client.key"))
    anon = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anon.load_verify_locations(good.ca)
    for ctx in (other, anon):
        with socket.create_connection(addr, timeout=10) as raw:
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                with ctx.wrap_socket(raw, server_hostname="kvstore") as s:
                    s.sendall(ping)  # TLS 1.3 reports the refused certificate on first use
                    if not s.recv(RESP_HEAD.size):
                        raise ConnectionError("closed")
    # The right certificate is served.
    ok = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ok.load_verify_locations(good.ca)
    ok.load_cert_chain(good.cert, good.key)
    with socket.create_connection(addr, timeout=10) as raw, ok.wrap_socket(raw, server_hostname="kvstore") as s:
        s.sendall(ping)
        assert RESP_HEAD.unpack(s.recv(RESP_HEAD.size))[1] == FrameStatus.OK


def test_plaintext_is_refused_off_loopback_unless_allowed(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")
    with pytest.raises(InvalidArgument, match="refusing to listen in plaintext on 0.0.0.0:7100"):
        check_listen("0.0.0.0:7100", None, "meta.listen")
    check_listen("0.0.0.0:7100", TlsConfig(allow_plaintext=True), "meta.listen")
    check_listen("127.0.0.1:0", None, "meta.listen")
    # The command refuses it too, with a clear message and exit status.
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "meta", "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "refusing to listen in plaintext" in r.stderr


def test_tls_settings_are_checked(tmp_path):
    with pytest.raises(InvalidArgument, match="tls.cert, tls.key: TLS needs"):
        SyncKVStoreClient("127.0.0.1:1", tls=TlsConfig(ca=str(tmp_path / "x")))
    (tmp_path / "junk.pem").write_text("not a certificate")
    bad = TlsConfig(ca=str(tmp_path / "junk.pem"), cert=str(tmp_path / "junk.pem"), key=str(tmp_path / "junk.pem"))
    with pytest.raises(InvalidArgument, match="is not a PEM file"):
        SyncKVStoreClient("127.0.0.1:1", tls=bad)


def test_only_the_service_drives_a_daemon(secured):
    # The daemon's control API (commit, move, invalidate, inventory) answers the metadata
    # service's certificate only: a client's, though signed by the same CA, is refused.
    from kvstore.v1 import daemon_pb2, daemon_pb2_grpc

    good = tls_of(secured.certs, "client")
    with SyncKVStoreClient(secured.meta_addr, tls=good) as c:
        ctl = c.stats().daemons[0].info.control_addr
    ca, cert, key = (open(p, "rb").read() for p in (good.ca, good.cert, good.key))
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    with grpc.secure_channel(ctl, creds, options=[("grpc.ssl_target_name_override", "kvstore")]) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            daemon_pb2_grpc.DaemonControlStub(ch).GetInventory(daemon_pb2.InventoryRequest(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("sealed", [True, False])
def test_tcp_reads_and_writes_with_sealed_records_or_tls_records(secured, sealed):
    t = tls_of(secured.certs, "client")
    t.sealed_records = sealed
    keys = KS.block_keys(np.arange(16 * 24) + 10_000)
    assert len(keys) == 24
    data = [np.random.default_rng(100 + i).integers(0, 256, 300_000 + i, dtype=np.uint8) for i in range(len(keys))]
    # Two blocks of several records each (a sealed record holds at most 1 MiB): one read of a
    # payload then takes several answers of the sealed socket.
    data[-2:] = [np.random.default_rng(7 + i).integers(0, 256, (3 << 20) + 5 + i, dtype=np.uint8) for i in range(2)]
    with SyncKVStoreClient(secured.meta_addr, ClientConfig(transport="tcp"), tls=t) as c:
        assert c.put(keys, data).stored == len(keys)
        out = [np.zeros_like(b) for b in data]
        assert c.get_into(keys, out) == len(keys)
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        c.remove(keys)


class FlippingRelay:
    """A TCP relay to ``target`` that flips one bit of the daemon's stream at byte ``at`` (past
    the TLS handshake: inside the sealed records)."""

    def __init__(self, target: tuple[str, int], at: int) -> None:
        self.target, self.at = target, at
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.flipped = 0
        import threading

        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(a, b, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(b, a, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while chunk := src.recv(65536):
                if flip and seen <= self.at < seen + len(chunk):
                    chunk = bytearray(chunk)
                    chunk[self.at - seen] ^= 0x10
                    self.flipped += 1
                seen += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.srv.close()


def test_a_bit_flipped_on_the_wire_is_a_miss_never_wrong_bytes(secured):
    """An attacker on the network path alters one bit of a sealed record carrying payload: the
    get loads nothing from that connection (a miss), and what it does report loaded is exact;
    the stored blocks are untouched, so a clean read afterwards gets them all."""
    t = tls_of(secured.certs, "client")
    keys = KS.block_keys(np.arange(16 * 8) + 20_000)
    assert len(keys) == 8
    data = [np.random.default_rng(200 + i).integers(0, 256, 256 << 10, dtype=np.uint8) for i in range(len(keys))]
    host, port = data_addr(secured, t)
    relay = FlippingRelay((host, port), at=1 << 20)
    try:
        with SyncKVStoreClient(secured.meta_addr, ClientConfig(transport="tcp", io_threads=1), tls=t) as c:
            assert c.put(keys, data).stored == len(keys)
            tcp = c._client._tcp
            connect = tcp._connect
            tcp.close()  # no pooled connection around the relay
            tcp._connect = lambda addr: connect(relay.addr)
            out = [np.zeros_like(b) for b in data]
            got = c.get_into(keys, out)
            assert relay.flipped == 1
            assert got < len(keys), "a get through an altered stream loaded every block"
            assert all(np.array_equal(out[i], data[i]) for i in range(got))
            tcp._connect = connect
            tcp.close()
            clean = [np.zeros_like(b) for b in data]
            assert c.get_into(keys, clean) == len(keys)
            assert all(np.array_equal(a, b) for a, b in zip(clean, data))
    finally:
        relay.close()
