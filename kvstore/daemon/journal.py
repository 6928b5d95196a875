"""The SSD segment's journal (:mod:`kvstore.daemon.ssd`) as numpy columns: its records packed
and replayed many at a time.

::

    record = magic "KVJ2" | op u8 | pad 3 | key 16s | offset u64 | size u64 | length u64
             | checksum u64 | gen u64 | crc u32 (xxh32 of the 64 bytes before it)

Replay gives what applying the records one by one gives: an ADD makes its block the one at its
offset; a DEL removes the block at its offset if that block has the DEL's key and generation.
So the block left at an offset is the last ADD there, unless a DEL after it names it. The
records are read up to the first one whose magic or CRC is wrong (a torn or damaged tail:
nothing after it is trusted).
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import BinaryIO

import numpy as np
import xxhash

from kvstore.batch import record_crcs
from kvstore.blocks import U64, BlockCols

_REC = struct.Struct("<4sB3x16sQQQQQ")
_CRC = struct.Struct("<I")
REC_SIZE = _REC.size + _CRC.size
JMAGIC = b"KVJ2"
OP_ADD, OP_DEL = 1, 2
RECORD_DTYPE = np.dtype(
    [("magic", "<u4"), ("op", "u1"), ("pad", "V3"), ("key", "u1", (16,)), ("offset", "<u8"), ("size", "<u8"),
     ("length", "<u8"), ("checksum", "<u8"), ("gen", "<u8"), ("crc", "<u4")]
)  # fmt: skip
_MAGIC_U32 = int.from_bytes(JMAGIC, "little")
_WRITE_RECORDS = 1 << 16  # records packed per write when a journal is rewritten


def pack_record(op: int, key: bytes, offset: int, size: int, length: int, csum: int, gen: int) -> bytes:
    """One record, CRC included."""
    body = _REC.pack(JMAGIC, op, key, offset, size, length, csum, gen)
    return body + _CRC.pack(xxhash.xxh32_intdigest(body))


def pack_records(blocks: BlockCols, op: int = OP_ADD) -> np.ndarray:
    """One record per block (in their order), CRCs included: ``len(blocks) * REC_SIZE`` bytes."""
    recs = np.zeros(len(blocks), RECORD_DTYPE)
    recs["magic"], recs["op"] = _MAGIC_U32, op
    recs["key"] = blocks.keys
    for f in BlockCols.FIELDS:
        recs[f] = getattr(blocks, f)
    raw = recs.view(np.uint8)
    recs["crc"] = record_crcs(raw, REC_SIZE, _REC.size)
    return raw


def write_records(f: BinaryIO, blocks: BlockCols) -> None:
    """Writes an ADD record for each block, a bounded number of records at a time."""
    for lo in range(0, len(blocks), _WRITE_RECORDS):
        f.write(pack_records(blocks.take(slice(lo, lo + _WRITE_RECORDS))).data)


def _last_of_each(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``values`` (ascending) and the index of the last occurrence of each."""
    n = values.size
    bits = max(1, (n - 1).bit_length())
    index = np.arange(n, dtype=U64)
    if n and int(values.max()) < 1 << (64 - bits):
        # One sort of (value, index) packed into a u64: a plain sort, several times as fast as
        # an argsort of the values.
        packed = np.sort((values << np.uint64(bits)) | index)
        v, i = packed >> np.uint64(bits), packed & np.uint64((1 << bits) - 1)
    else:
        order = np.lexsort((index, values))
        v, i = values[order], index[order]
    last = np.ones(n, bool)
    last[:-1] = v[1:] != v[:-1]
    return v[last], i[last].astype(np.int64)


def replay_records(recs: np.ndarray) -> tuple[BlockCols, int]:
    """The blocks that records (a RECORD_DTYPE array) leave, ordered by offset, and how many
    leading records are whole (the rest is a torn or damaged tail, ignored)."""
    n = recs.size
    crc = record_crcs(recs.view(np.uint8), REC_SIZE, _REC.size)
    bad = (crc != recs["crc"]) | (recs["magic"] != _MAGIC_U32)
    whole = int(np.argmax(bad)) if bool(bad.any()) else n
    recs = recs[:whole]
    op, offset = recs["op"], recs["offset"]
    adds = np.flatnonzero(op == OP_ADD)
    if adds.size == 0:
        return BlockCols.empty(), whole
    at, last = _last_of_each(offset[adds])
    last = adds[last]  # the record index of the last ADD at each offset, offsets ascending
    dels = np.flatnonzero(op == OP_DEL)
    dead = np.zeros(last.size, bool)
    if dels.size:
        pos = np.minimum(np.searchsorted(at, offset[dels]), at.size - 1)
        named = last[pos]
        hit = (at[pos] == offset[dels]) & (dels > named) & (recs["gen"][dels] == recs["gen"][named])
        hit &= (recs["key"][dels] == recs["key"][named]).all(axis=1)
        dead[pos[hit]] = True
    live = recs[last[~dead]]
    return BlockCols(live["key"], live["offset"], live["size"], live["length"], live["checksum"], live["gen"]), whole


def replay(path: str | os.PathLike) -> tuple[BlockCols, int]:
    """The blocks the journal at ``path`` leaves (ordered by offset) and the byte length of its
    whole records. The file is mapped, not read into memory: only the columns of the blocks
    that are left are made."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return BlockCols.empty(), 0
    try:
        n = os.fstat(fd).st_size // REC_SIZE
        if n == 0:
            return BlockCols.empty(), 0
        with mmap.mmap(fd, n * REC_SIZE, prot=mmap.PROT_READ) as m:
            recs = np.frombuffer(m, RECORD_DTYPE, count=n)
            try:
                live, whole = replay_records(recs)
            finally:
                del recs  # no view of the map outlives it
        return live, whole * REC_SIZE
    finally:
        os.close(fd)
