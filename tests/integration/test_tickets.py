"""Capability tickets on the data port, with real processes: a peer that talks to the data port
directly can only do what the metadata service signed for it. Forged writes over stored blocks,
read tickets used to write, tickets for another extent, expired tickets and replayed write
tickets are all refused, and the stored blocks stay genuine."""

from __future__ import annotations

import socket
import time

import grpc
import numpy as np
import pytest

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient, tickets
from kvstore.extent import checksum
from kvstore.transport.frames import ENTRY, MAGIC, REQ_HEAD, RESP_HEAD, VERSION, FrameStatus, Op
from kvstore.v1 import meta_pb2, meta_pb2_grpc
from kvstore.wire import U64, locations_from_pb, pack

KS = KeySpace(ModelFingerprint("tickets", "bf16", 2, 2, 64))
KEYS = KS.block_keys(np.arange(64))
DATA = [np.full(5000, 40 + i, np.uint8) for i in range(len(KEYS))]


def start(cluster, *meta_sets: str, daemon_sets: tuple[str, ...] = ()):  # noqa: ANN001, ANN201
    cluster.start_meta(*meta_sets)
    cluster.start_daemon(*daemon_sets)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(KEYS, DATA).stored == len(KEYS)
    return cluster


def stub(meta: str):  # noqa: ANN201
    return meta_pb2_grpc.MetaServiceStub(grpc.insecure_channel(meta))


def genuine(meta: str) -> bool:
    with SyncKVStoreClient(meta) as c:
        out = [np.zeros(5000, np.uint8) for _ in KEYS]
        return c.get_into(KEYS, out) == len(KEYS) and all(np.array_equal(a, b) for a, b in zip(out, DATA))


def acquire(meta: str, keys: list[bytes]):  # noqa: ANN201
    r = stub(meta).Acquire(meta_pb2.AcquireRequest(keys=b"".join(keys)), timeout=10)
    return r, locations_from_pb(r.locations, r.hit_count)


def addr_of(p) -> tuple[str, int]:  # noqa: ANN001
    host, _, port = p.daemon.data_addr.rpartition(":")
    return host, int(port)


def entry(key: bytes, p, ticket: bytes, length: int | None = None, csum: int = 0) -> bytes:  # noqa: ANN001
    tag, expiry = tickets.TICKET.unpack(ticket)
    n = p.length if length is None else length
    return ENTRY.pack(key, p.segment_id, expiry, p.offset, n, csum, p.gen, tag)


def send(addr: tuple[str, int], op: Op, entries: list[bytes], payload: bytes = b"") -> tuple[int, bytes]:
    """One frame; (frame status, message or per-entry statuses)."""
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(REQ_HEAD.pack(MAGIC, VERSION, op, 0, 5, len(entries)) + b"".join(entries) + payload)
        head = RESP_HEAD.unpack(s.recv(RESP_HEAD.size, socket.MSG_WAITALL))
        status, count, msg_len = head[1], head[5], head[6]
        if status != FrameStatus.OK:
            return status, s.recv(msg_len, socket.MSG_WAITALL)
        if op == Op.WRITE:
            return status, s.recv(count, socket.MSG_WAITALL)
        return status, s.recv(1, socket.MSG_WAITALL)


def test_a_forged_write_over_a_stored_block_is_refused(cluster):
    start(cluster)
    r, places = acquire(cluster.meta_addr, KEYS[:1])
    p = places[0]
    forged = bytes(5000)
    for ticket in (tickets.NO_TICKET, p.ticket):  # none, and a read ticket used to write
        st, msg = send(
            addr_of(p), Op.WRITE, [entry(KEYS[0], p, ticket, csum=checksum(np.frombuffer(forged, np.uint8)))], forged
        )
        assert st == FrameStatus.BAD_FRAME and b"ticket" in msg, msg
    stub(cluster.meta_addr).Release(meta_pb2.ReleaseRequest(lease_id=r.lease_id), timeout=10)
    assert genuine(cluster.meta_addr)


def test_a_ticket_reads_only_its_own_extent(cluster):
    start(cluster)
    r, places = acquire(cluster.meta_addr, KEYS[:2])
    a, b = places
    # Block 0's ticket, naming block 1's extent: refused. Its own: served.
    st, msg = send(
        addr_of(a), Op.READ, [ENTRY.pack(KEYS[1], b.segment_id, *_exp(a), b.offset, b.length, 0, b.gen, _tag(a))]
    )
    assert st == FrameStatus.BAD_FRAME and b"ticket does not match" in msg
    st, first = send(addr_of(a), Op.READ, [entry(KEYS[0], a, a.ticket)])
    assert st == FrameStatus.OK and first == b"\x00"  # EntryStatus.OK, then the payload
    # A changed expiry no longer matches the MAC.
    tag, expiry = tickets.TICKET.unpack(a.ticket)
    st, msg = send(
        addr_of(a), Op.READ, [ENTRY.pack(KEYS[0], a.segment_id, expiry + 3600, a.offset, a.length, 0, a.gen, tag)]
    )
    assert st == FrameStatus.BAD_FRAME and b"ticket does not match" in msg
    stub(cluster.meta_addr).Release(meta_pb2.ReleaseRequest(lease_id=r.lease_id), timeout=10)
    assert genuine(cluster.meta_addr)


