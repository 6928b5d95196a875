"""The store-level peer comparison (bench/peers.py): the kvstore and Redis measurements run
against real servers at a tiny size and give well-formed numbers; a wrong byte is caught; a peer
that cannot run or fails ends the run instead of being left out; the report names where kvstore
is behind. Mooncake is not exercised here."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import bench.peers as peers  # noqa: E402
import bench.peers_harness as harness  # noqa: E402
import bench.peers_report as report  # noqa: E402
import bench.peers_servers as servers  # noqa: E402
import bench.peers_systems as adapters  # noqa: E402

pytestmark = pytest.mark.timeout(60)

TINY = harness.Plan(
    batch_bytes=512 << 10,
    reps=2,
    latency_samples=12,
    lookup_s=0.3,
    sizes={"64KiB": 64 << 10},
    lookup_keys=1000,
    rounds=2,
)


def _needs_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install redis hiredis)")


def _check(measured: dict, systems: list[str]) -> None:
    s = measured["sizes"]["64KiB"]
    assert s["objects"] == 8 and s["batch_bytes"] == 512 << 10
    assert sorted(s["systems"]) == sorted(systems)
    for name, m in s["systems"].items():
        assert m["put_gbps"] > 0 and m["get_gbps"] > 0, name
        assert len(m["put_gbps_reps"]) == len(m["get_gbps_reps"]) == TINY.reps, name
        assert m["latency_samples"] == TINY.latency_samples, name
        assert 0 < m["get_p50_ms"] <= m["get_p99_ms"], name
    assert sorted(measured["lookup"]) == sorted(systems)
    for name, lk in measured["lookup"].items():
        assert lk["keys_per_lookup"] == 1000 and lk["calls"] > 0, name
        assert lk["keys_per_s"] > 0, name
        assert 0 < lk["p50_ms"] <= lk["p99_ms"], name
        assert 0 < lk["one_key_p50_ms"] <= lk["one_key_p99_ms"], name


def test_kvstore_and_redis_measurements(tmp_path: Path) -> None:
    _needs_redis()
    with servers.RedisServer(tmp_path) as redis_server, servers.KVStoreServer(tmp_path, "128MiB") as kv:
        runners = [
            harness.Runner(adapters.KVStorePeer(kv.meta, "shm")),
            harness.Runner(adapters.KVStorePeer(kv.meta, "tcp")),
            harness.Runner(adapters.RedisPeer(redis_server.port)),
        ]
        suite = harness.Suite(runners, TINY, progress=False)
        try:
            measured = suite.run()
        finally:
            suite.close()
        assert "Redis server" in redis_server.version
    _check(measured, ["kvstore-shm", "kvstore-tcp", "redis"])


class _Corrupting(adapters.RedisPeer):
    """Redis whose batch gets flip one byte: the bench must notice."""

    name = "corrupting"

    def get(self, keys: list[bytes], bufs: harness.Buffers) -> None:
        super().get(keys, bufs)
        bufs.arrays[-1][7] ^= 0xFF


def test_a_wrong_byte_fails_the_run(tmp_path: Path) -> None:
    _needs_redis()
    with servers.RedisServer(tmp_path) as redis_server:
        runner = harness.Runner(_Corrupting(redis_server.port))
        runner.start_size(64 << 10, 4)
        try:
            runner.rep(0)  # a clean round trip would pass; this one has one flipped byte
        except harness.BenchError as e:
            assert "differ" in str(e)
        else:
            pytest.fail("a get with a flipped byte was not detected")
        finally:
            runner.close()


def test_a_peer_failing_during_the_run_fails_it(tmp_path: Path) -> None:
    _needs_redis()
    with servers.RedisServer(tmp_path) as redis_server:
        suite = harness.Suite([harness.Runner(_Corrupting(redis_server.port))], TINY, progress=False)
        try:
            with pytest.raises(harness.SystemFailed, match="corrupting: failed during the measurements: .*differ") as e:
                suite.run()
        finally:
            suite.close()
    assert e.value.system == "corrupting"


def test_a_peer_that_cannot_run_fails_the_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not silently left out: the run stops with the peer's name and why, exits non-zero and
    writes nothing. Only --skip leaves a peer out (here Mooncake, so that Redis is the one missing)."""
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **kw: None if cmd == "redis-server" else which(cmd, *a, **kw))
    out = tmp_path / "peers.json"
    assert peers.main(["--quick", "--no-report", "--skip", "mooncake", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "redis: cannot run: redis-server is not installed" in err
    assert "--skip redis" in err
    assert not out.exists()


def test_objects_and_keys_are_identical_across_processes_and_distinct_per_system() -> None:
    a, b = harness.Objects(64 << 10, 3), harness.Objects(64 << 10, 3)
    assert np.array_equal(a.src.flat, b.src.flat)  # seeded: the Mooncake worker builds the same bytes
    assert a.src.ptrs[1] - a.src.ptrs[0] == 64 << 10
    k1 = harness.batch_keys("redis", 64 << 10, 0, 5)
    assert k1 == harness.batch_keys("redis", 64 << 10, 0, 5)
    assert len(set(k1)) == 5 and all(len(k) == 16 for k in k1)
    others = [("kvstore-tcp", 64 << 10, 0), ("redis", 2 << 20, 0), ("redis", 64 << 10, 1), ("redis", 1024, -1)]
    for system, size, rep in others:
        assert not set(k1) & set(harness.batch_keys(system, size, rep, 5))


def _result(redis_get: float, redis_p50: float) -> dict:
    def m(put: float, get: float, p50: float) -> dict:
        return {"put_gbps": put, "get_gbps": get, "get_p50_ms": p50, "get_p99_ms": p50 * 2}

    r = {
        "command": "python bench/peers.py --quick",
        "date": "2026-12-01 00:00 UTC",
        "machine": "test",
        "seed": harness.SEED,
        "plan": {"batch_bytes": 32 << 20, "reps": 3, "latency_samples": 100, "lookup_keys": 1000, "lookup_s": 1.0},
        "systems": {
            "kvstore-shm": {"status": "ok", "version": "kvstore", "how": "shm"},
            "kvstore-tcp": {"status": "ok", "version": "kvstore", "how": "tcp"},
            "redis": {"status": "ok", "version": "redis", "how": "SET/GET"},
            "mooncake": {"status": "skipped", "reason": "cannot create a private network namespace"},
        },
        "sizes": {
            "64KiB": {
                "systems": {
                    "kvstore-shm": m(4.0, 5.0, 0.5),
                    "kvstore-tcp": m(2.0, 2.0, 0.6),
                    "redis": m(1.0, redis_get, redis_p50),
                }
            }
        },
        "lookup": {
            name: {
                "keys_per_lookup": 1000,
                "calls": 10,
                "keys_per_s": 1_000_000,
                "p50_ms": 1.0,
                "p99_ms": 1.0,
                "one_key_p50_ms": 0.5 if name.startswith("kvstore") else 0.1,
                "one_key_p99_ms": 0.6,
            }
            for name in ("kvstore-shm", "kvstore-tcp", "redis")
        },
    }
    r["comparisons"] = report.compare(r)
    r["losses"] = report.losses(r)
    return r


def test_report_says_where_kvstore_is_behind_and_by_how_much() -> None:
    r = _result(redis_get=2.5, redis_p50=0.1)
    tcp = [s for s in r["losses"] if s.startswith("kvstore tcp is behind Redis")]
    assert len(tcp) == 1
    assert "get at 64KiB (2.00 GB/s vs 2.50 GB/s, 20% lower)" in tcp[0]
    assert "get p50 at 64KiB (0.6 ms vs 0.1 ms, 6.0x longer)" in tcp[0]
    md = report.render(r, "peers_throughput.png")
    assert "Where kvstore is behind:" in md and tcp[0] in md
    assert "Mooncake (cannot create a private network namespace)" in md
    assert "| 64KiB | Redis | 1.00 | 2.50 |" in md
    # Why single gets are slower: the round trip, on the lookup port and over gRPC with mTLS.
    assert "p50 0.500 ms on the service's lookup port" in md and "against Redis 0.100 ms" in md
    assert "over gRPC with mTLS" not in md  # no kvstore-tls lookups in this result: not named


def test_report_without_losses() -> None:
    r = _result(redis_get=1.0, redis_p50=1.0)
    assert r["losses"] == []
    assert "kvstore is ahead of every measured peer on every metric" in report.render(r, None)
