"""Registration of a daemon's inventory in vectorised chunks (kvstore.meta.inventory), against a
reference that adopts item by item as the contract says: extents accepted in offset order
unless they overlap an accepted one, leave the segment or are malformed; then, oldest first,
each accepted, well-formed, nonzero-generation, untombstoned item whose key is new becomes a
block (the first of a key's repeats), the rest are refused, and the refused ones whose extent
was their own are tombstoned. Random inventories at several chunk sizes give the same blocks,
locations, refusals and tombstones; the decoded wire columns are the same inventory; and a
daemon dropped whole leaves the table as if its blocks were dropped one by one."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.extent import ALIGN, HEADER_SIZE
from kvstore.meta.index import DaemonSpec, Index, IndexLimits, InventoryItem, SegmentSpec, Tier, Tombstone
from kvstore.meta.inventory import INVENTORY, columns, decode
from tests.unit.test_index import FakeClock

SLOTS = 4000


def spec(daemon_id: str = "d1") -> DaemonSpec:
    seg = SegmentSpec(1, Tier.DRAM, SLOTS * ALIGN, f"/dev/shm/{daemon_id}")
    return DaemonSpec(daemon_id, "h1", "a", "c", (seg,))


def random_inventory(rnd: random.Random, n: int) -> list[InventoryItem]:
    keys = [rnd.getrandbits(128).to_bytes(16, "little") for _ in range(n)]
    items = []
    for i in range(n):
        k = keys[rnd.randrange(i)] if i and rnd.random() < 0.03 else keys[i]  # a repeated key
        slot = rnd.randrange(SLOTS + 20)  # some past the segment's end, some overlapping
        length = rnd.choice((ALIGN - HEADER_SIZE, ALIGN - HEADER_SIZE, 2 * ALIGN - HEADER_SIZE))
        gen = 0 if rnd.random() < 0.02 else rnd.randrange(1, 1 << 40)
        off = slot * ALIGN + (8 if rnd.random() < 0.01 else 0)  # a few misaligned
        items.append(InventoryItem(k, off, length, rnd.getrandbits(64), 0, gen))
    if n > 5:
        items[3] = items[3]._replace(key=b"short")  # malformed: refused alone
    return sorted(items, key=lambda it: it.gen)


def reference(items: list[InventoryItem], dead: set[tuple[bytes, int, int]]) -> tuple[dict, int, set]:
    """(key -> (offset, gen), refused count, tombstoned (key, offset, gen)) item by item."""
    size = lambda it: (HEADER_SIZE + it.length + ALIGN - 1) // ALIGN * ALIGN  # noqa: E731
    good = [len(it.key) == 16 for it in items]
    order = sorted(range(len(items)), key=lambda i: items[i].offset)
    accepted = [False] * len(items)
    cursor = 0
    for i in order:
        it = items[i]
        if not good[i] or it.offset < cursor or it.offset % ALIGN or it.offset + size(it) > SLOTS * ALIGN:
            continue
        accepted[i] = True
        cursor = it.offset + size(it)
    blocks: dict[bytes, tuple[int, int]] = {}
    refused, tombs = 0, set()
    for i, it in enumerate(items):
        ok = accepted[i] and it.gen != 0 and (it.key, it.offset, it.gen) not in dead
        if ok and it.key not in blocks:
            blocks[it.key] = (it.offset, it.gen)
            continue
        refused += 1
        if ok:
            tombs.add((it.key, it.offset, it.gen))
    return blocks, refused, tombs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunk", [0, 1, 97, 1000])
def test_chunked_adoption_adopts_refuses_and_tombstones_as_item_by_item(seed: int, chunk: int) -> None:
    rnd = random.Random(seed)
    items = random_inventory(rnd, 3000)
    ix = Index(IndexLimits(cache_policy=rnd.choice(("lru", "adaptive"))), FakeClock())
    # Tombstones owed to the daemon from before: those items stay dropped.
    dead_items = [it for it in items[10:40] if len(it.key) == 16]
    for it in dead_items:
        ix._tombstone_item("d1", Tombstone(1, it.key, it.offset, it.gen))
    steps = ix.register_daemon_steps(spec(), {1: items}, chunk=chunk)
    n_steps = 0
    while True:
        try:
            next(steps)
            n_steps += 1
        except StopIteration as done:
            refused = done.value
            break
    if chunk:
        assert n_steps == -(-len(items) // chunk)  # one step per chunk (a step ends before each)
    want, want_refused, want_tombs = reference(items, {(it.key, it.offset, it.gen) for it in dead_items})
    assert refused == want_refused
    got = {}
    for k in want:
        (loc,) = ix.locations(ix.lookup(k, with_locations=True)[2])
        got[k] = (loc.offset, loc.gen)
    assert got == want and len(ix) == len(want)
    tombs = {(t.key, t.offset, t.gen) for t in ix.take_tombstones()["d1"]} - {
        (it.key, it.offset, it.gen) for it in dead_items
    }
    assert tombs == want_tombs
    ix.check_integrity()


def test_the_wire_columns_decode_to_the_same_inventory_oldest_first() -> None:
    rnd = random.Random(5)
    items = [it for it in random_inventory(rnd, 200) if len(it.key) == 16]
    rnd.shuffle(items)
    u64 = lambda f: np.array([getattr(it, f) for it in items], dtype="<u8").tobytes()  # noqa: E731
    cols = {f: u64(f) for f in ("offset", "length", "checksum", "gen")}
    a = decode(1, b"".join(it.key for it in items), cols)
    want = columns(sorted(items, key=lambda it: it.gen))
    assert a.dtype == INVENTORY and (a["gen"] == want["gen"]).all() and (a["key"] == want["key"]).all()
    assert (a["offset"] == want["offset"]).all() and a["ok"].all()
    with pytest.raises(InvalidArgument, match="inventory checksum"):
        decode(1, b"".join(it.key for it in items), {**cols, "checksum": cols["checksum"][:-8]})
    with pytest.raises(InvalidArgument, match="keys are"):
        decode(1, b"x" * 17, cols)


@pytest.mark.parametrize("share", [0.05, 0.9])
def test_a_daemon_dropped_whole_leaves_the_rest_found_and_the_accounting_right(share: float) -> None:
    """A daemon with a small share of the table drops its rows one by one; one with most of it
    has the hash table rebuilt from the rows that stay: either way the others are found."""
    rnd = random.Random(7)
    ix = Index(IndexLimits(cache_policy="adaptive"), FakeClock())
    n = 3000
    keys = [rnd.getrandbits(128).to_bytes(16, "little") for _ in range(n)]
    mine = int(n * share)
    for d, ks in (("d1", keys[:mine]), ("d2", keys[mine:])):
        inv = {1: [InventoryItem(k, i * ALIGN, ALIGN - HEADER_SIZE, 1, 0, i + 1) for i, k in enumerate(ks)]}
        assert ix.register_daemon(spec(d), inv) == 0
    lease = ix.acquire(keys[0])  # d1's first block, leased while its daemon goes
    pinned = keys[mine : mine + 5]
    assert ix.pin(b"".join(pinned)) == 5
    ix._drop_daemon("d1")
    ix.check_integrity()
    assert len(ix) == n - mine and ix.lookup(keys[0])[0] == 0
    assert all(ix.lookup(k)[0] == 1 for k in keys[mine:])
    assert all(ix.is_pinned(k) for k in pinned)
    ix.release(lease.lease_id)
    ix.check_integrity()
    # The rows are reused by the next registration.
    assert ix.register_daemon(spec("d1"), {1: [InventoryItem(keys[0], 0, ALIGN - HEADER_SIZE, 1, 0, 9)]}) == 0
    assert ix.lookup(keys[0])[0] == 1 and ix.table.n_rows == n
    ix.check_integrity()
