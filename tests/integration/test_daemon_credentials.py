"""A daemon's credentials with a service that has identities (meta.auth_file), against real
processes: the embedded store (`kvstore serve`) trusts its own daemon with an auth file that
lists only tenants, and serves them apart; no other process can pass for that daemon; a separate
daemon without credentials, or with a tenant's, stops at once with an error that names the
settings, and leaves no shared memory behind."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, Proc, wait_until

from kvstore import SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.daemon.arena import remove_files
from tests.integration.test_tenants import DA, DB, KEYS, TOK, auth_file


def _get(c: SyncKVStoreClient) -> tuple[int, list[np.ndarray]]:
    out = [np.zeros(5000, np.uint8) for _ in KEYS]
    return c.get_into(KEYS, out), out


def _daemon(meta: str, tmp_path, *sets: str) -> subprocess.CompletedProcess:  # noqa: ANN001
    """`kvstore daemon` expected to stop on its own (no READY line)."""
    args = ["daemon", "--meta", meta, "--dram", "8MiB", "--data-dir", str(tmp_path / "lone"),
            "--set", f"daemon.shm_dir={tmp_path / 'lone-shm'}"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=60
    )


@pytest.fixture
def embedded(tmp_path):  # noqa: ANN001, ANN201
    """`kvstore serve` with an auth file of two tenants, nothing else."""
    auth = auth_file(tmp_path / "auth.yaml", "a", "b")
    p = Proc(
        ["serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), "--dram", "32MiB",
         "--set", f"meta.auth_file={auth}", "--set", f"daemon.shm_dir={tmp_path / 'shm'}"],
        tmp_path / "serve.log",
    )  # fmt: skip
    try:
        p.wait_ready()
        yield p
    finally:
        p.stop()
        if p.info.get("shm_path"):
            remove_files(p.info["shm_path"])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_serve_with_an_auth_file_of_tenants_only_serves_them_apart(embedded, transport):
    meta = embedded.info["meta"]

    def client(who: str) -> SyncKVStoreClient:
        return SyncKVStoreClient(meta, ClientConfig(token=TOK[who], transport=transport, retries=0))

    with client("a") as a, client("b") as b:
        assert a.put(KEYS, DA).stored == len(KEYS)
        assert b.lookup(KEYS) == 0 and _get(b)[0] == 0
        assert b.put(KEYS, DB).stored == len(KEYS)
        for c, want in ((a, DA), (b, DB)):
            n, out = _get(c)
            assert n == len(KEYS) and all(np.array_equal(x, y) for x, y in zip(out, want))
        assert b.remove(KEYS) == len(KEYS)
        assert _get(a)[0] == len(KEYS) and _get(b)[0] == 0
    assert "UNAUTHENTICATED" not in embedded.log_path.read_text()


def test_no_other_process_passes_for_the_embedded_daemon(embedded, tmp_path):
    # Its own id, no token: the trust the serving process gives its daemon is not the id's.
    r = _daemon(embedded.info["meta"], tmp_path, f"daemon.daemon_id={embedded.info['daemon_id']}")
    assert r.returncode == 1 and "READY" not in r.stdout
    assert "Unauthenticated" in r.stderr and "daemon.token is not set" in r.stderr, r.stderr[-2000:]


def test_a_daemon_without_credentials_stops_with_the_settings_named(cluster, tmp_path):
    cluster.start_meta(f"meta.auth_file={auth_file(tmp_path / 'auth.yaml', 'a', 'node')}")
    r = _daemon(cluster.meta_addr, tmp_path, "daemon.daemon_id=lone")
    assert r.returncode == 1 and "READY" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvstore: Unauthenticated:"), r.stderr[-2000:]
    assert "daemon.token is not set" in last and "daemon.daemon_id=lone" in last and "meta.auth_file" in last
    assert "event=registration_refused" in r.stderr and r.stderr.count("event=registration_refused") == 1
    # A token the service does not know, and a tenant's: each named as such.
    r = _daemon(cluster.meta_addr, tmp_path, "daemon.daemon_id=lone", "daemon.token=not-a-known-token-0123456789")
    assert r.returncode == 1 and "daemon.token is not one the service knows" in r.stderr
    r = _daemon(cluster.meta_addr, tmp_path, "daemon.daemon_id=lone", f"daemon.token={TOK['a']}")
    assert r.returncode == 1 and "kvstore: PermissionDenied:" in r.stderr and "role: daemon" in r.stderr
    # A segment made by a daemon that never registered holds nothing: it is not left behind.
    assert not os.path.exists(tmp_path / "lone-shm" / "kvstore-lone-dram")
    # With its identity's token it registers and serves.
    cluster.start_daemon(f"daemon.token={TOK['node']}", name="node")


def test_a_registered_daemon_refused_later_waits_and_comes_back(cluster, tmp_path):
    """The service restarts with identities that no longer list the daemon: the daemon keeps
    running (and its segment), says why it is refused, and registers again once the service
    knows it again."""
    listed = auth_file(tmp_path / "auth.yaml", "a", "node")
    cluster.start_meta(f"meta.auth_file={listed}")
    daemon = cluster.start_daemon(f"daemon.token={TOK['node']}", name="node")
    port = cluster.meta_addr.rpartition(":")[2]

    def restart(auth) -> None:  # noqa: ANN001
        meta = next(p for p in cluster.procs if p.args[0] == "meta")
        meta.stop()
        cluster.procs.remove(meta)
        cluster.start_meta(f"meta.auth_file={auth}", listen=f"127.0.0.1:{port}")

    restart(auth_file(tmp_path / "tenants.yaml", "a"))
    wait_until(lambda: "event=credentials_refused" in daemon.log_path.read_text(), 30)
    assert daemon.child.alive() and "daemon.token is not one the service knows" in daemon.log_path.read_text()
    restart(listed)
    wait_until(lambda: daemon.log_path.read_text().count("event=registered ") >= 2, 60)
    assert daemon.child.alive()
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(token=TOK["a"], retries=0)) as a:
        assert a.put(KEYS, DA).stored == len(KEYS) and _get(a)[0] == len(KEYS)
