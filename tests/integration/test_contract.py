"""The failure contract under races, with real processes: removals and re-puts of the same keys,
service restarts right after a removal, writers that never commit, the statuses of every
server for bad and unparseable input, and a full file system under the SSD tier.

Every block's bytes are derived from its key and a version, so a read that returned another
block's bytes (or an older version's) is caught.
"""

from __future__ import annotations

import math
import os
import random
import socket
import subprocess
import time

import grpc
import numpy as np
import pytest
import xxhash
from conftest import wait_until

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.daemon.arena import ShmArena
from kvstore.errors import InvalidArgument, ResourceExhausted, Unavailable, from_rpc_error
from kvstore.extent import HEADER_SIZE, Sealer, checksum
from kvstore.keys import pack_keys
from kvstore.transport.shm import ShmTransport
from kvstore.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc, meta_pb2, meta_pb2_grpc
from kvstore.wire import U8, U64, locations_from_pb, pack

KS = KeySpace(ModelFingerprint("contract-model", "bf16", 2, 2, 64))
BLOCK = 4096


def chain(n: int, start: int) -> list[bytes]:
    return KS.block_keys(np.arange(start * 16, (start + n) * 16))


def block(key: bytes, version: int = 0, size: int = BLOCK) -> np.ndarray:
    seed = xxhash.xxh64_intdigest(key + version.to_bytes(4, "little"))
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(meta: str, keys: list[bytes], version: int, transport: str) -> int:
    """How many leading blocks a reader gets; asserts each one holds exactly its bytes."""
    with SyncKVStoreClient(meta, ClientConfig(transport=transport)) as c:
        out = [np.zeros(BLOCK, np.uint8) for _ in keys]
        n = c.get_into(keys, out)
    for i in range(n):
        assert np.array_equal(out[i], block(keys[i], version)), f"block {i} holds other bytes ({transport})"
    return n


def restart_meta(cluster, meta, listen: str, *sets: str):
    meta.kill()
    cluster.procs.remove(meta)
    return cluster.start_meta(*sets, listen=listen)


# ---- 1. remove, then re-put the same keys ---------------------------------------------------------


def test_reput_after_remove_is_never_lost(cluster):
    """put(k); remove(k); put(k), 50 times, with delays from 0 to 1 s between the removal and
    the re-put (quadratically spaced: most fall inside one heartbeat, 0.5 s, where a late
    invalidation would strike): every re-put chain is served through shared memory and TCP,
    and still after a service restart. Removed bytes are never served in their place."""
    listen = f"127.0.0.1:{_free_port()}"
    hb = ("meta.heartbeat_interval_s=0.5",)
    meta = cluster.start_meta(*hb, listen=listen)
    cluster.start_daemon(dram="16MiB")
    lanes = 50
    chains = [chain(16, 1000 + 100 * i) for i in range(lanes)]
    with SyncKVStoreClient(cluster.meta_addr) as c:
        for i, keys in enumerate(chains):
            assert c.put(keys, [block(k, 0) for k in keys]).stored == 16
            assert c.remove(keys) == 16
            time.sleep((i / (lanes - 1)) ** 2)  # 0 .. 1 s
            assert c.put(keys, [block(k, 1) for k in keys]).stored == 16
    time.sleep(0.6)  # past a heartbeat: a late invalidation would have landed by now
    for transport in ("shm", "tcp"):
        lost = [i for i in range(lanes) if served(cluster.meta_addr, chains[i], 1, transport) != 16]
        assert not lost, f"{transport}: re-put chains not served: {lost}"
    restart_meta(cluster, meta, listen, *hb)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        wait_until(lambda: c.lookup(chains[-1]) == 16)
    for transport in ("shm", "tcp"):
        lost = [i for i in range(lanes) if served(cluster.meta_addr, chains[i], 1, transport) != 16]
        assert not lost, f"after restart, {transport}: re-put chains not served: {lost}"


# ---- 2. a restarted service resurrects nothing ----------------------------------------------------


