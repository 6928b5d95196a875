"""What an operator sees, with real processes: Prometheus /metrics of the metadata service and
of daemons (parsed with prometheus-client's own parser; counters move as a client works),
gRPC reflection, structured JSON logs with request ids, and a SIGTERM drain of a daemon during
reads (no read that started before it fails; its blocks leave the index at once)."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig
from tests.conftest import wait_until

FP = ModelFingerprint("obs-test", "float16", 2, 2, 64, 16)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """name, sorted labels -> value, from GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, lbl), v in m.items() if n == name and set(labels.items()) <= set(lbl))


def blocks_for(n: int, size: int, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    keys = KeySpace(FP, namespace=f"obs-{seed}").block_keys(list(range(n * 16)))
    data = [np.frombuffer(k * (size // 16), np.uint8).copy() for k in keys]  # bytes derived from the key
    return keys, data


def test_serve_exports_service_and_daemon_metrics_that_move(cluster):
    p = cluster.start_meta("meta.metrics_port=0")
    mport = p.info["metrics_port"]
    d = cluster.start_daemon("daemon.metrics_port=0")
    dport = d.info["metrics_port"]
    before, dbefore = scrape(mport), scrape(dport)
    assert value(before, "kvstore_meta_daemon_up", daemon=d.info["daemon_id"]) == 1.0
    assert value(dbefore, "kvstore_daemon_registered", daemon=d.info["daemon_id"]) == 1.0
    keys, data = blocks_for(8, 64 << 10)
    cfg = ClientConfig(meta=cluster.meta_addr, transport="tcp")
    with SyncKVStoreClient(config=cfg) as c:
        assert c.put(keys, data).stored == 8
        out = [np.empty_like(b) for b in data]
        assert c.get_into(keys, out) == 8
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        other, _ = blocks_for(4, 64 << 10, seed=1)
        assert c.get_into(other, [np.empty(64 << 10, np.uint8)] * 4) == 0
    after, dafter = scrape(mport), scrape(dport)
    rpc = "kvstore_rpc_duration_seconds_count"
    for method in ("PutStart", "PutCommit", "Acquire", "Release"):
        assert value(after, rpc, method=method) > value(before, rpc, method=method), method
    assert value(after, "kvstore_meta_put_keys_total") - value(before, "kvstore_meta_put_keys_total") == 8
    assert (
        value(after, "kvstore_meta_hits_total", tier="dram") - value(before, "kvstore_meta_hits_total", tier="dram")
        == 8
    )
    assert value(after, "kvstore_meta_misses_total") - value(before, "kvstore_meta_misses_total") >= 4
    assert value(after, "kvstore_meta_keys") == 8
    assert value(after, "kvstore_meta_not_admitted_keys_total") == 0  # a roomy pool stores everything
    assert value(after, "kvstore_meta_policy_frequency_mode") in (0, 1)
    # No eviction yet: each shadow's calibration is its prior (1 for recency, recency's for the others).
    assert value(after, "kvstore_meta_policy_calibration", mode="recency") == 1.0
    assert value(after, "kvstore_meta_policy_calibration", mode="frequency") == 1.0
    assert value(after, "kvstore_meta_policy_calibration", mode="second_chance") == 1.0
    assert value(after, "kvstore_meta_policy_second_chance_mode") == 0  # it starts in recency mode
    assert value(after, "kvstore_meta_segment_used_bytes", tier="dram") >= 8 * (64 << 10)
    # The daemon moved the bytes over TCP and committed the blocks.
    moved = lambda m, direction: value(m, "kvstore_daemon_bytes_total", transport="tcp", direction=direction)  # noqa: E731
    assert moved(dafter, "write") - moved(dbefore, "write") == 8 * (64 << 10)
    assert moved(dafter, "read") - moved(dbefore, "read") == 8 * (64 << 10)
    assert value(dafter, "kvstore_daemon_commits_total") - value(dbefore, "kvstore_daemon_commits_total") == 8
    assert value(dafter, rpc, method="Commit") > value(dbefore, rpc, method="Commit")
    # Errors are counted by code: a commit of an unknown put is NOT_FOUND or FAILED_PRECONDITION.
    with SyncKVStoreClient(config=cfg) as c:
        from kvstore.v1 import meta_pb2

        with pytest.raises(Exception):  # noqa: B017 - the code is what is checked below
            c._run(c._client._rpc(c._client._stub.PutCommit, meta_pb2.PutCommitRequest(put_id=12345)))
    errs = scrape(mport)
    assert value(errs, "kvstore_rpc_errors_total", method="PutCommit") >= 1
    # An aborted put's extents are held back until its write tickets lapse, and shown as such.
    assert value(errs, "kvstore_meta_segment_held_bytes", tier="dram") == 0
    with SyncKVStoreClient(config=cfg) as c:
        from kvstore.keys import pack_keys
        from kvstore.wire import U64, pack

        more, _ = blocks_for(2, 64 << 10, seed=2)
        req = meta_pb2.PutStartRequest(keys=pack_keys(more), sizes=pack([64 << 10] * 2, U64))
        put = c._run(c._client._rpc(c._client._stub.PutStart, req))
        c._run(c._client._rpc(c._client._stub.PutAbort, meta_pb2.PutAbortRequest(put_id=put.put_id)))
    assert value(scrape(mport), "kvstore_meta_segment_held_bytes", tier="dram") >= 2 * (64 << 10)


def test_kvstore_serve_exposes_both_on_one_port(tmp_path):
    from kvstore.procs import start

    child = start(["serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), "--dram", "32MiB",
                   "--metrics-port", "0"])  # fmt: skip
    try:
        m = scrape(child.info["metrics_port"])
        assert value(m, "kvstore_meta_daemon_up", daemon=child.info["daemon_id"]) == 1.0
        assert value(m, "kvstore_daemon_registered", daemon=child.info["daemon_id"]) == 1.0
        assert value(m, "kvstore_rpc_duration_seconds_count", method="RegisterDaemon") >= 1
    finally:
        child.stop()


def test_reflection_lists_the_services(store):
    addr = store.meta_addr
    daemon = store.procs[-1].info
    for target, want in (
        (addr, "kvstore.v1.MetaService"),
        (f"127.0.0.1:{daemon['control_port']}", "kvstore.v1.DaemonControl"),
    ):
        with grpc.insecure_channel(target) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            resp = next(
                iter(
                    stub.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
                    )
                )
            )
            names = {s.name for s in resp.list_services_response.service}
            assert {want, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_json_logs_carry_request_ids_and_one_line_per_failed_request(cluster):
    p = cluster.start_meta("log.format=json")
    from kvstore.v1 import meta_pb2

    with SyncKVStoreClient(cluster.meta_addr) as c:
        with pytest.raises(Exception):  # noqa: B017
            c._run(c._client._rpc(c._client._stub.PutCommit, meta_pb2.PutCommitRequest(put_id=777)))
    p.stop()
    lines = [json.loads(line) for line in p.log_path.read_text().splitlines() if line.startswith("{")]
    assert lines, "no JSON log lines"
    assert all({"ts", "level", "logger", "msg"} <= set(x) for x in lines)
    failed = [x for x in lines if x.get("event") == "rpc_failed"]
    assert len(failed) == 1, failed
    f = failed[0]
    assert f["rpc"] == "PutCommit" and f["put_id"] == 777 and f["request_id"] and f["code"]
    assert any(x.get("event") == "meta_started" for x in lines)


def test_sigterm_drain_serves_reads_in_flight_and_blocks_leave_the_index(cluster):
    cluster.start_meta()
    d = cluster.start_daemon(dram="256MiB")
    did = d.info["daemon_id"]
    keys, data = blocks_for(48, 1 << 20)  # 48 MiB: a get over TCP takes a while
    with SyncKVStoreClient(config=ClientConfig(meta=cluster.meta_addr)) as c:
        assert c.put(keys, data).stored == 48
    results: list[tuple[float, float, int | Exception]] = []
    stop = threading.Event()

    def reader(transport: str) -> None:
        with SyncKVStoreClient(config=ClientConfig(meta=cluster.meta_addr, transport=transport)) as c:
            out = [np.empty_like(b) for b in data]
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    n = c.get_into(keys, out)
                    ok = all(np.array_equal(out[i], data[i]) for i in range(n))
                    results.append((t0, time.monotonic(), n if ok else RuntimeError("wrong bytes")))
                except Exception as e:  # noqa: BLE001 - recorded, asserted below
                    results.append((t0, time.monotonic(), e))

    threads = [threading.Thread(target=reader, args=(t,)) for t in ("tcp", "shm")]
    for t in threads:
        t.start()
    wait_until(lambda: len(results) >= 4, timeout=30)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        t_sig = time.monotonic()
        d.p.send_signal(signal.SIGTERM)
        # Its blocks leave the index through the drain, not at the lease TTL (1.5 s here).
        wait_until(lambda: c.stats().keys == 0, timeout=10, interval=0.01)
        s = c.stats()
        assert did not in {x.info.daemon_id for x in s.daemons}
        assert s.counters["daemons_drained"] == 1 and s.counters["daemons_lost"] == 0
    d.p.wait(30)
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(60)
    started_before = [r for r in results if r[0] < t_sig]
    assert started_before, "no read overlapped the drain"
    for _t0, _t1, r in started_before:
        assert r == 48, f"a read that started before SIGTERM got {r!r}"
    # Reads after it: never an error, never wrong bytes; reads from known locations are served
    # through the grace (daemon.drain_direct_grace_s, 1 s), and are misses once it has passed.
    for t0, _t1, r in results:
        assert isinstance(r, int), r
        if t0 > t_sig + 1.0 + 0.1:
            assert r == 0, r
    assert any(t0 > t_sig + 1.1 for t0, _t1, _r in results), "no read came after the grace"
    assert d.p.returncode == 0
    log = d.log_path.read_text()
    assert "event=draining" in log and "event=drained" in log


def test_health_follows_the_service_contact(cluster):
    """A daemon reports NOT_SERVING while the service cannot hear it (service killed) for a
    lease, and SERVING again once it re-registered with a new service on the same port."""
    meta = cluster.start_meta()
    d = cluster.start_daemon()
    ctl = f"127.0.0.1:{d.info['control_port']}"

    def status() -> int:
        with grpc.insecure_channel(ctl) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status

    assert status() == health_pb2.HealthCheckResponse.SERVING
    addr = cluster.meta_addr
    meta.kill()
    cluster.procs.remove(meta)
    wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10)
    cluster.start_meta(listen=addr)
    wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=15)


def test_liveness_stays_serving_while_readiness_follows_the_service(cluster):
    meta = cluster.start_meta()
    d = cluster.start_daemon()
    ctl = f"127.0.0.1:{d.info['control_port']}"

    def status(service: str) -> int:
        with grpc.insecure_channel(ctl) as ch:
            req = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status

    meta.kill()
    wait_until(lambda: status("") == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10)
    assert status("kvstore.liveness") == health_pb2.HealthCheckResponse.SERVING


def test_a_retired_daemon_removes_its_segment_after_the_drain(cluster):
    import os

    cluster.start_meta()
    keep = cluster.start_daemon()
    gone = cluster.start_daemon("daemon.remove_segment_on_drain=true")
    for p in (keep, gone):
        p.p.send_signal(signal.SIGTERM)
        assert p.p.wait(30) == 0
    assert os.path.exists(keep.info["shm_path"])  # kept for a warm restart
    assert not os.path.exists(gone.info["shm_path"])
