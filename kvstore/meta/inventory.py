"""A daemon's inventory in columns, and its adoption by the index in vectorised chunks.

An inventory is what a daemon's segment holds committed, one row per block (:data:`INVENTORY`:
key, offset, payload length, checksum, extent size or 0, generation, and whether the row is
well formed), oldest generation first (the recency order it is adopted in). The service decodes
it from the wire's packed columns without a Python object per block (:func:`decode`); tests
and tools may hand lists of :class:`~kvstore.meta.records.InventoryItem` (:func:`columns`).

:class:`Adoption` (a mixin of :class:`kvstore.meta.index.Index`) adopts a chunk at a time: a
handful of vectorised passes (hash-table probes, column writes, the policy's counts) per chunk,
so that a registration of millions of blocks costs seconds in chunks of a few tens of
milliseconds, between which the service serves other calls.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.extent import HEADER_SIZE
from kvstore.keys import KEY_BYTES
from kvstore.meta.records import GEN_LIMIT, Daemon, InventoryItem, Segment, Tier, Tombstone
from kvstore.meta.table import READY, WRITTEN, words

INVENTORY = np.dtype(
    [("key", "V16"), ("offset", "<u8"), ("length", "<u8"), ("checksum", "<u8"), ("size", "<u8"), ("gen", "<u8"),
     ("ok", "u1")]
)  # fmt: skip
_M64 = 1 << 64


def columns(items: Iterable[InventoryItem] | np.ndarray, segment_id: int = 0) -> np.ndarray:
    """An inventory as columns (:data:`INVENTORY`); an array passes through. An item whose key
    is not 16 bytes or whose offset, length, checksum or size does not fit 64 bits is kept,
    marked not ``ok`` (it is refused on its own); a generation outside [0, 2**63) refuses the
    whole inventory (:func:`check_gens`)."""
    if isinstance(items, np.ndarray):
        return items
    items = list(items)
    a = np.zeros(len(items), dtype=INVENTORY)
    for i, it in enumerate(items):
        if not 0 <= it.gen < GEN_LIMIT:
            raise InvalidArgument(
                f"inventory of segment {segment_id}, item {i} (key {bytes(it.key).hex()}): "
                f"generation {it.gen} is outside [0, 2**63)"
            )
        fields = (it.offset, it.length, it.checksum, it.size, it.gen)
        if len(it.key) != KEY_BYTES or not all(0 <= v < _M64 for v in fields):
            continue
        a[i] = (bytes(it.key), *fields, 1)
    return a


def decode(segment_id: int, keys: bytes, cols: dict[str, bytes]) -> np.ndarray:
    """One segment's inventory from the wire's packed columns (``cols``: offset, length,
    checksum, gen as u64 arrays, size as u64 or empty), sorted oldest generation first; raises
    :class:`InvalidArgument` naming the column that does not hold one value per key."""
    if len(keys) % KEY_BYTES:
        raise InvalidArgument(f"inventory of segment {segment_id}: keys are {len(keys)} bytes, not N x {KEY_BYTES}")
    n = len(keys) // KEY_BYTES
    a = np.zeros(n, dtype=INVENTORY)
    a["key"] = np.frombuffer(keys, dtype="V16")
    for name in ("offset", "length", "checksum", "gen", "size"):
        raw = cols.get(name, b"")
        if name == "size" and not raw:
            continue
        if len(raw) != 8 * n:
            raise InvalidArgument(f"inventory {name}: {len(raw)} bytes for {n} keys (want {8 * n})")
        a[name] = np.frombuffer(raw, dtype="<u8")
    a["ok"] = 1
    return a[np.argsort(a["gen"], kind="stable")]


def check_gens(segment_id: int, a: np.ndarray) -> None:
    """Refuses an inventory naming a generation at or past ``GEN_LIMIT`` (no index made it)."""
    bad = np.flatnonzero(a["ok"].astype(bool) & (a["gen"] >= GEN_LIMIT))
    if len(bad):
        i = int(bad[0])
        raise InvalidArgument(
            f"inventory of segment {segment_id}, item {i} (key {bytes(a['key'][i]).hex()}): "
            f"generation {int(a['gen'][i])} is outside [0, 2**63)"
        )


def extent_sizes(a: np.ndarray, align: int) -> np.ndarray:
    """Each item's extent bytes: its own ``size``, else its length's (header and padding in)."""
    derived = (
        (HEADER_SIZE + a["length"].astype(np.uint64) + np.uint64(align - 1)) // np.uint64(align) * np.uint64(align)
    )
    return np.where(a["size"] != 0, a["size"], derived)


_IDENT = np.dtype([("key", "V16"), ("offset", "<u8"), ("gen", "<u8")])


def _ident(a: np.ndarray) -> np.ndarray:
    """Each row's (key, offset, generation), packed as one 32-byte value."""
    out = np.empty(len(a), dtype=_IDENT)
    out["key"], out["offset"], out["gen"] = a["key"], a["offset"], a["gen"]
    return out.view("V32")


def _dead_mask(a: np.ndarray, dead: np.ndarray) -> np.ndarray:
    """Which items are tombstoned (``dead``: the tombstones owed to the daemon on this segment,
    as :data:`INVENTORY` rows, :func:`dead_rows`)."""
    if not len(dead) or not len(a):
        return np.zeros(len(a), dtype=bool)
    return np.isin(_ident(a), _ident(dead))


