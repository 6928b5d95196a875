"""Packing of per-key columns for the gRPC messages (see proto/kvstore/v1/common.proto)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvstore import tickets
from kvstore.errors import InvalidArgument
from kvstore.v1 import common_pb2 as pb

U8, U16, U32, U64 = np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8")


def pack(values: Sequence[int], dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes() if len(values) else b""


def unpack(data: bytes, dtype: np.dtype, what: str, count: int | None = None) -> list[int]:
    """A packed column as a list of ints; ``count`` (if given) must match."""
    if len(data) % dtype.itemsize:
        raise InvalidArgument(f"{what}: {len(data)} bytes is not a whole number of {dtype.itemsize}-byte values")
    n = len(data) // dtype.itemsize
    if count is not None and n != count:
        raise InvalidArgument(f"{what}: {n} values for {count} keys")
    return np.frombuffer(data, dtype=dtype).tolist() if n else []


def leading(flags: bytes | bytearray, mask: int = 0xFF) -> int:
    """Length of the leading run of per-key flag bytes with any bit of ``mask`` set."""
    n = 0
    for f in flags:
        if not f & mask:
            break
        n += 1
    return n


def daemon_to_pb(spec) -> pb.DaemonInfo:  # noqa: ANN001 - kvstore.meta.index.DaemonSpec
    return pb.DaemonInfo(
        daemon_id=spec.daemon_id,
        host_id=spec.host_id,
        data_addr=spec.data_addr,
        control_addr=spec.control_addr,
        segments=[
            pb.Segment(segment_id=s.segment_id, tier=int(s.tier), capacity_bytes=s.capacity, shm_path=s.shm_path)
            for s in spec.segments
        ],
    )


ROW_DTYPE = np.dtype(
    [("ref", "<u4"), ("reserved", "<u4"), ("offset", "<u8"), ("length", "<u8"), ("checksum", "<u8"), ("gen", "<u8")]
)


def pack_rows(p) -> bytes:  # noqa: ANN001 - kvstore.meta.records.Places
    """Places as the wire's packed location rows (:data:`ROW_DTYPE`), in one pass."""
    rows = np.zeros(len(p), dtype=ROW_DTYPE)
    rows["ref"], rows["offset"], rows["length"] = p.refs, p.offset, p.length
    rows["checksum"], rows["gen"] = p.checksum, p.gen
    return rows.tobytes()


def places_to_pb(p, op: int = 0, ttl_s: float = 0.0, keys: bool = False) -> pb.Locations:  # noqa: ANN001
    """Packs replicas (:class:`kvstore.meta.records.Places`, columns) as location rows, in one
    pass, plus one SegmentRef per distinct segment, and with ``op`` (tickets.READ or WRITE) a
    capability ticket per row for ``ttl_s`` seconds, signed with each daemon's ticket key (none
    for daemons without one); with ``keys``, the keys the blocks are stored under."""
    if not len(p):
        return pb.Locations()
    signed = b""
    segs = p.segments
    if op and any(s.daemon.spec.ticket_key for s in segs.values()):
        refs = p.refs.tolist()
        signed = tickets.issue_many(
            [segs[r].daemon.spec.ticket_key for r in refs],
            op,
            [
                (segs[r].spec.segment_id, off, ln, gen, p.keys[16 * i : 16 * i + 16])
                for i, (r, off, ln, gen) in enumerate(zip(refs, p.offset.tolist(), p.length.tolist(), p.gen.tolist()))
            ],
            ttl_s,
        )
    return pb.Locations(
        keys=p.keys if keys else b"",
        tickets=signed,
        rows=pack_rows(p),
        segments=[_segment_ref(s) for s in segs.values()],
    )


def _segment_ref(s) -> pb.SegmentRef:  # noqa: ANN001 - kvstore.meta.records.Segment
    """A segment as location messages describe it, built once per segment (its spec does not change)."""
    ref = s.pb_ref
    if ref is None:
        ref = s.pb_ref = pb.SegmentRef(
            ref=s.ref, daemon=daemon_to_pb(s.daemon.spec), segment_id=s.spec.segment_id, tier=int(s.spec.tier)
        )
    return ref


class Placement(NamedTuple):
    """One decoded location, as the client uses it."""

    daemon: pb.DaemonInfo
    segment: pb.Segment
    offset: int
    length: int
    checksum: int
    gen: int = 0
    ticket: bytes = tickets.NO_TICKET  # mac | expiry for the data port
    key: bytes = b""  # the key the block is stored under, where it differs from the one asked for

    @property
    def segment_id(self) -> int:
        return self.segment.segment_id


def locations_from_pb(msg: pb.Locations, count: int) -> list[Placement]:
    """Decodes ``count`` location rows; raises InvalidArgument if the message does not hold them."""
    if count == 0:
        return []
    # Each read of a bytes field copies it out of the message: read once, sliced after.
    rows_raw, keys_raw, tickets_raw = msg.rows, msg.keys, msg.tickets
    if len(rows_raw) != count * ROW_DTYPE.itemsize:
        raise InvalidArgument(f"locations: {len(rows_raw)} bytes of rows for {count} keys")
    if keys_raw and len(keys_raw) != count * 16:
        raise InvalidArgument(f"locations: {len(keys_raw)} bytes of keys for {count} keys")
    stored = [keys_raw[i : i + 16] for i in range(0, 16 * count, 16)] if keys_raw else [b""] * count
    size = tickets.TICKET.size
    if tickets_raw and len(tickets_raw) != count * size:
        raise InvalidArgument(f"locations: {len(tickets_raw)} bytes of tickets for {count} keys")
    signed = (
        [tickets_raw[i : i + size] for i in range(0, size * count, size)]
        if tickets_raw
        else [tickets.NO_TICKET] * count
    )
    table = {}
    for ref in msg.segments:
        seg = next((s for s in ref.daemon.segments if s.segment_id == ref.segment_id), None)
        if seg is None:
            seg = pb.Segment(segment_id=ref.segment_id, tier=ref.tier)
        table[ref.ref] = (ref.daemon, seg)
    out = []
    rows = np.frombuffer(rows_raw, dtype=ROW_DTYPE).tolist()
    for (ref, _r, off, length, csum, gen), ticket, key in zip(rows, signed, stored):
        if ref not in table:
            raise InvalidArgument(f"locations: row names segment ref {ref}, which the message does not describe")
        daemon, seg = table[ref]
        out.append(Placement(daemon, seg, off, length, csum, gen, ticket, key))
    return out
