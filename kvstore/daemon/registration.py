"""Sending a registration: the daemon's inventory in one RegisterDaemon call, or, past what one
message may carry (the channel's limit is 256 MiB; ten million blocks are about 560 MB), in
parts on one RegisterDaemonStream call (:mod:`kvstore.meta.daemon_calls`), each part a slice of
the packed columns, never a Python object per block.
"""

from __future__ import annotations

import grpc

from kvstore.keys import KEY_BYTES
from kvstore.v1 import common_pb2, meta_pb2

# Inventory bytes per message of a streamed registration (about 300,000 blocks): each message is
# parsed on the service's event loop, about 10 ms a part.
PART_BYTES = 16 << 20
_COLUMNS = ("offset", "length", "checksum", "gen", "size")


def _rows(inv: common_pb2.Inventory) -> int:
    return len(inv.keys) // KEY_BYTES


def split_inventory(invs: list[common_pb2.Inventory], part_bytes: int = PART_BYTES) -> list[list[common_pb2.Inventory]]:
    """The inventory messages cut into parts of at most about ``part_bytes`` each (at least one
    block a part), in order. Each message's columns are read out once (a read of a bytes field
    copies it) and sliced."""
    parts: list[list[common_pb2.Inventory]] = [[]]
    room = part_bytes
    for inv in invs:
        n = _rows(inv)
        per_row = max(1, inv.ByteSize() // max(1, n))
        keys = inv.keys
        cols = {c: v for c in _COLUMNS if (v := getattr(inv, c))}
        lo = 0
        while lo < n:
            if room < per_row and parts[-1]:
                parts.append([])
                room = part_bytes
            take = max(1, min(n - lo, room // per_row))
            parts[-1].append(
                common_pb2.Inventory(
                    segment_id=inv.segment_id,
                    keys=keys[KEY_BYTES * lo : KEY_BYTES * (lo + take)],
                    **{c: v[8 * lo : 8 * (lo + take)] for c, v in cols.items()},
                )
            )
            room -= take * per_row
            lo += take
    return [p for p in parts if p] or [[]]


async def send_registration(
    stub,  # noqa: ANN001 - meta_pb2_grpc.MetaServiceStub
    info: common_pb2.DaemonInfo,
    invs: list[common_pb2.Inventory],
    ticket_key: bytes,
    registration: int,
    part_bytes: int = PART_BYTES,
) -> meta_pb2.RegisterDaemonResponse:
    """Registers with one call, streamed in parts when the inventory passes ``part_bytes``. The
    call's deadline grows with the inventory (the service adopts a few million blocks a second)."""
    blocks = sum(_rows(inv) for inv in invs)
    timeout = 30.0 + blocks / 200_000
    if sum(inv.ByteSize() for inv in invs) <= part_bytes:
        req = meta_pb2.RegisterDaemonRequest(
            daemon=info, inventory=invs, ticket_key=ticket_key, registration=registration
        )
        return await stub.RegisterDaemon(req, timeout=timeout)
    parts = split_inventory(invs, part_bytes)

    async def messages():  # noqa: ANN202
        yield meta_pb2.RegisterDaemonRequest(
            daemon=info, inventory=parts[0], ticket_key=ticket_key, registration=registration
        )
        for p in parts[1:]:
            yield meta_pb2.RegisterDaemonRequest(inventory=p)

    try:
        return await stub.RegisterDaemonStream(messages(), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        # A service from before streamed registrations: one message (refused if too large).
        req = meta_pb2.RegisterDaemonRequest(
            daemon=info, inventory=invs, ticket_key=ticket_key, registration=registration
        )
        return await stub.RegisterDaemon(req, timeout=timeout)
