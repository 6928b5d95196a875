"""Bad input gets a typed error naming the problem, and nothing stored changes."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from conftest import raw_call

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.errors import InvalidArgument, NotFound
from kvstore.transport.frames import ENTRY, MAGIC, REQ_HEAD, RESP_HEAD, VERSION, FrameStatus, Op
from kvstore.v1 import meta_pb2
from kvstore.wire import U64, pack

KS = KeySpace(ModelFingerprint("bad-input", "bf16", 2, 2, 64))
KEYS = KS.block_keys(np.arange(64))
DATA = [np.full(5000, i, np.uint8) for i in range(4)]


@pytest.fixture
def loaded(store):
    with SyncKVStoreClient(store.meta_addr) as c:
        assert c.put(KEYS, DATA).stored == 4
    return store


def assert_unchanged(meta: str) -> None:
    with SyncKVStoreClient(meta) as c:
        out = [np.zeros(5000, np.uint8) for _ in KEYS]
        assert c.get_into(KEYS, out) == 4
        assert all(np.array_equal(a, b) for a, b in zip(out, DATA))
        s = c.stats()
        assert s.keys == 4 and s.pending_puts == 0 and s.segments[0].blocks == 4


@pytest.mark.parametrize(
    "method,request_,match",
    [
        ("Lookup", meta_pb2.LookupRequest(keys=b"x" * 15), "multiple of 16"),
        ("Lookup", meta_pb2.LookupRequest(keys=b""), "empty batch"),
        ("Lookup", meta_pb2.LookupRequest(keys=b"k" * 16 * 16385), "over the limit of 16384"),
        ("Acquire", meta_pb2.AcquireRequest(keys=b"x" * 33), "multiple of 16"),
        ("Acquire", meta_pb2.AcquireRequest(keys=b"k" * 16, ttl_ms=10**9), "lease ttl"),
        ("PutStart", meta_pb2.PutStartRequest(keys=b"a" * 32, sizes=pack([100], U64)), "1 values for 2 keys"),
        ("PutStart", meta_pb2.PutStartRequest(keys=b"a" * 16, sizes=pack([0], U64)), r"sizes\[0\]: block size"),
        ("PutStart", meta_pb2.PutStartRequest(keys=b"a" * 16, sizes=pack([2**63], U64)), r"sizes\[0\]: block size"),
        ("PutStart", meta_pb2.PutStartRequest(keys=b"a" * 16, sizes=pack([512 << 20], U64)), "larger than any segment"),
        ("PutStart", meta_pb2.PutStartRequest(keys=b"a" * 16, sizes=b"\x01\x02\x03"), "not a whole number"),
        ("PutStart", meta_pb2.PutStartRequest(keys=b"a" * 32, sizes=pack([10, 10], U64)), "repeat a key"),
        ("Remove", meta_pb2.KeysRequest(keys=b"x" * 17), "multiple of 16"),
        ("Pin", meta_pb2.KeysRequest(keys=b""), "empty batch"),
        ("Release", meta_pb2.ReleaseRequest(lease_id=12345), "lease 12345 is unknown"),
        ("PutAbort", meta_pb2.PutAbortRequest(put_id=999), "put 999 is unknown"),
    ],
)
def test_metadata_rpc_bad_input_is_typed_and_changes_nothing(loaded, method, request_, match):
    with pytest.raises((InvalidArgument, NotFound), match=match) as ei:
        raw_call(loaded.meta_addr, method, request_)
    assert not ei.value.retryable
    assert_unchanged(loaded.meta_addr)


def test_put_commit_of_unknown_put_is_expired_error(loaded):
    from kvstore.errors import Expired

    with pytest.raises(Expired, match="unknown or past its deadline"):
        raw_call(loaded.meta_addr, "PutCommit", meta_pb2.PutCommitRequest(put_id=42, checksums=pack([1], U64)))
    assert_unchanged(loaded.meta_addr)


def test_put_commit_with_wrong_checksum_count(loaded):
    resp = raw_call(
        loaded.meta_addr,
        "PutStart",
        meta_pb2.PutStartRequest(keys=b"q" * 16, sizes=pack([100], U64)),
    )
    with pytest.raises(InvalidArgument, match="2 for 1 allocated"):
        raw_call(
            loaded.meta_addr, "PutCommit", meta_pb2.PutCommitRequest(put_id=resp.put_id, checksums=pack([1, 2], U64))
        )
    raw_call(loaded.meta_addr, "PutAbort", meta_pb2.PutAbortRequest(put_id=resp.put_id))
    assert_unchanged(loaded.meta_addr)


def test_client_side_bad_input(loaded):
    with SyncKVStoreClient(loaded.meta_addr) as c:
        with pytest.raises(InvalidArgument, match="key 1 must be 16 bytes, got 15"):
            c.lookup([KEYS[0], b"short-key-15byt"])
        with pytest.raises(InvalidArgument, match="3 buffers for 4 keys"):
            c.put(KEYS, DATA[:3])
        with pytest.raises(InvalidArgument, match=r"buffers\[2\] holds 4999 bytes but block 2 is 5000"):
            c.get_into(KEYS, [np.zeros(5000 if i != 2 else 4999, np.uint8) for i in range(4)])
        with pytest.raises(InvalidArgument, match="read-only"):
            c.get_into(KEYS[:1], [bytes(5000)])
        with pytest.raises(InvalidArgument, match="not C-contiguous"):
            c.get_into(KEYS[:1], [np.zeros((100, 100), np.uint8)[:, :50]])
        with pytest.raises(InvalidArgument, match="empty"):
            c.put([KS.block_keys(np.arange(500, 516))[0]], [b""])
        with pytest.raises(InvalidArgument, match="buffer protocol"):
            c.put(KEYS[:1], [object()])
    assert_unchanged(loaded.meta_addr)


def _data_port(loaded) -> tuple[str, int]:
    with SyncKVStoreClient(loaded.meta_addr) as c:
        addr = c.stats().daemons[0].info.data_addr
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _frame_error(addr: tuple[str, int], payload: bytes) -> str:
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(payload)
        head = s.recv(RESP_HEAD.size, socket.MSG_WAITALL)
        magic, status, _op, _f, _rid, _count, msg_len = RESP_HEAD.unpack(head)
        assert magic == MAGIC and status == FrameStatus.BAD_FRAME
        msg = s.recv(msg_len, socket.MSG_WAITALL).decode()
        assert s.recv(1) == b""  # the daemon closed the connection
        return msg


@pytest.mark.parametrize(
    "payload,match",
    [
        (b"HTTP" + bytes(16), "bad magic"),
        (REQ_HEAD.pack(MAGIC, 9, Op.READ, 0, 1, 0), "unsupported protocol version 9"),
        (REQ_HEAD.pack(MAGIC, VERSION, 77, 0, 1, 0), "unknown op 77"),
        (REQ_HEAD.pack(MAGIC, VERSION, Op.READ, 0, 1, 10**6), "over the limit"),
        (
            REQ_HEAD.pack(MAGIC, VERSION, Op.READ, 0, 1, 1) + ENTRY.pack(b"k" * 16, 42, 0, 0, 10, 0, 0, bytes(16)),
            "unknown segment 42",
        ),
        (
            REQ_HEAD.pack(MAGIC, VERSION, Op.READ, 0, 1, 1) + ENTRY.pack(b"k" * 16, 1, 0, 2**40, 10, 0, 0, bytes(16)),
            "outside segment",
        ),
        (
            REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 1, 1) + ENTRY.pack(b"k" * 16, 1, 0, 0, 0, 0, 0, bytes(16)),
            "length 0",
        ),
        (
            REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 1, 1) + ENTRY.pack(b"k" * 16, 1, 0, 0, 2**62, 0, 0, bytes(16)),
            "outside segment",
        ),
    ],
)
def test_malformed_data_port_frames(loaded, payload, match):
    msg = _frame_error(_data_port(loaded), payload)
    assert match in msg
    assert_unchanged(loaded.meta_addr)


def test_data_port_write_without_a_ticket_is_refused(loaded):
    # A well-formed write the service did not hand out (no capability ticket) is not applied.
    host, port = _data_port(loaded)
    payload = bytes(256)
    with socket.create_connection((host, port), timeout=10) as s:
        off = 32 << 20  # free space in the 64 MiB segment
        s.sendall(
            REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 7, 1)
            + ENTRY.pack(b"z" * 16, 1, 0, off, 256, 12345, 0, bytes(16))
            + payload
        )
        head = RESP_HEAD.unpack(s.recv(RESP_HEAD.size, socket.MSG_WAITALL))
        assert head[1] == FrameStatus.BAD_FRAME
        assert "ticket" in s.recv(head[6], socket.MSG_WAITALL).decode()
    assert_unchanged(loaded.meta_addr)


def test_unknown_config_key_is_refused_by_name(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "meta", "--set", "meta.listne=127.0.0.1:0"],
        capture_output=True,
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 2
    assert b"unknown config key meta.listne" in r.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("daemon:\n  dram: 1GiB\n")
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "daemon", "--config", str(cfg)], capture_output=True, cwd=REPO, timeout=60
    )
    assert r.returncode == 2 and b"unknown config key daemon.dram" in r.stderr


def test_a_client_that_raises_mid_call_releases_its_lease_and_aborts_its_put(loaded):
    with SyncKVStoreClient(loaded.meta_addr) as c:
        inner = c._client

        def boom(*_a, **_k):  # noqa: ANN002, ANN003
            raise RuntimeError("the caller's buffer went away")

        inner._read_run, inner._write_all = boom, boom  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            c.get_into(KEYS[:4], [np.zeros(5000, np.uint8) for _ in range(4)])
        with pytest.raises(RuntimeError):
            c.put(KS.block_keys(np.arange(1000, 1032))[:2], [np.ones(5000, np.uint8)] * 2)
    # Both went at once (the lease TTL is 10 s and the put deadline 30 s: far longer than this).
    with SyncKVStoreClient(loaded.meta_addr) as c:
        s = c.stats()
        assert s.active_leases == 0 and s.pending_puts == 0
    assert_unchanged(loaded.meta_addr)


def test_an_inventory_larger_than_its_segment_is_refused_before_decoding(loaded):
    from kvstore.v1 import common_pb2

    info = common_pb2.DaemonInfo(
        daemon_id="liar",
        host_id="h",
        data_addr="127.0.0.1:1",
        control_addr="127.0.0.1:1",
        segments=[common_pb2.Segment(segment_id=1, tier=1, capacity_bytes=8 * 256)],  # 8 slots of ALIGN
    )
    inv = common_pb2.Inventory(segment_id=1, keys=b"k" * 16 * 9)  # 9 blocks in 8 slots
    with pytest.raises(InvalidArgument, match="9 blocks cannot fit it"):
        raw_call(loaded.meta_addr, "RegisterDaemon", meta_pb2.RegisterDaemonRequest(daemon=info, inventory=[inv]))
    inv = common_pb2.Inventory(segment_id=7, keys=b"k" * 16)
    with pytest.raises(InvalidArgument, match="segment is not declared"):
        raw_call(loaded.meta_addr, "RegisterDaemon", meta_pb2.RegisterDaemonRequest(daemon=info, inventory=[inv]))
    assert_unchanged(loaded.meta_addr)