def _forge_uncommitted(meta: str, keys: list[bytes]) -> None:
    """A writer that reserves space, writes payloads and headers of its own making (sealed with
    a secret of its own, or copied from a committed block), and never commits."""
    with grpc.insecure_channel(meta) as ch:
        resp = meta_pb2_grpc.MetaServiceStub(ch).PutStart(
            meta_pb2.PutStartRequest(keys=pack_keys(keys), sizes=pack([BLOCK] * len(keys), U64)), timeout=10
        )
    places = locations_from_pb(resp.placements, len(keys))
    seg = places[0].daemon.segments[0]
    arena = ShmArena(seg.shm_path, seg.capacity_bytes)
    forger = Sealer(os.urandom(32))
    try:
        for k, p in zip(keys, places):
            data = block(k, 7)
            arena.array[p.offset + HEADER_SIZE : p.offset + HEADER_SIZE + BLOCK] = data
            hdr = forger.pack(k, BLOCK, checksum(data), p.gen, p.offset)
            arena.array[p.offset : p.offset + HEADER_SIZE] = np.frombuffer(hdr, np.uint8)
    finally:
        arena.close()


def test_a_commit_of_bytes_never_written_is_never_served(cluster):
    """A writer that commits its reservation without writing the payloads as a writer does
    (other bytes than its checksums name; the right bytes without the write stamp, as a writer
    that died before it; nothing): a reader gets exactly the blocks written as promised, over
    shared memory and TCP, never the others' bytes. Blocks never stamped are refused at the
    commit; a stamped block whose read failed its checksum is reported and leaves the index."""
    cluster.start_meta()
    cluster.start_daemon(dram="64MiB")
    keys = chain(4, 700_000)
    with grpc.insecure_channel(cluster.meta_addr) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        resp = stub.PutStart(meta_pb2.PutStartRequest(keys=pack_keys(keys), sizes=pack([BLOCK] * 4, U64)), timeout=10)
        places = locations_from_pb(resp.placements, 4)
        seg = places[0].daemon.segments[0]
        arena = ShmArena(seg.shm_path, seg.capacity_bytes)
        try:  # block 0 written as promised, block 1 with other bytes, block 2 unstamped, block 3 never
            for i in (0, 1):
                assert ShmTransport.write(arena, places[i].offset, block(keys[i], i), places[i].gen)
            p = places[2]
            arena.array[p.offset + HEADER_SIZE : p.offset + HEADER_SIZE + BLOCK] = block(keys[2])
        finally:
            arena.close()
        sums = [checksum(block(k)) for k in keys]
        got = stub.PutCommit(meta_pb2.PutCommitRequest(put_id=resp.put_id, checksums=pack(sums, U64)), timeout=10)
        assert got.committed == 2  # the two stamped blocks; 2 and 3 refused by the daemon
    assert served(cluster.meta_addr, keys, 0, "tcp") == 1
    assert served(cluster.meta_addr, keys, 0, "shm") == 1
    for i in (1, 2, 3):
        for transport in ("shm", "tcp"):
            assert served(cluster.meta_addr, keys[i:], 0, transport) == 0, (i, transport)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.exists(keys) == [True, False, False, False]


