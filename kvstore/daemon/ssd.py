"""The SSD segment: one preallocated extent file plus an append-only journal.

Why extent files and not a log: the metadata service allocates extents in every segment with
the same allocator (4 KiB aligned here), so freed space is reused in place and there is no
garbage collection or compaction of data, ever; each block is one large aligned write. The
journal makes recovery O(live blocks): replay it, then check each block's header and checksum.

::

    <dir>/ssd-<segment>.data      capacity bytes, fallocated; extent = 64 B header | stored payload | pad to 4 KiB
    <dir>/ssd-<segment>.journal   records: magic "KVJ2" | op u8 | pad 3 | key 16s | offset u64 | size u64
                                           | length u64 | checksum u64 | gen u64 | crc u32 (xxh32 of the rest)

A block is written (one pwrite of its sealed header + payload) and is then *pending*: only when
the metadata service commits the put (:meth:`SsdSegment.commit`, or a finished tier move) is
its ADD record appended, so a writer that never committed leaves nothing that recovery adopts.
A removed or evicted block gets a DEL record naming its generation (a newer block in the same
extent has another one and stays). If the journal cannot grow (a full file system), a commit
answers :class:`~kvstore.errors.ResourceExhausted` and nothing is half-appended (the journal is
cut back to its last whole record); a DEL that cannot be appended clears the block's header on
disk instead, so the block can never be adopted again.

At tens of millions of blocks nothing here is one Python object per block: the committed blocks
are columns by offset under a small overlay of recent changes (:mod:`kvstore.daemon.ssd_map`),
the journal is replayed and rewritten as arrays (:mod:`kvstore.daemon.journal`), recovery checks
the blocks a disk window at a time in batches (:mod:`kvstore.daemon.ssd_verify`), and the
inventory is columns (:class:`kvstore.blocks.BlockCols`).

Durability (``daemon.ssd_durability``): ``fast`` leaves flushing to the OS, which is
enough for any process crash (the page cache survives it); ``durable`` fsyncs data and journal
before a commit or removal is acknowledged, which is what survives power loss.

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

import errno
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvstore.blocks import Block, BlockCols
from kvstore.daemon import journal
from kvstore.daemon.codec import compress, decompress
from kvstore.daemon.journal import OP_ADD, OP_DEL, REC_SIZE
from kvstore.daemon.ssd_map import BlockMap
from kvstore.daemon.ssd_verify import verify_blocks
from kvstore.errors import ResourceExhausted
from kvstore.extent import HEADER_SIZE, SSD_ALIGN, ExtentHeader, Sealer, checksum, extent_size

log = logging.getLogger("kvstore.daemon.ssd")

__all__ = ["OP_ADD", "OP_DEL", "REC_SIZE", "ReadStatus", "SsdBlock", "SsdSegment"]

SsdBlock = Block  # key, offset, size (extent bytes), length (raw payload bytes), checksum, gen


class ReadStatus(NamedTuple):
    ok: bool
    reason: str  # "", "mismatch" (not this block), "checksum" (bytes damaged), "io"


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
        sealer: Sealer | None = None,
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
        self.sealer = sealer or Sealer.load_or_create(d / "ssd.secret")
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
        # Unbuffered appends: a failed write leaves nothing queued that a later flush or close
        # could trip over.
        self._jfd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._jsize = os.fstat(self._jfd).st_size
        self._records = 0
        self._compact_at = 100_000
        self._live = BlockMap()  # offset -> committed block: the inventory (columns, kvstore.daemon.ssd_map)
        self._pending: dict[int, SsdBlock] = {}  # offset -> written, not yet committed
        self._buf = _Aligned()
        self.counters = {"writes": 0, "write_bytes": 0, "stored_bytes": 0, "compressed": 0, "reads": 0,
                         "read_bytes": 0, "checksum_failures": 0, "recovered": 0, "discarded": 0,
                         "commits": 0, "journal_full": 0}  # fmt: skip

    # ---- journal ----------------------------------------------------------------------------

    def _append(self, op: int, key: bytes, offset: int, size: int, length: int, csum: int, gen: int) -> None:
        """Appends one record (the caller holds the journal lock). Raises ResourceExhausted when
        the file system is full and OSError on other failures; either way the journal is left
        ending in whole records and the in-memory state is unchanged."""
        rec = journal.pack_record(op, key, offset, size, length, csum, gen)
        try:
            n = os.write(self._jfd, rec)
            if n != len(rec):
                raise OSError(errno.ENOSPC, f"short journal write ({n} of {len(rec)} bytes)")
            if self.durable:
                os.fsync(self._fd)
                os.fsync(self._jfd)
        except OSError as e:
            self._cut_journal()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.counters["journal_full"] += 1
                raise ResourceExhausted(f"SSD journal {self.journal_path}: no space left on the file system") from None
            raise
        self._jsize += len(rec)
        self._records += 1
        if op == OP_ADD:
            self._live.put(SsdBlock(key, offset, size, length, csum, gen))
        else:
            self._live.pop(offset)
        if self._records > max(4 * len(self._live), self._compact_at):
            self._compact_locked()

    def _cut_journal(self) -> None:
        """Cuts a partly written record off the journal's end."""
        try:
            if os.fstat(self._jfd).st_size > self._jsize:
                os.truncate(self.journal_path, self._jsize)
        except OSError as e:  # the next replay stops at the torn record anyway
            log.warning("event=journal_cut_failed path=%s reason=%r", self.journal_path, str(e))

    def _compact_locked(self) -> None:
        """Rewrites the journal with one ADD per live block, in offset order (atomic rename). On a
        full file system the old journal stays and compaction is tried again after as many
        records."""
        tmp = self.journal_path.with_suffix(".journal.tmp")
        try:
            with open(tmp, "wb") as f:
                journal.write_records(f, self._live.columns())
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._compact_at = 2 * self._records
            log.warning("event=journal_compaction_failed path=%s reason=%r", self.journal_path, str(e))
            return
        os.replace(tmp, self.journal_path)
        os.close(self._jfd)
        self._jfd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND)
        self._jsize = os.fstat(self._jfd).st_size
        self._records = len(self._live)
        self._compact_at = 100_000

    # ---- blocks -----------------------------------------------------------------------------

    def _check_range(self, offset: int, size: int) -> None:
        if offset < 0 or offset % SSD_ALIGN or offset + size > self.size:
            raise ValueError(
                f"extent at {offset} of {size} bytes is outside segment {self.segment_id} ({self.size} bytes)"
            )

    def write(self, offset: int, key: bytes, raw: np.ndarray, csum: int, gen: int) -> int:
        """Stores one block at ``offset`` (its extent was reserved for ``raw.size`` bytes) as
        *pending*: it is adopted by nothing until :meth:`commit`. Returns the extent bytes
        actually used (smaller when compressed)."""
        reserved = extent_size(raw.size, SSD_ALIGN)
        self._check_range(offset, reserved)
        flags, stored = compress(raw, self.compress_policy)
        length = len(stored) if stored is not None else raw.size
        size = extent_size(length, SSD_ALIGN)
        buf = self._buf.get(size)
        hdr = self.sealer.pack(key, length, csum, gen, offset, flags=flags, raw_length=raw.size)
        buf[:HEADER_SIZE] = np.frombuffer(hdr, np.uint8)
        buf[HEADER_SIZE : HEADER_SIZE + length] = np.frombuffer(stored, np.uint8) if stored is not None else raw
        buf[HEADER_SIZE + length :] = 0
        written = os.pwrite(self._fd, buf, offset)
        if written != size:
            raise OSError(f"short write to {self.path}: {written} of {size} bytes")
        with self._jlock:
            self._pending.pop(offset, None)
            self._pending[offset] = SsdBlock(key, offset, size, raw.size, csum, gen)
            while len(self._pending) > 65536:  # writers that never committed nor aborted
                del self._pending[next(iter(self._pending))]
        self.counters["writes"] += 1
        self.counters["write_bytes"] += raw.size
        self.counters["stored_bytes"] += length
        self.counters["compressed"] += int(flags != 0)
        return size

    def commit(self, offset: int, key: bytes, gen: int) -> SsdBlock | None:
        """Makes the pending block (``key``, ``gen``) at ``offset`` a committed one (its journal
        record is appended, and fsynced in durable mode). None if no such block was written;
        raises ResourceExhausted when the journal cannot grow."""
        with self._jlock:
            b = self._pending.get(offset)
            if b is None or b.key != key or b.gen != gen:
                live = self._live.get(offset)
                return live if live is not None and live.key == key and live.gen == gen else None
            self._append(OP_ADD, key, offset, b.size, b.length, b.checksum, gen)
            del self._pending[offset]
            self.counters["commits"] += 1
            return b

    def _header(self, offset: int) -> ExtentHeader | None:
        buf = self._buf.get(SSD_ALIGN)
        if os.preadv(self._fd, [buf], offset) != SSD_ALIGN:
            return None
        return self.sealer.parse(buf, 0, at=offset)

    def read(
        self,
        offset: int,
        key: bytes,
        length: int,
        out: np.ndarray | None = None,
        staging: np.ndarray | None = None,
        gen: int | None = None,
    ) -> tuple[ReadStatus, np.ndarray | None]:
        """Reads and verifies one block's raw payload (and, given ``gen``, that it is that
        generation). Returns it: a view of ``out`` if given, else of ``staging`` (a page-aligned
        buffer of at least :meth:`staging_bytes`, read into directly), else of a per-thread
        buffer valid until this thread's next read."""
        reserved = extent_size(length, SSD_ALIGN)
        try:
            self._check_range(offset, reserved)
        except ValueError:
            return ReadStatus(False, "mismatch"), None
        if (
            staging is not None
            and staging.size >= self.stage_bytes(offset, length)
            and staging.ctypes.data % SSD_ALIGN == 0
        ):
            buf = staging
        else:
            buf = self._buf.get(reserved + length)  # extent, then room for a decompressed copy
        try:
            got = os.preadv(self._fd, [buf[:reserved]], offset)
        except OSError:
            return ReadStatus(False, "io"), None
        h = self.sealer.parse(buf, 0, at=offset) if got >= HEADER_SIZE else None
        if h is None or h.key != key or h.raw_length != length or HEADER_SIZE + h.length > got:
            return ReadStatus(False, "mismatch"), None
        if gen is not None and h.gen != gen:
            return ReadStatus(False, "mismatch"), None
        stored = buf[HEADER_SIZE : HEADER_SIZE + h.length]
        if out is None and h.flags and buf.size < reserved + length:
            out = np.empty(length, np.uint8)  # stored compressed after all: no room to inflate in place
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

    def committed_gen(self, offset: int) -> int | None:
        """The generation of the committed block at ``offset`` (None: none there)."""
        b = self._live.get(offset)
        return b.gen if b is not None else None

    def holds(self, offset: int, key: bytes, length: int, gen: int) -> bool:
        """Whether the committed block at ``offset`` is (``key``, ``gen``) of ``length`` raw
        bytes: a read is worth a buffer only then."""
        b = self._live.get(offset)
        return b is not None and b.key == key and b.length == length and b.gen == gen

    def stage_bytes(self, offset: int, length: int) -> int:
        """What :meth:`read` needs of a staging buffer for the block at ``offset``: its extent,
        plus room to decompress it unless it is stored raw."""
        reserved = extent_size(length, SSD_ALIGN)
        b = self._live.get(offset)
        return reserved if b is not None and b.size >= reserved else self.staging_bytes(length)

    @staticmethod
    def staging_bytes(length: int) -> int:
        """Size of a staging buffer that :meth:`read` can use for a block of ``length`` bytes."""
        return extent_size(length, SSD_ALIGN) + length

    def invalidate(self, offset: int, key: bytes, gen: int) -> bool:
        """Forgets the block (``key``, ``gen``) at ``offset`` (a DEL record), unless a newer
        block now lives there. Where the journal cannot grow, the block's header is cleared on
        disk instead, so that no recovery adopts it."""
        with self._jlock:
            p = self._pending.get(offset)
            if p is not None and p.key == key and p.gen == gen:
                del self._pending[offset]
                return True
            b = self._live.get(offset)
            if b is None or b.key != key or b.gen != gen:
                return False
            try:
                self._append(OP_DEL, key, offset, 0, 0, 0, gen)
            except (ResourceExhausted, OSError) as e:
                log.warning("event=ssd_del_not_journaled offset=%d reason=%r action=clear_header", offset, str(e))
                zero = self._buf.get(SSD_ALIGN)
                zero[:] = 0
                os.pwrite(self._fd, zero, offset)
                if self.durable:
                    os.fsync(self._fd)
                self._live.pop(offset)
            return True

    def recover(self, verify: bool = True) -> tuple[BlockCols, int]:
        """Replays the journal (discarding a torn tail), keeps each block whose header (and,
        with ``verify``, payload checksum) is whole, compacts the journal if it holds anything
        else. Returns the blocks, oldest first, and how many records were discarded."""
        live, good = journal.replay(self.journal_path)
        with self._jlock:
            size = os.fstat(self._jfd).st_size
            if size > good:  # cut the torn tail so that new records follow whole ones
                os.truncate(self.journal_path, good)
            self._jsize = good
        # Verified in large sequential windows: one read covers many neighbouring extents.
        ok = verify_blocks(self, live, verify)
        found = live.take(ok)
        discarded = len(live) - len(found)
        with self._jlock:
            self._live = BlockMap(found)
            self._records = good // REC_SIZE
            if self._records != len(found):
                self._compact_locked()
        self.counters["recovered"] = len(found)
        self.counters["discarded"] = discarded
        return found.by_gen(), discarded

    def _header_ok(self, offset: int, key: bytes, length: int, csum: int, gen: int) -> bool:
        h = self._header(offset)
        return h is not None and h.key == key and h.raw_length == length and h.checksum == csum and h.gen == gen

    def inventory(self) -> BlockCols:
        """The blocks this segment holds now, oldest first (from the journal's live set)."""
        with self._jlock:
            blocks = self._live.columns()  # never changed in place: sorted outside the lock
        return blocks.by_gen()

    @property
    def journal_bytes(self) -> int:
        return self._jsize

    def close(self) -> None:
        """Closes the files; never raises (nothing is buffered: every record was written whole
        or cut back)."""
        with self._jlock:
            for fd in (self._jfd, self._fd):
                try:
                    os.close(fd)
                except OSError as e:
                    log.warning("event=ssd_close_failed path=%s reason=%r", self.path, str(e))
