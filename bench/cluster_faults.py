"""The cluster fault suite: 3 hosts (network namespaces), 2 metadata shards x (primary, standby),
Redis with a replica and 3 Sentinels, a daemon per host, and clients in the root namespace
putting and reading blocks whose every byte is checked, through these faults in turn:

1. ``kill -9`` a shard's primary (the standby takes over; lookups measured until served again);
2. ``kill -9`` a daemon, then start it again (its shared-memory segment is reattached);
3. cut a host off (its link down for longer than a daemon lease), then bring it back;
4. ``kill -9`` the Redis primary (Sentinel promotes the replica);
5. a stale leader: a shard's leader paused (SIGSTOP) past its lease, a standby takes over, the
   old one resumed: a put it had handed out cannot be written or committed, and a control call
   with its epoch is refused by the daemon;
6. restart everything one by one (Redis replicas and Sentinels, shards, daemons).

Figures (:func:`run`): wrong bytes returned (must be 0), committed blocks lost per fault (after
the fault is over: 0 wherever a replica survived), seconds until lookups are served again after
a primary (or Redis) is killed, errors that were not typed (kvstore.errors), and the background
writer's puts and reads. Run by ``tests/cluster/test_faults.py`` (CI) and ``bench/cluster.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

BLOCK = 16 << 10
CHAIN = 4


class Checker:
    """Blocks the suite stored, and the reading that checks every byte of them."""

    def __init__(self, client, rng: np.random.Generator) -> None:  # noqa: ANN001
        self.c = client
        self.rng = rng
        self.chains: list[tuple[list[bytes], list[np.ndarray]]] = []
        self.wrong_bytes = 0
        self.untyped: list[str] = []
        self.typed = 0

    def put_chains(self, n: int) -> int:
        stored = 0
        for _ in range(n):
            keys = [self.rng.bytes(16) for _ in range(CHAIN)]
            bufs = [self.rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(CHAIN)]
            r = self.call(self.c.put, keys, bufs)
            if r is not None and r.stored == CHAIN:
                self.chains.append((keys, bufs))
                stored += CHAIN
        return stored

    def call(self, fn, *args):  # noqa: ANN001, ANN202
        from kvstore.errors import KVStoreError

        try:
            return fn(*args)
        except KVStoreError:
            self.typed += 1
            return None
        except Exception as e:  # noqa: BLE001 - counted: every error must be typed
            self.untyped.append(f"{type(e).__name__}: {e}")
            return None

    def verify(self) -> int:
        """Reads every stored block; returns how many are missing (each loaded one is compared
        byte for byte; a difference is counted in ``wrong_bytes``)."""
        missing = 0
        for keys, bufs in self.chains:
            out = [np.zeros(BLOCK, dtype=np.uint8) for _ in keys]
            n = self.call(self.c.get_into, keys, out)
            n = n or 0
            for a, b in zip(out[:n], bufs[:n]):
                self.wrong_bytes += int(np.count_nonzero(a != b))
            missing += CHAIN - n
        return missing

    def outage(self, window: float) -> float:
        """Lookups of every stored chain's head, again and again for ``window`` seconds after a
        fault: the longest time they were not answered with hits (from the fault on, or from
        the last answered one to the next), or inf if they were not answered at the end."""
        t0 = time.monotonic()
        heads = [keys[0] for keys, _ in self.chains]
        last_ok, worst, ok_now = t0, 0.0, False
        while time.monotonic() - t0 < window or not ok_now:
            if time.monotonic() - t0 > 4 * window:
                return float("inf")
            ok = self.call(self.c.exists, heads)
            now = time.monotonic()
            ok_now = ok is not None and all(ok)
            if ok_now:
                worst = max(worst, now - last_ok)
                last_ok = now
            time.sleep(0.02)
        return worst

    def settle(self, timeout: float) -> int:
        """Missing blocks once recovery is over (polls until none is missing, or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            missing = self.verify()
            if missing == 0 or time.monotonic() > deadline:
                return missing
            time.sleep(0.25)


class Writer(threading.Thread):
    """Background traffic through every fault: put a new chain, read it back, compare."""

    def __init__(self, make_client, seed: int) -> None:  # noqa: ANN001
        super().__init__(daemon=True)
        self.make_client = make_client
        self.seed = seed
        self.stop_ev = threading.Event()
        self.stats = {"puts": 0, "put_failed": 0, "reads": 0, "read_missed": 0, "wrong_bytes": 0, "untyped": 0}
        self.untyped: list[str] = []

    def run(self) -> None:
        from kvstore.errors import KVStoreError

        rng = np.random.default_rng(self.seed)
        with self.make_client() as c:
            while not self.stop_ev.is_set():
                keys = [rng.bytes(16) for _ in range(CHAIN)]
                bufs = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(CHAIN)]
                try:
                    r = c.put(keys, bufs)
                    self.stats["puts"] += 1
                    if r.stored != CHAIN:
                        self.stats["put_failed"] += 1
                        continue
                    out = [np.zeros(BLOCK, dtype=np.uint8) for _ in keys]
                    n = c.get_into(keys, out)
                    self.stats["reads"] += 1
                    self.stats["read_missed"] += int(n < CHAIN)
                    self.stats["wrong_bytes"] += sum(int(np.count_nonzero(a != b)) for a, b in zip(out[:n], bufs[:n]))
                    # Its blocks go again, so that the pool never fills: a block the suite
                    # checks must not leave by eviction and count as lost.
                    c.remove(keys)
                except KVStoreError:
                    self.stats["put_failed"] += 1
                    time.sleep(0.05)
                except Exception as e:  # noqa: BLE001 - counted: every error must be typed
                    self.stats["untyped"] += 1
                    self.untyped.append(f"{type(e).__name__}: {e}")
                    time.sleep(0.05)