def dead_rows(tombstones: Iterable[Tombstone], segment_id: int) -> np.ndarray:
    """The tombstones of ``segment_id`` among ``tombstones``, as :data:`INVENTORY` rows."""
    ts = [t for t in tombstones if t.segment_id == segment_id]
    d = np.zeros(len(ts), dtype=INVENTORY)
    if ts:
        d["key"] = np.frombuffer(b"".join(t.key for t in ts), dtype="V16")
        d["offset"] = [t.offset for t in ts]
        d["gen"] = [t.gen for t in ts]
    return d


def _first_of_each(q: np.ndarray) -> np.ndarray:
    """Indexes of ``q``'s keys ((n, 2) words) without the repeats of a key seen before, in
    order (sorted by the low word: keys are hashes, so equal low words are rare and checked)."""
    lo = np.sort(q[:, 0])
    if not (lo[1:] == lo[:-1]).any():
        return np.arange(len(q))
    order = np.argsort(q[:, 0], kind="stable")
    s = q[order]
    # Walk the runs of equal low words (the sort is stable: a key's first occurrence comes
    # first in its run) and drop each key seen before.
    keep = np.ones(len(q), dtype=bool)
    runs = np.flatnonzero(s[1:, 0] == s[:-1, 0])
    seen: set[tuple[int, int]] = set()
    for j in np.unique(np.concatenate((runs, runs + 1))).tolist():
        k = (int(s[j, 0]), int(s[j, 1]))
        if k in seen:
            keep[order[j]] = False
        seen.add(k)
    return np.flatnonzero(keep)


class Adoption:
    """Adopting inventory chunks into the block table (a mixin over ``table``, ``policy``,
    ``segments``, ``_last_gen`` and ``_tombstone_item``; :meth:`_adopt` is the one-item path for
    a key the index holds already)."""

    def _adopt_chunk(
        self, daemon: Daemon, seg: Segment, a: np.ndarray, sizes: np.ndarray, accepted: np.ndarray, dead: np.ndarray
    ) -> int:
        """Adopts a chunk of ``seg``'s inventory, in its order (oldest first): each item whose
        extent was ``accepted`` by the segment's allocator, well formed, of a nonzero generation
        and not tombstoned becomes a committed block, or a clean copy of one the index holds
        (:meth:`_adopt`); the others are refused, their accepted extents given back, and those
        refused for a clash with what the index holds tombstoned (the daemon must drop them too,
        or a reader that remembers their location would still find them there). Returns how
        many were refused."""
        n = len(a)
        if not n:
            return 0
        t = self.table
        self._last_gen = max(self._last_gen, int(a["gen"].max()))
        good = a["ok"].astype(bool) & (a["gen"] != 0)
        cand = accepted & good & ~_dead_mask(a, dead)
        q = np.ascontiguousarray(a["key"]).view("<u8").reshape(-1, 2)
        rows = self._settle(t.find(q))
        adopted = np.zeros(n, dtype=bool)
        # New keys, the first of each (a key twice in one inventory: the first wins), as far as
        # the table has room.
        new = np.flatnonzero(cand & (rows < 0))
        if len(new):
            new = new[_first_of_each(q[new])][: t.room()]
            freqs = self.policy.entering_many(q[new])
            r = t.add(q[new], ready=True)
            self.policy.entered(r, freqs)
            # Fresh rows come in one run: written as a slice, not gathered row by row.
            at = slice(int(r[0]), int(r[-1]) + 1) if int(r[-1]) - int(r[0]) + 1 == len(r) else r
            t.seg[at], t.off[at], t.size[at] = seg.ref, a["offset"][new], sizes[new]
            t.length[at], t.csum[at], t.gen[at] = a["length"][new], a["checksum"][new], a["gen"][new]
            t.flags[at] |= WRITTEN
            t.stamp(r)
            seg.blocks += len(r)
            adopted[new] = True
        # Keys the index holds already (before this chunk): a clean copy, or a clash.
        for i in np.flatnonzero(cand & (rows >= 0)).tolist():
            it = InventoryItem(
                bytes(a["key"][i]), *(int(a[f][i]) for f in ("offset", "length", "checksum", "size", "gen"))
            )
            adopted[i] = self._adopt(daemon, seg, it, int(sizes[i]))
        refused = np.flatnonzero(~adopted)
        for i in refused[accepted[refused]].tolist():
            seg.alloc.release(int(a["offset"][i]), int(sizes[i]))
            if cand[i]:
                key, off, gen = bytes(a["key"][i]), int(a["offset"][i]), int(a["gen"][i])
                self._tombstone_item(daemon.spec.daemon_id, Tombstone(seg.spec.segment_id, key, off, gen))
        return len(refused)

    def _adopt(self, daemon: Daemon, seg: Segment, it: InventoryItem, size: int) -> bool:
        """Adopts one inventory item whose key the index holds as a clean copy of that block
        (the daemon holds it committed in its DRAM and on its SSD: the DRAM replica, adopted
        first, is what readers get); False (nothing changed) if it clashes instead: a block being
        written, stored on another daemon or on this tier already, or another block (length,
        checksum)."""
        t = self.table
        row = int(self._settle(t.find(words(it.key)))[0])
        if (
            row >= 0
            and int(t.flags[row]) & READY
            and not t.copy[row]
            and seg.spec.tier == Tier.SSD
            and self.segments[int(t.seg[row])] is daemon.tier(Tier.DRAM)
            and int(t.length[row]) == it.length
            and int(t.csum[row]) == it.checksum
        ):
            self._add_copy(row, seg, it.offset, size, it.gen)
            return True
        return False
