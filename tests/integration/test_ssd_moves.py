"""Reads racing tier moves, with real processes: blocks go down to SSD under DRAM pressure and
come back up after reads while readers on the same host (staged) and forced TCP read them. A
block never stops being served because it moved while a get was under way, bytes are always
right, and nothing is reported corrupt."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import wait_until

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig

KS = KeySpace(ModelFingerprint("ssd-moves", "bf16", 2, 2, 64))
SIZE = 64 << 10
CHAIN = 4


def content(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_gets_racing_demotion_and_promotion_always_serve_every_block(cluster, transport):
    cluster.start_meta("meta.dram_high_watermark=0.5", "meta.dram_low_watermark=0.3")
    cluster.start_daemon("daemon.ssd_bytes=64MiB", dram="4MiB", name=f"moves-{transport}")
    chains = [KS.block_keys(np.arange(i * 16 * CHAIN, (i + 1) * 16 * CHAIN)) for i in range(60)]  # 15 MiB
    with SyncKVStoreClient(cluster.meta_addr) as c:
        for keys in chains:
            r = c.put(keys, [content(k) for k in keys])
            assert r.stored + r.skipped == CHAIN
        wait_until(lambda: c.stats().counters["demoted"] > 0)
    misses: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            with SyncKVStoreClient(cluster.meta_addr, ClientConfig(transport=transport, location_cache=0)) as c:
                for _ in range(150):
                    i = int(rng.integers(len(chains)))
                    out = [np.empty(SIZE, np.uint8) for _ in range(CHAIN)]
                    n = c.get_into(chains[i], out)
                    for k, o in zip(chains[i][:n], out[:n]):
                        assert np.array_equal(o, content(k)), "wrong bytes served"
                    if n < CHAIN:
                        misses.append((i, n))
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    with SyncKVStoreClient(cluster.meta_addr) as c:
        k = c.stats().counters
        assert k["promoted"] > 0 and k["demoted"] > 0, "the reads did not race any moves"
        assert k["corrupt_reported"] == 0 and k["evictions"] == 0
        assert not misses, f"{len(misses)} gets missed blocks that were stored all along: {misses[:5]}"
        assert c.stats().keys == CHAIN * len(chains)
