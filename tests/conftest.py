"""Shared fixtures: real ``kvstore`` processes on loopback ephemeral ports.

Servers print ``READY {json}`` once they accept requests; :class:`Proc` waits for that line
with a deadline (never a fixed sleep), through :func:`kvstore.procs.start`. Daemons' shared-memory files are removed on teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.daemon.arena import remove_files
from kvstore.procs import Child, start

REPO = Path(__file__).resolve().parent.parent
FAST = [
    "meta.heartbeat_interval_s=0.1",
    "meta.daemon_ttl_s=1.5",
    "meta.sweep_interval_s=0.05",
    "meta.allow_clock_skew=true",
]


class Proc:
    """A ``kvstore`` subcommand running as a separate process (see :func:`kvstore.procs.start`)."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.child: Child | None = None
        self.info: dict = {}

    def wait_ready(self, timeout: float = 30.0) -> dict:
        try:
            self.child = start(self.args, timeout=timeout, stderr=self._log, cwd=REPO)
        except RuntimeError:
            raise RuntimeError(
                f"kvstore {' '.join(self.args)} not ready; log:\n{self.log_path.read_text()[-3000:]}"
            ) from None
        self.info = self.child.info
        return self.info

    @property
    def p(self):  # noqa: ANN201 - the Popen, for tests that signal it
        return self.child.proc  # type: ignore[union-attr]

    def kill(self) -> None:
        if self.child is not None and self.child.alive():
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(10)

    def stop(self) -> None:
        if self.child is not None and self.child.alive():
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


class Cluster:
    """Starts metadata services and daemons for one test and tears them all down."""

    def __init__(self, tmp: Path, meta_sets: tuple[str, ...] | None = None) -> None:
        self.tmp = tmp
        # Settings of every metadata service this cluster starts; by default those of
        # KVSTORE_TEST_META_SETS (space-separated), to run a whole suite on other settings
        # (e.g. "meta.cache_policy=lru").
        self.meta_sets = tuple(os.environ.get("KVSTORE_TEST_META_SETS", "").split()) if meta_sets is None else meta_sets
        self.procs: list[Proc] = []
        self.shm_paths: list[str] = []
        self.meta_addr = ""

    def start_meta(self, *sets: str, listen: str = "127.0.0.1:0") -> Proc:
        p = Proc(
            ["meta", "--listen", listen, *[a for s in (*FAST, *self.meta_sets, *sets) for a in ("--set", s)]],
            self.tmp / "meta.log",
        )
        self.procs.append(p)
        self.meta_addr = p.wait_ready()["meta"]
        return p

    def start_daemon(self, *sets: str, dram: str = "64MiB", name: str | None = None, host_id: str = "") -> Proc:
        name = name or f"t{uuid.uuid4().hex[:10]}"
        data_dir = self.tmp / f"daemon-{name}"
        args = ["daemon", "--meta", self.meta_addr, "--dram", dram, "--data-dir", str(data_dir),
                "--set", f"daemon.daemon_id={name}"]  # fmt: skip
        if host_id:
            args += ["--set", f"daemon.host_id={host_id}"]
        for s in sets:
            args += ["--set", s]
        p = Proc(args, self.tmp / f"daemon-{name}.log")
        self.procs.append(p)
        info = p.wait_ready()
        self.shm_paths.append(info["shm_path"])
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        for path in self.shm_paths:
            remove_files(path)
            try:
                os.unlink(path.removesuffix("-dram") + "-staging")
            except FileNotFoundError:
                pass

    def wait_served(self, timeout: float = 15.0) -> None:
        """Until every daemon started serves its DRAM segment to reads without a lease (from its
        first heartbeat after registering, kvstore.daemon.arena)."""
        from kvstore.daemon.arena import ShmArena

        for path in self.shm_paths:
            if os.path.exists(path):
                probe = ShmArena(path, os.path.getsize(path))
                try:
                    wait_until(probe.served, timeout)
                finally:
                    probe.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def store(cluster: Cluster) -> Cluster:
    """One metadata service and one 64 MiB daemon."""
    cluster.start_meta()
    cluster.start_daemon()
    return cluster


def wait_until(pred: Callable[[], bool], timeout: float = 15.0, interval: float = 0.02) -> None:
    """Polls ``pred`` until it holds; fails the test at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


def raw_call(meta: str, method: str, request):  # noqa: ANN001, ANN201
    """One MetaService call with a raw request message; a failure raises the typed error."""
    import grpc

    from kvstore.errors import from_rpc_error
    from kvstore.v1 import meta_pb2_grpc

    with grpc.insecure_channel(meta) as ch:
        try:
            return getattr(meta_pb2_grpc.MetaServiceStub(ch), method)(request, timeout=10)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


def recv_all(sock, n: int) -> bytes:  # noqa: ANN001 - a socket
    """Exactly ``n`` bytes from ``sock``; asserts that the peer does not close first."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"connection closed after {len(out)} of {n} bytes"
        out.extend(chunk)
    return bytes(out)


def locations(meta: str, keys: list[bytes]) -> list:
    """Where the service says the leading stored run of ``keys`` lives (Lookup with locations)."""
    import grpc

    from kvstore.keys import pack_keys
    from kvstore.v1 import meta_pb2, meta_pb2_grpc
    from kvstore.wire import locations_from_pb

    with grpc.insecure_channel(meta) as ch:
        resp = meta_pb2_grpc.MetaServiceStub(ch).Lookup(
            meta_pb2.LookupRequest(keys=pack_keys(keys), with_locations=True), timeout=10
        )
    return locations_from_pb(resp.locations, resp.hit_count)


def flip_byte(path: str | Path, offset: int, mask: int = 0x40) -> None:
    """Flips bits of one stored byte in place (a daemon's segment file): silent corruption."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
