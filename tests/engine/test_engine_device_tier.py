"""The worker's cache reporter (engine.device_tier), against a recording stand-in for the store
client: events are netted per key, the first report and the first after a failure replace
everything (reset) with the mirrored set, and closing drops the holdings."""

from __future__ import annotations

import pytest

from engine.device_tier import CacheReporter


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.fail = False

    def report_engine_blocks(self, engine_id, url="", added=(), removed=(), **kw):  # noqa: ANN001, ANN003, ANN201
        if self.fail:
            raise ConnectionError("store away")
        self.calls.append({"added": list(added), "removed": list(removed), **kw})
        return 0


def test_events_are_netted_and_resets_follow_failures():
    rec = Recorder()
    rep = CacheReporter(rec, "w", "http://w")
    rep.events.extend([(True, b"a"), (True, b"b"), (False, b"a"), (True, b"c")])
    assert rep.report_once()
    assert rec.calls[-1]["reset"] and sorted(rec.calls[-1]["added"]) == [b"b", b"c"]
    rep.events.extend([(False, b"b"), (True, b"d"), (True, b"d")])
    assert rep.report_once()
    assert rec.calls[-1]["added"] == [b"d"] and rec.calls[-1]["removed"] == [b"b"]
    assert not rec.calls[-1].get("reset")
    rec.fail = True
    rep.events.append((True, b"e"))
    assert not rep.report_once()
    rec.fail = False
    assert rep.report_once()  # after a failure: the whole set again, as a reset
    assert rec.calls[-1]["reset"] and sorted(rec.calls[-1]["added"]) == [b"c", b"d", b"e"]
    rep.close()
    assert rec.calls[-1]["leave"]


def test_the_interval_must_be_below_the_ttl():
    with pytest.raises(ValueError):
        CacheReporter(Recorder(), "w", "u", interval_s=2.0, ttl_s=2.0)


def test_large_reports_are_sent_in_batches_with_the_reset_first():
    rec = Recorder()
    rep = CacheReporter(rec, "w", "u", max_batch=2)
    rep.events.extend((True, bytes([i]) * 16) for i in range(5))
    assert rep.report_once()
    assert [len(c["added"]) for c in rec.calls] == [2, 2, 1]
    assert [bool(c.get("reset")) for c in rec.calls] == [True, False, False]
    rep.events.extend([(False, bytes([0]) * 16), (False, bytes([1]) * 16), (True, bytes([9]) * 16)])
    rec.calls.clear()
    assert rep.report_once()
    assert sum(len(c["removed"]) for c in rec.calls) == 2 and sum(len(c["added"]) for c in rec.calls) == 1
    assert all(len(c["added"]) + len(c["removed"]) <= 2 for c in rec.calls)


def test_a_key_dropped_and_taken_again_between_reports_sends_nothing():
    rec = Recorder()
    rep = CacheReporter(rec, "w", "u")
    rep.events.append((True, b"k" * 16))
    rep.report_once()
    rep.events.extend([(False, b"k" * 16), (True, b"k" * 16)])
    rep.report_once()
    assert rec.calls[-1]["added"] == [] and rec.calls[-1]["removed"] == []
    assert rep.held == {b"k" * 16}


def test_holdings_that_may_have_lapsed_are_sent_again_whole():
    class Counting(Recorder):
        def report_engine_blocks(self, engine_id, url="", added=(), removed=(), **kw):  # noqa: ANN001, ANN003, ANN201
            super().report_engine_blocks(engine_id, url, added, removed, **kw)
            return len(added) if kw.get("reset") else 1  # the index counts one key only

    rec = Counting()
    rep = CacheReporter(rec, "w", "u")
    rep.events.extend([(True, b"a" * 16), (True, b"b" * 16)])
    rep.report_once()
    assert rep.synced
    rep.report_once()  # the index says 1, the reporter holds 2: resent at most every RESYNC_S
    assert rep.synced and not rec.calls[-1].get("reset")
    rep.last_reset -= 60
    rep.report_once()
    assert not rep.synced
    rep.report_once()
    assert rec.calls[-1].get("reset") and len(rec.calls[-1]["added"]) == 2
    rep.last_ok -= 60  # no report taken for a minute: the ttl passed, the index forgot
    rep.report_once()
    assert rec.calls[-1].get("reset")
