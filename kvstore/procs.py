"""Starting the project's servers as child processes and waiting until they are ready.

Every server (``kvstore serve|meta|daemon``, engine workers) prints one line ``READY {json}`` on
stdout once it accepts requests; :func:`start` waits for that line (with a deadline, never a
fixed sleep) and returns the process with the parsed JSON. A third-party server that prints no
such line (``redis-server``, ``mooncake_master``) is started by :func:`start_listening`, which
waits until its port accepts connections instead.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from kvstore.daemon.arena import remove_files


class Child:
    """A started server process and what it printed in its READY line."""

    def __init__(self, proc: subprocess.Popen, info: dict, name: str) -> None:
        self.proc = proc
        self.info = info
        self.name = name

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0, keep_shm: bool = False) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; a daemon's shared-memory files are removed
        unless ``keep_shm`` (a daemon that starts again reattaches them)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        shm = self.info.get("shm_path")
        if shm and self.info.get("owns_shm", True) and not keep_shm:
            remove_files(shm)
            staging = shm.removesuffix("-dram") + "-staging"
            if os.path.exists(staging):
                os.unlink(staging)


def start(
    args: Sequence[str],
    name: str = "",
    module: str = "kvstore.cli",
    timeout: float = 120.0,
    stderr: IO | int | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdin: IO | int | None = None,
    preexec_fn: Callable[[], object] | None = None,
    prefix: Sequence[str] = (),
) -> Child:
    """Runs ``python -m <module> <args>`` (after ``prefix``, e.g. ``ip netns exec HOST``, which
    execs it in place) and waits for its READY line."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", module, *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=cwd,
        preexec_fn=preexec_fn,
    )
    lines: queue.Queue[bytes] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.put(raw)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if line.startswith(b"READY "):
            return Child(proc, json.loads(line[6:]), name or args[0])
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"{name or ' '.join(args)} did not become ready (exit code {proc.poll()})")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(proc: subprocess.Popen, port: int, timeout: float, name: str, host: str = "127.0.0.1") -> None:
    """Waits until ``port`` accepts connections; raises RuntimeError if ``proc`` exits first or
    the deadline passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} not listening on {port} after {timeout:.0f} s")


def start_listening(
    cmd: Sequence[str],
    port: int,
    name: str,
    timeout: float = 60.0,
    host: str = "127.0.0.1",
    stdout: IO | int | None = None,
    stderr: IO | int | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    preexec_fn: Callable[[], object] | None = None,
) -> Child:
    """Runs a server that prints no READY line (a third-party program, ``cmd`` as given) and waits
    until it accepts connections on ``port``; if it does not, stops it and raises RuntimeError.
    The child's info is ``{"port": port}``."""
    proc = subprocess.Popen(list(cmd), stdout=stdout, stderr=stderr, env=env, cwd=cwd, preexec_fn=preexec_fn)
    child = Child(proc, {"port": port}, name)
    try:
        wait_port(proc, port, timeout, name, host)
    except BaseException:
        child.stop()
        raise
    return child
