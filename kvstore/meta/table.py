"""The index's block table: every block's state in fixed-width columns (numpy arrays),
found through an open-addressing hash table of row numbers keyed by the 128-bit block key.

No Python object exists per block: a block is a row, its key two 64-bit words, its replica
(segment, extent, checksum, generation), its recency stamp, its lease count and its flags
columns of that row. Memory per block is the columns' width (:data:`ROW_BYTES`, and
:data:`COUNT_BYTES` more with the adaptive policy) over the rows' fill, plus 4 bytes over the
hash table's fill, whatever the number of blocks; a batch lookup
is a handful of vectorised gathers (one per probe round), whose cost does not grow with the
table but for cache misses.

Hashing. Slots are linear-probed; the slot of a key is a multiply-shift hash of both its
words with per-table random multipliers, so that keys chosen by a client cannot be aimed at one
probe run without knowing them (keys are already hashes, but a tenant sends the bytes it likes).
Deletion shifts the run back (no tombstone slots), so probe runs stay as short as the fill.

Recency, eviction order and the row flags: :mod:`kvstore.meta.recency`.
"""

from __future__ import annotations

import random

import numpy as np

from kvstore.errors import ResourceExhausted
from kvstore.keys import KEY_BYTES
from kvstore.meta.copies import Copies
from kvstore.meta.recency import HELD, LIVE, PINNED, READY, WRITTEN, Recency  # noqa: F401 - re-exported

_COLUMNS = (
    ("kw", np.uint64, 2),  # the key, as its two little-endian words side by side (one cache line)
    ("seg", np.uint32, 1),  # segment ref (kvstore.meta.records.Segment.ref)
    ("off", np.uint64, 1), ("size", np.uint64, 1),  # the extent in the segment
    ("length", np.uint64, 1),  # payload bytes
    ("csum", np.uint64, 1), ("gen", np.uint64, 1),
    ("recent", np.uint64, 1),  # recency: larger is more recent
    ("leases", np.uint32, 1), ("flags", np.uint8, 1),
    ("copy", np.uint32, 1),  # the row's first further replica (kvstore.meta.copies), 0: none
)  # fmt: skip
# Kept only for the adaptive policy (kvstore.meta.policy): a block's access count
# (epoch << 8 | count) and second chance's mark (the spell it was read again in).
COUNT_COLUMNS = (("freq", np.uint64, 1), ("again", np.uint32, 1))
ROW_BYTES = sum(np.dtype(t).itemsize * w for _, t, w in _COLUMNS)
COUNT_BYTES = sum(np.dtype(t).itemsize * w for _, t, w in COUNT_COLUMNS)
_M64 = (1 << 64) - 1
_TAG = 0x7FFFFFFF  # a slot holds tag << 32 | ready << 31 | row (row < 2**31); -1 is empty
_SLOT_READY = 1 << 31
_MIN_SLOTS = 1 << 10
_MAX_FILL = 0.7  # of the hash table, before it doubles
_WINDOW = 8  # slots compared per probe round (64 bytes: one cache line, mostly)
_SCALAR = 32  # keys left at which probing goes on key by key
_GROW = 1.5  # rows grow by half


_KEY = np.dtype((np.void, KEY_BYTES))


def words(packed: bytes) -> np.ndarray:
    """Packed 16-byte keys as an (n, 2) array of their low and high 64-bit words."""
    return np.frombuffer(packed, dtype="<u8").reshape(-1, 2)


def _as_keys(w: np.ndarray) -> np.ndarray:
    """(n, 2) words as n 16-byte values, compared in one operation."""
    return np.ascontiguousarray(w).view(_KEY).ravel()


