"""The DRAM segment: a shared-memory arena (a file under /dev/shm) that the daemon and
same-host clients map, so that a same-host put or get is one memcpy with no socket.

The arena outlives a daemon crash (the file stays), so a restarted daemon reattaches it and
rebuilds its inventory with :func:`kvstore.extent.scan`.

Two locks (``flock``, which the kernel drops the moment the process dies):

- the daemon holds an exclusive lock on the arena itself for as long as it runs, so that no
  second daemon attaches to an arena that one already uses (and ``kvstore shm``,
  :mod:`kvstore.daemon.shm`, tells a live daemon's arena from one left behind by that lock);
- it holds one on ``<arena>.served`` while its blocks are in the metadata service's index and
  it serves them (:meth:`ShmArena.serve`): from its first heartbeat after registering (by then
  the blocks the service refused from its inventory are invalidated) until a drain, or until
  the service no longer knows it. A client tells at the cost of one system call whether that
  holds (:meth:`ShmArena.served`) before it reads a block there without asking the service.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
import weakref
from pathlib import Path

import numpy as np

from kvstore.extent import CLEARED, HEADER_SIZE, SECRET_BYTES, Sealer, Stamper, make_secret


def _check_owner(fd: int, path: str) -> None:
    uid = os.fstat(fd).st_uid
    if uid != os.geteuid():
        raise PermissionError(f"shared memory {path} is owned by uid {uid}, not this process's user ({os.geteuid()})")


def _lock_owner(fd: int, path: str, deadline: float) -> None:
    """Takes the arena's exclusive lock for this daemon; another daemon that uses the arena
    holds it for good (a few retries, until ``deadline`` on the monotonic clock, cover one that
    is just letting go, and ``kvstore shm clean`` removing it)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(f"shared memory {path} is already in use by another daemon (it holds its lock)") from None
            time.sleep(0.01)


