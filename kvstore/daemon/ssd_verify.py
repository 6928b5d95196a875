"""The SSD segment's check of its journal's blocks at a restart (:meth:`kvstore.daemon.ssd.
SsdSegment.recover`), in large sequential reads and in batches.

Each block the journal names must have, at its offset, a header sealed by this daemon for that
offset that names it (key, raw length, checksum, generation) and whose stored length fits its
extent; with ``verify``, its payload must match the checksum too (after decompression, for the
few blocks stored compressed). The blocks are taken in offset order, a window of up to 8 MiB at
a time: one read covers all the neighbouring extents that fit in it, whose headers are then
gathered and checked as columns, seals and checksums in batches (:mod:`kvstore.batch`), while
the next window is being read. A block larger than the window is read alone.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from kvstore.batch import checksums
from kvstore.blocks import U64, BlockCols
from kvstore.daemon.codec import decompress
from kvstore.extent import HEADER_DTYPE, HEADER_SIZE, SSD_ALIGN, checksum

if TYPE_CHECKING:
    from kvstore.daemon.ssd import SsdSegment

WINDOW = 8 << 20
_HEADER_BYTES = np.arange(HEADER_SIZE, dtype=np.int64)


def verify_blocks(seg: SsdSegment, blocks: BlockCols, verify: bool, window: int = WINDOW) -> np.ndarray:
    """Which of ``blocks`` (ordered by offset) are whole on ``seg``'s disk: a boolean mask."""
    n = len(blocks)
    ok = np.zeros(n, bool)
    off, size = blocks.offset, blocks.size
    fits = (off % SSD_ALIGN == 0) & (size >= HEADER_SIZE) & (off <= seg.size)
    fits &= size <= np.uint64(seg.size) - np.minimum(off, np.uint64(seg.size))
    for i in np.flatnonzero(fits & (size > window)).tolist():  # larger than a window: alone
        key, o, length, csum, gen = (
            blocks.keys[i].tobytes(),
            int(off[i]),
            int(blocks.length[i]),
            int(blocks.checksum[i]),
            int(blocks.gen[i]),
        )
        ok[i] = seg.read(o, key, length, gen=gen)[0].ok if verify else seg._header_ok(o, key, length, csum, gen)
    todo = np.flatnonzero(fits & (size <= window))
    starts, ends = off[todo], off[todo] + size[todo]
    if not todo.size:
        return ok
    bufs = [np.frombuffer(mmap.mmap(-1, window), np.uint8) for _ in range(2)]  # page-aligned, for direct I/O

    def read(lo: int, buf: np.ndarray) -> int:
        return os.preadv(seg._fd, [buf[: min(window, seg.size - lo)]], lo)

    with ThreadPoolExecutor(1, thread_name_prefix="kvstore-ssd-verify") as io:
        pending = io.submit(read, int(starts[0]), bufs[0])
        j = cur = 0
        while j < todo.size:
            lo, got, buf = int(starts[j]), pending.result(), bufs[cur]
            hi = np.uint64(lo + got)
            k = int(np.searchsorted(starts, hi, "left"))  # the blocks that start in the window
            inside = ends[j:k] <= hi
            # Those that fit, up to the first that does not.
            run = k - j if bool(inside.all()) else int(np.argmin(inside))
            nxt = j + max(run, 1)  # none fits: the file ends inside the first, which fails
            if nxt < todo.size:  # the next window is read while this one is checked
                pending = io.submit(read, int(starts[nxt]), bufs[1 - cur])
            if run:
                idx = todo[j:nxt]
                ok[idx] = _check_window(seg, buf, lo, blocks, idx, verify)
            j, cur = nxt, 1 - cur
    return ok


def _check_window(seg: SsdSegment, buf: np.ndarray, lo: int, blocks: BlockCols, idx: np.ndarray, verify: bool):  # noqa: ANN202
    rel = (blocks.offset[idx] - np.uint64(lo)).astype(np.int64)
    raw = buf[rel[:, None] + _HEADER_BYTES]  # (m, 64): the headers, gathered
    h = raw.view(HEADER_DTYPE).reshape(-1)
    ok = seg.sealer.check_many(raw, blocks.offset[idx])
    ok &= (h["key"] == blocks.keys[idx]).all(axis=1)
    ok &= (h["raw_length"] == blocks.length[idx]) & (h["checksum"] == blocks.checksum[idx])
    ok &= h["gen"] == blocks.gen[idx]
    ok &= h["length"] <= blocks.size[idx] - np.uint64(HEADER_SIZE)
    if not verify:
        return ok
    plain = np.flatnonzero(ok & (h["flags"] == 0))
    if plain.size:
        sums = checksums(buf, rel[plain].astype(U64) + np.uint64(HEADER_SIZE), h["length"][plain])
        ok[plain] = sums == h["checksum"][plain]
    for i in np.flatnonzero(ok & (h["flags"] != 0)).tolist():  # stored compressed: one at a time
        start = int(rel[i]) + HEADER_SIZE
        stored = buf[start : start + int(h["length"][i])]
        out = np.empty(int(blocks.length[idx[i]]), np.uint8)
        ok[i] = decompress(memoryview(stored), int(h["flags"][i]), out) and checksum(out) == int(h["checksum"][i])
    return ok