def test_restart_after_remove_or_uncommitted_write_resurrects_nothing(cluster):
    """Remove, then SIGKILL the service 0 to 1 s later (60 removals over 12 restarts); and in
    each round a writer that wrote bytes and headers but never committed. After each restart
    (and after a daemon restart at the end) none of those blocks is found; every committed,
    not removed block is served byte-exact."""
    listen = f"127.0.0.1:{_free_port()}"
    meta = cluster.start_meta(listen=listen)
    daemon = cluster.start_daemon(dram="64MiB")
    rounds, per_round = 12, 5
    delays = [i / (rounds * per_round - 1) for i in range(rounds * per_round)]
    random.Random(1).shuffle(delays)
    removed: list[list[bytes]] = []
    forged: list[list[bytes]] = []
    kept: list[list[bytes]] = []
    for r in range(rounds):
        base = 100_000 + 1000 * r
        sets = [chain(8, base + 10 * j) for j in range(per_round)]
        keep = chain(8, base + 900)
        fake = chain(4, base + 800)
        with SyncKVStoreClient(cluster.meta_addr) as c:
            for keys in [*sets, keep]:
                assert c.put(keys, [block(k) for k in keys]).stored == 8
            _forge_uncommitted(cluster.meta_addr, fake)
            # Remove set j so that the kill follows it by delays[r * per_round + j].
            order = sorted(range(per_round), key=lambda j: -delays[r * per_round + j])
            t_kill = time.monotonic() + max(delays[r * per_round + j] for j in order)
            for j in order:
                time.sleep(max(0.0, t_kill - delays[r * per_round + j] - time.monotonic()))
                assert c.remove(sets[j]) == 8
        time.sleep(max(0.0, t_kill - time.monotonic()))
        meta = restart_meta(cluster, meta, listen)
        removed += sets
        forged.append(fake)
        kept.append(keep)
        with SyncKVStoreClient(cluster.meta_addr) as c:
            wait_until(lambda keep=keep: c.lookup(keep) == 8)  # the daemon re-registered
            back = [i for i, keys in enumerate(removed) if c.exists(keys) != [False] * 8]
            assert not back, f"round {r}: removed sets came back: {back}"
            assert all(c.exists(keys) == [False] * 4 for keys in forged), f"round {r}: uncommitted blocks visible"
    for keys in kept:
        assert served(cluster.meta_addr, keys, 0, "shm") == 8
        assert served(cluster.meta_addr, keys, 0, "tcp") == 8
    # A restarted daemon rescans its arena: still exactly the committed, not removed blocks.
    daemon.kill()
    cluster.procs.remove(daemon)
    name = daemon.info["daemon_id"]
    cluster.start_daemon(dram="64MiB", name=name)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        wait_until(lambda: all(c.lookup(keys) == 8 for keys in kept))
        assert not any(any(c.exists(keys)) for keys in removed + forged)
        s = c.stats()
        assert s.keys == 8 * rounds


# ---- 3. retryable conditions are UNAVAILABLE --------------------------------------------------------


def test_no_daemon_yet_or_all_excluded_is_unavailable_not_resource_exhausted(cluster):
    listen = f"127.0.0.1:{_free_port()}"
    # A 1 s heartbeat: the restarted service waits up to that long for the daemon to come back.
    meta = cluster.start_meta("meta.heartbeat_interval_s=1.0", "meta.daemon_ttl_s=10", listen=listen)
    d = cluster.start_daemon()
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(chain(2, 1), [block(k) for k in chain(2, 1)]).stored == 2
    with grpc.insecure_channel(cluster.meta_addr) as ch:
        with pytest.raises(grpc.RpcError) as err:
            meta_pb2_grpc.MetaServiceStub(ch).PutStart(
                meta_pb2.PutStartRequest(
                    keys=pack_keys(chain(1, 5)), sizes=pack([BLOCK], U64), exclude_daemons=[d.info["daemon_id"]]
                ),
                timeout=10,
            )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    meta = restart_meta(cluster, meta, listen, "meta.heartbeat_interval_s=1.0", "meta.daemon_ttl_s=10")
    codes: dict[str, int] = {}
    deadline = time.monotonic() + 20
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(retries=0)) as c:
        i = 0
        while time.monotonic() < deadline:
            keys = chain(1, 10 + i)
            i += 1
            try:
                c.put(keys, [block(keys[0])])
            except Unavailable:
                codes["UNAVAILABLE"] = codes.get("UNAVAILABLE", 0) + 1
                continue
            except ResourceExhausted:
                codes["RESOURCE_EXHAUSTED"] = codes.get("RESOURCE_EXHAUSTED", 0) + 1
                continue
            break
        else:
            pytest.fail(f"no put succeeded after the restart: {codes}")
    assert "RESOURCE_EXHAUSTED" not in codes, codes
    assert codes.get("UNAVAILABLE", 0) >= 1, "the window before re-registration was not observed"


