"""The staging region: shared memory that the daemon reads SSD blocks into for clients on its
own host, so that a same-host SSD read crosses no socket.

A client on the daemon's host asks for SSD blocks over the data port with the READ flag
``STAGED``; the daemon reads each block with direct I/O straight into this region, verifies it
(header, generation, checksum; decompressing where it was stored compressed), and answers with
where it lies instead of streaming it. The client maps the region (same rules as the DRAM arena:
the daemon's user only) and copies each block once; it does not checksum again, because the
bytes it copies were verified in place and nothing else writes there meanwhile.

The region is split into equal slices, one per data-port connection that asks (taken at its first
staged read, given back when it closes), and each slice into two halves that the connection's
staged requests use in turn. A client may keep two requests in flight on a connection (it sends
the next before it reads this one's answer, so the daemon never waits for it between requests),
and it sends a request only once it has copied every answer but the last one's. So a half is
written again only after its reader is done with it. The head of a staged answer tells the
client how many bytes one request may stage (a half); blocks that do not fit, or requests when
every slice is taken, are streamed over the socket as before.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from kvstore.daemon.arena import ShmArena
from kvstore.extent import SSD_ALIGN


class Staging:
    def __init__(self, path: str | os.PathLike, slices: int, slice_bytes: int) -> None:
        # What one request may stage: half a slice, so that two requests in flight on a
        # connection never share bytes.
        self.request_bytes = slice_bytes // 2 - (slice_bytes // 2) % SSD_ALIGN
        self.slice_bytes = 2 * self.request_bytes
        if slices <= 0 or self.request_bytes <= 0:
            raise ValueError(f"a staging region needs at least one slice of at least {2 * SSD_ALIGN // 1024} KiB")
        self.arena = ShmArena(path, slices * self.slice_bytes, create=True, stamps=False)
        self.path = str(path)
        self.size = self.arena.size
        self._free = list(range(slices - 1, -1, -1))
        self._lock = threading.Lock()
        # The head of a READ response that staged blocks: where the client maps them, and how
        # many bytes one request may stage.
        # The inode tells a client that the region at this path was made anew (a restarted
        # daemon) and its mapping of the old one must go.
        self.message = f"{self.path}\n{self.size}\n{self.request_bytes}\n{self.arena.inode}".encode()

    def take(self) -> int | None:
        """A free slice's index, or None when every slice is held by a connection."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, index: int) -> None:
        with self._lock:
            self._free.append(index)

    def view(self, index: int, half: int) -> np.ndarray:
        """Half ``half`` (0 or 1) of slice ``index``: where one request stages its blocks."""
        base = index * self.slice_bytes + (half & 1) * self.request_bytes
        return self.arena.array[base : base + self.request_bytes]

    def offset_of(self, payload: np.ndarray) -> int:
        """Where ``payload`` (a view into the region) starts in it."""
        return payload.ctypes.data - self.arena.array.ctypes.data

    def close(self, unlink: bool = True) -> None:
        self.arena.close()
        if unlink:
            Path(self.path).unlink(missing_ok=True)