class BlockTable(Recency):
    """Rows of block state and the hash table that finds them. Pure state, no locking."""

    def __init__(self, rows: int = 1024, seed: int | None = None, counts: bool = False) -> None:
        """``rows`` to start with (more come as needed); ``counts``: with the adaptive policy's
        columns (:data:`COUNT_COLUMNS`)."""
        rnd = random.Random(seed)
        self._m1 = rnd.getrandbits(64) | 1
        self._m2 = rnd.getrandbits(64) | 1
        self._s = rnd.getrandbits(64)
        self._np_s, self._np_m1, self._np_m2 = np.uint64(self._s), np.uint64(self._m1), np.uint64(self._m2)
        self._np_tag = np.uint64(_TAG)
        self.cap = max(16, rows)
        self._columns = _COLUMNS + (COUNT_COLUMNS if counts else ())
        for name, t, w in self._columns:
            setattr(self, name, np.zeros((self.cap, w) if w > 1 else self.cap, dtype=t))
        self.copies = Copies(self.copy)
        self.n_rows = 0  # rows ever used (a high-water mark); free ones are on _free
        self._free = np.empty(64, dtype=np.int64)
        self._n_free = 0
        self.live = 0  # rows in the hash table
        bits = max(_MIN_SLOTS, 1 << int(np.ceil(np.log2(max(1, rows) / _MAX_FILL)))).bit_length() - 1
        self._set_slots(bits)
        self._clock = 0  # the last stamp given
        # Per segment ref: (rows, their stamps then, next position) of the oldest evictable rows.
        self._oldest: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}

    # ---- hashing ----------------------------------------------------------------------------

    def _set_slots(self, bits: int) -> None:
        self.bits = bits
        self.mask = (1 << bits) - 1
        self.slots = np.full(1 << bits, -1, dtype=np.int64)
        self._np_shift = np.uint64(64 - bits)

    def _hash_v(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(home slot, tag) of each key: the hash's top bits and its low 31 bits."""
        h = (lo ^ self._np_s) * self._np_m1 + hi * self._np_m2
        return (h >> self._np_shift).astype(np.int64), (h & self._np_tag).astype(np.int64)

    def _home(self, row: int) -> int:
        lo, hi = int(self.kw[row, 0]), int(self.kw[row, 1])
        return (((lo ^ self._s) * self._m1 + hi * self._m2) & _M64) >> (64 - self.bits)

    def find(self, q: np.ndarray) -> np.ndarray:
        """The row of each key ((n, 2) words), -1 where it is not in the table."""
        return self._probe(q)[0]

    def find_ready(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The row of each key and whether it is committed (READY), from the hash table alone:
        a lookup touches a slot window and a key per block, not the block's other columns."""
        rows, pos = self._probe(q)
        ready = rows >= 0
        ready[ready] = (self.slots[pos[ready]] & _SLOT_READY) != 0
        return rows, ready

    def set_ready(self, rows: np.ndarray) -> None:
        """Marks stored rows committed (READY), in their flags and their hash slots."""
        self.flags[rows] |= READY
        self.slots[self._probe(self.kw[rows])[1]] |= _SLOT_READY

    def _probe(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, slot) of each key, -1 where it is not in the table. The first round looks at
        each key's home slot alone (where most keys are); then each round compares a window of
        slots by tag; a tag that matches is checked against the row's key; the few keys left at
        the end of long probe runs go one by one."""
        n = len(q)
        out = np.full(n, -1, dtype=np.int64)
        at_slot = np.full(n, -1, dtype=np.int64)
        if n == 0 or self.live == 0:
            return out, at_slot
        slots, mask, steps = self.slots, self.mask, np.arange(_WINDOW)
        kw, qk = _as_keys(self.kw), _as_keys(q)
        slot, tag = self._hash_v(q[:, 0], q[:, 1])
        v = slots[slot]
        full = v >= 0
        row = v & _TAG
        match = full & ((v >> 32) == tag)
        r = row[match]
        ok = match.copy()
        ok[match] = kw[r] == qk[match]
        out[ok] = row[ok]
        at_slot[ok] = slot[ok]
        go = full & ~ok
        todo = np.flatnonzero(go)
        slot, tag = (slot[go] + 1) & mask, tag[go]
        while len(todo) > _SCALAR:
            v = slots[(slot[:, None] + steps) & mask]
            empty = v < 0
            stop = empty | ((v >> 32) == tag[:, None])
            j = stop.argmax(1)
            stopped = stop[np.arange(len(j)), j]
            at = v[np.arange(len(j)), j]
            cand = stopped & (at >= 0)
            row = at & _TAG
            ok = cand.copy()
            r = row[cand]
            ok[cand] = kw[r] == qk[todo[cand]]
            out[todo[ok]] = row[ok]
            at_slot[todo[ok]] = ((slot + j) & mask)[ok]
            # On: past a window with no stop, or past a tag that matched another key.
            go = ~stopped | (cand & ~ok)
            nxt = np.where(stopped, slot + j + 1, slot + _WINDOW) & mask
            todo, slot, tag = todo[go], nxt[go], tag[go]
        for i, sl, tg in zip(todo.tolist(), slot.tolist(), tag.tolist()):
            key = qk[i]
            while (v := int(slots[sl])) >= 0:
                if v >> 32 == tg and kw[v & _TAG] == key:
                    out[i] = v & _TAG
                    at_slot[i] = sl
                    break
                sl = (sl + 1) & mask
        return out, at_slot

    def _insert_v(self, rows: np.ndarray) -> None:
        """Hashes rows whose keys are not in the table (and are distinct)."""
        slot, tag = self._hash_v(self.kw[rows, 0], self.kw[rows, 1])
        tag = (tag << 32) | np.where(self.flags[rows] & READY, _SLOT_READY, 0)  # the slot's upper half
        todo = rows.astype(np.int64)
        slots, mask, steps = self.slots, self.mask, np.arange(_WINDOW)
        # First round: each key's home slot alone (empty for most keys at the table's fill).
        keep = self._claim(slot, np.flatnonzero(slots[slot] < 0), tag | todo)
        todo, slot, tag = todo[keep], slot[keep], tag[keep]
        while todo.size:
            empty = slots[(slot[:, None] + steps) & mask] < 0
            j = empty.argmax(1)
            has = empty[np.arange(len(j)), j]
            keep = self._claim((slot + j) & mask, np.flatnonzero(has), tag | todo)
            slot = np.where(has, slot, slot + _WINDOW) & mask
            todo, slot, tag = todo[keep], slot[keep], tag[keep]

    def _claim(self, target: np.ndarray, cand: np.ndarray, value: np.ndarray) -> np.ndarray:
        """Writes ``value`` into the empty slot ``target`` of each of the ``cand`` keys, one key per
        slot (whichever wrote its mark last: marks are negative, below the empty slot's -1);
        returns which keys are still to place (the others probe on from where they were)."""
        slots, mark = self.slots, -2 - cand
        slots[target[cand]] = mark
        win = cand[slots[target[cand]] == mark]
        slots[target[win]] = value[win]
        keep = np.ones(len(target), dtype=bool)
        keep[win] = False
        return keep

    def _unhash(self, row: int) -> None:
        """Takes ``row`` out of the hash table, shifting the rest of its probe run back."""
        slots, mask = self.slots, self.mask
        i = self._home(row)
        while int(slots[i]) & _TAG != row or slots[i] < 0:
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            v = int(slots[j])
            if v < 0:
                break
            h = self._home(v & _TAG)
            # It stays where it is if its home lies cyclically in (i, j].
            if (i < h <= j) if i <= j else (h > i or h <= j):
                continue
            slots[i] = v
            i = j
        slots[i] = -1

    def _unhash_many(self, rows: np.ndarray) -> None:
        """Takes ``rows`` (distinct, hashed) out of the hash table, vectorised: their slots are
        emptied, and every entry after one of them up to the end of its probe run (the next
        empty slot) is taken out and inserted again from its home, so that no run is broken.
        Costs the rows and the runs they sit in, not the table."""
        slots, mask, steps = self.slots, self.mask, np.arange(1, _WINDOW + 1)
        at = self._probe(self.kw[rows])[1]
        slots[at] = -1
        # Each emptied slot's run: from the slot after it to the next empty one.
        start, todo = (at + 1) & mask, np.arange(len(at))
        length = np.zeros(len(at), dtype=np.int64)
        while todo.size:
            v = slots[(start[todo, None] + length[todo, None] + steps - 1) & mask]
            empty = v < 0
            found = empty.any(1)
            length[todo] += np.where(found, empty.argmax(1), _WINDOW)
            todo = todo[~found]
        n = int(length.sum())
        if not n:
            return
        first = np.repeat(start, length)
        pos = (first + np.arange(n) - np.repeat(np.cumsum(length) - length, length)) & mask
        pos = np.unique(pos)
        moved = slots[pos] & _TAG
        slots[pos] = -1
        self._insert_v(moved)

    # ---- rows -------------------------------------------------------------------------------

    def _grow_rows(self, need: int) -> None:
        cap = max(need, int(self.cap * _GROW))
        for name, _, _ in self._columns:
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
            new[: self.n_rows] = old[: self.n_rows]
            setattr(self, name, new)
        self.cap = cap
        self.copies.relink(self.copy)

    def reserve(self, more: int) -> None:
        """Room for ``more`` rows beyond the live ones, made now (columns grown and the hash
        table sized once, rather than step by step as they come: a registration of millions)."""
        need = self.live + more
        fresh = max(0, more - self._n_free)
        if self.n_rows + fresh > self.cap:
            self._grow_rows(self.n_rows + fresh)
        if need > _MAX_FILL * len(self.slots):
            self._rehash(int(np.ceil(np.log2(need / _MAX_FILL))))

    def add(self, q: np.ndarray, ready: bool = False) -> np.ndarray:
        """New rows (flags LIVE, and READY if ``ready``; other columns zero) for keys ((n, 2)
        words) not in the table, distinct."""
        n = len(q)
        reuse = min(n, self._n_free)
        rows = np.empty(n, dtype=np.int64)
        rows[:reuse] = self._free[self._n_free - reuse : self._n_free]
        self._n_free -= reuse
        fresh = n - reuse
        if self.n_rows + fresh > _TAG:
            self._n_free += reuse  # nothing taken
            raise ResourceExhausted(f"the block table is full ({_TAG} rows): split the index into more shards")
        if self.n_rows + fresh > self.cap:
            self._grow_rows(self.n_rows + fresh)
        rows[reuse:] = np.arange(self.n_rows, self.n_rows + fresh)
        if reuse:  # (rows never used are zero already: columns grow zeroed)
            for name, _, _ in self._columns:
                getattr(self, name)[rows[:reuse]] = 0
        self.kw[rows[:reuse]] = q[:reuse]
        self.kw[self.n_rows : self.n_rows + fresh] = q[reuse:]
        self.n_rows += fresh
        self.flags[rows] = LIVE | READY if ready else LIVE
        self.live += n
        if self.live > _MAX_FILL * len(self.slots):
            self._rehash(self.bits + max(1, int(np.ceil(np.log2(self.live / (_MAX_FILL * len(self.slots)))))))
        else:
            self._insert_v(rows)
        return rows

    def _rehash(self, bits: int) -> None:
        self._set_slots(bits)
        rows = np.flatnonzero(self.flags[: self.n_rows] & LIVE)
        self._insert_v(rows)

    def unlink(self, row: int) -> None:
        """The block leaves the table (its row stays until :meth:`free`: leases may hold it)."""
        self._unhash(row)
        self.flags[row] &= 0xFF ^ (LIVE | READY)
        self.live -= 1

    def unlink_many(self, rows: np.ndarray) -> None:
        """:meth:`unlink` for each of ``rows`` (distinct, live): a few are taken out of their
        probe runs one by one, more in one vectorised pass over their runs; half the table or
        more (a daemon's whole segment) by rebuilding the hash table from the rows that stay."""
        if len(rows) * 2 < self.live:
            if len(rows) <= _SCALAR:
                for r in rows.tolist():
                    self._unhash(r)
            else:
                self._unhash_many(rows)
            self.flags[rows] &= 0xFF ^ (LIVE | READY)
            self.live -= len(rows)
            return
        self.flags[rows] &= 0xFF ^ (LIVE | READY)
        self.live -= len(rows)
        bits = self.bits
        while bits > 10 and self.live < _MAX_FILL * (1 << (bits - 2)):
            bits -= 1  # shrink to the rows left (never below the fill that would grow it back)
        self._rehash(bits)

    def reserve_free(self, n: int) -> None:
        """Room on the free list for ``n`` more rows, made now (one copy of what is on it) rather
        than as they come (a copy of a list of millions at each doubling)."""
        need = self._n_free + n
        if need > len(self._free):
            grown = np.empty(max(need, 2 * len(self._free)), dtype=np.int64)
            grown[: self._n_free] = self._free[: self._n_free]
            self._free = grown

    def free_many(self, rows: np.ndarray) -> None:
        """:meth:`free` for each of ``rows`` (unlinked, distinct)."""
        self.flags[rows] = 0
        self.reserve_free(len(rows))
        need = self._n_free + len(rows)
        self._free[self._n_free : need] = rows
        self._n_free = need

    def room(self) -> int:
        """How many more rows the table can hold."""
        return _TAG - self.n_rows + self._n_free

    def free(self, row: int) -> None:
        """Returns an unlinked row for reuse."""
        self.flags[row] = 0
        if self._n_free == len(self._free):
            self.reserve_free(1)
        self._free[self._n_free] = row
        self._n_free += 1

    def key(self, row: int) -> bytes:
        return self.kw[row].astype("<u8").tobytes()

    def keys(self, rows: np.ndarray) -> bytes:
        """The packed keys of ``rows``."""
        return self.kw[rows].astype("<u8").tobytes()

    # ---- introspection ----------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes held by the columns, the hash table and the free-row stack."""
        cols = sum(getattr(self, n).nbytes for n, _, _ in self._columns)
        return cols + self.slots.nbytes + self._free.nbytes + self.copies.nbytes()

    def check_integrity(self) -> None:
        live = np.flatnonzero(self.flags[: self.n_rows] & LIVE)
        assert len(live) == self.live, f"live rows {len(live)} != {self.live}"
        found = self.find(self.kw[live])
        assert (found == live).all(), "a live row is not found by its key"
        held = self.slots[self.slots >= 0]
        in_slots = held & _TAG
        assert (np.sort(in_slots) == np.sort(live)).all(), "the hash table does not hold exactly the live rows"
        ready = (held & _SLOT_READY) != 0
        assert (ready == ((self.flags[in_slots] & READY) != 0)).all(), "a slot's ready bit is not its row's"
        free = self._free[: self._n_free]
        assert len(set(free.tolist())) == len(free), "a row is free twice"
        assert not (self.flags[free] & LIVE).any(), "a free row is live"
        assert not self.copy[free].any(), "a free row has copies"
        self.copies.check_integrity(self.n_rows)


assert KEY_BYTES == 16  # two 64-bit words per key
