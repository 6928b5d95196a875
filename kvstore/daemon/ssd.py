"""The SSD segment: one preallocated extent file plus an append-only journal.

Why extent files and not a log: the metadata service allocates extents in every segment with
the same allocator (4 KiB aligned here), so freed space is reused in place and there is no
garbage collection or compaction of data, ever; each block is one large aligned write. The
journal makes recovery O(live blocks): replay it, then check each block's header and checksum.

::

    <dir>/ssd-<segment>.data      capacity bytes, fallocated; extent = 64 B header | stored payload | pad to 4 KiB
    <dir>/ssd-<segment>.journal   records: magic "KVJ1" | op u8 | pad 3 | key 16s | offset u64 | size u64
                                           | length u64 | checksum u64 | seq u64 | crc u32 (xxh32 of the rest)

A block is written (one pwrite of header + payload), then its ADD record is appended; a freed
block gets a DEL record. A crash between the two leaves no record, so the block is simply not
adopted. Durability (``daemon.ssd_durability``): ``fast`` leaves flushing to the OS, which is
enough for any process crash (the page cache survives it); ``durable`` fsyncs data and journal
before a write is acknowledged, which is what survives power loss.

Compression (``daemon.ssd_compress``): ``auto`` tries lz4 on a sample of each block, plain and
byte-shuffled (the two bytes of each 16-bit element split into planes, as blosc does), and
stores the block compressed only if the sample shrinks by at least 20 %; ``off`` never tries.
Why 20 %: on real bf16 KV, byte-shuffled lz4 saves about 16 % (ratio 1.19) but runs at about
0.5 GB/s, a quarter of the disk's write speed (bench/tier_throughput.py), so a 16 % saving is
not worth it; blocks with padding, zeros or low-entropy content (ratios of 2 to 250) are.
The header then records the codec in its flags, the stored length and the raw length; its
checksum is always that of the raw payload, so a reader's check after decompression covers
the stored bytes too.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvstore.extent import HEADER_SIZE, SSD_ALIGN, ExtentHeader, checksum, extent_size, pack_header, parse_header

F_LZ4 = 1
F_SHUFFLE2 = 2

_REC = struct.Struct("<4sB3x16sQQQQQ")
_CRC = struct.Struct("<I")
REC_SIZE = _REC.size + _CRC.size
_JMAGIC = b"KVJ1"
OP_ADD, OP_DEL = 1, 2
_SAMPLE = 64 << 10


class SsdBlock(NamedTuple):
    key: bytes
    offset: int
    size: int  # extent bytes
    length: int  # raw payload bytes
    checksum: int
    seq: int


class ReadStatus(NamedTuple):
    ok: bool
    reason: str  # "", "mismatch" (not this block), "checksum" (bytes damaged), "io"


def shuffle2(raw: np.ndarray) -> np.ndarray:
    """Splits 16-bit elements into a plane of low bytes and a plane of high bytes."""
    n = raw.size // 2 * 2
    w = raw[:n].view("<u2")
    out = np.empty(raw.size, np.uint8)
    out[: n // 2] = w & 0xFF
    out[n // 2 : n] = w >> 8
    out[n:] = raw[n:]
    return out


def unshuffle2(planes: np.ndarray, out: np.ndarray) -> None:
    n = out.size // 2 * 2
    w = out[:n].view("<u2")
    np.left_shift(planes[n // 2 : n].astype("<u2"), 8, out=w)
    w |= planes[: n // 2]
    out[n:] = planes[n:]


def _lz4():
    import lz4.block

    return lz4.block


def compress(raw: np.ndarray, policy: str) -> tuple[int, bytes | None]:
    """(flags, stored bytes) if compressing pays for this block, else (0, None)."""
    if policy == "off" or raw.size < 4096:
        return 0, None
    lz4 = _lz4()
    sample = raw[:_SAMPLE]
    best_flags, best = 0, sample.size * 0.8  # must save at least 20 %
    for flags in (F_LZ4, F_LZ4 | F_SHUFFLE2):
        src = shuffle2(sample) if flags & F_SHUFFLE2 else sample
        size = len(lz4.compress(src, mode="fast", store_size=False))
        if size < best:
            best_flags, best = flags, size
    if not best_flags:
        return 0, None
    src = shuffle2(raw) if best_flags & F_SHUFFLE2 else raw
    data = lz4.compress(src, mode="fast", store_size=False)
    if len(data) >= raw.size * 0.95:
        return 0, None
    return best_flags, data


def decompress(stored: memoryview, flags: int, out: np.ndarray) -> bool:
    """Decodes into ``out`` (raw length). False if the stored bytes do not decode."""
    try:
        data = _lz4().decompress(stored, uncompressed_size=out.size)
    except Exception:  # noqa: BLE001 - lz4 raises LZ4BlockError on damaged input
        return False
    if len(data) != out.size:
        return False
    src = np.frombuffer(data, np.uint8)
    if flags & F_SHUFFLE2:
        unshuffle2(src, out)
    else:
        out[:] = src
    return True


class _Aligned(threading.local):
    """A per-thread page-aligned buffer for direct I/O, grown on demand and reused."""

    def get(self, size: int) -> np.ndarray:
        size = (size + SSD_ALIGN - 1) // SSD_ALIGN * SSD_ALIGN
        buf = getattr(self, "buf", None)
        if buf is None or buf.size < size:
            self.map = mmap.mmap(-1, max(size, 4 << 20))
            self.buf = buf = np.frombuffer(self.map, np.uint8)
            buf[:] = 0  # touch once: first-touch page faults are slow
        return buf[:size]


class SsdSegment:
    """A fixed-capacity SSD segment. Thread-safe: data-port threads and tier moves share it."""

    def __init__(
        self,
        directory: str | os.PathLike,
        segment_id: int,
        capacity: int,
        direct_io: bool = True,
        durability: str = "fast",
        compress_policy: str = "auto",
    ) -> None:
        if durability not in ("fast", "durable"):
            raise ValueError(f"ssd durability must be fast or durable, got {durability!r}")
        if compress_policy not in ("auto", "off"):
            raise ValueError(f"ssd compression must be auto or off, got {compress_policy!r}")
        self.segment_id = segment_id
        self.size = capacity - capacity % SSD_ALIGN
        self.durable = durability == "durable"
        self.compress_policy = compress_policy
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"ssd-{segment_id}.data"
        self.journal_path = d / f"ssd-{segment_id}.journal"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < self.size:
                os.ftruncate(fd, self.size)
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {self.size} bytes for {self.path}: {e.strerror}") from None
        finally:
            os.close(fd)
        self.direct = False
        flags = os.O_RDWR
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(self.path, flags | os.O_DIRECT)
                self.direct = True
            except OSError:  # tmpfs and some filesystems refuse O_DIRECT
                self._fd = os.open(self.path, flags)
        else:
            self._fd = os.open(self.path, flags)
        self._jlock = threading.Lock()
        self._journal = open(self.journal_path, "ab")  # noqa: SIM115 - lives as long as the segment
        self._records = 0
        self._live: dict[int, SsdBlock] = {}  # offset -> block: the inventory, and for compaction
        self._seq = 0
        self._buf = _Aligned()
        self.counters = {"writes": 0, "write_bytes": 0, "stored_bytes": 0, "compressed": 0, "reads": 0,
                         "read_bytes": 0, "checksum_failures": 0, "recovered": 0, "discarded": 0}  # fmt: skip

    # ---- journal ----------------------------------------------------------------------------

    def _append(self, op: int, key: bytes, offset: int, size: int, length: int, csum: int) -> None:
        with self._jlock:
            self._seq += 1
            body = _REC.pack(_JMAGIC, op, key, offset, size, length, csum, self._seq)
            self._journal.write(body + _CRC.pack(xxhash.xxh32_intdigest(body)))
            self._records += 1
            if op == OP_ADD:
                self._live[offset] = SsdBlock(key, offset, size, length, csum, self._seq)
            else:
                self._live.pop(offset, None)
            self._journal.flush()
            if self.durable:
                os.fsync(self._fd)
                os.fsync(self._journal.fileno())
            if self._records > 4 * len(self._live) + 100_000:
                self._compact_locked()

    def _replay(self) -> tuple[dict[int, tuple], int]:
        """Live records by offset, and the byte length of the whole (untorn) journal."""
        live: dict[int, tuple] = {}
        try:
            raw = self.journal_path.read_bytes()
        except FileNotFoundError:
            return live, 0
        good = 0
        for pos in range(0, len(raw) - REC_SIZE + 1, REC_SIZE):
            body = raw[pos : pos + _REC.size]
            if _CRC.unpack_from(raw, pos + _REC.size)[0] != xxhash.xxh32_intdigest(body):
                break  # a torn or damaged tail: nothing after it is trusted
            magic, op, key, offset, size, length, csum, seq = _REC.unpack(body)
            if magic != _JMAGIC:
                break
            self._seq = max(self._seq, seq)
            if op == OP_ADD:
                live[offset] = (key, offset, size, length, csum, seq)
            elif op == OP_DEL and live.get(offset, (None,))[0] == key:
                del live[offset]
            good = pos + REC_SIZE
        return live, good

    def _compact_locked(self) -> None:
        """Rewrites the journal with one ADD per live block (atomic rename)."""
        tmp = self.journal_path.with_suffix(".journal.tmp")
        with open(tmp, "wb") as f:
            for b in sorted(self._live.values(), key=lambda b: b.seq):
                body = _REC.pack(_JMAGIC, OP_ADD, b.key, b.offset, b.size, b.length, b.checksum, b.seq)
                f.write(body + _CRC.pack(xxhash.xxh32_intdigest(body)))
            f.flush()
            os.fsync(f.fileno())
        self._journal.close()
        os.replace(tmp, self.journal_path)
        self._journal = open(self.journal_path, "ab")  # noqa: SIM115
        self._records = len(self._live)

    # ---- blocks -----------------------------------------------------------------------------

    def _check_range(self, offset: int, size: int) -> None:
        if offset < 0 or offset % SSD_ALIGN or offset + size > self.size:
            raise ValueError(
                f"extent at {offset} of {size} bytes is outside segment {self.segment_id} ({self.size} bytes)"
            )

    def write(self, offset: int, key: bytes, raw: np.ndarray, csum: int) -> int:
        """Stores one block at ``offset`` (its extent was reserved for ``raw.size`` bytes).
        Returns the extent bytes actually used (smaller when compressed)."""
        reserved = extent_size(raw.size, SSD_ALIGN)
        self._check_range(offset, reserved)
        flags, stored = compress(raw, self.compress_policy)
        length = len(stored) if stored is not None else raw.size
        size = extent_size(length, SSD_ALIGN)
        buf = self._buf.get(size)
        buf[:HEADER_SIZE] = np.frombuffer(pack_header(key, length, csum, flags=flags, raw_length=raw.size), np.uint8)
        buf[HEADER_SIZE : HEADER_SIZE + length] = np.frombuffer(stored, np.uint8) if stored is not None else raw
        buf[HEADER_SIZE + length :] = 0
        written = os.pwrite(self._fd, buf, offset)
        if written != size:
            raise OSError(f"short write to {self.path}: {written} of {size} bytes")
        self._append(OP_ADD, key, offset, size, raw.size, csum)
        self.counters["writes"] += 1
        self.counters["write_bytes"] += raw.size
        self.counters["stored_bytes"] += length
        self.counters["compressed"] += int(flags != 0)
        return size

    def _header(self, offset: int) -> ExtentHeader | None:
        buf = self._buf.get(SSD_ALIGN)
        if os.preadv(self._fd, [buf], offset) != SSD_ALIGN:
            return None
        return parse_header(buf, 0)

    def read(
        self,
        offset: int,
        key: bytes,
        length: int,
        out: np.ndarray | None = None,
        staging: np.ndarray | None = None,
    ) -> tuple[ReadStatus, np.ndarray | None]:
        """Reads and verifies one block's raw payload. Returns it: a view of ``out`` if given,
        else of ``staging`` (a page-aligned buffer of at least :meth:`staging_bytes`, read into
        directly), else of a per-thread buffer valid until this thread's next read."""
        reserved = extent_size(length, SSD_ALIGN)
        try:
            self._check_range(offset, reserved)
        except ValueError:
            return ReadStatus(False, "mismatch"), None
        if staging is not None and staging.size >= reserved + length and staging.ctypes.data % SSD_ALIGN == 0:
            buf = staging
        else:
            buf = self._buf.get(reserved + length)  # extent, then room for a decompressed copy
        try:
            got = os.preadv(self._fd, [buf[:reserved]], offset)
        except OSError:
            return ReadStatus(False, "io"), None
        h = parse_header(buf, 0) if got >= HEADER_SIZE else None
        if h is None or h.key != key or h.raw_length != length or HEADER_SIZE + h.length > got:
            return ReadStatus(False, "mismatch"), None
        stored = buf[HEADER_SIZE : HEADER_SIZE + h.length]
        dest = out if out is not None else (buf[reserved : reserved + length] if h.flags else stored)
        if h.flags:
            if not decompress(memoryview(stored), h.flags, dest):
                self.counters["checksum_failures"] += 1
                return ReadStatus(False, "checksum"), None
        elif dest is not stored:
            dest[:] = stored
        if checksum(dest) != h.checksum:
            self.counters["checksum_failures"] += 1
            return ReadStatus(False, "checksum"), None
        self.counters["reads"] += 1
        self.counters["read_bytes"] += length
        return ReadStatus(True, ""), dest

    @staticmethod
    def staging_bytes(length: int) -> int:
        """Size of a staging buffer that :meth:`read` can use for a block of ``length`` bytes."""
        return extent_size(length, SSD_ALIGN) + length

    def invalidate(self, offset: int, key: bytes) -> bool:
        """Forgets a freed block (a DEL record), unless a newer block now lives there."""
        with self._jlock:
            b = self._live.get(offset)
            if b is None or b.key != key:
                return False
        self._append(OP_DEL, key, offset, 0, 0, 0)
        return True

    def recover(self, verify: bool = True) -> tuple[list[SsdBlock], int]:
        """Replays the journal (discarding a torn tail), keeps each block whose header (and,
        with ``verify``, payload checksum) is whole, compacts the journal. Returns the blocks,
        oldest first, and how many records were discarded."""
        live, good = self._replay()
        with self._jlock:
            size = self.journal_path.stat().st_size if self.journal_path.exists() else 0
            if size > good:  # cut the torn tail so that new records follow whole ones
                self._journal.close()
                os.truncate(self.journal_path, good)
                self._journal = open(self.journal_path, "ab")  # noqa: SIM115
        records = sorted(live.values(), key=lambda r: r[1])
        # Verify in large sequential windows: one read covers many neighbouring extents.
        ok_flags = self._verify_windows(records, verify)
        found = [SsdBlock(*r) for r, ok in zip(records, ok_flags) if ok]
        discarded = len(records) - len(found)
        with self._jlock:
            self._live = {b.offset: b for b in found}
            self._compact_locked()
        self.counters["recovered"] = len(found)
        self.counters["discarded"] = discarded
        found.sort(key=lambda h: h.seq)
        return found, discarded

    def _verify_windows(self, records: list[tuple], verify: bool, window: int = 8 << 20) -> list[bool]:
        out: list[bool] = []
        buf = self._buf.get(window)
        lo = hi = -1
        for key, offset, size, length, csum, _seq in records:
            if offset < 0 or offset % SSD_ALIGN or offset + size > self.size or size < HEADER_SIZE:
                out.append(False)
                continue
            if size > window:  # a block larger than the window: read it alone (reuses the buffer)
                out.append(
                    self.read(offset, key, length)[0].ok if verify else self._header_ok(offset, key, length, csum)
                )
                lo = hi = -1
                continue
            if not (lo <= offset and offset + size <= hi):
                lo = offset
                got = os.preadv(self._fd, [buf[: min(window, self.size - offset)]], offset)
                hi = offset + got
                if offset + size > hi:
                    out.append(False)
                    continue
            rel = offset - lo
            h = parse_header(buf, rel)
            ok = h is not None and h.key == key and h.raw_length == length and h.checksum == csum
            ok = ok and HEADER_SIZE + h.length <= size  # type: ignore[union-attr]
            if ok and verify:
                stored = buf[rel + HEADER_SIZE : rel + HEADER_SIZE + h.length]  # type: ignore[union-attr]
                if h.flags:  # type: ignore[union-attr]
                    raw = np.empty(length, np.uint8)
                    ok = decompress(memoryview(stored), h.flags, raw) and checksum(raw) == csum  # type: ignore[union-attr]
                else:
                    ok = checksum(stored) == csum
            out.append(ok)
        return out

    def _header_ok(self, offset: int, key: bytes, length: int, csum: int) -> bool:
        h = self._header(offset)
        return h is not None and h.key == key and h.raw_length == length and h.checksum == csum

    def inventory(self) -> list[SsdBlock]:
        """The blocks this segment holds now, oldest first (from the journal's live set)."""
        with self._jlock:
            return sorted(self._live.values(), key=lambda b: b.seq)

    def close(self) -> None:
        with self._jlock:
            self._journal.close()
        os.close(self._fd)
