"""Mooncake Store for bench/peers.py, inside a private network namespace.

Mooncake's data ports bind every interface, so its master, the storage process that contributes
the memory segment, and the client all run in a network namespace of their own (``unshare -n``)
that holds nothing but loopback. This module is both sides of that:

- in bench/peers.py's process, :func:`start_mooncake` starts the worker in the namespace and
  returns a :class:`RemoteRunner` that drives it over a pipe, with the harness's interface;
- in the namespace, ``python -m bench.peers_mooncake --worker CFG`` (:func:`mooncake_worker`)
  starts ``mooncake_master`` and the storage process (``--storage CFG``, :func:`mooncake_storage`)
  through :mod:`kvstore.procs`, then runs a :class:`~bench.peers_harness.Runner` over
  :class:`~bench.peers_systems.MooncakePeer` for each request, timing its own calls.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.peers_harness import BenchError, Objects, Plan, Runner, Unavailable  # noqa: E402
from bench.peers_systems import MooncakePeer  # noqa: E402
from kvstore import procs  # noqa: E402

MOONCAKE_DIST = "mooncake-transfer-engine-non-cuda"


def _mooncake_dir() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(
            f"the mooncake package is not installed (pip install {MOONCAKE_DIST}; apt-get install -y libibverbs1)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _mooncake_version() -> str:
    for dist in (MOONCAKE_DIST, "mooncake-transfer-engine"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "mooncake (version unknown)"


def start_mooncake(tmp: Path, plan: Plan) -> RemoteRunner:
    """Starts the worker in a new network namespace; it starts the master, the storage process
    and the client there and answers once the client is set up."""
    _mooncake_dir()
    unshare = shutil.which("unshare")
    if unshare is None:
        raise Unavailable(
            "unshare (util-linux) is not installed: Mooncake's data ports need a private network namespace"
        )
    ns_cmd = [unshare, "-n"] if os.geteuid() == 0 else [unshare, "-r", "-n"]
    probe = subprocess.run([*ns_cmd, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise Unavailable(f"cannot create a private network namespace ({' '.join(ns_cmd)}): {probe.stderr.strip()}")
    cfg = {
        "segment_bytes": 4 * plan.batch_bytes + (64 << 20),
        "local_buffer_bytes": 16 << 20,
        "parent_netns": os.readlink("/proc/self/ns/net"),
        "log": str(tmp / "mooncake.log"),
    }
    log_path = tmp / "mooncake.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*ns_cmd, sys.executable, "-m", "bench.peers_mooncake", "--worker", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    try:
        return RemoteRunner(proc, "mooncake", log_path)
    except BenchError:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        raise


class RemoteRunner:
    """A :class:`Runner` in the Mooncake worker process, driven over its stdin / stdout."""

    def __init__(self, proc: subprocess.Popen, name: str, log_path: Path, timeout_s: float = 300.0) -> None:
        self.proc = proc
        self.name = name
        self.log_path = log_path
        self.timeout_s = timeout_s
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict = self._answer(120.0, starting=True)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace"))
        self._lines.put(None)

    def _answer(self, timeout: float, starting: bool = False) -> Any:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"{self.name}: no answer within {timeout:.0f} s; {self._log_tail()}") from None
        if line is None:
            raise BenchError(f"{self.name}: worker exited (rc {self.proc.wait(10)}); {self._log_tail()}")
        msg = json.loads(line)
        if not msg.get("ok"):
            # A failed start-up also shows the log: what the master and the storage process said.
            tail = f"; {self._log_tail()}" if starting else ""
            raise BenchError(f"{self.name}: {msg.get('error')}{tail}")
        return msg.get("result")

    def _log_tail(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        benign = ("metadata not found", "Failed to retrieve segment descriptor")  # at every start-up
        lines = [ln for ln in lines if not any(b in ln for b in benign)]
        errors = [ln for ln in lines if ln.startswith(("E", "F")) or "rror" in ln]
        return "log: " + " | ".join((errors or lines)[-4:])[-1500:]

    def _call(self, op: str, **kw: Any) -> Any:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"{self.name}: worker is gone; {self._log_tail()}") from None
        return self._answer(self.timeout_s)

    def start_size(self, size: int, n: int, objs: Objects | None = None) -> None:
        self._call("start_size", size=size, n=n)  # the worker builds the same seeded objects

    def end_size(self) -> None:
        self._call("end_size")

    def rep(self, rep: int, keep: bool = False) -> dict:
        return self._call("rep", rep=rep, keep=keep)

    def latency(self, samples: int, seed: int) -> list[float]:
        return self._call("latency", samples=samples, seed=seed)

    def lookup_start(self, n: int, object_bytes: int) -> None:
        self._call("lookup_start", n=n, object_bytes=object_bytes)

    def lookup(self, seconds: float) -> list[float]:
        return self._call("lookup", seconds=seconds)

    def lookup_one(self, samples: int) -> list[float]:
        return self._call("lookup_one", samples=samples)

    def lookup_end(self) -> None:
        self._call("lookup_end")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._call("close")
            except BenchError:
                pass
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(30)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait(10)


# ---- in the namespace ------------------------------------------------------------------------


def _loopback_only(parent_netns: str) -> None:
    """Refuses to go on unless this process is in a network namespace of its own in which no
    interface but loopback is up; then brings loopback up (``ip link set lo up``)."""
    here = os.readlink("/proc/self/ns/net")
    if here == parent_netns:
        raise BenchError("not in a private network namespace; refusing to start Mooncake")
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("16sH22x", name.encode(), 0)
            flags = struct.unpack("16sH22x", fcntl.ioctl(s, siocgifflags, req))[1]
            if name == "lo":
                fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))
            elif flags & iff_up:
                raise BenchError(f"interface {name} is up in the namespace; refusing to start Mooncake")


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _protocol_channel() -> Any:
    """Keeps the real stdout for protocol lines and sends fd 1 to stderr (the log), so that
    nothing a library prints can corrupt the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def mooncake_worker(cfg: dict) -> int:
    proto = _protocol_channel()

    def reply(**kw: Any) -> None:
        proto.write(json.dumps(kw) + "\n")
        proto.flush()

    master: procs.Child | None = None
    storage: procs.Child | None = None
    runner: Runner | None = None
    try:
        _loopback_only(cfg["parent_netns"])
        # The transfer engine advertises the first non-loopback address unless told otherwise.
        os.environ.update(MC_TCP_BIND_ADDRESS="127.0.0.1", MC_FORCE_TCP="1")
        master_bin = _mooncake_dir() / "mooncake_master"
        rpc, http, metrics = procs.free_port(), procs.free_port(), procs.free_port()
        master = procs.start_listening(
            [str(master_bin), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={http}", f"--metrics_port={metrics}", "--metrics_host=127.0.0.1",
             "--enable_metric_reporting=false"],
            rpc, "mooncake_master", timeout=30, preexec_fn=_die_with_parent,
        )  # fmt: skip
        procs.wait_port(master.proc, http, 30, "mooncake_master (HTTP metadata)")
        metadata_url, master_addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        scfg = {"metadata": metadata_url, "master": master_addr, "segment_bytes": cfg["segment_bytes"]}
        try:
            storage = procs.start(
                ["--storage", json.dumps(scfg)], name="mooncake storage process", module="bench.peers_mooncake",
                timeout=90, stdin=subprocess.PIPE, cwd=REPO, preexec_fn=_die_with_parent,
            )  # fmt: skip
        except RuntimeError as e:
            raise BenchError(f"storage process did not start: {e}") from None
        runner = Runner(MooncakePeer(metadata_url, master_addr, cfg["local_buffer_bytes"]))
        reply(ok=True, result={"version": _mooncake_version(), "segment_bytes": cfg["segment_bytes"]})
        for raw in sys.stdin:
            msg = json.loads(raw)
            op = msg.pop("op")
            if op == "close":
                reply(ok=True, result=None)
                break
            try:
                reply(ok=True, result=getattr(runner, op)(**msg))
            except Exception as e:
                traceback.print_exc()
                reply(ok=False, error=f"{type(e).__name__}: {e}")
        return 0
    except Exception as e:
        traceback.print_exc()
        reply(ok=False, error=f"{type(e).__name__}: {e}")
        return 1
    finally:
        if runner is not None:
            try:
                runner.close()
            except Exception:
                traceback.print_exc()
        if storage is not None:
            # The storage process ends when its stdin closes.
            storage.proc.stdin.close()  # type: ignore[union-attr]
            try:
                storage.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            storage.stop(10)
        if master is not None:
            master.stop(10)


def mooncake_storage(cfg: dict) -> int:
    """The process that contributes Mooncake's memory segment; ends when its stdin closes."""
    proto = _protocol_channel()
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", cfg["metadata"], cfg["segment_bytes"], 16 << 20, "tcp", "", cfg["master"])
    if rc != 0:
        print(f"mooncake storage process: setup returned {rc}", file=sys.stderr)  # to the log
        return 1
    proto.write("READY " + json.dumps({"segment_bytes": cfg["segment_bytes"]}) + "\n")  # see kvstore.procs
    proto.flush()
    sys.stdin.buffer.read()
    store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Mooncake's side of bench/peers.py (started by it, not by hand).")
    role = ap.add_mutually_exclusive_group(required=True)
    role.add_argument("--worker", help="JSON: start the master, the storage process and a client; serve the pipe")
    role.add_argument("--storage", help="JSON: contribute the memory segment until stdin closes")
    ns = ap.parse_args(argv)
    return mooncake_worker(json.loads(ns.worker)) if ns.worker else mooncake_storage(json.loads(ns.storage))


if __name__ == "__main__":
    sys.exit(main())
