"""The write path of :class:`kvstore.client.KVStoreClient` (a mixin over its state): PutStart,
the copy (shared memory on the same host, the data port otherwise) with a checksum per block,
PutCommit, and retries on other daemons for blocks whose daemon failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvstore.client.buffers import INLINE_COPY_BYTES, byte_views
from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted, Unavailable
from kvstore.extent import checksum
from kvstore.keys import KEY_BYTES, pack_keys
from kvstore.transport.shm import ShmTransport
from kvstore.v1 import common_pb2, meta_pb2
from kvstore.wire import U8, U64, Placement, locations_from_pb, pack, unpack

log = logging.getLogger("kvstore.client")


class PutResult(NamedTuple):
    stored: int  # newly written and committed
    skipped: int  # already stored or being written by someone else (dedup)
    rejected: int  # no space even after eviction, or not admitted by the cache policy


class Writes:
    """put and what it takes."""

    def _abort(self, put_id: int) -> None:
        """Gives a put's reservation back without waiting for the answer."""
        self._background(self._stub.PutAbort, meta_pb2.PutAbortRequest(put_id=put_id), f"abort_failed put={put_id}")

    async def put(self, keys: Sequence[bytes] | bytes, buffers: Sequence[Any], *, chain: bool = True) -> PutResult:
        """Stores blocks; keys already stored (or being stored) are skipped.

        ``chain``: the keys are one prefix chain in order (the usual case), which lets the
        service keep a chain's head longer than its tail. A daemon that fails mid-write is
        excluded and its blocks are placed elsewhere (``client.retries`` times).
        """
        packed = pack_keys(keys)
        n = len(packed) // KEY_BYTES
        if len(buffers) != n:
            raise InvalidArgument(f"put: {len(buffers)} buffers for {n} keys")
        srcs = byte_views(buffers, writable=False)
        sizes = list(map(len, srcs))
        if 0 in sizes:
            i = sizes.index(0)
            raise InvalidArgument(f"buffers[{i}] is empty: blocks must hold at least one byte")
        self._prune()
        stored = skipped = rejected = no_space = 0
        todo = list(range(n))
        excluded: list[str] = []
        for attempt in range(self.cfg.retries + 1):
            sub = b"".join(packed[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in todo)
            resp = await self._rpc(
                self._stub.PutStart,
                meta_pb2.PutStartRequest(
                    keys=sub,
                    sizes=pack([srcs[i].size for i in todo], U64),
                    chain=chain and attempt == 0,
                    host_id=self.host_id,
                    timeout_ms=int(self.cfg.put_timeout_s * 1000),
                    exclude_daemons=excluded,
                ),
            )
            status = unpack(resp.status, U8, "status", len(todo))
            skipped += sum(1 for s in status if s in (1, 2))
            rejected += sum(1 for s in status if s in (3, 4))  # no space, or not admitted by the policy
            alloc = [todo[k] for k, s in enumerate(status) if s == 0]
            if not alloc:
                break
            places = locations_from_pb(resp.placements, len(alloc))
            total = sum(srcs[i].size for i in alloc)
            args = (packed, alloc, places, srcs)
            copy = None
            try:
                if total > INLINE_COPY_BYTES:
                    copy = asyncio.get_running_loop().run_in_executor(self._pool, self._write_all, *args)
                    sums, written, failed = await copy
                else:
                    sums, written, failed = self._write_all(*args)
            except BaseException:
                if copy is not None and not copy.done():
                    # Cancelled while its thread still writes into the reservation: it is given
                    # up once that copy has ended, so that no other put gets those bytes first.
                    copy.add_done_callback(lambda _f, put_id=resp.put_id: self._abort(put_id))
                else:
                    self._abort(resp.put_id)  # the reservation goes now, not at its deadline
                raise
            try:
                commit = await self._rpc(
                    self._stub.PutCommit,
                    meta_pb2.PutCommitRequest(put_id=resp.put_id, checksums=pack(sums, U64), written=pack(written, U8)),
                )
            except BaseException:
                # No answer (a deadline, a lost connection, a cancelled caller): the reservation
                # goes now, not at its deadline, so that a retry of these keys is not told they
                # are being written (skipped) by the put it gave up. A commit the service has
                # begun has left the reservation table, and the abort then changes nothing.
                self._abort(resp.put_id)
                raise
            stored += commit.committed
            outcome = unpack(commit.status, U8, "status", len(alloc)) if commit.status else [0] * len(alloc)
            ok = [k for k, st in enumerate(outcome) if st == common_pb2.COMMIT_OK]
            # The placement came before the bytes: it carries the checksum the block was sealed
            # with only from here (without it a read from the remembered location would fail).
            self._known.remember(
                [packed[alloc[k] * KEY_BYTES : (alloc[k] + 1) * KEY_BYTES] for k in ok],
                [places[k]._replace(checksum=sums[k]) for k in ok],
                read=False,
            )
            full = outcome.count(common_pb2.COMMIT_NO_SPACE)
            no_space += full
            rejected += full
            # Not written, or its daemon could not commit it: try again on another daemon.
            todo = [i for i, st in zip(alloc, outcome) if st not in (common_pb2.COMMIT_OK, common_pb2.COMMIT_NO_SPACE)]
            if not todo:
                break
            lost = (common_pb2.COMMIT_MISMATCH, common_pb2.COMMIT_UNAVAILABLE)
            failed += [p.daemon.daemon_id for p, st in zip(places, outcome) if st in lost]
            excluded.extend(d for d in dict.fromkeys(failed) if d not in excluded)
            log.info("event=put_retry blocks=%d excluded=%s", len(todo), ",".join(excluded))
        else:
            if todo:
                raise Unavailable(f"put: {len(todo)} blocks could not be written after {self.cfg.retries + 1} attempts")
        if no_space and not stored and not skipped:
            raise ResourceExhausted(f"put: no space to store {no_space} blocks (a daemon's storage is full)")
        return PutResult(stored, skipped, rejected)

    def _write_all(
        self, packed: bytes, alloc: list[int], places: list[Placement], srcs: list[np.ndarray]
    ) -> tuple[list[int], list[int], list[str]]:
        """Writes the allocated blocks, split over the I/O threads. Returns (checksums,
        written flags, daemons that failed), all in placement order."""
        ranges = self._split([p.length for p in places])
        args = (packed, alloc, places, srcs)
        futs = [self._chunk_pool.submit(self._write_range, *args, lo, hi) for lo, hi in ranges[1:]]
        parts = [self._write_range(*args, *ranges[0])] + [f.result() for f in futs]
        sums = [c for part in parts for c in part[0]]
        written = [w for part in parts for w in part[1]]
        failed = sorted({d for part in parts for d in part[2]})
        return sums, written, failed

    def _write_range(
        self, packed: bytes, alloc: list[int], places: list[Placement], srcs: list[np.ndarray], lo: int, hi: int
    ) -> tuple[list[int], list[int], list[str]]:
        sums = []
        written = [0] * (hi - lo)
        failed: list[str] = []
        tcp_groups: dict[str, list[int]] = {}
        for k in range(lo, hi):
            i, p = alloc[k], places[k]
            src = srcs[i]
            csum = checksum(src)
            sums.append(csum)
            if self._use_shm(p):
                arena = self._shm.arena(p.segment.shm_path, p.segment.capacity_bytes)
                written[k - lo] = int(ShmTransport.write(arena, p.offset, src, p.gen))
            else:
                tcp_groups.setdefault(p.daemon.data_addr, []).append(k)
        for addr, ks in tcp_groups.items():
            items = [
                (places[k].key or packed[alloc[k] * KEY_BYTES : (alloc[k] + 1) * KEY_BYTES], places[k].segment_id,
                 places[k].offset, places[k].length, sums[k - lo], places[k].gen, places[k].ticket)
                for k in ks
            ]  # fmt: skip
            try:
                ok = self._tcp.write(addr, items, [srcs[alloc[k]] for k in ks])
            except KVStoreError as e:
                log.info("event=write_failed addr=%s reason=%r", addr, str(e))
                failed.append(places[ks[0]].daemon.daemon_id)
                continue
            for k, good in zip(ks, ok):
                written[k - lo] = int(good)
        return sums, written, failed
