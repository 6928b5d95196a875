"""The index's hit counters, in-process: a get's keys are counted once each, as the reader loaded
them, when its lease ends (Release: ``unread``, ``asked_again``; an expiry counts the run as
read); reads of known locations count through Touch, by the tier the client read; and what is
malformed is refused without counting anything."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.meta.index import Tier
from tests.unit.test_index import BLK, make, pk, put

COUNTS = ("hit_keys", "miss_keys", "hit_bytes", "ssd_hit_keys", "acquires", "touches", "touched_keys")


def counts(idx) -> dict[str, int]:  # noqa: ANN001
    return {k: idx.counters[k] for k in COUNTS}


def test_a_lease_counts_its_run_when_released_as_the_reader_loaded_it():
    idx, _ = make()
    put(idx, 0, 1, 2, 3)
    a = idx.acquire(pk(0, 1, 2, 3, 7, 8))  # a run of 4, then 2 keys not stored
    assert a.hit_count == 4
    assert counts(idx)["hit_keys"] == 0 and counts(idx)["miss_keys"] == 0  # counted at release
    idx.release(a.lease_id, corrupt=[2], unread=2)  # block 2 failed: it and block 3 were not loaded
    c = counts(idx)
    assert (c["hit_keys"], c["miss_keys"], c["hit_bytes"], c["acquires"]) == (2, 4, 2 * BLK, 1)


def test_a_run_of_nothing_counts_its_misses_at_once():
    idx, _ = make()
    assert idx.acquire(pk(5, 6, 7)).hit_count == 0
    assert counts(idx)["miss_keys"] == 3 and counts(idx)["hit_keys"] == 0


def test_keys_asked_again_are_counted_by_the_acquire_that_asks_them():
    idx, _ = make()
    put(idx, 0, 1, 2, 3)
    a = idx.acquire(pk(0, 1, 2, 3, 9))
    idx.release(a.lease_id, unread=3, asked_again=True)  # block 1 moved mid-read: asked again
    assert counts(idx)["hit_keys"] == 1 and counts(idx)["miss_keys"] == 0
    b = idx.acquire(pk(1, 2, 3, 9))
    idx.release(b.lease_id)
    c = counts(idx)
    assert (c["hit_keys"], c["miss_keys"]) == (4, 1)  # 5 keys asked, each counted once


def test_an_expired_lease_counts_its_run_as_read():
    idx, clock = make()
    put(idx, 0, 1)
    idx.acquire(pk(0, 1, 4), ttl_s=1.0)
    clock.advance(5.0)
    idx.expire()
    assert (counts(idx)["hit_keys"], counts(idx)["miss_keys"]) == (2, 1)


def test_unread_past_the_run_is_refused_and_the_lease_stays():
    idx, _ = make()
    put(idx, 0, 1)
    a = idx.acquire(pk(0, 1))
    with pytest.raises(InvalidArgument, match="unread: 3 blocks is outside the leased run of 2"):
        idx.release(a.lease_id, unread=3)
    assert a.lease_id in idx.leases and counts(idx)["hit_keys"] == 0
    idx.release(a.lease_id, unread=0)
    assert counts(idx)["hit_keys"] == 2


def test_touch_counts_stored_runs_as_hits_by_the_tier_the_client_read():
    idx, _ = make()
    put(idx, 0, 1, 2)
    tiers = bytes([Tier.DRAM, Tier.SSD, Tier.SSD]) + bytes([Tier.DRAM, Tier.DRAM])
    assert idx.touch([pk(0, 1, 2), pk(0, 5)], interval_s=0.05, tiers=tiers) == 4
    c = counts(idx)
    # The second chain's key 5 is not stored (dropped since the read): counted nowhere.
    assert (c["hit_keys"], c["ssd_hit_keys"], c["hit_bytes"], c["miss_keys"]) == (4, 2, 4 * BLK, 0)
    assert (c["touches"], c["touched_keys"], c["acquires"]) == (2, 4, 0)
    assert idx.touch([pk(1)]) == 1  # no tiers: the block's tier now (DRAM)
    assert counts(idx)["ssd_hit_keys"] == 2 and counts(idx)["hit_keys"] == 5


@pytest.mark.parametrize(
    ("tiers", "message"),
    [(b"\x01", "tiers: 1 bytes for 2 keys"), (b"\x01\x03", "each byte must be 1 \\(DRAM\\) or 2 \\(SSD\\)")],
)
def test_touch_with_malformed_tiers_is_refused_before_counting(tiers, message):
    idx, _ = make()
    put(idx, 0, 1)
    with pytest.raises(InvalidArgument, match=message):
        idx.touch([pk(0, 1)], tiers=tiers)
    assert counts(idx) == dict.fromkeys(COUNTS, 0)


def test_the_touch_interval_is_the_longest_reported_in_the_last_minute():
    idx, clock = make()
    assert idx.touch_interval_s == 0.0
    idx.touch([], interval_s=0.2)
    idx.touch([], interval_s=0.05)
    assert idx.touch_interval_s == 0.2
    clock.advance(61)
    idx.touch([], interval_s=0.05)  # the long one is over a minute old
    assert idx.touch_interval_s == 0.05
    clock.advance(500)
    assert idx.touch_interval_s == 0.0  # nobody reported lately
