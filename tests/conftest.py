"""Shared fixtures: real ``kvstore`` processes on loopback ephemeral ports.

Servers print ``READY {json}`` once they accept requests; :class:`Proc` waits for that line
with a deadline (never a fixed sleep). Daemons' shared-memory files are removed on teardown.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FAST = [
    "meta.heartbeat_interval_s=0.1",
    "meta.daemon_ttl_s=1.5",
    "meta.sweep_interval_s=0.05",
    "meta.allow_clock_skew=true",
]


class Proc:
    """A ``kvstore`` subcommand running as a separate process."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=full_env,
            cwd=REPO,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict = {}

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for raw in self.p.stdout:
            self._lines.put(raw.decode(errors="replace"))

    def wait_ready(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.1)
            except queue.Empty:
                if self.p.poll() is not None:
                    break
                continue
            if line.startswith("READY "):
                self.info = json.loads(line[6:])
                return self.info
        raise RuntimeError(f"kvstore {' '.join(self.args)} not ready; log:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


class Cluster:
    """Starts metadata services and daemons for one test and tears them all down."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.shm_paths: list[str] = []
        self.meta_addr = ""

    def start_meta(self, *sets: str, listen: str = "127.0.0.1:0") -> Proc:
        p = Proc(
            ["meta", "--listen", listen, *[a for s in (*FAST, *sets) for a in ("--set", s)]], self.tmp / "meta.log"
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
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


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
