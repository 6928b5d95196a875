"""Tier moves in the index (:class:`kvstore.meta.index.Index`): a daemon's DRAM
above its high watermark sends its least recently used blocks to its SSD (or just drops their
DRAM copy where a clean SSD copy exists), and blocks read from SSD come back to DRAM: the row
stays where the block is found, and a finished move points its primary replica at the copy.
A mixin over the index's state (``table``, ``segments``, ``daemons``, ``leases``,
``moves``, ``promote_queue``, ``counters``).

A move holds a lease on its row for its duration, so the row is neither evicted, nor moved
again, nor reused by another block (a row is freed only when its last lease ends) while the
daemon copies; the SSD extent is reserved in the move, not in the table. When the copy is
done and the row still holds the block that was copied (same generation, still committed),
the row takes the new location. A demoted block's DRAM copy leaves: a tombstone tells the
daemon, and its extent goes back at once, or, if readers leased the block meanwhile, once the
last of their leases can have ended (the tombstone goes out at once: a reader of the old copy
finds it gone and asks again, it never finds another block there). A promoted block keeps its
SSD copy as a clean copy (:mod:`kvstore.meta.copies`): demoting it again is a drop of the DRAM
copy, and puts short of DRAM may drop it at once (:meth:`~kvstore.meta.index.Index._evict`).
If the row no longer holds the block copied, the new copy leaves instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from kvstore.extent import extent_size
from kvstore.meta.records import Daemon, Segment, Tier, Tombstone
from kvstore.meta.table import LIVE, PINNED, READY


def tiered(daemons: Iterable[Daemon], skip: set[str]) -> Iterator[tuple[Daemon, Segment, Segment]]:
    """(daemon, its DRAM segment, its SSD segment) of the daemons with both, except those in
    ``skip`` (a batch of their moves is still under way) and those adopting their inventory."""
    for d in daemons:
        if d.spec.daemon_id in skip or d.adopting:
            continue
        dram, ssd = d.tier(Tier.DRAM), d.tier(Tier.SSD)
        if dram is not None and ssd is not None:
            yield d, dram, ssd


@dataclass(slots=True)
class Move:
    """A copy of one block between a daemon's DRAM and its SSD (``src`` and ``dst`` are
    :class:`~kvstore.meta.index.Location`; the daemon link reads them as it reads replicas)."""

    move_id: int
    src: object
    dst: object
    demote: bool
    row: int


class TierMoves:
    """Demotions and promotions between a daemon's DRAM and SSD segments, over the block table."""

    def plan_moves(self, max_bytes: int = 64 << 20, skip: Iterable[str] = ()) -> dict[str, list[Move]]:
        """Plans demotions: per daemon (except those in ``skip``, whose previous batch is still
        under way, and those adopting their inventory), while its DRAM is above the high
        watermark, its least recently used blocks go to its SSD, down to the low watermark or
        ``max_bytes``; and promotions of blocks read from SSD. Each move leases its block and
        reserves its target; the caller has the daemon copy the bytes and then calls
        :meth:`finish_move`."""
        plans: dict[str, list[Move]] = {}
        skip = set(skip)
        for d, dram, ssd in tiered(self.daemons.values(), skip):
            moves = self._plan_demotions(dram, ssd, max_bytes)
            if moves:
                plans[d.spec.daemon_id] = moves
        self._plan_promotions(plans, max_bytes, skip)
        return plans

    def _queue_promotions(self, rows: np.ndarray) -> np.ndarray:
        """Blocks just read (or touched) from SSD, to be promoted to DRAM in the background;
        returns which of ``rows`` are on SSD."""
        t = self.table
        on = t.seg[rows]
        ssd = np.zeros(len(rows), dtype=bool)
        for ref in np.unique(on).tolist():
            if self.segments[ref].spec.tier == Tier.SSD:
                mask = on == ref
                ssd |= mask
                for row in rows[mask].tolist():
                    self.promote_queue[row] = int(t.gen[row])
        return ssd

    def _plan_promotions(self, plans: dict[str, list[Move]], max_bytes: int, skip: set[str]) -> None:
        """Blocks read from SSD come back to DRAM, oldest read first, into the room above the
        high watermark (halfway to full: the next round of demotions then moves the coldest
        blocks out, and puts keep room in the rest), ``max_bytes`` at most."""
        t = self.table
        moving = {mv.row for mv in self.moves.values()}
        high = self.limits.dram_high_watermark
        later: list[tuple[int, int]] = []
        budget = max_bytes
        while self.promote_queue and budget > 0:
            row, gen = next(iter(self.promote_queue.items()))
            del self.promote_queue[row]
            if int(t.flags[row]) & (LIVE | READY) != (LIVE | READY) or int(t.gen[row]) != gen or row in moving:
                continue  # gone, replaced, moved or moving since it was read
            seg = self.segments[int(t.seg[row])]
            dram = seg.daemon.tier(Tier.DRAM)
            if seg.spec.tier != Tier.SSD or not self._current(seg) or dram is None:
                continue
            if dram.daemon.spec.daemon_id in skip or dram.daemon.adopting:
                later.append((row, gen))
                continue
            size = extent_size(int(t.length[row]), dram.align)
            if dram.alloc.used + size > dram.alloc.capacity * (high + (1 - high) / 2):
                continue
            off = dram.alloc.alloc(size)
            if off is None:
                continue
            src = self.locations([row])[0]
            mv = self._start_move(row, src, src._replace(segment=dram, offset=off, size=size), demote=False)
            plans.setdefault(dram.daemon.spec.daemon_id, []).append(mv)
            moving.add(row)
            budget -= src.length
        for row, gen in later:
            self.promote_queue[row] = gen

    def _start_move(self, row: int, src, dst, demote: bool) -> Move:  # noqa: ANN001 - Locations
        """Leases the row for the move's duration and gives the target a fresh generation."""
        t = self.table
        if t.leases[row] == 0:
            self.segments[int(t.seg[row])].leased += 1
        t.leases[row] += 1
        mv = Move(next(self._move_ids), src, dst._replace(gen=int(self._gens(1)[0])), demote, row)
        self.moves[mv.move_id] = mv
        return mv

    def _plan_demotions(self, dram: Segment, ssd: Segment, max_bytes: int) -> list[Move]:
        cap = dram.alloc.capacity
        if dram.alloc.used <= cap * self.limits.dram_high_watermark:
            return []
        limit = min(dram.alloc.used - int(cap * self.limits.dram_low_watermark), max_bytes)
        t = self.table
        moves: list[Move] = []
        planned = 0
        for row in self.policy.demotion_order(dram.ref, limit):
            if planned >= limit:
                break
            if t.copy[row]:  # a clean SSD copy already: the DRAM copy just goes
                planned += int(t.size[row])
                self.counters["dropped_clean"] += 1
                self._drop_primary(row)
                continue
            length = int(t.length[row])
            size = extent_size(length, ssd.align)
            if size > ssd.alloc.capacity:
                continue  # no eviction on SSD makes room for it
            off = self._room_in(ssd, size)
            if off is None:
                break  # SSD full of leased, pinned or in-flight blocks
            src = self.locations([row])[0]
            moves.append(self._start_move(row, src, src._replace(segment=ssd, offset=off, size=size), demote=True))
            planned += src.size
        return moves

    def finish_move(self, move_id: int, ok: bool, stored_size: int = 0) -> None:
        """Completes a move after the daemon copied the bytes (``ok``) or failed to. On success,
        if the row still holds the block copied, it points at the SSD copy from then on and the
        DRAM copy leaves; otherwise the SSD copy leaves. A target stored in fewer bytes
        (compressed) gives back the rest of its extent."""
        mv = self.moves.pop(move_id, None)
        if mv is None:
            return
        t = self.table
        row, src, dst = mv.row, mv.src, mv.dst
        same = (
            int(t.flags[row]) & (LIVE | READY) == (LIVE | READY)
            and int(t.gen[row]) == src.gen
            and int(t.seg[row]) == src.segment.ref
        )
        if ok and same and self._current(dst.segment):
            seg = dst.segment
            size = seg.trim(dst.offset, dst.size, stored_size)
            if mv.demote:  # the DRAM copy leaves
                self._tombstone_item(
                    src.segment.daemon.spec.daemon_id,
                    Tombstone(src.segment.spec.segment_id, src.key, src.offset, src.gen),
                )
                if t.leases[row] > 1:  # leased meanwhile: the old extent is not reused while those leases last
                    until = max((x.deadline for x in self.leases.values() if (x.rows == row).any()), default=0.0)
                    self._quarantine.hold(src.segment, src.offset, src.size, until)
                else:
                    src.segment.alloc.release(src.offset, src.size)
                src.segment.blocks -= 1
                if t.flags[row] & PINNED:
                    src.segment.pinned -= 1
            else:  # promoted: the SSD copy stays, clean, so that leaving DRAM again costs no copy
                t.copies.add(row, src.segment.ref, src.offset, src.size, src.gen)
            src.segment.leased -= 1  # the row (leased, by the move at least) changes segment
            seg.leased += 1
            seg.blocks += 1
            if t.flags[row] & PINNED:
                seg.pinned += 1
            t.seg[row], t.off[row], t.size[row], t.gen[row] = seg.ref, dst.offset, size, dst.gen
            kind = "demoted" if mv.demote else "promoted"
            self.counters[kind] += 1
            self.counters[f"{kind}_bytes"] += src.length
            self._unlease(row)  # the move's own lease: the block is now its new segment's most recent
            return
        self.counters["moves_failed"] += 1
        if self._current(dst.segment):
            # The daemon may have written the copy: it must forget it.
            self._tombstone_item(
                dst.segment.daemon.spec.daemon_id, Tombstone(dst.segment.spec.segment_id, dst.key, dst.offset, dst.gen)
            )
            dst.segment.alloc.release(dst.offset, dst.size)
        self._unlease(row)

    def _fail_moves(self, daemon_id: str) -> None:
        """Ends every move of a daemon that leaves the index, unfinished."""
        for mid in [m for m, mv in self.moves.items() if mv.src.segment.daemon.spec.daemon_id == daemon_id]:
            self.finish_move(mid, False)

    def _move_extents(self) -> Iterable[tuple[Segment, int, int]]:
        """(segment, offset, size) reserved for the moves in flight (for integrity checks)."""
        for mv in self.moves.values():
            yield mv.dst.segment, mv.dst.offset, mv.dst.size
