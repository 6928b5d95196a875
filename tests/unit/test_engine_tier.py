"""The device tier in the index (kvstore.meta.engines): engines' reported holdings appear and
disappear with their reports, lapse when reports stop, answer per tier in lookups, and bad
reports change nothing."""

from __future__ import annotations

import random

import pytest

from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.meta.engines import EngineTier
from kvstore.meta.records import SegmentSpec, Tier
from tests.unit.test_index import SEG, FakeClock, dspec, k, make, pk, put


def held_by(idx, ids, engine: str) -> list[int]:  # noqa: ANN001
    _tiers, engines = idx.tiers(pk(*ids))
    row = engines.get(engine)
    return list(row[1]) if row else [0] * len(ids)


def test_reports_add_and_drop_holdings_and_lookups_answer_per_engine():
    idx, _ = make()
    assert idx.report_engine("w1", "http://w1", pk(0, 1, 2), b"", reset=True) == 3
    assert idx.report_engine("w2", "http://w2", pk(0, 1), b"") == 2
    assert held_by(idx, [0, 1, 2, 3], "w1") == [1, 1, 1, 0]
    assert held_by(idx, [0, 1, 2, 3], "w2") == [1, 1, 0, 0]
    assert idx.tiers(pk(0))[1]["w1"][0] == "http://w1"
    assert idx.report_engine("w1", "http://w1", b"", pk(1)) == 2  # its cache dropped block 1
    assert held_by(idx, [0, 1, 2], "w1") == [1, 0, 1]
    idx.check_integrity()
    # A reset replaces everything: a restarted engine never keeps its predecessor's holdings.
    assert idx.report_engine("w1", "http://w1", pk(5), b"", reset=True) == 1
    assert held_by(idx, [0, 2, 5], "w1") == [0, 0, 1]
    # Leaving drops at once.
    assert idx.report_engine("w2", "", b"", b"", leave=True) == 0
    assert "w2" not in idx.tiers(pk(0, 1))[1]
    idx.check_integrity()


def test_holdings_lapse_when_reports_stop_and_a_stalled_service_gives_grace():
    idx, clock = make(engine_ttl_s=2.0)
    idx.report_engine("w1", "u", pk(0, 1), b"", reset=True)
    idx.report_engine("w2", "u", pk(0), b"", ttl_s=10.0)
    clock.advance(1.5)
    idx.report_engine("w1", "u", b"", b"")  # a heartbeat: no events
    clock.advance(1.5)
    assert idx.expire()["engines"] == 0
    assert held_by(idx, [0, 1], "w1") == [1, 1]
    idx.grace(5.0)  # the service did not run for 5 s: nobody's report could land
    clock.advance(4.0)
    assert idx.expire()["engines"] == 0
    clock.advance(1.6)
    assert idx.expire()["engines"] == 1  # w1's time passed; w2 asked for 10 s (+5 s grace)
    assert held_by(idx, [0, 1], "w1") == [0, 0]
    assert held_by(idx, [0], "w2") == [1]
    clock.advance(20)
    assert idx.expire()["engines"] == 1
    assert idx.tiers(pk(0))[1] == {}
    idx.check_integrity()


def test_tiers_name_the_store_tier_of_each_ready_replica():
    ssd = SegmentSpec(SEG + 1, Tier.SSD, 8 * 4096 * 16, "")
    idx, _ = make()
    idx.register_daemon(dspec("d2", extra=(ssd,)), {})
    put(idx, 0, 1)
    tiers, _ = idx.tiers(pk(0, 1, 2))
    assert tiers[0] & 1 and tiers[1] & 1 and tiers[2] == 0
    assert not tiers[0] & 2


