"""Starting the project's servers as child processes and waiting until they are ready.

Every server (``kvstore serve|meta|daemon``, engine workers) prints one line ``READY {json}`` on
stdout once it accepts requests; :func:`start` waits for that line (with a deadline, never a
fixed sleep) and returns the process with the parsed JSON.
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
from collections.abc import Sequence
from pathlib import Path
from typing import IO


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

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        shm = self.info.get("shm_path")
        if shm and os.path.exists(shm) and self.info.get("owns_shm", True):
            os.unlink(shm)


def start(
    args: Sequence[str],
    name: str = "",
    module: str = "kvstore.cli",
    timeout: float = 120.0,
    stderr: IO | int | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> Child:
    """Runs ``python -m <module> <args>`` and waits for its READY line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=cwd,
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
    raise RuntimeError(f"{name or ' '.join(args)} did not become ready (exit code {proc.poll()})")
