"""The data port's check of a frame's entries (:func:`check_entries`): what a READ or WRITE may
name, and the capability ticket each entry must carry. Pure but for the memo of verified tickets:
the frame parser that the property tests and the atheris harness drive."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore import tickets
from kvstore.extent import HEADER_SIZE
from kvstore.transport.frames import FrameError, Op, TicketError

# Tickets remembered as verified (DataPort), at most.
_VERIFIED_MAX = 1 << 16


def check_entries(
    entries: list[tuple],
    op: int,
    segments: dict,
    max_block_bytes: int,
    ticket_key: bytes | Callable[[int, int], bytes],
    skew_s: float,
    verified: dict | None = None,
) -> list:
    """The segments (anything with a ``size``) that a frame's entries name, once every entry is
    checked: a known segment, an extent inside it, a length within ``max_block_bytes``, and
    (given a ``ticket_key``, or a function of (segment id, offset) giving the key of that extent's
    metadata shard) a capability ticket for exactly this entry. Pure but for ``verified``: the
    frame parser that the property tests and the atheris harness drive. Raises FrameError.

    ``verified`` (optional) remembers tickets whose MAC matched, with everything the MAC covers
    and the key that checked it, so that a ticket used again (a client re-reading a block it
    knows) costs a lookup instead of a keyed hash; its expiry is checked every time. Bounded by
    ``_VERIFIED_MAX`` entries (cleared when full)."""
    arenas = []
    signed = bool(ticket_key) and op in (Op.READ, Op.WRITE)
    top = tickets.READ if op == Op.READ else tickets.WRITE
    for i, (key, seg_id, expiry, off, length, _c, gen, tag) in enumerate(entries):
        arena = segments.get(seg_id)
        if arena is None:
            raise FrameError(f"entry {i}: unknown segment {seg_id}")
        if length <= 0 or off < 0 or off + HEADER_SIZE + length > arena.size:
            raise FrameError(
                f"entry {i}: extent offset {off} length {length} is outside segment {seg_id} of {arena.size} bytes"
            )
        if length > max_block_bytes:
            raise FrameError(f"entry {i}: length {length} is over the block limit of {max_block_bytes} bytes")
        if signed:
            k = ticket_key(seg_id, off) if callable(ticket_key) else ticket_key
            if not k:
                raise TicketError(f"entry {i}: no metadata shard has handed out extent {off} of segment {seg_id}")
            signed_entry = (k, top, seg_id, off, length, gen, expiry, key, tag)
            if verified is not None and signed_entry in verified:
                if expiry + skew_s < time.time():
                    raise TicketError(f"entry {i}: ticket expired")
            else:
                why = tickets.check(k, top, seg_id, off, length, gen, expiry, key, tag, skew_s)
                if why:
                    raise TicketError(f"entry {i}: {why}")
                if verified is not None:
                    if len(verified) >= _VERIFIED_MAX:
                        verified.clear()
                    verified[signed_entry] = True
        arenas.append(arena)
    return arenas
