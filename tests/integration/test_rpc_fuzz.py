"""Property-based fuzzing of every RPC of the metadata service and of the daemon's control API,
against real servers: random, malformed, oversized and extreme messages built from each
method's own protobuf descriptor. Every call ends in a typed status (never UNKNOWN or
INTERNAL: those are unhandled errors), no call hangs, both servers stay up, their memory stays
bounded, and the blocks stored before stay genuine.

``KVSTORE_FUZZ_EXAMPLES`` sets the examples per method (default 40); the figures are printed
at the end (``-s``) and asserted.
"""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.v1 import daemon_pb2, meta_pb2

EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "40"))
KS = KeySpace(ModelFingerprint("rpc-fuzz", "bf16", 2, 2, 64))
KEYS = KS.block_keys(np.arange(64))
DATA = [np.full(5000, 3 + i, np.uint8) for i in range(4)]
# AdvanceClock exists for deadline tests (meta.allow_clock_skew) and is refused in production.
SKIP = {"AdvanceClock"}
TYPED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNIMPLEMENTED,
}
FIGURES: dict[str, dict[str, int]] = {}

_INTS = {
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
}


def _repeated(f) -> bool:  # noqa: ANN001 - a FieldDescriptor
    rep = getattr(f, "is_repeated", None)
    return bool(rep) if rep is not None else f.label == F.LABEL_REPEATED


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, 1, 2, 15, 16, 4096, 1 << 20, 1 << 30, 2**32 - 1, 2**63 - 1, lo, hi, -1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def _bytes(stored: bool) -> st.SearchStrategy[bytes]:
    """Random bytes, and the shapes the service parses: packed 16-byte keys (with ``stored``,
    the stored ones among them), packed u64 and u8 arrays."""
    key = st.binary(min_size=16, max_size=16)
    keys = st.lists(st.sampled_from(KEYS[:4]) | key if stored else key, max_size=20).map(b"".join)
    u64 = st.lists(_ints(0, 2**64 - 1), max_size=20).map(lambda v: np.array(v, np.uint64).tobytes())
    return st.one_of(st.binary(max_size=200), keys, u64, st.binary(min_size=1, max_size=3))


def message(desc, depth: int = 0, stored: bool = True) -> st.SearchStrategy:  # noqa: ANN001 - a Descriptor
    """A strategy for random messages of ``desc`` (nested to depth 2, repeated up to 3); with
    ``stored``, key fields may name the blocks stored before the fuzz."""
    fields = {}
    for f in desc.fields:
        if f.type == F.TYPE_MESSAGE:
            if depth >= 2:
                continue
            one = message(f.message_type, depth + 1, stored)
        elif f.type == F.TYPE_ENUM:
            one = _ints(-(2**31), 2**31 - 1) | st.sampled_from([v.number for v in f.enum_type.values])
        elif f.type in _INTS:
            one = _ints(*_INTS[f.type])
        elif f.type == F.TYPE_BOOL:
            one = st.booleans()
        elif f.type == F.TYPE_BYTES:
            one = _bytes(stored)
        elif f.type == F.TYPE_STRING:
            one = st.text(max_size=40)
        elif f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
            one = st.floats(allow_nan=True, allow_infinity=True, width=32 if f.type == F.TYPE_FLOAT else 64)
        else:  # pragma: no cover - a new field type
            raise AssertionError(f"no strategy for field type {f.type}")
        fields[f.name] = st.lists(one, max_size=3) if _repeated(f) else one
    cls = _message_class(desc)
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: _build(cls, desc, kw))


def _message_class(desc):  # noqa: ANN001, ANN202
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(desc)


def _build(cls, desc, kw: dict):  # noqa: ANN001, ANN202
    msg = cls()
    for name, value in kw.items():
        f = desc.fields_by_name[name]
        if _repeated(f):
            if f.type == F.TYPE_MESSAGE:
                for v in value:
                    getattr(msg, name).add().CopyFrom(v)
            else:
                getattr(msg, name).extend(value)
        elif f.type == F.TYPE_MESSAGE:
            getattr(msg, name).CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


