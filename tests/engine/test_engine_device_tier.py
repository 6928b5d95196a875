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