@pytest.mark.parametrize(
    "call, match",
    [
        (dict(engine_id="", url="u", added=b""), "engine_id"),
        (dict(engine_id="w", url="u", added=b"x" * 15), "multiple of 16"),
        (dict(engine_id="w", url="u", added=pk(0), ttl_s=61.0), "over the limit"),
        (dict(engine_id="w", url="u", added=pk(0), ttl_s=float("nan")), "finite"),
        (dict(engine_id="w", url="u", added=pk(0), ttl_s=-1.0), "negative"),
        (dict(engine_id="w" * 600, url="u", added=pk(0)), "engine_id"),
        (dict(engine_id="w", url="u" * 2000, added=pk(0)), "url"),
    ],
)
def test_bad_reports_are_refused_and_change_nothing(call, match):
    idx, _ = make()
    idx.report_engine("w", "u", pk(7), b"", reset=True)

    def state():  # noqa: ANN202
        t = idx.engine_tier
        return (
            {k: set(v) for k, v in t.holders.items()},
            {e: (set(r.keys), r.url, r.deadline) for e, r in t.engines.items()},
        )

    before = state()
    for reset in (False, True):
        with pytest.raises(InvalidArgument, match=match):
            idx.report_engine(
                call["engine_id"], call["url"], call["added"], b"", reset=reset, ttl_s=call.get("ttl_s", 0.0)
            )
        assert state() == before


def test_engines_and_keys_per_engine_are_bounded():
    tier = EngineTier(max_engines=2, max_blocks=3)
    tier.report("a", "", [k(0), k(1)], [], False, 1.0, 0.0)
    tier.report("b", "", [k(0)], [], False, 1.0, 0.0)
    with pytest.raises(ResourceExhausted):
        tier.report("c", "", [k(0)], [], False, 1.0, 0.0)
    assert tier.report("a", "", [k(2), k(3), k(4)], [], False, 1.0, 0.0) == 3  # two past the cap
    assert tier.counters["engine_keys_dropped"] == 2
    tier.check_integrity()


def test_random_event_streams_keep_the_holders_exact():
    """Against a model (per engine, a set of keys): any sequence of reports, leaves and
    expiries leaves exactly the model's holdings."""
    rng = random.Random(7)
    tier = EngineTier(max_engines=8, max_blocks=10_000)
    clock = FakeClock(0.0)
    model: dict[str, tuple[set, float]] = {}
    for _ in range(3000):
        eid = f"e{rng.randrange(5)}"
        op = rng.random()
        if op < 0.05:
            tier.report(eid, "", [], [], False, 1.0, clock.t, leave=True)
            model.pop(eid, None)
        elif op < 0.1:
            clock.advance(rng.random())
            tier.expire(clock.t)
            model = {e: v for e, v in model.items() if v[1] >= clock.t}
        else:
            add = [k(rng.randrange(40)) for _ in range(rng.randrange(6))]
            rem = [k(rng.randrange(40)) for _ in range(rng.randrange(4))]
            reset = rng.random() < 0.05
            tier.report(eid, "", add, rem, reset, 1.0, clock.t)
            keys = set() if reset or eid not in model else model[eid][0]
            keys = (keys - set(rem)) | set(add)
            model[eid] = (keys, clock.t + 1.0)
        tier.check_integrity()
    assert {e: r.keys for e, r in tier.engines.items()} == {e: v[0] for e, v in model.items()}
    held = tier.held([k(i) for i in range(40)])
    for e, (keys, _) in model.items():
        row = held.get(e, ("", bytearray(40)))[1]
        assert {k(i) for i in range(40) if row[i]} == keys


def test_one_tenant_cannot_take_every_engine_slot():
    tier = EngineTier(max_engines=10, max_per_owner=2)
    tier.report("a\0w1", "", [], [], False, 1.0, 0.0, owner="a")
    tier.report("a\0w2", "", [], [], False, 1.0, 0.0, owner="a")
    with pytest.raises(ResourceExhausted, match="max_engines_per_tenant"):
        tier.report("a\0w3", "", [], [], False, 1.0, 0.0, owner="a")
    tier.report("b\0w1", "", [], [], False, 1.0, 0.0, owner="b")  # another tenant still can
    tier.report("a\0w1", "", [], [], False, 1.0, 0.0, leave=True, owner="a")
    tier.report("a\0w3", "", [], [], False, 1.0, 0.0, owner="a")  # a slot freed by leaving
    for i in range(5):  # without credentials (owner ""), only max_engines bounds
        tier.report(f"open{i}", "", [], [], False, 1.0, 0.0)
    tier.check_integrity()
