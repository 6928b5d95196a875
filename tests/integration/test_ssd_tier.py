"""The SSD tier with real daemon processes and real files: demotion and promotion cycles, crash
recovery, damaged bytes, a full disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO, wait_until
from test_faults import locations

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.errors import ResourceExhausted
from kvstore.extent import HEADER_SIZE

KS = KeySpace(ModelFingerprint("ssd-tier", "bf16", 2, 2, 64))
SIZE = 256 << 10


def content(key: bytes, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def chain(n: int, start: int) -> list[bytes]:
    return KS.block_keys(np.arange(start, start + 16 * n))


def tiers(c: SyncKVStoreClient) -> dict[int, tuple[int, int]]:
    return {s.tier: (s.blocks, s.used_bytes) for s in c.stats().segments}


def read_all(c: SyncKVStoreClient, chains: list[list[bytes]]) -> int:
    """Reads every chain; returns blocks loaded; asserts every loaded byte is right."""
    loaded = 0
    for keys in chains:
        out = [np.empty(SIZE, np.uint8) for _ in keys]
        n = c.get_into(keys, out)
        for k, o in zip(keys[:n], out[:n]):
            assert np.array_equal(o, content(k)), "wrong bytes served"
        loaded += n
    return loaded


def flip(path, at: int, mask: int) -> None:  # noqa: ANN001
    """Damages the byte at ``at`` of the file at ``path``."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


TIERED = ["daemon.ssd_bytes=64MiB"]


def test_demote_under_pressure_then_promote_on_hit_bytes_identical(cluster):
    cluster.start_meta("meta.dram_high_watermark=0.7", "meta.dram_low_watermark=0.5")
    cluster.start_daemon(*TIERED, dram="4MiB")
    chains = [chain(4, 1000 * i) for i in range(10)]  # 40 x 256 KiB = 10 MiB > 4 MiB of DRAM
    with SyncKVStoreClient(cluster.meta_addr) as c:
        for keys in chains:
            res = c.put(keys, [content(k) for k in keys])
            assert res.stored + res.skipped == 4
        wait_until(lambda: c.stats().counters["demoted"] > 0)
        wait_until(lambda: tiers(c)[1][1] <= 0.7 * (4 << 20))
        s = c.stats()
        assert s.keys == 40, "demotion must not lose blocks"
        assert tiers(c)[2][0] > 0 and s.counters["evictions"] == 0
        # Every block is served whole, from DRAM or SSD.
        assert read_all(c, chains) == 40
        assert c.stats().counters["ssd_hit_keys"] > 0
        # Blocks read from SSD come back to DRAM (keeping their SSD copy).
        wait_until(lambda: c.stats().counters["promoted"] > 0)
        assert read_all(c, chains) == 40

        # A second wave demotes again: cycles keep bytes identical.
        def moved_down() -> int:
            k = c.stats().counters
            return k["demoted"] + k["dropped_clean"]

        before = moved_down()
        more = [chain(4, 50_000 + 1000 * i) for i in range(8)]
        for keys in more:
            c.put(keys, [content(k) for k in keys])
        wait_until(lambda: moved_down() > before)
        assert read_all(c, chains + more) == 72
        assert c.stats().counters["corrupt_reported"] == 0


WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from kvstore import SyncKVStoreClient, KeySpace, ModelFingerprint
    from kvstore.errors import KVStoreError
    meta, log = sys.argv[1], sys.argv[2]
    ks = KeySpace(ModelFingerprint("ssd-tier", "bf16", 2, 2, 64))
    def content(key):
        return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, 65536, dtype=np.uint8)
    with SyncKVStoreClient(meta) as c, open(log, "a") as f:
        for i in range(100000):
            keys = ks.block_keys(np.arange(i * 64, i * 64 + 64))
            try:
                r = c.put(keys, [content(k) for k in keys])
            except KVStoreError:
                continue
            if r.stored + r.skipped == len(keys):
                f.write("".join(k.hex() + "\\n" for k in keys)); f.flush()
    """
)


def test_sigkill_during_write_burst_then_restart_serves_committed_blocks(cluster):
    cluster.start_meta("meta.dram_high_watermark=0.6", "meta.dram_low_watermark=0.4")
    name = "crashy"
    d = cluster.start_daemon(*TIERED, dram="8MiB", name=name)
    log = cluster.tmp / "committed.txt"
    w = subprocess.Popen([sys.executable, "-c", WRITER, cluster.meta_addr, str(log)], cwd=REPO)
    try:
        with SyncKVStoreClient(cluster.meta_addr) as c:
            wait_until(lambda: log.exists() and len(log.read_text().split()) >= 600, timeout=60)
            wait_until(lambda: c.stats().counters["demoted"] > 0)
            old = {x.info.data_addr for x in c.stats().daemons}
            d.kill()  # mid-burst: the writer keeps going and gets errors
            committed = [bytes.fromhex(h) for h in log.read_text().split()]
            w.kill()
            w.wait()
            cluster.procs.remove(d)
            cluster.start_daemon(*TIERED, dram="8MiB", name=name)

            # Served by the restarted daemon: its registration replaced the dead one's (whose
            # entries would count as keys until then, at an address nobody answers).
            def restarted() -> bool:
                st = c.stats()
                return st.keys >= 0.999 * len(committed) and all(x.info.data_addr not in old for x in st.daemons)

            wait_until(restarted, timeout=30)
            served = 0
            for i in range(0, len(committed), 4):
                keys = committed[i : i + 4]
                out = [np.empty(65536, np.uint8) for _ in keys]
                n = c.get_into(keys, out)
                for k, o in zip(keys[:n], out[:n]):
                    assert np.array_equal(o, content(k, 65536)), "a block was served wrong after the crash"
                served += n
            k = {n: v for n, v in c.stats().counters.items() if v}
            assert served >= 0.999 * len(committed), f"{served} of {len(committed)} committed blocks served; {k}"
    finally:
        w.kill()


def test_flipped_byte_on_ssd_is_a_miss_and_the_replica_is_dropped(cluster):
    cluster.start_meta("meta.dram_high_watermark=0.05", "meta.dram_low_watermark=0")
    cluster.start_daemon(*TIERED, dram="4MiB", name="flip")
    keys = chain(6, 77)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        c.put(keys, [content(k) for k in keys])
        wait_until(lambda: tiers(c).get(2, (0, 0))[0] == 6 and tiers(c)[1][0] == 0)
        loc = locations(cluster.meta_addr, keys)[3]
        assert loc.segment.tier == 2
        data = cluster.tmp / "daemon-flip" / "ssd" / "ssd-2.data"
        flip(data, loc.offset + HEADER_SIZE + 4321, 0x10)
        out = [np.empty(SIZE, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == 3
        assert all(np.array_equal(out[i], content(keys[i])) for i in range(3))
        wait_until(lambda: c.lookup(keys) == 3)
        assert c.stats().counters["corrupt_reported"] == 1


def test_damaged_header_on_ssd_is_a_miss_reported_on_the_second_look(cluster):
    # The daemon finds another header where the index says the block is: not there. The client
    # asks the index again (a block that moved is found at its new place), finds the same
    # place, and reports it; the index forgets it. Forced TCP: every block is streamed.
    cluster.start_meta("meta.dram_high_watermark=0.05", "meta.dram_low_watermark=0")
    cluster.start_daemon(*TIERED, dram="4MiB", name="hdr")
    keys = chain(6, 177)
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(transport="tcp", location_cache=0)) as c:
        c.put(keys, [content(k) for k in keys])
        wait_until(lambda: tiers(c).get(2, (0, 0))[0] == 6 and tiers(c)[1][0] == 0)
        loc = locations(cluster.meta_addr, keys)[2]
        data = cluster.tmp / "daemon-hdr" / "ssd" / "ssd-2.data"
        flip(data, loc.offset + 3, 0x01)
        out = [np.empty(SIZE, np.uint8) for _ in keys]
        acquires = c.stats().counters["acquires"]
        assert c.get_into(keys, out) == 2
        assert c.stats().counters["acquires"] == acquires + 2, "the index was not asked again"
        assert all(np.array_equal(out[i], content(keys[i])) for i in range(2))
        wait_until(lambda: c.lookup(keys) == 2)
        assert c.stats().counters["corrupt_reported"] == 1
        assert c.get_into(keys, out) == 2  # a plain miss now: nothing more reported
        assert c.stats().counters["corrupt_reported"] == 1


def test_torn_journal_and_flipped_byte_after_restart_are_discarded(cluster):
    cluster.start_meta("meta.dram_high_watermark=0.05", "meta.dram_low_watermark=0")
    d = cluster.start_daemon(*TIERED, dram="4MiB", name="torn")
    keys = chain(6, 500)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        c.put(keys, [content(k) for k in keys])
        wait_until(lambda: tiers(c).get(2, (0, 0))[0] == 6 and tiers(c)[1][0] == 0)
        locs = locations(cluster.meta_addr, keys)
    d.kill()
    cluster.procs.remove(d)
    ssd = cluster.tmp / "daemon-torn" / "ssd"
    # Damage block 1's payload, and tear the journal's last record in half.
    flip(ssd / "ssd-2.data", locs[1].offset + HEADER_SIZE + 99, 0xFF)
    journal = (ssd / "ssd-2.journal").read_bytes()
    torn_key = journal[-68 + 8 : -68 + 24]  # the last record's key (records are 68 bytes)
    assert torn_key in keys and torn_key != keys[1]
    os.truncate(ssd / "ssd-2.journal", len(journal) - 20)
    # The shared-memory arena is gone too (as after a reboot): only the SSD can serve.
    os.unlink(cluster.shm_paths[-1])
    cluster.start_daemon(*TIERED, dram="4MiB", name="torn")
    with SyncKVStoreClient(cluster.meta_addr) as c:
        wait_until(lambda: c.stats().keys >= 4)
        lost = {keys[1], torn_key}  # damaged bytes; torn journal record
        assert c.exists(keys) == [k not in lost for k in keys]
        expect = 0 if torn_key == keys[0] else 1
        assert c.lookup(keys) == expect
        out = [np.empty(SIZE, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == expect
        assert all(np.array_equal(out[i], content(keys[i])) for i in range(expect))
    log = (cluster.tmp / "daemon-torn.log").read_text()
    assert "discarded=1" in log


def test_full_ssd_answers_resource_exhausted_and_loses_nothing(cluster):
    cluster.start_meta("meta.dram_high_watermark=0.99", "meta.dram_low_watermark=0.98")
    cluster.start_daemon("daemon.ssd_bytes=2MiB", "daemon.ssd_compress=off", dram="1MiB")
    stored: list[bytes] = []
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(retries=0)) as c:
        with pytest.raises(ResourceExhausted):
            for i in range(40):
                keys = chain(1, 100 * i)
                res = c.put(keys, [content(k) for k in keys])
                assert res.stored == 1
                assert c.pin(keys) == 1  # nothing may be evicted
                stored += keys
        assert len(stored) >= 8
        t = tiers(c)
        assert t[1][0] >= 1 and t[2][0] >= 1, "DRAM and SSD both filled"
        for k in stored:
            out = [np.empty(SIZE, np.uint8)]
            assert c.get_into([k], out) == 1 and np.array_equal(out[0], content(k))
        assert c.stats().keys == len(stored)


def test_stat_shows_both_tiers(cluster):
    cluster.start_meta()
    cluster.start_daemon(*TIERED, dram="4MiB")
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stat", "--meta", cluster.meta_addr, "--json"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    segs = json.loads(r.stdout)["segments"]
    assert sorted(s["tier"] for s in segs) == ["TIER_DRAM", "TIER_SSD"]
