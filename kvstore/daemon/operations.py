"""What the metadata service has a daemon do to its segments: commit written blocks (sealed
header in DRAM, journal record on SSD), drop committed blocks it dropped (each only if still that
generation), and move blocks between tiers. The list of committed blocks (the inventory, as
columns) is the daemon's: :meth:`kvstore.daemon.server.CacheDaemon.inventory_columns`."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore.daemon.arena import ShmArena
from kvstore.daemon.ssd import SsdSegment
from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.extent import HEADER_SIZE, Sealer, checksum, extent_size
from kvstore.keys import unpack_keys
from kvstore.v1 import common_pb2, daemon_pb2
from kvstore.wire import U8, U32, U64, pack, unpack

log = logging.getLogger("kvstore.daemon")


class SegmentOps:
    """The operations on a daemon's segments (segment id -> arena), counted in ``counters``."""

    def __init__(
        self,
        segments: dict[int, ShmArena | SsdSegment],
        sealer: Sealer,
        counters: dict[str, int],
        on_commit: Callable[[int], None] | None = None,
        require_stamp: bool = True,
    ) -> None:
        self.segments = segments
        self.sealer = sealer
        self.counters = counters
        self.on_commit = on_commit  # told each committed generation (the data port spends its ticket)
        self.require_stamp = require_stamp  # a DRAM commit needs its writer's stamp (kvstore.extent)

    def move(self, req: daemon_pb2.MoveRequest, current: Callable[[], bool] | None = None) -> daemon_pb2.MoveResponse:
        """Copies blocks between segments; a source that fails its check (key, generation,
        checksum) is not copied. The copy is written committed, with its own generation.
        ``current``, asked before each block: whether the call still may act (it was made for
        the daemon's current registration); once not, no further block is copied."""
        keys = unpack_keys(req.keys)
        n = len(keys)
        cols = (
            unpack(req.src_segment, U32, "src_segment", n),
            unpack(req.src_offset, U64, "src_offset", n),
            unpack(req.dst_segment, U32, "dst_segment", n),
            unpack(req.dst_offset, U64, "dst_offset", n),
            unpack(req.length, U64, "length", n),
            unpack(req.checksum, U64, "checksum", n),
            unpack(req.src_gen, U64, "src_gen", n),
            unpack(req.dst_gen, U64, "dst_gen", n),
        )
        ok, stored = [], []
        for key, ss, so, ds, do, length, csum, sgen, dgen in zip(keys, *cols):
            src, dst = self.segments.get(ss), self.segments.get(ds)
            size = 0
            if current is not None and not current():
                src = dst = None  # registered again meanwhile: its targets may be another block's
            try:
                if isinstance(src, ShmArena) and isinstance(dst, SsdSegment):
                    h = self.sealer.parse(src.view, so) if 0 <= so <= src.size - HEADER_SIZE else None
                    if h is not None and h.key == key and h.gen == sgen and h.length == length:
                        payload = src.array[so + HEADER_SIZE : so + HEADER_SIZE + length]
                        if checksum(payload) == csum:
                            size = dst.write(do, key, payload, csum, dgen)
                            if dst.commit(do, key, dgen) is None:
                                size = 0
                elif isinstance(src, SsdSegment) and isinstance(dst, ShmArena):
                    # Not over a block as new as the copy or newer (a replayed or late move).
                    fits = 0 <= do and do + HEADER_SIZE + length <= dst.size
                    if fits and not dst.sealed_since(self.sealer, do, dgen):
                        dst.clear_header(do)
                        out = dst.array[do + HEADER_SIZE : do + HEADER_SIZE + length]
                        status, _ = src.read(so, key, length, out=out, gen=sgen)
                        if status.ok and dst.commit(self.sealer, do, key, length, csum, dgen):
                            size = extent_size(length)
            except (OSError, ValueError, ResourceExhausted) as e:
                log.warning("event=move_failed key=%s reason=%r", key.hex(), str(e))
            ok.append(int(size > 0))
            stored.append(size)
        self.counters["moves"] += sum(ok)
        self.counters["moves_failed"] += len(ok) - sum(ok)
        return daemon_pb2.MoveResponse(ok=pack(ok, U8), stored_size=pack(stored, U64))

    def commit(self, req: daemon_pb2.CommitRequest) -> daemon_pb2.CommitResponse:
        """Makes written blocks committed: a sealed header in DRAM (the writer moved only the
        payload), a journal record on SSD (the data port wrote it pending)."""
        keys = unpack_keys(req.keys)
        n = len(keys)
        segs = unpack(req.segment, U32, "segment", n)
        offs = unpack(req.offset, U64, "offset", n)
        lens = unpack(req.length, U64, "length", n)
        sums = unpack(req.checksum, U64, "checksum", n)
        gens = unpack(req.gen, U64, "gen", n)
        status, stored = [], []
        for key, seg_id, off, length, csum, gen in zip(keys, segs, offs, lens, sums, gens):
            seg = self.segments.get(seg_id)
            st, size = common_pb2.COMMIT_MISMATCH, 0
            try:
                if isinstance(seg, ShmArena):
                    if seg.commit(self.sealer, off, key, length, csum, gen, stamped=self.require_stamp):
                        st, size = common_pb2.COMMIT_OK, extent_size(length)
                elif isinstance(seg, SsdSegment):
                    b = seg.commit(off, key, gen)
                    if b is not None and b.checksum == csum and b.length == length:
                        st, size = common_pb2.COMMIT_OK, b.size
            except ResourceExhausted as e:
                log.warning("event=commit_no_space key=%s reason=%r", key.hex(), e.message)
                st = common_pb2.COMMIT_NO_SPACE
            except OSError as e:
                log.warning("event=commit_failed key=%s reason=%r", key.hex(), str(e))
                st = common_pb2.COMMIT_UNAVAILABLE
            if st == common_pb2.COMMIT_OK and self.on_commit is not None:
                self.on_commit(gen)
            if st == common_pb2.COMMIT_MISMATCH:
                log.info("event=commit_refused key=%s segment=%d offset=%d reason=mismatch", key.hex(), seg_id, off)
            status.append(st)
            stored.append(size)
        self.counters["commits"] += status.count(common_pb2.COMMIT_OK)
        return daemon_pb2.CommitResponse(status=pack(status, U8), stored_size=pack(stored, U64))

    def invalidate(self, invalidations) -> int:  # noqa: ANN001
        """Drops committed blocks the service dropped, each only if it is still that generation."""
        cleared = 0
        for inv in invalidations:
            seg = self.segments.get(inv.segment_id)
            keys = unpack_keys(inv.keys) if inv.keys else []
            offs = unpack(inv.offset, U64, "offset", len(keys))
            gens = unpack(inv.gen, U64, "gen", len(keys))
            if seg is None:
                raise InvalidArgument(f"invalidation names unknown segment {inv.segment_id}")
            for key, off, gen in zip(keys, offs, gens):
                if isinstance(seg, ShmArena):
                    cleared += seg.invalidate(self.sealer, off, key, gen)
                else:
                    cleared += seg.invalidate(off, key, gen)
        self.counters["invalidations"] += cleared
        return cleared
