"""Packing of per-key columns for the gRPC messages (see proto/kvstore/v1/common.proto)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


def locations_to_pb(locs: Sequence) -> pb.Locations:  # noqa: ANN001 - index.Location
    """Column-packs locations; each distinct daemon is sent once."""
    if not locs:
        return pb.Locations()
    index: dict[str, int] = {}
    daemons: list[pb.DaemonInfo] = []
    didx = []
    for loc in locs:
        i = index.get(loc.daemon.daemon_id)
        if i is None:
            i = index[loc.daemon.daemon_id] = len(daemons)
            daemons.append(daemon_to_pb(loc.daemon))
        didx.append(i)
    cols = list(zip(*[(loc.segment_id, loc.offset, loc.length, loc.checksum, loc.tier) for loc in locs]))
    return pb.Locations(
        daemon_index=pack(didx, U16),
        segment_id=pack(cols[0], U32),
        offset=pack(cols[1], U64),
        length=pack(cols[2], U64),
        checksum=pack(cols[3], U64),
        tier=pack(cols[4], U8),
        daemons=daemons,
    )


class Placement:
    """One decoded location, as the client uses it."""

    __slots__ = ("daemon", "segment_id", "offset", "length", "checksum", "tier")

    def __init__(self, daemon: pb.DaemonInfo, segment_id: int, offset: int, length: int, checksum: int, tier: int):
        self.daemon = daemon
        self.segment_id = segment_id
        self.offset = offset
        self.length = length
        self.checksum = checksum
        self.tier = tier


def locations_from_pb(msg: pb.Locations, count: int) -> list[Placement]:
    if count == 0:
        return []
    didx = unpack(msg.daemon_index, U16, "daemon_index", count)
    seg = unpack(msg.segment_id, U32, "segment_id", count)
    off = unpack(msg.offset, U64, "offset", count)
    length = unpack(msg.length, U64, "length", count)
    csum = unpack(msg.checksum, U64, "checksum", count)
    tier = unpack(msg.tier, U8, "tier", count)
    daemons = list(msg.daemons)
    return [Placement(daemons[d], s, o, n, c, t) for d, s, o, n, c, t in zip(didx, seg, off, length, csum, tier)]
