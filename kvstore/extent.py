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

import hashlib
import hmac
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvstore.batch import checksums, ordered_map, seals, take_columns
from kvstore.blocks import U64, BlockCols, oldest_first
from kvstore.errors import InvalidArgument
from kvstore.overlap import newest_wins

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
# The header as numpy columns (no padding: the same 64 bytes).
HEADER_DTYPE = np.dtype(
    [("magic", "<u4"), ("version", "<u2"), ("flags", "<u2"), ("key", "u1", (16,)), ("length", "<u8"),
     ("checksum", "<u8"), ("gen", "<u8"), ("raw_length", "<u8"), ("seal", "<u8")]
)  # fmt: skip


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

    def pack_many(
        self,
        keys: np.ndarray,
        length: np.ndarray,
        csum: np.ndarray,
        gen: np.ndarray,
        offset: np.ndarray,
        flags: int = 0,
        raw_length: np.ndarray | None = None,
    ) -> np.ndarray:
        """Sealed headers for many extents at once ((n, 64) uint8): row i is what :meth:`pack`
        gives for ``keys[i]`` ((n, 16) uint8), ``length[i]``, ... at ``offset[i]``."""
        offset = np.asarray(offset, U64)
        h = np.zeros(offset.size, HEADER_DTYPE)
        h["magic"], h["version"], h["flags"] = _MAGIC_U32, VERSION, flags
        h["key"] = np.asarray(keys, np.uint8).reshape(-1, 16)
        h["length"], h["checksum"], h["gen"] = length, csum, gen
        h["raw_length"] = length if raw_length is None else raw_length
        raw = h.view(np.uint8).reshape(-1, HEADER_SIZE)
        h["seal"] = seals(self._secret, raw, offset)
        return raw

    def check_many(self, headers: np.ndarray, at: np.ndarray) -> np.ndarray:
        """Which of ``headers`` ((n, 64) uint8, one header a row) have the magic, version 2 and
        this daemon's seal for the extent at segment offset ``at[i]``: a boolean array. What
        :meth:`parse` checks of one header, for many at once."""
        headers = np.ascontiguousarray(headers, np.uint8).reshape(-1, HEADER_SIZE)
        f = headers.view(HEADER_DTYPE).reshape(-1)
        ok = (f["magic"] == _MAGIC_U32) & (f["version"] == VERSION)
        if bool(ok.all()):  # the usual case: no gather
            return seals(self._secret, headers, at) == f["seal"]
        idx = np.flatnonzero(ok)
        if idx.size:
            ok[idx] = seals(self._secret, headers[idx], np.asarray(at, U64)[idx]) == f["seal"][idx]
        return ok


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
    blocks: BlockCols  # the committed extents, oldest write first
    discarded: int


_SCAN_SLOTS = 1 << 22  # ALIGN slots searched for the magic per pass (1 GiB of segment)
_SCAN_BATCH = 1 << 17  # candidates checked per batch (8 MiB of headers)


def scan(segment: np.ndarray, sealer: Sealer, verify: bool = True) -> ScanResult:
    """Finds whole, committed extents in a segment (a contiguous uint8 array), oldest write first.

    Candidates are the ALIGN-aligned offsets holding the magic; each must carry this daemon's
    seal for its offset, be version 2 with no flags, fit in the segment, and (``verify``) match
    its payload checksum. Where two valid extents overlap (a stale header left inside a newer
    extent's range), the newer write wins (:func:`kvstore.overlap.newest_wins`). ``discarded``
    counts candidates that failed any check or lost to a newer extent.

    Vectorised: the headers of a batch of candidates are gathered at once and checked as
    columns; seals and checksums are computed in batches (natively, without the GIL, where the
    module was built: :mod:`kvstore.batch`), the batches spread over the machine's cores.
    Memory: about twice the candidates' columns (48 bytes each) and a few batches, whatever the
    segment's size.
    """
    if not isinstance(segment, np.ndarray) or segment.dtype != np.uint8 or segment.ndim != 1:
        raise InvalidArgument("a segment to scan is a 1-D uint8 array")
    if not segment.flags.c_contiguous:
        raise InvalidArgument("a segment to scan must be contiguous")
    size = segment.size - segment.size % ALIGN
    nslots = size // ALIGN
    words = segment[:size].view("<u4")[:: ALIGN // 4]
    found = [lo + np.flatnonzero(words[lo : lo + _SCAN_SLOTS] == _MAGIC_U32) for lo in range(0, nslots, _SCAN_SLOTS)]
    slots = np.concatenate(found) if found else np.zeros(0, np.int64)
    del found
    heads = segment[:size].view(f"V{HEADER_SIZE}")[:: ALIGN // HEADER_SIZE]
    n = slots.size
    cols = BlockCols(np.empty((n, 16), np.uint8), *(np.empty(n, U64) for _ in BlockCols.FIELDS))
    filled = 0
    batches = (slots[b : b + _SCAN_BATCH] for b in range(0, n, _SCAN_BATCH))
    for part in ordered_map(lambda at: _check(segment, heads, at, sealer, verify), batches):
        k = len(part)
        cols.keys[filled : filled + k] = part.keys
        for f in BlockCols.FIELDS:
            getattr(cols, f)[filled : filled + k] = getattr(part, f)
        filled += k
    del slots
    valid = cols.take(slice(0, filled))  # views: in offset order
    idx = np.flatnonzero(newest_wins(valid.offset, valid.offset + valid.size, valid.gen))
    idx = idx[oldest_first(valid.gen[idx], valid.offset[idx])]
    kept = take_columns([valid.keys, *(getattr(valid, f) for f in BlockCols.FIELDS)], idx)
    return ScanResult(BlockCols(*kept), n - idx.size)


def _check(segment: np.ndarray, heads: np.ndarray, slots: np.ndarray, sealer: Sealer, verify: bool) -> BlockCols:
    """The candidates at ``slots`` that pass every check, in slot order."""
    raw = heads[slots].view(np.uint8).reshape(-1, HEADER_SIZE)  # a copy: what is checked is what is kept
    f = raw.view(HEADER_DTYPE).reshape(-1)
    offs = slots.astype(U64) * np.uint64(ALIGN)
    room = np.uint64(segment.size - HEADER_SIZE) - offs  # an ALIGN slot always holds a whole header
    ok = (f["flags"] == 0) & (f["length"] <= room)
    ok &= sealer.check_many(raw, offs)
    idx = np.flatnonzero(ok)
    length = f["length"][idx]
    if verify and idx.size:
        sums = checksums(segment, offs[idx] + np.uint64(HEADER_SIZE), length)
        keep = sums == f["checksum"][idx]
        idx, length = idx[keep], length[keep]
    size = (length + np.uint64(HEADER_SIZE + ALIGN - 1)) // np.uint64(ALIGN) * np.uint64(ALIGN)
    return BlockCols(f["key"][idx], offs[idx], size, length, f["checksum"][idx], f["gen"][idx])