def _tag(p) -> bytes:  # noqa: ANN001
    return tickets.TICKET.unpack(p.ticket)[0]


def _exp(p) -> tuple[int]:  # noqa: ANN001
    return (tickets.TICKET.unpack(p.ticket)[1],)


def test_an_expired_ticket_is_refused(cluster):
    start(cluster, "meta.read_ticket_ttl_s=0", daemon_sets=("daemon.ticket_skew_s=0",))
    r, places = acquire(cluster.meta_addr, KEYS[:1])
    p = places[0]
    r2 = stub(cluster.meta_addr).Acquire(meta_pb2.AcquireRequest(keys=KEYS[0], ttl_ms=1), timeout=10)
    short = locations_from_pb(r2.locations, 1)[0]
    time.sleep(max(0.0, tickets.TICKET.unpack(short.ticket)[1] - time.time()) + 1.2)
    st, msg = send(addr_of(p), Op.READ, [entry(KEYS[0], short, short.ticket)])
    assert st == FrameStatus.BAD_FRAME and b"ticket expired" in msg
    st, _ = send(addr_of(p), Op.READ, [entry(KEYS[0], p, p.ticket)])  # the longer lease's ticket still serves
    assert st == FrameStatus.OK


def test_a_replayed_write_ticket_is_refused(cluster):
    start(cluster)
    s = stub(cluster.meta_addr)
    key = KS.block_keys(np.arange(5000, 5016))[0]
    payload = np.full(3000, 99, np.uint8)
    r = s.PutStart(meta_pb2.PutStartRequest(keys=key, sizes=pack([payload.size], U64)), timeout=10)
    p = locations_from_pb(r.placements, 1)[0]
    frame = [entry(key, p, p.ticket, csum=checksum(payload))]
    st, statuses = send(addr_of(p), Op.WRITE, frame, payload.tobytes())
    assert st == FrameStatus.OK and statuses == b"\x00"
    c = s.PutCommit(meta_pb2.PutCommitRequest(put_id=r.put_id, checksums=pack([checksum(payload)], U64)), timeout=10)
    assert c.committed == 1
    # The same frame again, other bytes: the generation is sealed there, the write is refused.
    other = np.full(3000, 7, np.uint8)
    frame = [entry(key, p, p.ticket, csum=checksum(other))]
    st, statuses = send(addr_of(p), Op.WRITE, frame, other.tobytes())
    assert st == FrameStatus.OK and statuses == b"\x01"  # EntryStatus.MISMATCH: not applied
    with SyncKVStoreClient(cluster.meta_addr) as cl:
        out = np.zeros(3000, np.uint8)
        assert cl.get_into([key], [out]) == 1 and np.array_equal(out, payload)
    assert genuine(cluster.meta_addr)


def test_tickets_can_be_turned_off(cluster):
    start(cluster, "meta.data_tickets=false")
    r, places = acquire(cluster.meta_addr, KEYS[:1])
    p = places[0]
    assert p.ticket == tickets.NO_TICKET
    st, first = send(addr_of(p), Op.READ, [entry(KEYS[0], p, p.ticket)])
    assert st == FrameStatus.OK and first == b"\x00"


@pytest.mark.parametrize("op", [tickets.READ, tickets.WRITE])
def test_ticket_check_unit(op):
    key = tickets.new_key()
    t = tickets.issue(key, op, 1, 4096, 100, 7, b"k" * 16, 10)
    tag, expiry = tickets.TICKET.unpack(t)
    assert tickets.check(key, op, 1, 4096, 100, 7, expiry, b"k" * 16, tag) == ""
    assert "does not match" in tickets.check(key, 3 - op, 1, 4096, 100, 7, expiry, b"k" * 16, tag)
    assert "does not match" in tickets.check(key, op, 1, 8192, 100, 7, expiry, b"k" * 16, tag)
    assert "does not match" in tickets.check(tickets.new_key(), op, 1, 4096, 100, 7, expiry, b"k" * 16, tag)
    assert "expired" in tickets.check(key, op, 1, 4096, 100, 7, int(time.time()) - 3600, b"k" * 16, tag)
    assert "expired" in tickets.check(key, op, 1, 4096, 100, 7, expiry, b"k" * 16, tag, skew_s=-20)


def test_tickets_issued_in_a_batch_equal_one_by_one():
    k1, k2 = tickets.new_key(), tickets.new_key()
    rows = [(1, 4096 * i, 100 + i, 7 + i, bytes([i]) * 16) for i in range(5)]
    keys = [k1, k2, b"", k1, k2]
    batch = tickets.issue_many(keys, tickets.READ, rows, 10)
    size = tickets.TICKET.size
    for i, (key, (seg, off, ln, gen, blk)) in enumerate(zip(keys, rows)):
        t = batch[i * size : (i + 1) * size]
        if not key:
            assert t == tickets.NO_TICKET
            continue
        tag, expiry = tickets.TICKET.unpack(t)
        assert tickets.check(key, tickets.READ, seg, off, ln, gen, expiry, blk, tag) == ""