def _stale_leader(tb, chk: Checker, shard: int) -> dict:  # noqa: ANN001
    """Pauses shard ``shard``'s leader past its lease; a put it handed out before the pause must
    change nothing after it resumes."""
    import grpc

    from kvstore.transport.tcp import TcpTransport
    from kvstore.v1 import daemon_pb2, daemon_pb2_grpc, meta_pb2, meta_pb2_grpc
    from kvstore.wire import U64, locations_from_pb, pack

    key = next(k for k in (chk.rng.bytes(16) for _ in range(10_000)) if _shard_of(tb, k) == shard)
    data = chk.rng.integers(0, 256, BLOCK, dtype=np.uint8)
    k, r = tb.leader_process(shard)
    old = tb.leaders()[shard]
    ch = grpc.insecure_channel(old.addr)
    stub = meta_pb2_grpc.MetaServiceStub(ch)
    start = stub.PutStart(
        meta_pb2.PutStartRequest(keys=key, sizes=pack([BLOCK], U64), host_id="client-root"), timeout=5
    )
    place = locations_from_pb(start.placements, 1)[0]
    tb.pause(tb.shards[(k, r)])
    t0 = time.monotonic()
    new = tb.wait_leaders(not_epochs={shard: old.epoch}, timeout=30)[shard]
    takeover = time.monotonic() - t0
    # Until the placement's daemon has registered with the new leader (it then refuses the old
    # epoch and the old leader's tickets): an empty invalidation with the new epoch passes.
    dch = grpc.insecure_channel(place.daemon.control_addr)
    dstub = daemon_pb2_grpc.DaemonControlStub(dch)
    deadline = time.monotonic() + 30
    while True:
        try:
            dstub.Invalidate(daemon_pb2.InvalidateRequest(shard=shard, epoch=new.epoch), timeout=5)
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    registered = time.monotonic() - t0
    tb.resume(tb.shards[(k, r)])
    out = {"takeover_s": round(takeover, 3), "daemon_registered_s": round(registered, 3)}
    tcp = TcpTransport(5.0)
    try:
        from kvstore.extent import checksum

        ok = tcp.write(
            place.daemon.data_addr,
            [(key, place.segment_id, place.offset, place.length, checksum(data), place.gen, place.ticket)],
            [data],
        )
        out["stale_write_accepted"] = bool(ok[0])
    except Exception as e:  # noqa: BLE001 - a refusal is what is expected
        out["stale_write_accepted"] = False
        out["stale_write_refusal"] = type(e).__name__
    finally:
        tcp.close()
    try:
        stub.PutCommit(
            meta_pb2.PutCommitRequest(put_id=start.put_id, checksums=pack([checksum(data)], U64), written=b"\x01"),
            timeout=5,
        )
        out["stale_commit_accepted"] = True
    except grpc.RpcError as e:
        out["stale_commit_accepted"] = False
        out["stale_commit_refusal"] = e.code().name
    ch.close()
    # A control call with the old epoch, straight to the daemon.
    try:
        dstub.Invalidate(daemon_pb2.InvalidateRequest(shard=shard, epoch=old.epoch), timeout=5)
        out["stale_control_accepted"] = True
    except grpc.RpcError as e:
        out["stale_control_accepted"] = False
        out["stale_control_refusal"] = e.code().name
    dch.close()
    with_key = chk.call(chk.c.exists, [key])
    out["stale_block_visible"] = bool(with_key and with_key[0])
    return out


