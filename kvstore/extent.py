"""Self-describing extents: the on-segment format of one stored block.

::

    offset                      offset+64                        offset+64+length
    | header (64 B)             | payload (length B)             | pad to 256 B |

    header = magic "KVB1" | version u16 | flags u16 | key 16s | length u64 | checksum u64
             | seq u64 | raw_length u64 | reserved 4 | header_crc u32 (xxh32 of bytes 0..60)

A writer first clears the magic, then writes the payload, then the header; so a header whose
magic, header crc and payload checksum all hold describes a whole block, and a daemon can
rebuild its inventory from its segment alone (see :func:`scan`). ``checksum`` is xxh3-64 of
the payload and is verified by every reader after its copy.
"""

from __future__ import annotations

import struct
import time
from typing import NamedTuple

import numpy as np
import xxhash

MAGIC = b"KVB1"
VERSION = 1
HEADER_SIZE = 64
ALIGN = 256
_HEADER = struct.Struct("<4sHH16sQQQQ4x")  # 60 bytes, then the u32 header crc
_CRC = struct.Struct("<I")
_MAGIC_U32 = int.from_bytes(MAGIC, "little")
CLEARED = bytes(HEADER_SIZE)


class ExtentHeader(NamedTuple):
    key: bytes
    length: int  # stored payload bytes
    checksum: int  # xxh3-64 of the raw (uncompressed) payload
    seq: int
    offset: int = 0
    flags: int = 0  # codec bits (SSD segments); 0 = stored raw
    raw_length: int = 0


def checksum(data) -> int:  # noqa: ANN001 - any buffer
    """xxh3-64 of a payload (any buffer-protocol object)."""
    return xxhash.xxh3_64_intdigest(data)


SSD_ALIGN = 4096  # direct I/O granularity


def extent_size(length: int, align: int = ALIGN) -> int:
    """Bytes an extent of ``length`` payload bytes takes in a segment (header and padding included)."""
    return (HEADER_SIZE + length + align - 1) // align * align


def pack_header(
    key: bytes, length: int, csum: int, seq: int | None = None, flags: int = 0, raw_length: int | None = None
) -> bytes:
    if seq is None:
        seq = time.time_ns()
    body = _HEADER.pack(MAGIC, VERSION, flags, key, length, csum, seq, length if raw_length is None else raw_length)
    return body + _CRC.pack(xxhash.xxh32_intdigest(body))


def parse_header(buf, offset: int = 0) -> ExtentHeader | None:  # noqa: ANN001
    """The header at ``buf[offset:]`` if it is whole (magic, version and crc hold), else None."""
    raw = bytes(buf[offset : offset + HEADER_SIZE])
    if len(raw) < HEADER_SIZE or raw[:4] != MAGIC:
        return None
    body = raw[:60]
    if _CRC.unpack_from(raw, 60)[0] != xxhash.xxh32_intdigest(body):
        return None
    magic, version, flags, key, length, csum, seq, raw_len = _HEADER.unpack(body)
    if version != VERSION:
        return None
    return ExtentHeader(key, length, csum, seq, offset, flags, raw_len)


class ScanResult(NamedTuple):
    extents: list[ExtentHeader]
    discarded: int


def scan(segment: np.ndarray, verify: bool = True) -> ScanResult:
    """Finds whole extents in a segment (a uint8 array), oldest write first.

    Candidates are the ALIGN-aligned offsets holding the magic (found vectorised); each must
    have a valid header crc, fit in the segment, and (``verify``) match its payload checksum.
    Where two valid extents overlap (a stale header left inside a newer extent's range), the
    newer write wins. ``discarded`` counts candidates that failed any check.
    """
    size = segment.size - segment.size % ALIGN
    words = segment[:size].view("<u4")[:: ALIGN // 4]
    candidates = np.flatnonzero(words == _MAGIC_U32) * ALIGN
    found: list[ExtentHeader] = []
    discarded = 0
    for off in candidates.tolist():
        h = parse_header(segment, off)
        if h is None or h.flags or off + HEADER_SIZE + h.length > segment.size:
            discarded += 1
            continue
        if verify and checksum(segment[off + HEADER_SIZE : off + HEADER_SIZE + h.length]) != h.checksum:
            discarded += 1
            continue
        found.append(h)
    # Resolve overlaps: newest first claims its range.
    found.sort(key=lambda h: -h.seq)
    taken: list[tuple[int, int]] = []
    kept: list[ExtentHeader] = []
    import bisect

    for h in found:
        lo, hi = h.offset, h.offset + extent_size(h.length)
        i = bisect.bisect_left(taken, (lo, hi))
        if (i > 0 and taken[i - 1][1] > lo) or (i < len(taken) and taken[i][0] < hi):
            discarded += 1
            continue
        taken.insert(i, (lo, hi))
        kept.append(h)
    kept.sort(key=lambda h: h.seq)
    return ScanResult(kept, discarded)
