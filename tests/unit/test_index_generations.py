"""Generations in the index (kvstore.meta.index): a registration naming one past the range the
index hands out is refused whole, the counter never passes 64 bits, and a put that fails after
reserving space gives it all back."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import Internal, InvalidArgument
from kvstore.extent import ALIGN, HEADER_SIZE
from kvstore.meta.index import GEN_LIMIT, GEN_MAX, ROW, DaemonSpec, Index, IndexLimits, InventoryItem, SegmentSpec, Tier
from tests.unit.test_index import FakeClock

BLK = ALIGN - HEADER_SIZE


def key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def spec(daemon_id: str, slots: int = 8) -> DaemonSpec:
    seg = SegmentSpec(1, Tier.DRAM, slots * ALIGN, f"/dev/shm/{daemon_id}")
    return DaemonSpec(daemon_id, f"h-{daemon_id}", f"{daemon_id}:data", f"{daemon_id}:ctl", (seg,))


def gens_of(ix: Index, placements: np.ndarray) -> list[int]:
    return [x.gen for x in ix.locations(placements)]


def state(ix: Index) -> tuple:
    """What a refused call must leave as it was."""
    segs = sorted(
        (did, sid, s.alloc.used, sorted(s.alloc._by_start.items()), s.blocks)
        for did, d in ix.daemons.items()
        for sid, s in d.segments.items()
    )
    return segs, ix._last_gen, sorted(ix.puts), dict(ix.counters), {d: list(t) for d, t in ix.tombstones.items()}


def loaded() -> Index:
    ix = Index(IndexLimits(cache_policy="lru"), FakeClock())
    ix.register_daemon(spec("d1"), {})
    p = ix.put_start(key(0) + key(1), [BLK, BLK])
    assert ix.put_commit(p.put_id, [5, 6]) == 2
    return ix


def put_works(ix: Index, first: int) -> list[int]:
    p = ix.put_start(key(first) + key(first + 1), [BLK, BLK])
    assert p.status == [0, 0]
    assert ix.put_commit(p.put_id, [7, 8]) == 2
    assert ix.lookup(key(first) + key(first + 1))[0] == 2
    ix.check_integrity()
    return gens_of(ix, p.placements)


@pytest.mark.parametrize("gen", [GEN_LIMIT, GEN_MAX, -1])
@pytest.mark.parametrize("daemon_id", ["d2", "d1"], ids=["new", "again"])
def test_a_registration_naming_a_generation_out_of_range_is_refused_whole(gen: int, daemon_id: str) -> None:
    ix = loaded()
    before = state(ix)
    inv = {1: [InventoryItem(key(50), 0, BLK, 1, 0, 7), InventoryItem(key(51), ALIGN, BLK, 1, 0, gen)]}
    with pytest.raises(InvalidArgument, match=rf"segment 1, item 1 \(key {key(51).hex()}\): generation {gen} "):
        ix.register_daemon(spec(daemon_id), inv)
    assert state(ix) == before
    assert sorted(ix.daemons) == ["d1"]
    assert ix.lookup(key(0) + key(1))[0] == 2  # a re-registration refused drops nothing
    assert ix.lookup(key(50))[0] == 0
    ix.check_integrity()
    # Puts go on, with generations that fit the wire.
    for g in put_works(ix, 10):
        assert 0 < g < GEN_LIMIT


def test_the_generation_just_below_the_limit_is_adopted_and_later_puts_fit_64_bits() -> None:
    ix = loaded()
    assert ix.register_daemon(spec("d2"), {1: [InventoryItem(key(50), 0, BLK, 1, 0, GEN_LIMIT - 1)]}) == 0
    assert ix.lookup(key(50))[0] == 1
    gens = put_works(ix, 10)
    assert GEN_LIMIT <= gens[0] < gens[1] <= GEN_MAX
    rows = ix.lookup(key(10) + key(11), with_locations=True)[2]
    assert [ROW.unpack_from(ix.location_rows(rows), i * ROW.size)[5] for i in range(2)] == gens
    assert [ROW.unpack(x.row)[5] for x in ix.locations(rows)] == gens


def test_the_generation_counter_never_passes_64_bits() -> None:
    ix = loaded()
    ix._last_gen = GEN_MAX - 1  # as if 2**63 placements had been made above the highest registered
    before = state(ix)
    with pytest.raises(Internal, match="generation counter exhausted"):
        ix.put_start(key(10) + key(11), [BLK, BLK])
    assert state(ix) == before
    assert ix.lookup(key(10))[0] == 0
    ix.check_integrity()
    p = ix.put_start(key(10), [BLK])  # the last one there is
    assert gens_of(ix, p.placements) == [GEN_MAX]
    assert ix.put_commit(p.put_id, [1]) == 1
    with pytest.raises(Internal):
        ix.put_start(key(11), [BLK])
    ix.check_integrity()


# Where it fails: placing its second block (the first has its extent), or adding the placed
# blocks to the table (every extent reserved).
@pytest.mark.parametrize("where", ["allocate", "add"])
def test_a_put_that_fails_after_reserving_space_gives_it_all_back(where: str, monkeypatch) -> None:  # noqa: ANN001
    ix = loaded()
    before = state(ix)
    calls = []

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 2 or where == "add":
            raise RuntimeError("placement failed")
        return real(*a, **k)

    if where == "add":
        real = ix.table.add
        monkeypatch.setattr(ix.table, "add", boom)
    else:
        real = ix._allocate
        monkeypatch.setattr(ix, "_allocate", boom)
    with pytest.raises(RuntimeError, match="placement failed"):
        ix.put_start(key(10) + key(11) + key(12), [BLK] * 3)
    monkeypatch.undo()
    after = state(ix)
    assert after[0] == before[0]  # every segment's space and free ranges as they were
    assert after[2] == before[2]  # no put
    assert ix.lookup(key(10), per_key=True)[1] == [False]
    assert ix.put_start(key(10), [BLK]).status == [0]  # not "in flight"
    ix.check_integrity()


@pytest.mark.parametrize("field", ["length", "checksum"])
def test_an_inventory_item_whose_values_pass_64_bits_is_refused_alone(field: str) -> None:
    ix = Index(IndexLimits(cache_policy="lru"), FakeClock())
    bad = InventoryItem(key(1), 0, BLK, 1, ALIGN, 9)._replace(**{field: 1 << 64})
    inv = {1: [bad, InventoryItem(key(2), ALIGN, BLK, 1, 0, 10)]}
    assert ix.register_daemon(spec("d1"), inv) == 1
    assert ix.lookup(key(2))[0] == 1 and ix.lookup(key(1))[0] == 0
    ix.check_integrity()
    put_works(ix, 10)