def _shard_of(tb, key: bytes) -> int:  # noqa: ANN001
    from kvstore.cluster.slots import SlotMap

    return SlotMap.even(tb.nshards).shard_of(key)


def run(tmp: Path, chains: int = 60, log=print) -> dict:  # noqa: ANN001
    """Runs the suite; returns its figures."""
    from kvstore.client import SyncKVStoreClient
    from kvstore.cluster.testbed import Testbed

    figures: dict = {"faults": {}, "lookup_recovery_s": {}}
    with Testbed(tmp, hosts=3) as tb:
        tb.start_redis(sentinel=True)
        tb.start_shards(2)
        for h in range(3):
            tb.start_daemon(h, name=f"d{h}")
        make = lambda: SyncKVStoreClient(config=tb.client_config(location_cache=0))  # noqa: E731
        with make() as c:
            chk = Checker(c, np.random.default_rng(1))
            stored = chk.put_chains(chains)
            log(f"stored {stored} blocks in {len(chk.chains)} chains over 3 daemons and 2 shards")
            writer = Writer(make, seed=2)
            writer.start()

            def fault(name: str, recover: float = 30.0) -> None:
                lost = chk.settle(recover)
                figures["faults"][name] = {"lost_blocks": lost}
                log(f"{name}: lost {lost} blocks, wrong bytes so far {chk.wrong_bytes}")

            # 1. kill -9 a shard primary
            k, r = tb.leader_process(0)
            old = {0: tb.leaders()[0].epoch}
            tb.shards[(k, r)].kill()
            s = chk.outage(6.0)
            figures["lookup_recovery_s"]["shard_primary_killed"] = round(s, 3)
            tb.wait_leaders(not_epochs=old)
            fault("shard_primary_killed")
            tb.start_shard(k, r, tb.shard_hosts[(k, r)])  # back, as a standby

            # 2. kill -9 a daemon, then start it again (same segment)
            tb.daemons["d2"].kill()
            missing_while_down = chk.settle(3.0)
            tb.start_daemon(2, name="d2")
            fault("daemon_killed_and_restarted")
            figures["faults"]["daemon_killed_and_restarted"]["missing_while_down"] = missing_while_down

            # 3. cut a host off (longer than a daemon lease), then bring it back
            tb.hosts.link(2, False)
            time.sleep(3.0)
            missing_cut = chk.verify()
            tb.hosts.link(2, True)
            fault("host_cut_off")
            figures["faults"]["host_cut_off"]["missing_while_cut"] = missing_cut

            # 4. kill -9 the Redis primary (Sentinel promotes the replica)
            tb.redis[0].kill()
            s = chk.outage(15.0)
            figures["lookup_recovery_s"]["redis_primary_killed"] = round(s, 3)
            fault("redis_primary_killed", recover=60)

            # 5. a stale leader
            figures["stale_leader"] = _stale_leader(tb, chk, 1)
            fault("stale_leader")

            # 6. restart everything one by one: Redis (the servers that are not the primary now,
            # which fault 4 already killed once) and the Sentinels, shards, daemons
            figures["restarted_redis_and_sentinels"] = tb.restart_redis_replicas()
            for (k, r), child in list(tb.shards.items()):
                child.stop(10)
                tb.start_shard(k, r, tb.shard_hosts[(k, r)])
                tb.wait_leaders()
            for name in list(tb.daemons):
                tb.restart_daemon(name)
            fault("rolling_restart", recover=60)

            writer.stop_ev.set()
            writer.join(60)
        figures["wrong_bytes"] = chk.wrong_bytes + writer.stats["wrong_bytes"]
        figures["untyped_errors"] = len(chk.untyped) + writer.stats["untyped"]
        figures["untyped_examples"] = (chk.untyped + writer.untyped)[:5]
        figures["typed_errors"] = chk.typed
        figures["writer"] = writer.stats
        figures["stored_blocks"] = stored
    return figures
