"""Daemon membership in the compact index (:class:`kvstore.meta.compact.CompactIndex`): an
inventory item adopted as a row, a daemon's loss. A mixin over the compact index's state
(``table``, ``segments``, ``daemons``, ``counters``), as :mod:`kvstore.meta.membership` is for
the object index; registration in steps, heartbeats, drain and stalls are
:class:`~kvstore.meta.membership.DaemonLife`'s, shared by both.
"""

from __future__ import annotations

import numpy as np

from kvstore.meta.allocator import Allocator
from kvstore.meta.membership import DaemonLife
from kvstore.meta.records import Daemon, InventoryItem, Segment, SegmentSpec, Tier
from kvstore.meta.table import LIVE, READY, WRITTEN, words


class CompactMembership(DaemonLife):
    """Daemons joining and being lost, over the block table."""

    def _new_segment(self, daemon: Daemon, sspec: SegmentSpec, alloc: Allocator) -> Segment:
        seg = super()._new_segment(daemon, sspec, alloc)
        self.segments[seg.ref] = seg
        return seg

    def _adopt(self, daemon: Daemon, seg: Segment, it: InventoryItem, size: int) -> bool:
        """Adopts one inventory item as a committed block, or as a clean copy of one (the
        daemon holds the block committed in its DRAM and on its SSD: the DRAM replica, adopted
        first, is what readers get); False (nothing changed) if it clashes with what the index
        holds: a block being written, stored on another daemon or on this tier already, of
        another length, or the table is full."""
        t = self.table
        row = int(t.find(words(it.key))[0])
        if row >= 0:
            if (
                int(t.flags[row]) & READY
                and not t.copy[row]
                and seg.spec.tier == Tier.SSD
                and self.segments[int(t.seg[row])] is daemon.tier(Tier.DRAM)
                and int(t.length[row]) == it.length
                and int(t.csum[row]) == it.checksum
            ):
                self._add_copy(row, seg, it.offset, size, it.gen)
                return True
            return False
        if t.room() < 1:
            return False
        freq = self.policy.entering(it.key)
        row = t.add(words(it.key))
        self.policy.entered(row, [freq])
        t.seg[row], t.off[row], t.size[row], t.length[row] = seg.ref, it.offset, size, it.length
        t.csum[row], t.gen[row] = it.checksum, it.gen
        t.flags[row] |= WRITTEN
        t.set_ready(row)
        t.stamp(row)
        seg.blocks += 1
        return True

    def _drop_daemon(self, daemon_id: str) -> None:
        """Forgets a daemon and its blocks (committed and reserved) and the extents held back
        there; a segment whose blocks are still leased stays known until the last lease ends."""
        self._fail_moves(daemon_id)
        d = self.daemons.pop(daemon_id)
        t = self.table
        for seg in d.segments.values():
            n = t.n_rows
            mine = np.flatnonzero(((t.flags[:n] & LIVE) != 0) & (t.seg[:n] == seg.ref))
            # In extent order, as the object index drops them: the cache policy's history
            # takes their counts in that order.
            for row in mine[np.argsort(t.off[mine], kind="stable")].tolist():
                self._drop(row, free=False)
            seg.quarantined = 0  # its entries in the quarantine are skipped when they come up
            t.forget_segment(seg.ref)
            if not seg.leased:
                self.segments.pop(seg.ref, None)

    def _leased_on(self, lease, daemon_id: str) -> bool:  # noqa: ANN001 - compact_reads.Lease
        return any(
            self.segments[ref].daemon.spec.daemon_id == daemon_id
            for ref in np.unique(self.table.seg[lease.rows]).tolist()
            if ref in self.segments
        )
