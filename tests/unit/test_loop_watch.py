"""The event-loop watch (kvstore.loop_watch): the longest hold of the last minute, and holds
found on a real loop."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from kvstore.loop_watch import WINDOW_S, LoopWatch


def test_the_longest_hold_of_the_window_is_kept_and_ages_out():
    w = LoopWatch(CollectorRegistry(), "t")
    w.record(0.002, now=0.0)
    w.record(0.300, now=1.0)
    w.record(0.010, now=2.0)
    assert w.max_lag(now=3.0) == 0.300
    assert w.max_lag(now=1.0 + WINDOW_S + 0.5) == 0.010  # the long one is older than the window
    assert w.max_lag(now=2.0 + WINDOW_S + 0.5) == 0.0


def test_a_hold_of_the_loop_is_seen_and_exported():
    reg = CollectorRegistry()

    async def main() -> float:
        w = LoopWatch(reg, "meta")
        w.start()
        await asyncio.sleep(0.05)
        time.sleep(0.12)  # holds the loop
        await asyncio.sleep(0.05)
        w.stop()
        return w.max_lag()

    assert asyncio.run(main()) >= 0.08
    assert reg.get_sample_value("kvstore_event_loop_lag_max_seconds", {"server": "meta"}) >= 0.08
    over = reg.get_sample_value("kvstore_event_loop_lag_seconds_bucket", {"server": "meta", "le": "0.05"})
    total = reg.get_sample_value("kvstore_event_loop_lag_seconds_count", {"server": "meta"})
    assert total - over >= 1  # one hold past 50 ms
