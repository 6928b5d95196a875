"""The device tier through a real metadata service: an engine's reports show in per-tier
lookups next to the store's own tiers, a leaving engine's holdings go at once and a silent
one's when its time to live passes, and bad reports get typed errors."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.errors import InvalidArgument

KS = KeySpace(ModelFingerprint("engine-tier", "bf16", 2, 2, 64))
KEYS = KS.block_keys(np.arange(16 * 8))


@pytest.fixture
def store(cluster):  # noqa: ANN001
    cluster.start_meta()
    cluster.start_daemon()
    return cluster


def test_engines_holdings_show_per_tier_next_to_the_stores(store):
    with SyncKVStoreClient(store.meta_addr) as c:
        assert c.put(KEYS[:3], [np.full(4096, i, np.uint8) for i in range(3)]).stored == 3
        assert c.report_engine_blocks("w1", "http://w1", KEYS[:6], reset=True) == 6
        assert c.report_engine_blocks("w2", "http://w2", KEYS[:2]) == 2
        t = c.lookup_tiers(KEYS)
        assert (t.stored, t.in_dram) == (3, 3)
        assert t.device("w1") == 6 and t.device("w2") == 2 and t.device("w3") == 0
        assert t.engines["w1"].url == "http://w1"
        # The cache of w1 drops block 1: its device hit is the leading run, 1.
        assert c.report_engine_blocks("w1", "http://w1", removed=KEYS[1:2]) == 5
        assert c.lookup_tiers(KEYS).device("w1") == 1
        assert c.report_engine_blocks("w2", leave=True) == 0
        assert "w2" not in c.lookup_tiers(KEYS).engines
        counters = c.stats().counters
        assert counters["engines"] == 1 and counters["engine_blocks"] == 5


def test_a_silent_engine_loses_its_holdings_when_its_time_passes(store):
    with SyncKVStoreClient(store.meta_addr) as c:
        c.report_engine_blocks("quiet", "u", KEYS[:4], reset=True, ttl_s=0.5)
        c.report_engine_blocks("chatty", "u", KEYS[:4], reset=True, ttl_s=0.5)
        assert c.lookup_tiers(KEYS).device("quiet") == 4
        deadline = time.monotonic() + 10
        while "quiet" in c.lookup_tiers(KEYS).engines:
            c.report_engine_blocks("chatty", "u", ttl_s=0.5)  # heartbeats keep it
            assert time.monotonic() < deadline, "a silent engine's holdings never lapsed"
            time.sleep(0.1)
        assert c.lookup_tiers(KEYS).device("chatty") == 4


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(engine_id=""), "engine_id"),
        (dict(engine_id="a\0b"), "NUL"),
        (dict(engine_id="w" * 300), "256"),
        (dict(engine_id="w", ttl_s=3600.0), "over the limit"),
        (dict(engine_id="w", added=[b"short"]), "16"),
        (dict(engine_id="w", added=[b"k" * 16] * 20_000), "over the limit"),
    ],
)
def test_bad_reports_get_invalid_argument(store, kw, match):
    with SyncKVStoreClient(store.meta_addr) as c:
        with pytest.raises((InvalidArgument, ValueError), match=match):
            c.report_engine_blocks(**kw)
        assert c.stats().counters.get("engines", 0) == 0
