"""The servers bench/peers.py measures, started through :mod:`kvstore.procs` on loopback ports:
``kvstore serve`` (metadata service + daemon) and ``redis-server`` with persistence off. Mooncake's
servers run inside its network namespace (:mod:`bench.peers_mooncake`)."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path
from typing import Any

from bench.peers_harness import BenchError, Unavailable
from kvstore import procs

REPO = Path(__file__).resolve().parent.parent


class KVStoreServer:
    """``kvstore serve`` (metadata service + daemon) on loopback ephemeral ports."""

    def __init__(self, tmp: Path, dram: str, sets: tuple[str, ...] = (), name: str = "kvstore") -> None:
        self.log_path = tmp / f"{name}-serve.log"
        args = ["serve", "--listen", "127.0.0.1:0", "--dram", dram, "--data-dir", str(tmp / f"{name}-data"),
                "--log-level", "warning", *[a for s in sets for a in ("--set", s)]]  # fmt: skip
        with open(self.log_path, "ab") as log:
            try:
                self.child = procs.start(args, name="kvstore serve", timeout=60, stderr=log, cwd=REPO)
            except RuntimeError as e:
                raise BenchError(
                    f"kvstore serve did not start ({e}); log: {self.log_path.read_text()[-2000:]}"
                ) from None
        self.info: dict = self.child.info
        self.meta: str = self.info["meta"]

    def stop(self) -> None:
        self.child.stop(20)  # also removes the daemon's shared-memory file

    def __enter__(self) -> KVStoreServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class RedisServer:
    """``redis-server`` on a loopback ephemeral port, persistence off (no RDB, no AOF)."""

    def __init__(self, tmp: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise Unavailable("redis-server is not installed (apt-get install -y redis-server)")
        self.version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
        self.log_path = tmp / "redis-server.log"
        err = ""
        for _ in range(5):  # the port is picked before redis binds it: retry if someone took it
            self.port = procs.free_port()
            cmd = [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                   "--protected-mode", "yes", "--dir", str(tmp)]  # fmt: skip
            with open(self.log_path, "ab") as log:
                try:
                    self.child = procs.start_listening(
                        cmd, self.port, "redis-server", timeout=20, stdout=log, stderr=subprocess.STDOUT
                    )
                    return
                except RuntimeError as e:
                    err = str(e)
        raise BenchError(f"redis-server did not start: {err}; log: {self.log_path.read_text()[-1000:]}")

    def versions(self) -> str:
        """The server's, redis-py's and hiredis' versions, for the report."""
        from redis.utils import HIREDIS_AVAILABLE

        hi = f"hiredis {importlib.metadata.version('hiredis')}" if HIREDIS_AVAILABLE else "no hiredis"
        return f"{self.version.split(' sha=')[0]}, redis-py {importlib.metadata.version('redis')}, {hi}"

    def stop(self) -> None:
        self.child.stop(20)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
