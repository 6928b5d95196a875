"""Tenants, daemons and admins with credentials (meta.auth_file), against real processes: two
tenants with identical prompts never see each other's blocks, neither can remove, pin, release
or commit what is the other's, only a daemon may register (under its own id), only an admin
reads statistics or acts on a tenant's blocks, and a restarted service keeps them apart."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.errors import NotFound, PermissionDenied, ResourceExhausted, Unauthenticated, from_rpc_error
from kvstore.v1 import common_pb2, meta_pb2, meta_pb2_grpc

TOK = {n: f"{n}-token-0123456789abcdef" for n in ("a", "b", "node", "ops")}
KS = KeySpace(ModelFingerprint("tenants", "bf16", 2, 2, 64))  # the same key space: identical prompts
KEYS = KS.block_keys(np.arange(64))
DA = [np.full(5000, 11, np.uint8) for _ in KEYS]
DB = [np.full(5000, 22, np.uint8) for _ in KEYS]


ROLES = {"a": ("tenant-a", "tenant"), "b": ("tenant-b", "tenant"), "node": ("node", "daemon"), "ops": ("ops", "admin")}


def auth_file(path, *who: str):  # noqa: ANN001, ANN201
    """An auth file with the identities ``who`` (keys of TOK), each with its token."""
    lines = [f"  {ROLES[w][0]}: {{role: {ROLES[w][1]}, tokens: [{TOK[w]}]}}" for w in who]
    path.write_text("identities:\n" + "\n".join(lines) + "\n")
    return path


@pytest.fixture
def tenants(cluster, tmp_path):  # noqa: ANN001
    auth = auth_file(tmp_path / "auth.yaml", "a", "b", "node", "ops")
    cluster.start_meta(f"meta.auth_file={auth}")
    cluster.start_daemon(f"daemon.token={TOK['node']}", name="node")
    cluster.auth = auth
    return cluster


def client(cluster, who: str, transport: str = "auto") -> SyncKVStoreClient:  # noqa: ANN001
    return SyncKVStoreClient(cluster.meta_addr, ClientConfig(token=TOK[who], transport=transport, retries=0))


def get(c: SyncKVStoreClient) -> tuple[int, list[np.ndarray]]:
    out = [np.zeros(5000, np.uint8) for _ in KEYS]
    return c.get_into(KEYS, out), out


def raw(cluster, who: str | None, method: str, request):  # noqa: ANN001, ANN201
    md = [("authorization", f"Bearer {TOK[who]}")] if who else None
    with grpc.insecure_channel(cluster.meta_addr) as ch:
        try:
            return getattr(meta_pb2_grpc.MetaServiceStub(ch), method)(request, metadata=md, timeout=10)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_identical_prompts_of_two_tenants_never_meet(tenants, transport):
    with client(tenants, "a", transport) as a, client(tenants, "b", transport) as b:
        assert a.put(KEYS, DA).stored == len(KEYS)
        assert b.lookup(KEYS) == 0 and get(b)[0] == 0  # 0 cross-tenant hits
        assert b.put(KEYS, DB).stored == len(KEYS)  # dedup is per tenant: stored again
        n, out = get(a)
        assert n == len(KEYS) and all(np.array_equal(x, y) for x, y in zip(out, DA))
        n, out = get(b)
        assert n == len(KEYS) and all(np.array_equal(x, y) for x, y in zip(out, DB))
        # B removing and pinning "its" keys touches only its own blocks.
        assert b.remove(KEYS) == len(KEYS)
        assert get(a)[0] == len(KEYS) and get(b)[0] == 0


def test_leases_and_puts_are_their_owners(tenants):
    with client(tenants, "a") as a:
        assert a.put(KEYS, DA).stored == len(KEYS)
    lease = raw(tenants, "a", "Acquire", meta_pb2.AcquireRequest(keys=b"".join(KEYS)))
    assert lease.hit_count == len(KEYS) and len(lease.locations.keys) == 16 * len(KEYS)
    assert lease.locations.keys != b"".join(KEYS)  # stored under the tenant's keys, not the asked ones
    with pytest.raises(NotFound):
        raw(tenants, "b", "Release", meta_pb2.ReleaseRequest(lease_id=lease.lease_id))
    raw(tenants, "a", "Release", meta_pb2.ReleaseRequest(lease_id=lease.lease_id))
    other = KS.block_keys(np.arange(100, 116))[0]
    put = raw(tenants, "a", "PutStart", meta_pb2.PutStartRequest(keys=other, sizes=np.array([10], "<u8").tobytes()))
    for method, req in (("PutAbort", meta_pb2.PutAbortRequest(put_id=put.put_id)),
                        ("PutCommit", meta_pb2.PutCommitRequest(put_id=put.put_id, checksums=bytes(8)))):  # fmt: skip
        with pytest.raises(NotFound):
            raw(tenants, "b", method, req)
    raw(tenants, "a", "PutAbort", meta_pb2.PutAbortRequest(put_id=put.put_id))


def test_roles(tenants):
    info = common_pb2.DaemonInfo(daemon_id="node", host_id="h", data_addr="127.0.0.1:1", control_addr="127.0.0.1:1")
    with pytest.raises(Unauthenticated):
        raw(tenants, None, "Lookup", meta_pb2.LookupRequest(keys=KEYS[0]))
    with pytest.raises(Unauthenticated):
        SyncKVStoreClient(tenants.meta_addr, ClientConfig(token="wrong-token-0123456789", retries=0)).lookup(KEYS)
    with pytest.raises(PermissionDenied, match="needs: daemon"):
        raw(tenants, "a", "RegisterDaemon", meta_pb2.RegisterDaemonRequest(daemon=info))
    fake = common_pb2.DaemonInfo(daemon_id="other", host_id="h", data_addr="127.0.0.1:1", control_addr="127.0.0.1:1")
    with pytest.raises(PermissionDenied, match="only under its own id"):
        raw(tenants, "node", "RegisterDaemon", meta_pb2.RegisterDaemonRequest(daemon=fake))
    with pytest.raises(PermissionDenied, match="only for itself"):
        raw(tenants, "node", "Heartbeat", meta_pb2.HeartbeatRequest(daemon_id="other"))
    with pytest.raises(PermissionDenied):
        raw(tenants, "a", "Stats", meta_pb2.StatsRequest())
    with pytest.raises(PermissionDenied):
        raw(tenants, "a", "DrainDaemon", meta_pb2.DrainDaemonRequest(daemon_id="node"))
    with pytest.raises(PermissionDenied, match="only on its own blocks"):
        raw(tenants, "b", "Remove", meta_pb2.KeysRequest(keys=KEYS[0], tenant="tenant-a"))
    with pytest.raises(PermissionDenied):
        raw(tenants, "node", "Lookup", meta_pb2.LookupRequest(keys=KEYS[0]))
    assert raw(tenants, "ops", "Stats", meta_pb2.StatsRequest()).daemons[0].info.daemon_id == "node"


def test_an_admin_acts_on_a_tenants_blocks(tenants):
    with client(tenants, "a") as a:
        assert a.put(KEYS, DA).stored == len(KEYS)
        packed = b"".join(KEYS)
        assert raw(tenants, "ops", "Remove", meta_pb2.KeysRequest(keys=packed)).count == 0  # its own: none
        assert raw(tenants, "ops", "Remove", meta_pb2.KeysRequest(keys=packed, tenant="tenant-a")).count == len(KEYS)
        assert a.lookup(KEYS) == 0


def test_a_restarted_service_keeps_tenants_apart(tenants):
    with client(tenants, "a") as a:
        assert a.put(KEYS, DA).stored == len(KEYS)
    meta = tenants.procs[0]
    meta.stop()
    tenants.procs.remove(meta)
    port = tenants.meta_addr.rpartition(":")[2]
    tenants.start_meta(f"meta.auth_file={tenants.auth}", listen=f"127.0.0.1:{port}")
    import time

    deadline = time.monotonic() + 20
    with client(tenants, "a") as a, client(tenants, "b") as b:
        while a.lookup(KEYS) < len(KEYS) and time.monotonic() < deadline:  # the daemon re-registers
            time.sleep(0.1)
        n, out = get(a)
        assert n == len(KEYS) and all(np.array_equal(x, y) for x, y in zip(out, DA))
        assert get(b)[0] == 0


def test_quotas_bound_what_a_tenant_holds(cluster, tmp_path):
    auth = auth_file(tmp_path / "auth.yaml", "a", "b", "node")
    # Each tenant may hold 3 blocks' bytes leased and 2 pinned (blocks are 5000 bytes).
    cluster.start_meta(f"meta.auth_file={auth}", "meta.tenant_max_leased_bytes=15000",
                       "meta.tenant_max_pinned_bytes=10000")  # fmt: skip
    cluster.start_daemon(f"daemon.token={TOK['node']}", name="node")
    with client(cluster, "a") as a, client(cluster, "b") as b:
        assert a.put(KEYS, DA).stored == 4 and b.put(KEYS, DB).stored == 4
    keys = b"".join(KEYS)
    l1 = raw(cluster, "a", "Acquire", meta_pb2.AcquireRequest(keys=keys[:32]))  # 2 blocks
    with pytest.raises(ResourceExhausted, match="holds 10000 bytes in read leases"):
        raw(cluster, "a", "Acquire", meta_pb2.AcquireRequest(keys=keys[:32]))
    assert raw(cluster, "b", "Acquire", meta_pb2.AcquireRequest(keys=keys[:48])).hit_count == 3  # B's own quota
    raw(cluster, "a", "Release", meta_pb2.ReleaseRequest(lease_id=l1.lease_id))
    assert raw(cluster, "a", "Acquire", meta_pb2.AcquireRequest(keys=keys[:48])).hit_count == 3
    assert raw(cluster, "a", "Pin", meta_pb2.KeysRequest(keys=keys[:32])).count == 2
    with pytest.raises(ResourceExhausted, match="pins 10000 bytes"):
        raw(cluster, "a", "Pin", meta_pb2.KeysRequest(keys=keys[32:48]))
    assert raw(cluster, "a", "Unpin", meta_pb2.KeysRequest(keys=keys[:16])).count == 1
    assert raw(cluster, "a", "Pin", meta_pb2.KeysRequest(keys=keys[32:48])).count == 1


def test_engines_of_one_tenant_are_invisible_to_another(tenants):
    with client(tenants, "a") as a, client(tenants, "b") as b:
        assert a.report_engine_blocks("worker-0", "http://a", KEYS[:3], reset=True) == 3
        assert a.lookup_tiers(KEYS).device("worker-0") == 3
        assert b.lookup_tiers(KEYS).engines == {}  # the same prompt, another tenant: nothing
        # The same engine name in tenant b is another engine: it cannot reset or drop a's.
        assert b.report_engine_blocks("worker-0", "http://b", [], reset=True) == 0
        assert b.report_engine_blocks("worker-0", leave=True) == 0
        assert a.lookup_tiers(KEYS).device("worker-0") == 3


def test_a_service_with_tenants_offers_no_lookup_port(tenants):
    # The lookup port carries no identity: with tenants, lookups stay on authenticated gRPC.
    assert raw(tenants, "a", "Lookup", meta_pb2.LookupRequest(keys=b"".join(KEYS))).lookup_port == 0
    with client(tenants, "a") as c:
        c.lookup(KEYS)
        assert c._client.lookup_port is None


def test_without_tls_only_the_service_drives_a_daemon(tenants):
    """The daemon's control API obeys calls signed with the key it gave the service: a peer
    that reaches the control port can neither list the tenants' blocks, nor drop them, nor seal
    an extent under another key, unsigned or signed with a key of its own; the service's own
    commits and invalidations go through."""
    import os

    from kvstore import tickets
    from kvstore.v1 import daemon_pb2, daemon_pb2_grpc

    with client(tenants, "a") as a:
        assert a.put(KEYS, DA).stored == len(KEYS)  # the service's commits are accepted
    daemon = tenants.procs[1]
    calls = {
        "GetInventory": daemon_pb2.InventoryRequest(),
        "Invalidate": daemon_pb2.InvalidateRequest(shard=0),
        "Commit": daemon_pb2.CommitRequest(shard=0, keys=KEYS[0], segment=b"\x01\0\0\0", offset=bytes(8)),
        "Move": daemon_pb2.MoveRequest(shard=0),
        "Info": daemon_pb2.InfoRequest(),
    }
    with grpc.insecure_channel(f"127.0.0.1:{daemon.info['control_port']}") as ch:
        stub = daemon_pb2_grpc.DaemonControlStub(ch)
        for method, req in calls.items():
            body = req.SerializeToString(deterministic=True)
            for md in (None, tickets.sign_control(os.urandom(32), method, 0, body), [(tickets.CONTROL_MD, "0.1.zz")]):
                with pytest.raises(grpc.RpcError) as e:
                    getattr(stub, method)(req, metadata=md, timeout=10)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (method, md)
                assert "control API" in e.value.details() or "signature" in e.value.details()
    with client(tenants, "a") as a:
        n, out = get(a)
        assert n == len(KEYS) and all(np.array_equal(x, y) for x, y in zip(out, DA))
    # The service's invalidations are accepted: an admin's removal reaches the daemon at once.
    assert raw(tenants, "ops", "Remove", meta_pb2.KeysRequest(keys=b"".join(KEYS), tenant="tenant-a")).count == len(
        KEYS
    )
    assert "invalidate_failed" not in tenants.procs[0].log_path.read_text()