def _open_owned(path: str, wait_s: float = 2.0) -> int:
    """The daemon's descriptor of the arena at ``path`` (made if missing), its lock taken. A
    file that left the path while we waited for its lock (``kvstore shm clean`` removes a stale
    arena while it holds the lock) is not used: the path is opened again."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            _check_owner(fd, path)
            _lock_owner(fd, path, deadline)  # before anything changes the file
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


def _stamp_key(path: str, create: bool) -> bytes | None:
    """The arena's stamp key, in ``<arena>.stamp`` (:mod:`kvstore.extent`): made once by the
    daemon (:func:`kvstore.extent.make_secret`), read by a client; never through a link, and
    only from a file of this process's user. None for a client that finds none (a daemon older
    than the stamp, which commits without one)."""
    p = path + ".stamp"
    if create:
        make_secret(p)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        if create:
            raise
        return None
    try:
        _check_owner(fd, p)
        key = os.read(fd, 2 * SECRET_BYTES)
    finally:
        os.close(fd)
    if len(key) != SECRET_BYTES:
        if create:
            raise OSError(f"{p} holds {len(key)} bytes, expected a {SECRET_BYTES}-byte stamp key")
        return None
    return key


# Files beside a DRAM arena: the lock that says it is served, its stamp key, and the record of
# the daemon that made it (kvstore.daemon.shm).
SIDECARS = (".served", ".stamp", ".owner")


def remove_files(path: str) -> None:
    """Removes a DRAM segment's files for good: the arena, its stamp key, its lock file and its
    owner record (a daemon that starts on the path again makes new ones). Files already gone
    are fine."""
    for p in (path, *(path + s for s in SIDECARS)):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


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

    def __init__(self, path: str | os.PathLike, size: int, create: bool = False, stamps: bool = True) -> None:
        self.path = str(path)
        self.size = size
        self.reattached = False
        self._owner = create  # the daemon's (a client's mapping removes nothing at close)
        if create:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            fd = _open_owned(self.path)
            try:
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
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                _check_owner(fd, self.path)
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise OSError(f"shared memory {self.path} is {actual} bytes, expected {size}")
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            except BaseException:
                os.close(fd)
                raise
        # Puts' blocks are stamped (kvstore.extent); a region no put writes (staging) has no key.
        key = _stamp_key(self.path, create) if stamps else None
        self._stamper = Stamper(key) if key is not None else None
        # Kept open: the daemon's holds its lock, a client's probes it. Closed by close(), or
        # when the arena is dropped (a client forgetting a retired segment).
        self._fd = fd
        self.inode = os.fstat(fd).st_ino
        self._closer = weakref.finalize(self, os.close, fd)
        self._served_fd = -1  # the daemon's lock on <path>.served
        self._probe_fd = -1  # a client's handle on it
        self.view = memoryview(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def serve(self) -> None:
        """The daemon: its blocks here are indexed and served (see the module docstring)."""
        if self._served_fd >= 0:
            return
        fd = os.open(self.path + ".served", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            _check_owner(fd, self.path + ".served")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._served_fd = fd

    def unserve(self) -> None:
        """The daemon stops serving reads without a lease from this arena (a drain, or the
        service no longer knows it)."""
        if self._served_fd >= 0:
            os.close(self._served_fd)  # the lock goes with it
            self._served_fd = -1

    def served(self) -> bool:
        """A client: whether the daemon serves this arena now. One system call (two when the
        lock file was made anew since it was last opened)."""
        for fresh in (False, True):
            if fresh or self._probe_fd < 0:
                if self._probe_fd >= 0:
                    os.close(self._probe_fd)
                    self._probe_fd = -1
                try:
                    self._probe_fd = os.open(self.path + ".served", os.O_RDONLY | os.O_NOFOLLOW)
                except OSError:
                    return False
            try:
                fcntl.flock(self._probe_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            except OSError:
                return False
            fcntl.flock(self._probe_fd, fcntl.LOCK_UN)
        return False

    def clear_header(self, offset: int) -> None:
        self.view[offset : offset + HEADER_SIZE] = CLEARED

    def stamp_written(self, offset: int, gen: int) -> None:
        """Marks the extent at ``offset`` written for the placement of generation ``gen``
        (its writer, after the whole payload is in; see :mod:`kvstore.extent`). Nothing where
        this mapping found no stamp key: its daemon is older than the stamp and commits without."""
        if self._stamper is not None and 0 <= offset <= self.size - HEADER_SIZE:
            self.view[offset : offset + Stamper.SIZE] = self._stamper.stamp(offset, gen)

    def written(self, offset: int, gen: int) -> bool:
        """Whether the extent at ``offset`` holds the write stamp of generation ``gen``."""
        if self._stamper is None or not 0 <= offset <= self.size - HEADER_SIZE:
            return False
        return self.view[offset : offset + Stamper.SIZE] == self._stamper.stamp(offset, gen)

    def commit(
        self, sealer: Sealer, offset: int, key: bytes, length: int, csum: int, gen: int, stamped: bool = False
    ) -> bool:
        """Writes the sealed header that makes the payload at ``offset`` a committed block
        (the daemon does this when the metadata service commits the put). False if the extent
        does not fit the segment. The payload is not hashed here: bytes that came over the data
        port were checked against ``csum`` as they arrived, and a same-host writer maps the
        arena with the daemon's own user (it could rewrite a committed block as well); every
        reader checks the checksum, so a block committed without its bytes is a miss at its
        first read, and dropped. (Hashing every block at commit cost a quarter to a third of
        the shared-memory put throughput, measured with bench/store_throughput.py.)

        With ``stamped`` (a put's commit), the payload must carry its writer's stamp of ``gen``
        (:meth:`stamp_written`): without one it was never written whole for this placement, and
        the extent may still hold the bytes of the block it held before, which a commit naming
        their checksum would otherwise serve as its own. The daemon's own copies (tier moves)
        write the payload themselves and pass ``stamped=False``."""
        if not 0 <= offset <= self.size - HEADER_SIZE - length or length < 0:
            return False
        # Generations only increase: an extent sealed with this generation is this commit done
        # before (a retry: the same block is fine), and one sealed with a later generation
        # holds a newer block that an older (replayed, late) commit must not overwrite.
        h = sealer.parse(self.view, offset)
        if h is not None and h.gen >= gen:
            return h.gen == gen and h.key == key and h.length == length and h.checksum == csum
        if stamped and not self.written(offset, gen):
            return False
        self.view[offset : offset + HEADER_SIZE] = sealer.pack(key, length, csum, gen, offset)
        return True

    def sealed_since(self, sealer: Sealer, offset: int, gen: int) -> bool:
        """Whether the extent at ``offset`` holds a committed block of generation ``gen`` or later."""
        if not 0 <= offset <= self.size - HEADER_SIZE:
            return False
        h = sealer.parse(self.view, offset)
        return h is not None and h.gen >= gen

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
        if self._owner:  # the daemon: no lock file left behind (served or not by now)
            Path(self.path + ".served").unlink(missing_ok=True)
        self.unserve()
        if self._probe_fd >= 0:
            os.close(self._probe_fd)
            self._probe_fd = -1
        if self._fd >= 0:
            self._closer()  # a daemon's lock goes with it
            self._fd = -1
        self.array = None  # type: ignore[assignment]
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a client still holds a view; the mapping dies with the process
