"""`kvstore shm list` and `kvstore shm clean` against real daemons: a live daemon's segment is
held and a killed one's stale (liveness from the daemon's lock), with the daemon id and data
directory each was started with; `clean --dry-run` removes nothing, `clean` removes only the
stale one and the live daemon serves on; a daemon stopped with SIGTERM says in its log what it
kept and how to remove it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from conftest import REPO

from kvstore import SyncKVStoreClient


def shm(tmp_path, *args: str) -> dict:  # noqa: ANN001
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "shm", *args, "--shm-dir", str(tmp_path / "shm"), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def by_daemon(regions: list[dict]) -> dict[str, dict]:
    return {r["daemon_id"]: r for r in regions if r["kind"] == "dram"}


def test_list_tells_held_from_stale_and_clean_removes_only_stale(cluster, tmp_path):
    shm_dir = tmp_path / "shm"
    cluster.start_meta()
    live = cluster.start_daemon(f"daemon.shm_dir={shm_dir}", name="live")
    dead = cluster.start_daemon(f"daemon.shm_dir={shm_dir}", name="dead")
    dead.kill()  # SIGKILL: its lock goes with the process, its files stay

    regions = by_daemon(shm(tmp_path, "list")["regions"])
    assert regions.keys() == {"live", "dead"}
    assert regions["live"]["state"] == "held" and regions["dead"]["state"] == "stale"
    for name, proc in (("live", live), ("dead", dead)):
        r = regions[name]
        assert r["path"] == proc.info["shm_path"] and r["size"] == 64 << 20
        assert r["data_dir"] == str((tmp_path / f"daemon-{name}").resolve())
        assert r["path"] + ".stamp" in r["files"] and r["path"] + ".owner" in r["files"]
    assert regions["live"]["pid"] == live.p.pid

    plan = shm(tmp_path, "clean", "--dry-run")
    assert [r["daemon_id"] for r in plan["removed"]] == ["dead"] and plan["dry_run"]
    assert os.path.exists(dead.info["shm_path"])  # nothing removed

    done = shm(tmp_path, "clean")
    assert [r["daemon_id"] for r in done["removed"]] == ["dead"]
    assert [r["daemon_id"] for r in done["kept"]] == ["live"]
    assert not any(str(p.name).startswith("kvstore-dead-") for p in shm_dir.iterdir())
    assert os.path.exists(live.info["shm_path"]) and os.path.exists(live.info["shm_path"] + ".stamp")
    assert by_daemon(shm(tmp_path, "list")["regions"]).keys() == {"live"}

    keys = [bytes([i]) * 16 for i in range(4)]
    blocks = [np.full(4096, i, np.uint8) for i in range(4)]
    with SyncKVStoreClient(cluster.meta_addr) as c:  # the live daemon serves on
        assert c.put(keys, blocks).stored == 4
        out = [np.empty_like(b) for b in blocks]
        assert c.get_into(keys, out) == 4 and all((a == b).all() for a, b in zip(out, blocks))

    live.stop()  # SIGTERM: it drains, and keeps its segment for a warm restart
    log = live.log_path.read_text()
    kept = [line for line in log.splitlines() if "event=shm_kept" in line]
    assert len(kept) == 1 and live.info["shm_path"] in kept[0] and "kvstore shm clean" in kept[0]
    assert by_daemon(shm(tmp_path, "list")["regions"])["live"]["state"] == "stale"


def test_the_table(cluster, tmp_path):
    cluster.start_meta()
    cluster.start_daemon(f"daemon.shm_dir={tmp_path / 'shm'}", name="tab")
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "shm", "list", "--shm-dir", str(tmp_path / "shm")],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    head, row = r.stdout.splitlines()[:2]
    assert head.split()[:4] == ["state", "kind", "size", "memory"]
    assert row.split()[:2] == ["held", "dram"] and "tab" in row.split()
    assert str((tmp_path / "daemon-tab").resolve()) in row
