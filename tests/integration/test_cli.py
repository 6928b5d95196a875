"""The kvstore command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from conftest import REPO, Proc

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.daemon.arena import remove_files


def test_serve_then_stat_table_and_json(tmp_path):
    p = Proc(
        ["serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), "--dram", "32MiB"], tmp_path / "s.log"
    )
    try:
        info = p.wait_ready()
        ks = KeySpace(ModelFingerprint("cli", "bf16", 1, 1, 8))
        keys = ks.block_keys(np.arange(48))
        with SyncKVStoreClient(info["meta"]) as c:
            c.put(keys, [np.ones(1000, np.uint8)] * 3)
            c.get_into(keys, [np.zeros(1000, np.uint8) for _ in keys])
        r = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "stat", "--meta", info["meta"]],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].split()[:4] == ["daemon", "host", "alive", "tier"]
        row = lines[1].split()
        assert row[0] == info["daemon_id"] and row[2] == "yes" and row[3] == "dram"
        assert "hit rate 100.0%" in r.stdout
        r = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "stat", "--meta", info["meta"], "--json"],
            capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        s = json.loads(r.stdout)
        assert s["keys"] == "3" or s["keys"] == 3
        assert int(s["segments"][0]["blocks"]) == 3
    finally:
        p.stop()
        if p.info.get("shm_path"):
            remove_files(p.info["shm_path"])


def test_stat_against_nothing_is_a_clear_error():
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stat", "--meta", "127.0.0.1:1", "--set", "client.rpc_timeout_s=2"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1
    assert "Unavailable" in r.stderr or "Timeout" in r.stderr


def test_store_only_demo_runs_and_every_loaded_block_equals_recompute():
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "demo", "--store-only", "--sessions", "2", "--turns", "2"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "every loaded block equals its recompute: yes" in r.stdout
    loaded = int(r.stdout.split("prefix reuse: ")[1].split()[0])
    assert loaded > 0
