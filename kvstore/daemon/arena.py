"""The DRAM segment: a shared-memory arena (a file under /dev/shm) that the daemon and
same-host clients map, so that a same-host put or get is one memcpy with no socket.

The arena outlives a daemon crash (the file stays), so a restarted daemon reattaches it and
rebuilds its inventory with :func:`kvstore.extent.scan`.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from kvstore.extent import CLEARED, HEADER_SIZE, Sealer


def _check_owner(fd: int, path: str) -> None:
    uid = os.fstat(fd).st_uid
    if uid != os.geteuid():
        raise PermissionError(f"shared memory {path} is owned by uid {uid}, not this process's user ({os.geteuid()})")


class ShmArena:
    """A fixed-size shared-memory segment, mapped read-write.

    ``create=True`` makes (or reattaches, if present at the same size) the file and allocates
    its pages once up front: first touch of fresh memory runs at a fraction of memcpy speed, so
    it must not happen on the request path.

    Access is limited to the daemon's user: the file is made with mode 0600 (a file of its own
    with a wider mode is narrowed), never through a symbolic link, and one owned by another
    user is refused; a client likewise maps only a file its own user owns (so a path handed to
    it cannot make it write into someone else's file), else it uses the data port.
    """

    def __init__(self, path: str | os.PathLike, size: int, create: bool = False) -> None:
        self.path = str(path)
        self.size = size
        self.reattached = False
        if create:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                _check_owner(fd, self.path)
                if os.fstat(fd).st_mode & 0o077:
                    os.fchmod(fd, 0o600)
                existing = os.fstat(fd).st_size
                if existing == size:
                    self.reattached = True
                else:
                    os.ftruncate(fd, 0)
                    os.ftruncate(fd, size)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.close(fd)
                    fd = -1
                    raise OSError(
                        e.errno, f"cannot allocate {size} bytes of shared memory at {self.path}: {e.strerror}"
                    ) from None
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                if fd >= 0:
                    os.close(fd)
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                _check_owner(fd, self.path)
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise OSError(f"shared memory {self.path} is {actual} bytes, expected {size}")
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        self.view = memoryview(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def clear_header(self, offset: int) -> None:
        self.view[offset : offset + HEADER_SIZE] = CLEARED

    def commit(self, sealer: Sealer, offset: int, key: bytes, length: int, csum: int, gen: int) -> bool:
        """Writes the sealed header that makes the payload at ``offset`` a committed block
        (the daemon does this when the metadata service commits the put). False if the extent
        does not fit the segment."""
        if not 0 <= offset <= self.size - HEADER_SIZE - length or length < 0:
            return False
        self.view[offset : offset + HEADER_SIZE] = sealer.pack(key, length, csum, gen, offset)
        return True

    def invalidate(self, sealer: Sealer, offset: int, key: bytes, gen: int) -> bool:
        """Clears the header at ``offset`` if it is the committed block (``key``, ``gen``): a
        newer block in the same extent has another generation and is left alone."""
        if not 0 <= offset <= self.size - HEADER_SIZE:
            return False
        h = sealer.parse(self.view, offset)
        if h is not None and h.key == key and h.gen == gen:
            self.clear_header(offset)
            return True
        return False

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a client still holds a view; the mapping dies with the process
