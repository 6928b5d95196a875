"""The staging region: shared memory that the daemon reads SSD blocks into for clients on its
own host, so that a same-host SSD read crosses no socket.

A client on the daemon's host asks for SSD blocks over the data port with the READ flag
``STAGED``; the daemon reads each block with direct I/O straight into this region, verifies it
(header, generation, checksum; decompressing where it was stored compressed), and answers with
where it lies instead of streaming it. The client maps the region (same rules as the DRAM arena:
the daemon's user only) and copies each block once; it does not checksum again, because the
bytes it copies were verified in place and nothing else writes there meanwhile.

The region is split into equal slices, one per data-port connection that asks (taken at its first
staged read, given back when it closes). A connection is one request at a time, and the client
copies a response's blocks before it sends its next request, so a slice is reused only after its
reader is done with it. Blocks that do not fit in the slice, or requests when every slice is
taken, are streamed over the socket as before.
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
        self.slice_bytes = slice_bytes - slice_bytes % SSD_ALIGN
        if slices <= 0 or self.slice_bytes <= 0:
            raise ValueError("a staging region needs at least one slice of at least 4 KiB")
        self.arena = ShmArena(path, slices * self.slice_bytes, create=True)
        self.path = str(path)
        self.size = self.arena.size
        self._free = list(range(slices - 1, -1, -1))
        self._lock = threading.Lock()
        # The head of a READ response that staged blocks: where the client maps them.
        # The inode tells a client that the region at this path was made anew (a restarted
        # daemon) and its mapping of the old one must go.
        self.message = f"{self.path}\n{self.size}\n{self.slice_bytes}\n{self.arena.inode}".encode()

    def take(self) -> int | None:
        """A free slice's index, or None when every slice is held by a connection."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, index: int) -> None:
        with self._lock:
            self._free.append(index)

    def view(self, index: int) -> np.ndarray:
        base = index * self.slice_bytes
        return self.arena.array[base : base + self.slice_bytes]

    def offset_of(self, payload: np.ndarray) -> int:
        """Where ``payload`` (a view into the region) starts in it."""
        return payload.ctypes.data - self.arena.array.ctypes.data

    def close(self, unlink: bool = True) -> None:
        self.arena.close()
        if unlink:
            Path(self.path).unlink(missing_ok=True)
