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
from kvstore.meta.records import Daemon, InventoryItem, Segment, SegmentSpec
from kvstore.meta.table import LIVE, WRITTEN, words


class CompactMembership(DaemonLife):
    """Daemons joining and being lost, over the block table."""

    def _new_segment(self, daemon: Daemon, sspec: SegmentSpec, alloc: Allocator) -> Segment:
        seg = super()._new_segment(daemon, sspec, alloc)
        self.segments[seg.ref] = seg
        return seg

    def _adopt(self, daemon: Daemon, seg: Segment, it: InventoryItem, size: int) -> bool:
        """Adopts one inventory item as a committed block; False (nothing changed) if the key is
        stored anywhere already (a block has one replica here) or the table is full."""
        t = self.table
        if t.find(words(it.key))[0] >= 0 or t.room() < 1:
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
