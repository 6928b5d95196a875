"""Same-host transport: the client maps the daemon's shared-memory segment and copies.

Reads copy then verify the checksum on the copy (the only bytes that matter are the ones the
caller got); writes clear the header, copy the payload and stamp the extent written for its
placement. The header is the daemon's to write, sealed, when the metadata service commits the
put (a writer cannot make bytes look committed), over that stamp only (kvstore.extent).
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
import time

import numpy as np
import xxhash

from kvstore.daemon.arena import ShmArena
from kvstore.extent import HEADER_SIZE, MAGIC, VERSION
from kvstore.tickets import NO_TICKET
from kvstore.transport import native
from kvstore.wire import Placement

_FIELDS = struct.Struct("<4sHH16sQQQ")  # the header's magic .. gen (kvstore.extent)
_PREFIX = _FIELDS.pack(MAGIC, VERSION, 0, bytes(16), 0, 0, 0)[:8]  # magic, version, flags 0

log = logging.getLogger("kvstore.client")


RETRY_S = 30.0


class ShmTransport:
    def __init__(self) -> None:
        self._arenas: dict[str, ShmArena] = {}
        self._inodes: dict[str, int] = {}
        self._refused: dict[str, float] = {}
        self._lock = threading.Lock()

    def usable(self, shm_path: str, size: int = 0) -> bool:
        """Whether this process can map the segment (given its size: maps it now). A segment it
        may not map (another user's, or a link) is remembered for ``RETRY_S`` and the caller
        uses the data port instead."""
        if not shm_path:
            return False
        if shm_path in self._arenas:
            return True
        refused = self._refused.get(shm_path)
        if refused is not None and time.monotonic() - refused < RETRY_S:
            return False
        if not os.path.exists(shm_path):
            return False
        if size:
            try:
                self.arena(shm_path, size)
            except OSError as e:
                self._refused[shm_path] = time.monotonic()
                log.info("event=shm_refused path=%s reason=%r", shm_path, str(e))
                return False
        return True

    def arena(self, shm_path: str, size: int, inode: int = 0) -> ShmArena:
        """The mapping of ``shm_path`` (made now if there is none of that size, or, given the
        file's ``inode``, none of that file)."""
        a = self._arenas.get(shm_path)
        if a is None or a.size != size or (inode and a.inode != inode):
            with self._lock:
                a = self._arenas.get(shm_path)
                if a is None or a.size != size or (inode and a.inode != inode):
                    a = self._arenas[shm_path] = ShmArena(shm_path, size)
                    self._inodes[shm_path] = a.inode
                    if inode and a.inode != inode:
                        raise OSError(f"{shm_path} is not the file the daemon named (inode {a.inode}, not {inode})")
        return a

    def prune(self) -> int:
        """Forgets mappings whose file is gone or was replaced (a daemon retired, or its segment
        recreated). The mapping itself is released once no read in progress holds it."""
        dropped = 0
        with self._lock:
            for path in list(self._arenas):
                try:
                    ino = os.stat(path).st_ino
                except FileNotFoundError:
                    ino = None
                if ino != self._inodes.get(path):
                    del self._arenas[path]
                    self._inodes.pop(path, None)
                    dropped += 1
        return dropped

    def mapped(self) -> int:
        return len(self._arenas)

    @staticmethod
    def read(
        arena: ShmArena, offset: int, length: int, dest: np.ndarray, csum: int, key: bytes = b"", gen: int = 0
    ) -> bool:
        """Copies one payload into ``dest``; True if the copy matches ``csum`` and (with ``key``)
        the extent's header named that block, ``key`` at generation ``gen``, both before and after
        the copy. That makes a read without a lease safe: an extent is freed or reused only after
        its header is cleared (invalidation, or the next writer), so a copy that raced with reuse
        fails a check instead of returning another block's bytes."""
        place = Placement(None, None, offset, length, csum, gen, NO_TICKET, key)  # type: ignore[arg-type]
        return ShmTransport.read_many(arena, [place], [dest], [key] if key else None, math.inf) == 1

    @staticmethod
    def read_many(
        arena: ShmArena, places: list, dests: list[np.ndarray], keys: list[bytes] | None, deadline: float
    ) -> int:
        """:meth:`read` for a run of placements (``kvstore.wire.Placement``) in one arena, in
        order, with the per-block work cut to the copy, the checksum and (with ``keys``, a read
        without a lease) the two header comparisons. Returns how many leading blocks were loaded;
        it stops at the first that fails (an extent outside the arena and a buffer of another
        size fail too), and once ``deadline`` (monotonic) passed.

        With the native copy (:mod:`kvstore.transport.native`) the run is one call that copies,
        checksums and compares headers with the GIL released."""
        if native.impl is not None:
            return native.impl.read_many(arena.array, HEADER_SIZE, places, dests, keys, deadline, _PREFIX)
        view, array, size = arena.view, arena.array, arena.size
        pack, hsize, monotonic, xxh3 = _FIELDS.pack, _FIELDS.size, time.monotonic, xxhash.xxh3_64_intdigest
        for n, p in enumerate(places):
            if monotonic() > deadline:
                return n
            off = p.offset
            start = off + HEADER_SIZE
            length = p.length
            dest = dests[n]
            if off < 0 or start + length > size or dest.size != length:
                return n
            if keys is not None:
                head = pack(MAGIC, VERSION, 0, p.key or keys[n], length, p.checksum, p.gen)
                if view[off : off + hsize] != head:
                    return n
                np.copyto(dest, array[start : start + length])
                if xxh3(dest) != p.checksum or view[off : off + hsize] != head:
                    return n
            else:
                np.copyto(dest, array[start : start + length])
                if xxh3(dest) != p.checksum:
                    return n
        return len(places)

    @staticmethod
    def write(arena: ShmArena, offset: int, src: np.ndarray, gen: int) -> bool:
        """Copies one payload into its reserved extent (of the placement of generation
        ``gen``), then stamps it written (the daemon commits it only so). False if the extent
        does not fit."""
        start = offset + HEADER_SIZE
        if offset < 0 or start + src.size > arena.size:
            return False
        arena.clear_header(offset)
        np.copyto(arena.array[start : start + src.size], src)
        arena.stamp_written(offset, gen)
        return True

    def close(self) -> None:
        for a in self._arenas.values():
            a.close()
        self._arenas.clear()