def methods(pb2, service: str) -> list[tuple[str, object, object]]:
    svc = pb2.DESCRIPTOR.services_by_name[service]
    return [(m.name, m.input_type, m.output_type) for m in svc.methods if m.name not in SKIP]


META = methods(meta_pb2, "MetaService")
DAEMON = methods(daemon_pb2, "DaemonControl")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):  # noqa: ANN001
    from tests.conftest import Cluster

    c = Cluster(tmp_path_factory.mktemp("rpc-fuzz"))
    try:
        c.start_meta()
        d = c.start_daemon("daemon.ssd_bytes=32MiB")
        with SyncKVStoreClient(c.meta_addr) as cl:
            assert cl.put(KEYS[:4], DATA).stored == 4
        c.daemon = d
        c.meta = c.procs[0]
        c.rss0 = {p.p.pid: _rss(p.p.pid) for p in c.procs}
        yield c
    finally:
        c.close()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) << 10


def _call(addr: str, service: str, name: str, out_desc, request) -> grpc.StatusCode:  # noqa: ANN001
    out_cls = _message_class(out_desc)
    with grpc.insecure_channel(addr) as ch:
        fn = ch.unary_unary(
            f"/kvstore.v1.{service}/{name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=out_cls.FromString,
        )
        try:
            fn(request, timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def _fuzz(servers, addr: str, service: str, name: str, in_desc, out_desc) -> None:  # noqa: ANN001
    fig = FIGURES.setdefault(f"{service}.{name}", {"examples": 0, "untyped": 0, "hangs": 0})

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    # Remove of a stored block is a legitimate removal, not damage: it gets other keys.
    @given(req=message(in_desc, stored=name != "Remove"))
    def run(req) -> None:  # noqa: ANN001
        code = _call(addr, service, name, out_desc, req)
        fig["examples"] += 1
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            fig["hangs"] += 1
        elif code not in TYPED:
            fig["untyped"] += 1
        assert code in TYPED, f"{service}.{name}({req!r}) ended in {code}"

    run()
    assert servers.meta.p.poll() is None and servers.daemon.p.poll() is None, "a server died"


@pytest.mark.parametrize("name,in_desc,out_desc", META, ids=[m[0] for m in META])
def test_meta_rpc_fuzz(servers, name, in_desc, out_desc):
    _fuzz(servers, servers.meta_addr, "MetaService", name, in_desc, out_desc)


@pytest.mark.parametrize("name,in_desc,out_desc", DAEMON, ids=[m[0] for m in DAEMON])
def test_daemon_rpc_fuzz(servers, name, in_desc, out_desc):
    with SyncKVStoreClient(servers.meta_addr) as c:
        addr = c.stats().daemons[0].info.control_addr
    _fuzz(servers, addr, "DaemonControl", name, in_desc, out_desc)


def test_after_the_fuzz_servers_serve_and_blocks_are_genuine(servers):
    with SyncKVStoreClient(servers.meta_addr) as c:
        out = [np.zeros(5000, np.uint8) for _ in range(4)]
        assert c.get_into(KEYS[:4], out) == 4
        assert all(np.array_equal(a, b) for a, b in zip(out, DATA))
    growth = {p.p.pid: _rss(p.p.pid) - servers.rss0[p.p.pid] for p in servers.procs}
    total = sum(f["examples"] for f in FIGURES.values())
    print(
        f"\nrpc fuzz: {len(FIGURES)} methods, {total} examples, untyped "
        f"{sum(f['untyped'] for f in FIGURES.values())}, hangs {sum(f['hangs'] for f in FIGURES.values())}, "
        f"RSS growth MiB {[round(g / 2**20, 1) for g in growth.values()]}"
    )
    for name, f in sorted(FIGURES.items()):
        print(f"  {name:32s} examples {f['examples']:4d}  untyped {f['untyped']}  hangs {f['hangs']}")
    assert len(FIGURES) == len(META) + len(DAEMON)
    assert all(f["examples"] >= 1 and f["untyped"] == 0 and f["hangs"] == 0 for f in FIGURES.values())
    assert all(g < 256 << 20 for g in growth.values()), growth