# ---- 4. bad and unparseable input: INVALID_ARGUMENT, never UNKNOWN ---------------------------------


def _raw(ch: grpc.Channel, path: str, body: bytes) -> grpc.StatusCode:
    if path.endswith("/Watch"):  # server streaming: the first answer is enough
        stream = ch.unary_stream(path, request_serializer=None, response_deserializer=None)(body, timeout=10)
        try:
            next(stream)
        except grpc.RpcError as e:
            return e.code()
        finally:
            stream.cancel()
        return grpc.StatusCode.OK
    call = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
    try:
        call(body, timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _methods(pb2, service: str) -> list[tuple[str, type]]:
    from google.protobuf import message_factory

    desc = pb2.DESCRIPTOR.services_by_name[service]
    return [(f"/{desc.full_name}/{m.name}", message_factory.GetMessageClass(m.input_type)) for m in desc.methods]


def _bad_bodies(cls: type, rng: random.Random) -> list[bytes]:
    bodies = [rng.randbytes(rng.randint(1, 64)) for _ in range(12)]
    bodies += [b"\x0a\xff", b"\x08", b"\x12\x05ab", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"]
    for f in cls.DESCRIPTOR.fields:  # a string or bytes field holding invalid UTF-8, a truncated varint
        tag = (f.number << 3) | 2
        if f.number < 16:
            bodies.append(bytes([tag, 2, 0xC3, 0x28]))
            bodies.append(bytes([(f.number << 3) | 0, 0x80]))
    return bodies


def test_unparseable_requests_are_invalid_argument_on_every_server(store):
    rng = random.Random(4)
    with SyncKVStoreClient(store.meta_addr) as c:
        info = c.stats().daemons[0].info
    from grpc_health.v1 import health_pb2

    seen: dict[grpc.StatusCode, int] = {}
    services = [
        (store.meta_addr, meta_pb2, "MetaService"),
        (info.control_addr, daemon_pb2, "DaemonControl"),
        (store.meta_addr, health_pb2, "Health"),
        (info.control_addr, health_pb2, "Health"),
    ]
    for addr, pb2, service in services:
        with grpc.insecure_channel(addr) as ch:
            for path, cls in _methods(pb2, service):
                for body in _bad_bodies(cls, rng):
                    code = _raw(ch, path, body)
                    seen[code] = seen.get(code, 0) + 1
                    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (path, body.hex(), code)
    assert seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 50, seen
    from grpc_health.v1 import health_pb2_grpc

    for addr in (store.meta_addr, info.control_addr):  # health still answers well-formed requests
        with grpc.insecure_channel(addr) as ch:
            hstub = health_pb2_grpc.HealthStub(ch)
            assert hstub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1  # SERVING
            watch = hstub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(watch).status == 1
            watch.cancel()
    with SyncKVStoreClient(store.meta_addr) as c:  # the servers still work
        keys = chain(2, 77)
        assert c.put(keys, [block(k) for k in keys]).stored == 2
        assert served(store.meta_addr, keys, 0, "tcp") == 2


def _code(fn) -> grpc.StatusCode:  # noqa: ANN001
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_bad_values_are_invalid_argument_and_change_nothing(store):
    with SyncKVStoreClient(store.meta_addr) as c:
        info = c.stats().daemons[0].info
    with grpc.insecure_channel(store.meta_addr) as ch, grpc.insecure_channel(info.control_addr) as dch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        # A segment of tier 99.
        bad = common_pb2.DaemonInfo(
            daemon_id="fake", host_id="h", data_addr="127.0.0.1:1", control_addr="127.0.0.1:1",
            segments=[common_pb2.Segment(segment_id=1, tier=99, capacity_bytes=1 << 20)],
        )  # fmt: skip
        req = meta_pb2.RegisterDaemonRequest(daemon=bad)
        assert _code(lambda: stub.RegisterDaemon(req, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        # Move with 17-byte keys, and with columns that do not match the keys.
        dstub = daemon_pb2_grpc.DaemonControlStub(dch)
        assert (
            _code(lambda: dstub.Move(daemon_pb2.MoveRequest(keys=b"k" * 17), timeout=10))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        assert (
            _code(lambda: dstub.Commit(daemon_pb2.CommitRequest(keys=b"k" * 16, segment=b"\x01"), timeout=10))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        # AdvanceClock with NaN or infinity leaves the clock finite.
        for v in (math.nan, math.inf, -math.inf):
            req = meta_pb2.AdvanceClockRequest(seconds=v)
            assert _code(lambda req=req: stub.AdvanceClock(req, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        assert math.isfinite(stub.AdvanceClock(meta_pb2.AdvanceClockRequest(seconds=0), timeout=10).now)
        # PutCommit with written flags other than 0 and 1; the put then commits normally.
        keys = chain(2, 88)
        resp = stub.PutStart(meta_pb2.PutStartRequest(keys=pack_keys(keys), sizes=pack([BLOCK] * 2, U64)), timeout=10)
        places = locations_from_pb(resp.placements, 2)
        for flags in ([7, 1], [1, 255]):
            req = meta_pb2.PutCommitRequest(put_id=resp.put_id, checksums=pack([1, 2], U64), written=pack(flags, U8))
            code = _code(lambda req=req: stub.PutCommit(req, timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        seg = places[0].daemon.segments[0]
        arena = ShmArena(seg.shm_path, seg.capacity_bytes)
        sums = []
        for k, p in zip(keys, places):
            assert ShmTransport.write(arena, p.offset, block(k), p.gen)
            sums.append(checksum(block(k)))
        arena.close()
        done = stub.PutCommit(
            meta_pb2.PutCommitRequest(put_id=resp.put_id, checksums=pack(sums, U64), written=pack([1, 1], U8)),
            timeout=10,
        )
        assert done.committed == 2
    assert served(store.meta_addr, keys, 0, "tcp") == 2
    assert served(store.meta_addr, keys, 0, "shm") == 2
    # The client side maps the status back to the same typed error.
    with grpc.insecure_channel(store.meta_addr) as ch:
        with pytest.raises(grpc.RpcError) as err:
            meta_pb2_grpc.MetaServiceStub(ch).Lookup(meta_pb2.LookupRequest(keys=b"x" * 17), timeout=10)
    assert isinstance(from_rpc_error(err.value), InvalidArgument)


# ---- 5. a full file system under the SSD tier ------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MiB tmpfs (needs root and mount rights; skipped elsewhere)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(path) -> None:  # noqa: ANN001
    """Takes every free byte of the file system (unbuffered writes until ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (bytes(1 << 16), bytes(4096), b"\0"):
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                pass
    finally:
        os.close(fd)


def test_full_file_system_is_resource_exhausted_and_shutdown_is_clean(cluster, small_fs):
    from kvstore.procs import start

    log = cluster.tmp / "serve.log"
    with open(log, "wb") as err:
        child = start(
            ["serve", "--listen", "127.0.0.1:0", "--dram", "1MiB", "--data-dir", str(cluster.tmp / "data"),
             "--set", f"daemon.ssd_dir={small_fs / 'ssd'}", "--set", "daemon.ssd_bytes=16MiB",
             "--set", "daemon.daemon_id=fullfs", "--set", "meta.heartbeat_interval_s=0.1"],
            stderr=err,
        )  # fmt: skip
        try:
            meta = child.info["meta"]
            size = 64 << 10
            first = chain(8, 1)  # 512 KiB: fits in DRAM
            with SyncKVStoreClient(meta) as c:
                assert c.put(first, [block(k, 0, size) for k in first]).stored == 8
                _fill(small_fs / "filler")
                errors = {"RESOURCE_EXHAUSTED": 0, "UNAVAILABLE": 0, "stored": 0}
                for i in range(40):
                    keys = chain(4, 100 + 10 * i)
                    try:
                        errors["stored"] += c.put(keys, [block(k, 0, size) for k in keys]).stored
                    except ResourceExhausted:
                        errors["RESOURCE_EXHAUSTED"] += 1
                    except Unavailable:
                        errors["UNAVAILABLE"] += 1
                print("full-fs puts:", errors)
                assert errors["UNAVAILABLE"] == 0, errors
                assert errors["RESOURCE_EXHAUSTED"] > 0, errors
                # Reads are unaffected: whatever is indexed is served byte-exact.
                out = [np.zeros(size, np.uint8) for _ in first]
                n = c.get_into(first, out)
                assert all(np.array_equal(out[i], block(first[i], 0, size)) for i in range(n))
        finally:
            child.stop()
    assert child.proc.returncode == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]


# ---- an unreachable daemon: removal fails loudly, is delivered later, stalls nobody else ----------


def test_removal_while_the_daemon_lease_lapses_is_unavailable_and_brings_nothing_back(cluster):
    """The daemon stops answering and its lease lapses while a removal waits for it (the
    service forgets it and closes its channel under the call): the removal still answers
    UNAVAILABLE, it does not hang to the client's deadline, and the tombstones are kept, so
    the daemon's re-registration brings none of the removed blocks back."""
    import signal

    cluster.start_meta("meta.daemon_ttl_s=1.5", "meta.daemon_rpc_timeout_s=4")
    slow = cluster.start_daemon(dram="32MiB")
    victim = chain(6, 6000)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(victim, [block(k) for k in victim]).stored == 6
    slow.p.send_signal(signal.SIGSTOP)
    try:
        with SyncKVStoreClient(cluster.meta_addr, ClientConfig(rpc_timeout_s=20, retries=0)) as c:
            with pytest.raises(Unavailable, match="did not confirm"):
                c.remove(victim)
            wait_until(lambda: not c.stats().daemons, timeout=10)  # its lease lapsed
    finally:
        slow.p.send_signal(signal.SIGCONT)
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(location_cache=0)) as c:
        wait_until(lambda: len(c.stats().daemons) == 1, timeout=20)  # back, registered again
        assert c.exists(victim) == [False] * 6
        assert served(cluster.meta_addr, victim, 0, "shm") == 0
        assert served(cluster.meta_addr, victim, 0, "tcp") == 0


def test_removal_on_a_stalled_daemon_is_unavailable_then_delivered_by_heartbeat(cluster):
    """A daemon that stops answering (SIGSTOP; its lease is long, so it stays in the index):
    removing its blocks answers UNAVAILABLE instead of a false OK; puts that do not touch it
    are not held up by its pending tombstones; once it answers again its heartbeat takes them,
    and a service restart then does not bring the removed blocks back."""
    import signal

    listen = f"127.0.0.1:{_free_port()}"
    sets = ("meta.daemon_ttl_s=60", "meta.daemon_rpc_timeout_s=3")
    meta = cluster.start_meta(*sets, listen=listen)
    slow = cluster.start_daemon(dram="32MiB")
    victim = chain(6, 4000)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(victim, [block(k) for k in victim]).stored == 6  # the only daemon: lands there
    cluster.start_daemon(dram="256MiB")  # more free space: later puts go here
    slow.p.send_signal(signal.SIGSTOP)
    try:
        with SyncKVStoreClient(cluster.meta_addr) as c:
            with pytest.raises(Unavailable, match="did not confirm"):
                c.remove(victim)
            assert c.lookup(victim) == 0  # gone from the index at once
            other = chain(4, 5000)
            t = time.monotonic()
            assert c.put(other, [block(k) for k in other]).stored == 4
            assert time.monotonic() - t < 2.5, "a put that never touched the stalled daemon waited for it"
    finally:
        slow.p.send_signal(signal.SIGCONT)
    # Its next heartbeats carry the tombstones until it acknowledges them.
    from test_faults import _header_cleared

    wait_until(lambda: all(_header_cleared(cluster, k) for k in victim), timeout=20)
    restart_meta(cluster, meta, listen, *sets)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        wait_until(lambda: c.lookup(other) == 4)
        wait_until(lambda: len(c.stats().daemons) == 2)
        assert c.exists(victim) == [False] * 6
        assert served(cluster.meta_addr, other, 0, "tcp") == 4
