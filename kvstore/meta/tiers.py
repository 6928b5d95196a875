"""Tier planning: which DRAM blocks a daemon demotes to SSD (in the cache policy's order, above
the high watermark) and which SSD blocks it promotes back after reads; each move leases its
source and reserves its target until the daemon reports the copy. Part of
:class:`kvstore.meta.index.Index` (a mixin over its state: ``daemons``, ``entries``, ``moves``,
``promote_queue``, ``policy``, ``counters``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvstore.extent import extent_size
from kvstore.meta.records import Daemon, Entry, Move, Replica, Segment, Tier


def tiered(daemons: Iterable[Daemon], skip: set[str]) -> Iterator[tuple[Daemon, Segment, Segment]]:
    """(daemon, its DRAM segment, its SSD segment) of the daemons with both, except those in
    ``skip`` (a batch of their moves is still under way) and those adopting their inventory."""
    for d in daemons:
        if d.spec.daemon_id in skip or d.adopting:
            continue
        dram, ssd = d.tier(Tier.DRAM), d.tier(Tier.SSD)
        if dram is not None and ssd is not None:
            yield d, dram, ssd


class TierMoves:
    """Demotions and promotions between a daemon's DRAM and SSD segments."""

    # ---- tier moves -------------------------------------------------------------------------

    def plan_moves(self, max_bytes: int = 64 << 20, skip: Iterable[str] = ()) -> dict[str, list[Move]]:
        """Plans demotions (DRAM above its high watermark: coldest replicas without an SSD copy
        go to SSD) and promotions (blocks recently read from SSD come back to DRAM), per daemon,
        except for the daemons in ``skip`` (their previous batch is still under way).

        Each move leases its source and reserves its target; the caller has the daemon copy
        the bytes and then calls :meth:`finish_move`. Nothing becomes visible before that.
        """
        plans: dict[str, list[Move]] = {}
        skip = set(skip)
        later: list[bytes] = []
        for d, dram, ssd in tiered(self.daemons.values(), skip):
            moves = self._plan_demotions(dram, ssd, max_bytes)
            if moves:
                plans.setdefault(d.spec.daemon_id, []).extend(moves)
        budget = max_bytes
        while self.promote_queue and budget > 0:
            key = next(iter(self.promote_queue))
            del self.promote_queue[key]
            e = self.entries.get(key)
            if e is None or not e.complete or e.moving or e.on(Tier.DRAM) is not None:
                continue
            src = e.on(Tier.SSD)
            if src is None or not src.ready:
                continue
            dram = src.segment.daemon.tier(Tier.DRAM)
            if dram is None:
                continue
            if dram.daemon.spec.daemon_id in skip or dram.daemon.adopting:
                later.append(key)
                continue
            # Promote into the room above the high watermark (halfway to full): the next round of
            # demotions then moves the coldest blocks out, and puts keep room in the rest.
            high = self.limits.dram_high_watermark
            if dram.alloc.used + extent_size(src.length, dram.align) > dram.alloc.capacity * (high + (1 - high) / 2):
                continue
            off = dram.alloc.alloc(extent_size(src.length, dram.align))
            if off is None:
                continue
            mv = self._start_move(e, src, dram, off, demote=False)
            plans.setdefault(dram.daemon.spec.daemon_id, []).append(mv)
            budget -= src.length
        for key in later:
            self.promote_queue[key] = None
        return plans

    def _plan_demotions(self, dram: Segment, ssd: Segment, max_bytes: int) -> list[Move]:
        cap = dram.alloc.capacity
        if dram.alloc.used <= cap * self.limits.dram_high_watermark:
            return []
        goal = dram.alloc.used - int(cap * self.limits.dram_low_watermark)
        moves: list[Move] = []
        planned = 0
        limit = min(goal, max_bytes)
        # The coldest replicas worth this round's bytes (a walk of the LRU's head, not a copy
        # of it); acting on them changes the LRU, so they are taken first.
        cands = self.policy.demotion_order((r for r in dram.lru.values() if not r.entry.moving), limit)
        for rep in cands:
            if planned >= limit:
                break
            e = rep.entry
            if e.moving or not rep.live or rep.segment.lru.get(e.key) is not rep:
                continue
            if e.on(Tier.SSD) is not None:  # already has an SSD copy: just drop this one
                planned += rep.size
                self.counters["dropped_clean"] += 1
                self._drop_replica(rep)
                continue
            size = extent_size(rep.length, ssd.align)
            if size > ssd.alloc.capacity:
                continue  # no eviction on SSD makes room for it
            off = ssd.alloc.alloc(size)
            while off is None:
                victim = self._victim(ssd)  # e has no SSD replica: it cannot be its own victim
                if victim is None:
                    break
                self._evict(victim)
                off = ssd.alloc.alloc(size)
            if off is None:
                break  # SSD full of leased / pinned / in-flight blocks
            moves.append(self._start_move(e, rep, ssd, off, demote=True))
            planned += rep.size
        return moves

    def _start_move(self, e: Entry, src: Replica, seg: Segment, offset: int, demote: bool) -> Move:
        if src.leases == 0:
            src.segment.leased += 1
            src.segment.lru.pop(e.key, None)
        src.leases += 1
        dst = self._add_replica(e, seg, offset, extent_size(src.length, seg.align), src.length)
        dst.written = True  # the daemon writes it as soon as it gets the move
        e.moving = True
        mv = Move(next(self._move_ids), src, dst, demote)
        self.moves[mv.move_id] = mv
        return mv

    def finish_move(self, move_id: int, ok: bool, stored_size: int = 0) -> None:
        """Completes a move after the daemon copied the bytes (``ok``) or failed to. On success
        the target becomes ready first; a demotion's source is freed only after that. A target
        stored in fewer bytes (compressed) gives back the rest of its extent."""
        mv = self.moves.pop(move_id, None)
        if mv is None:
            return
        e, src, dst = mv.src.entry, mv.src, mv.dst
        e.moving = False
        if ok and src.live and dst.live:
            dst.size = dst.segment.trim(dst.offset, dst.size, stored_size)
            self._make_ready(dst, src.checksum)
            kind = "demoted" if mv.demote else "promoted"
            self.counters[kind] += 1
            self.counters[f"{kind}_bytes"] += src.length
            self._unlease(src)
            if mv.demote:
                self._drop_replica(src)
            return
        self.counters["moves_failed"] += 1
        if dst.live:
            self._drop_replica(dst)
        self._unlease(src)
