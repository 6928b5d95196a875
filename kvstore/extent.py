"""Self-describing extents: the on-segment format of one stored block.

::

    offset                      offset+64                        offset+64+length
    | header (64 B)             | payload (length B)             | pad to 256 B |

    header = magic "KVB1" | version u16 (2) | flags u16 | key 16s | length u64 | checksum u64
             | gen u64 | raw_length u64 | seal u64

``gen`` is the generation the metadata service gave this placement: unique per placement, so
a removal or invalidation names exactly one write of a key at an offset and can never hit a
newer block that reuses the same extent. It is also the write order (the service draws it
from a nanosecond clock), which :func:`scan` uses where stale headers overlap.

``seal`` is a keyed hash (blake2b-64 under the daemon's secret, :class:`Sealer`) of the first
56 header bytes and the extent's offset. Only the daemon holds the secret and only the daemon
writes headers, and only when the metadata service commits a put (or finishes a tier move).
Writers move payload bytes only. So a header whose seal holds at its offset is a *committed*
block: a writer that died before its commit, or any process that can write the shared-memory
arena, cannot make bytes look committed, and a daemon rebuilding its inventory with
:func:`scan` reports exactly the committed blocks. ``checksum`` is xxh3-64 of the payload and
is verified by every reader after its copy.

A reader without the secret (a client) can still parse the fields with :func:`parse_fields`
and must then rely on the key, gen and payload checksum.

Between a reservation and its commit, a DRAM extent's header holds the *write stamp*
(:class:`Stamper`: magic "KVW1", the placement's generation, and a keyed BLAKE2b-64 of both and
the offset under the arena's stamp key), put there by whoever wrote the payload: the
shared-memory writer after its copy, or the daemon's data port after the whole payload arrived
and matched its checksum. The daemon commits a put's DRAM block only over its stamp: a put
committed without its write (an extent reused with the bytes of the block that held it before,
a write cut short) is refused, never sealed over stale bytes. The stamp key is in a file next to
the arena, mode 0600 (the same-host writers that may map the arena may read it); a remote writer,
who moves only payload bytes, could plant bytes where a later extent's header will be, but not
the key's MAC, so it cannot stamp an extent it did not write.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

MAGIC = b"KVB1"
VERSION = 2
HEADER_SIZE = 64
ALIGN = 256
_HEADER = struct.Struct("<4sHH16sQQQQ")  # 56 bytes, then the u64 seal
_SEAL = struct.Struct("<Q")
_OFFSET = struct.Struct("<Q")
_MAGIC_U32 = int.from_bytes(MAGIC, "little")
CLEARED = bytes(HEADER_SIZE)
WRITTEN_MAGIC = b"KVW1"
_WRITTEN = struct.Struct("<4sIQ")  # magic, 0, generation; then the MAC (8 bytes)
SECRET_BYTES = 32
_KNOWN_MAX = 1 << 16  # headers a Sealer remembers as checked


class ExtentHeader(NamedTuple):
    key: bytes
    length: int  # stored payload bytes
    checksum: int  # xxh3-64 of the raw (uncompressed) payload
    gen: int  # the placement's generation (unique; also write order)
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


def parse_fields(buf, offset: int = 0) -> ExtentHeader | None:  # noqa: ANN001
    """The header fields at ``buf[offset:]`` if magic and version hold, without checking the
    seal (for readers that do not hold the daemon's secret)."""
    raw = bytes(buf[offset : offset + HEADER_SIZE])
    if len(raw) < HEADER_SIZE or raw[:4] != MAGIC:
        return None
    _magic, version, flags, key, length, csum, gen, raw_len = _HEADER.unpack_from(raw)
    if version != VERSION:
        return None
    return ExtentHeader(key, length, csum, gen, offset, flags, raw_len)


def make_secret(path: str | os.PathLike) -> None:
    """Creates ``path`` holding ``SECRET_BYTES`` fresh random bytes, mode 0600, unless something
    is there already. Written whole under a private name, then linked into place: a crash never
    leaves a partial secret, and of two processes making it at once the first link wins."""
    p = Path(path)
    if os.path.lexists(p):
        return
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, os.urandom(SECRET_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, p)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


class Sealer:
    """Writes and checks the seals of one daemon's headers (its secret never leaves it)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("a sealing secret must be at least 16 bytes")
        self._secret = bytes(secret)
        self._keyed = hashlib.blake2b(key=self._secret, digest_size=8)  # copied per seal: no key setup each time
        # Headers known to be sealed for their offset: (header bytes, offset) -> fields. The seal
        # covers exactly those bytes and that offset, so the same bytes at the same offset pass
        # the same way every time: what this daemon sealed or checked once is not hashed again.
        # Bounded (cleared when full).
        self._known: dict[tuple[bytes, int], ExtentHeader] = {}

    @property
    def secret(self) -> bytes:
        """The sealing secret, for the daemon's native read serving (kvstore/transport/serve.c)
        in the same process; it is never sent anywhere."""
        return self._secret

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> Sealer:
        """The secret stored at ``path`` (mode 0600), created once with fresh random bytes.
        A daemon keeps it next to its state so that its blocks survive its restarts; a lost
        secret makes every old header unsealed, so nothing old is adopted (fail safe)."""
        p = Path(path)
        make_secret(p)
        secret = p.read_bytes()
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"{p} holds {len(secret)} bytes, expected a {SECRET_BYTES}-byte secret")
        return cls(secret)

    def _seal(self, body: bytes, offset: int) -> bytes:
        h = self._keyed.copy()
        h.update(body + _OFFSET.pack(offset))
        return h.digest()

    def _remember(self, raw: bytes, offset: int, h: ExtentHeader) -> None:
        known = self._known
        if len(known) >= _KNOWN_MAX:
            known.clear()
        known[(raw, offset)] = h

    def pack(
        self, key: bytes, length: int, csum: int, gen: int, offset: int, flags: int = 0, raw_length: int | None = None
    ) -> bytes:
        """A sealed header for the extent at ``offset``."""
        body = _HEADER.pack(MAGIC, VERSION, flags, key, length, csum, gen, length if raw_length is None else raw_length)
        raw = body + self._seal(body, offset)
        # What a fresh check of these bytes gives (the key as packed: 16 bytes).
        _magic, _version, flags, key, length, csum, gen, raw_len = _HEADER.unpack(body)
        self._remember(raw, offset, ExtentHeader(key, length, csum, gen, offset, flags, raw_len))
        return raw

    def parse(self, buf, offset: int = 0, at: int | None = None) -> ExtentHeader | None:  # noqa: ANN001
        """The header at ``buf[offset:]`` if it is whole and sealed by this daemon for the extent
        at segment offset ``at`` (default ``offset``), else None."""
        raw = bytes(buf[offset : offset + HEADER_SIZE])
        at = offset if at is None else at
        known = self._known.get((raw, at))
        if known is not None:
            return known
        if len(raw) < HEADER_SIZE or raw[:4] != MAGIC:
            return None
        body = raw[:56]
        if not hmac.compare_digest(raw[56:], self._seal(body, at)):
            return None
        _magic, version, flags, key, length, csum, gen, raw_len = _HEADER.unpack(body)
        if version != VERSION:
            return None
        h = ExtentHeader(key, length, csum, gen, at, flags, raw_len)
        self._remember(raw, at, h)
        return h


class Stamper:
    """Makes the write stamps of one arena (see the module docstring) under its stamp key."""

    SIZE = _WRITTEN.size + 8

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a stamp key must be at least 16 bytes")
        self._keyed = hashlib.blake2b(key=bytes(key), digest_size=8)

    def stamp(self, offset: int, gen: int) -> bytes:
        """The stamp of the placement of generation ``gen`` at segment offset ``offset``."""
        body = _WRITTEN.pack(WRITTEN_MAGIC, 0, gen)
        h = self._keyed.copy()
        h.update(body + _OFFSET.pack(offset))
        return body + h.digest()


class ScanResult(NamedTuple):
    extents: list[ExtentHeader]
    discarded: int


def scan(segment: np.ndarray, sealer: Sealer, verify: bool = True) -> ScanResult:
    """Finds whole, committed extents in a segment (a uint8 array), oldest write first.

    Candidates are the ALIGN-aligned offsets holding the magic (found vectorised); each must
    carry this daemon's seal for its offset, fit in the segment, and (``verify``) match its
    payload checksum. Where two valid extents overlap (a stale header left inside a newer
    extent's range), the newer write wins. ``discarded`` counts candidates that failed any check.
    """
    size = segment.size - segment.size % ALIGN
    words = segment[:size].view("<u4")[:: ALIGN // 4]
    candidates = np.flatnonzero(words == _MAGIC_U32) * ALIGN
    found: list[ExtentHeader] = []
    discarded = 0
    for off in candidates.tolist():
        h = sealer.parse(segment, off)
        if h is None or h.flags or off + HEADER_SIZE + h.length > segment.size:
            discarded += 1
            continue
        if verify and checksum(segment[off + HEADER_SIZE : off + HEADER_SIZE + h.length]) != h.checksum:
            discarded += 1
            continue
        found.append(h)
    # Resolve overlaps: newest first claims its range.
    found.sort(key=lambda h: -h.gen)
    taken: list[tuple[int, int]] = []
    kept: list[ExtentHeader] = []
    for h in found:
        lo, hi = h.offset, h.offset + extent_size(h.length)
        i = bisect.bisect_left(taken, (lo, hi))
        if (i > 0 and taken[i - 1][1] > lo) or (i < len(taken) and taken[i][0] < hi):
            discarded += 1
            continue
        taken.insert(i, (lo, hi))
        kept.append(h)
    kept.sort(key=lambda h: h.gen)
    return ScanResult(kept, discarded)
