#!/usr/bin/env python3
"""Store-level peers: kvstore next to what users would run instead, on identical objects, in one run.

    python bench/peers.py            # full size, a few minutes
    python bench/peers.py --quick    # about a minute

Systems, each measured in the same run, on the same seeded objects:

- kvstore, shared-memory path and TCP path: ``kvstore serve`` started here on loopback ephemeral
  ports, ``SyncKVStoreClient`` with ``ClientConfig(transport="shm")`` / ``("tcp")``.
- Redis used as a KV-block store the way LMCache's Redis backend uses it: one key per block, SET /
  GET of the bytes (pipelined for batches), EXISTS over many keys for lookups. ``redis-server`` is
  started here on a loopback ephemeral port with persistence off; redis-py with hiredis.
- Mooncake Store (``mooncake-transfer-engine-non-cuda``): ``mooncake_master``, a storage process
  that contributes the memory segment, and the client, all in a private network namespace
  (``unshare -n``) that holds nothing but loopback, because Mooncake's data ports bind every
  interface. The client there is driven over a pipe and times its own calls. Where it cannot run,
  the reason is recorded and the run compares kvstore with Redis only.

Per object size (64 KiB, 512 KiB, 2 MiB): put and get GB/s over a batch (medians of interleaved
repetitions; every get is compared byte for byte with what was put), per-object get p50 / p99
(single-object round trips after warm-up); and lookups of 1000 keys per call (keys/s, per-call p50 /
p99). Writes bench/results/peers.json, bench/results/peers_throughput.png and the "peers" section of
bench/RESULTS.md.
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
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvstore import KeySpace, ModelFingerprint  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"
SEED = 20261201
SIZES = {"64KiB": 64 << 10, "512KiB": 512 << 10, "2MiB": 2 << 20}
KVSTORE = ("kvstore-shm", "kvstore-tcp")
PEERS = ("redis", "mooncake")
FINGERPRINT = ModelFingerprint("bench-peers", "bf16", 32, 8, 128)


@dataclass(frozen=True)
class Plan:
    batch_bytes: int  # bytes per put / get batch, for every object size
    reps: int  # counted repetitions (one more, uncounted, warms every path up)
    latency_samples: int  # single-object gets per system and size
    lookup_s: float  # seconds of 1000-key lookups per system
    sizes: dict[str, int] = field(default_factory=lambda: dict(SIZES))
    lookup_keys: int = 1000
    lookup_object_bytes: int = 1024
    rounds: int = 3  # latency and lookups are interleaved over this many rounds


QUICK = Plan(batch_bytes=32 << 20, reps=3, latency_samples=120, lookup_s=1.5)
FULL = Plan(batch_bytes=128 << 20, reps=9, latency_samples=600, lookup_s=6.0)


class BenchError(RuntimeError):
    """A system answered wrongly (a miss, a short read, different bytes) or could not be run."""


class Skip(RuntimeError):
    """A peer is not available on this machine; the message says why."""


# ---- objects and keys ------------------------------------------------------------------------


class Buffers:
    """Equal-sized views into one contiguous array, with their addresses (for Mooncake)."""

    def __init__(self, flat: np.ndarray, size: int) -> None:
        self.flat = flat
        self.size = size
        self.arrays = [flat[i * size : (i + 1) * size] for i in range(flat.size // size)]
        base = flat.ctypes.data
        self.ptrs = [base + i * size for i in range(len(self.arrays))]
        self.sizes = [size] * len(self.arrays)


class Objects:
    """One batch: seeded random sources (identical in every process) and destinations touched
    once and reused, so no measurement pays for first-touch page faults."""

    def __init__(self, size: int, n: int) -> None:
        rng = np.random.default_rng([SEED, size, n])
        self.src = Buffers(np.frombuffer(rng.bytes(size * n), np.uint8), size)
        self.dst = Buffers(np.ones(size * n, np.uint8), size)


def batch_keys(system: str, size: int, rep: int, n: int) -> list[bytes]:
    """Block keys of one batch (a prefix chain), distinct per system, object size and repetition.
    ``rep`` -1 names the lookup set."""
    ks = KeySpace(FINGERPRINT, namespace=f"peers-{system}")
    first = (rep + 2) * 10_000_000 + size.bit_length() * 200_000
    return [bytes(k) for k in ks.block_keys(np.arange(first, first + n * FINGERPRINT.block_size))]


# ---- the systems -------------------------------------------------------------------------------


class KVStorePeer:
    """kvstore through ``SyncKVStoreClient``, forced onto one transport."""

    def __init__(self, meta: str, transport: str) -> None:
        from kvstore import SyncKVStoreClient
        from kvstore.config import ClientConfig

        self.name = f"kvstore-{transport}"
        self.client = SyncKVStoreClient(meta, ClientConfig(transport=transport))

    def native(self, keys: list[bytes]) -> bytes:
        return b"".join(keys)  # the client takes packed keys (N x 16 bytes) as well as a list

    def native_one(self, key: bytes) -> bytes:
        return key

    def register(self, bufs: Buffers) -> Any:
        return None

    def unregister(self, handle: Any) -> None:
        pass

    def put(self, keys: bytes, bufs: Buffers) -> None:
        r = self.client.put(keys, bufs.arrays)
        if r.stored != len(bufs.arrays):
            raise BenchError(f"{self.name}: put stored {r.stored} of {len(bufs.arrays)} blocks ({r})")

    def get(self, keys: bytes, bufs: Buffers) -> None:
        got = self.client.get_into(keys, bufs.arrays)
        if got != len(bufs.arrays):
            raise BenchError(f"{self.name}: get_into loaded {got} of {len(bufs.arrays)} blocks")

    def get_one(self, key: bytes, bufs: Buffers, i: int) -> None:
        if self.client.get_into(key, [bufs.arrays[i]]) != 1:
            raise BenchError(f"{self.name}: single-block get_into missed")

    def exists(self, keys: bytes) -> int:
        return self.client.lookup(keys)

    def remove(self, keys: bytes) -> None:
        self.client.remove(keys)

    def close(self) -> None:
        self.client.close()


class RedisPeer:
    """Redis as a block store: one key per block, pipelined SET / GET, multi-key EXISTS."""

    name = "redis"

    def __init__(self, port: int) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=120)
        self.r.ping()

    def native(self, keys: list[bytes]) -> list[bytes]:
        return keys

    def native_one(self, key: bytes) -> bytes:
        return key

    def register(self, bufs: Buffers) -> Any:
        return None

    def unregister(self, handle: Any) -> None:
        pass

    def put(self, keys: list[bytes], bufs: Buffers) -> None:
        # Pipelined SETs rather than one MSET: with the hiredis packer, MSET builds the whole
        # batch as one buffer and runs at about half the speed.
        p = self.r.pipeline(transaction=False)
        for k, a in zip(keys, bufs.arrays):
            p.set(k, memoryview(a))
        if not all(p.execute()):
            raise BenchError("redis: a SET failed")

    def get(self, keys: list[bytes], bufs: Buffers) -> None:
        p = self.r.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        for v, d in zip(p.execute(), bufs.arrays):
            if v is None or len(v) != d.size:
                raise BenchError(f"redis: GET returned {None if v is None else len(v)} bytes, expected {d.size}")
            np.copyto(d, np.frombuffer(v, np.uint8))  # into the caller's buffer, like get_into

    def get_one(self, key: bytes, bufs: Buffers, i: int) -> None:
        v = self.r.get(key)
        d = bufs.arrays[i]
        if v is None or len(v) != d.size:
            raise BenchError("redis: single GET missed")
        np.copyto(d, np.frombuffer(v, np.uint8))

    def exists(self, keys: list[bytes]) -> int:
        return self.r.exists(*keys)

    def remove(self, keys: list[bytes]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()


class MooncakePeer:
    """Mooncake Store's Python client: zero-copy batch_put_from / batch_get_into on registered
    buffers, batch_is_exist for lookups. Runs only inside the private network namespace."""

    name = "mooncake"

    def __init__(self, metadata_url: str, master_addr: str, local_buffer_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        # global_segment_size 0: this client contributes no memory; the storage process does.
        rc = self.store.setup("127.0.0.1", metadata_url, 0, local_buffer_bytes, "tcp", "", master_addr)
        if rc != 0:
            raise BenchError(f"mooncake: client setup returned {rc}")

    def native(self, keys: list[bytes]) -> list[str]:
        return [k.hex() for k in keys]

    def native_one(self, key: bytes) -> str:
        return key.hex()

    def register(self, bufs: Buffers) -> Any:
        rc = self.store.register_buffer(bufs.flat.ctypes.data, bufs.flat.nbytes)
        if rc != 0:
            raise BenchError(f"mooncake: register_buffer returned {rc}")
        return bufs.flat.ctypes.data

    def unregister(self, handle: Any) -> None:
        self.store.unregister_buffer(handle)

    def put(self, keys: list[str], bufs: Buffers) -> None:
        rc = self.store.batch_put_from(keys, bufs.ptrs, bufs.sizes)
        bad = [r for r in rc if r != 0]
        if bad:
            raise BenchError(f"mooncake: batch_put_from failed for {len(bad)} of {len(rc)} objects (codes {set(bad)})")

    def get(self, keys: list[str], bufs: Buffers) -> None:
        rc = self.store.batch_get_into(keys, bufs.ptrs, bufs.sizes)
        bad = [r for r in rc if r != bufs.size]
        if bad:
            raise BenchError(f"mooncake: batch_get_into short for {len(bad)} of {len(rc)} objects (got {set(bad)})")

    def get_one(self, key: str, bufs: Buffers, i: int) -> None:
        rc = self.store.get_into(key, bufs.ptrs[i], bufs.size)
        if rc != bufs.size:
            raise BenchError(f"mooncake: get_into returned {rc}, expected {bufs.size}")

    def exists(self, keys: list[str]) -> int:
        return sum(1 for r in self.store.batch_is_exist(keys) if r == 1)

    def remove(self, keys: list[str]) -> None:
        # force: a get leaves a short read lease on the object; no reader is left at this point.
        rc = self.store.batch_remove(keys, True)
        bad = [r for r in rc if r != 0]
        if bad:
            raise BenchError(f"mooncake: batch_remove failed for {len(bad)} objects (codes {set(bad)})")

    def close(self) -> None:
        self.store.close()


# ---- measurements (the same code drives every system, in this process or in the worker) ------


class Runner:
    """Measures one system. Every public method answers JSON-able data, so that the same code
    runs behind a pipe (:class:`RemoteRunner`) for the system in the network namespace."""

    def __init__(self, peer: Any) -> None:
        self.peer = peer
        self.name: str = peer.name
        self._objs: Objects | None = None
        self._handles: list[Any] = []
        self._kept: tuple[Any, list[Any]] | None = None
        self._lookup: tuple[Any, list[Any], Objects, Any, int] | None = None

    def start_size(self, size: int, n: int, objs: Objects | None = None) -> None:
        self.size, self.n = size, n
        self._objs = objs if objs is not None else Objects(size, n)
        self._handles = [self.peer.register(self._objs.src), self.peer.register(self._objs.dst)]

    def end_size(self) -> None:
        if self._kept is not None:
            self.peer.remove(self._kept[0])
            self._kept = None
        for h in self._handles:
            self.peer.unregister(h)
        self._handles = []
        self._objs = None

    def rep(self, rep: int, keep: bool = False) -> dict:
        """One batch put, then one batch get into zeroed buffers, then a byte-for-byte check."""
        o = self._objs
        assert o is not None
        raw = batch_keys(self.name, self.size, rep, self.n)
        keys = self.peer.native(raw)
        o.dst.flat.fill(0)
        t0 = time.perf_counter()
        self.peer.put(keys, o.src)
        t1 = time.perf_counter()
        self.peer.get(keys, o.dst)
        t2 = time.perf_counter()
        if not np.array_equal(o.dst.flat, o.src.flat):
            raise BenchError(f"{self.name}: a get returned bytes that differ from what was put ({self.size} B objects)")
        if keep:
            self._kept = (keys, [self.peer.native_one(k) for k in raw])
        else:
            self.peer.remove(keys)
        return {"put_s": t1 - t0, "get_s": t2 - t1}

    def latency(self, samples: int, seed: int) -> list[float]:
        """Single-object get round trips over the batch kept by the last rep, in a seeded random
        order, after a few uncounted ones; each result is checked."""
        o = self._objs
        assert o is not None and self._kept is not None
        ones = self._kept[1]
        order = np.random.default_rng([SEED, seed, self.size]).integers(0, len(ones), samples + 5)
        out: list[float] = []
        for j, i in enumerate(order):
            d = o.dst.arrays[i]
            d.fill(0)
            t = time.perf_counter()
            self.peer.get_one(ones[i], o.dst, int(i))
            dt = time.perf_counter() - t
            if not np.array_equal(d, o.src.arrays[i]):
                raise BenchError(f"{self.name}: a single-object get returned different bytes")
            if j >= 5:
                out.append(dt)
        return out

    def lookup_start(self, n: int, object_bytes: int) -> None:
        raw = batch_keys(self.name, object_bytes, -1, n)
        keys = self.peer.native(raw)
        objs = Objects(object_bytes, n)
        handle = self.peer.register(objs.src)
        self.peer.put(keys, objs.src)
        singles = [self.peer.native([k]) for k in raw]  # one-key batches
        self._lookup = (keys, singles, objs, handle, n)  # objs stays referenced while registered
        for _ in range(20):  # warm-up
            self._check_hits(self.peer.exists(keys), n)

    def lookup(self, seconds: float) -> list[float]:
        """Existence checks of the whole lookup set, one call after another, for ``seconds``."""
        assert self._lookup is not None
        keys, _, _, _, n = self._lookup
        lat: list[float] = []
        stop = time.perf_counter() + seconds
        while True:
            t = time.perf_counter()
            hits = self.peer.exists(keys)
            t2 = time.perf_counter()
            self._check_hits(hits, n)
            lat.append(t2 - t)
            if t2 >= stop:
                return lat

    def lookup_one(self, samples: int) -> list[float]:
        """Existence checks of one key at a time (the bare request round trip), after warm-up."""
        assert self._lookup is not None
        _, singles, _, _, _ = self._lookup
        lat: list[float] = []
        for j in range(samples + 5):
            t = time.perf_counter()
            hits = self.peer.exists(singles[j % len(singles)])
            dt = time.perf_counter() - t
            self._check_hits(hits, 1)
            if j >= 5:
                lat.append(dt)
        return lat

    def lookup_end(self) -> None:
        if self._lookup is not None:
            keys, _, _, handle, _ = self._lookup
            self.peer.remove(keys)
            self.peer.unregister(handle)
            self._lookup = None

    def _check_hits(self, hits: int, n: int) -> None:
        if hits != n:
            raise BenchError(f"{self.name}: lookup found {hits} of {n} stored keys")

    def close(self) -> None:
        self.peer.close()


class RemoteRunner:
    """A :class:`Runner` in the Mooncake worker process, driven over its stdin / stdout."""

    def __init__(self, proc: subprocess.Popen, name: str, log_path: Path, timeout_s: float = 300.0) -> None:
        self.proc = proc
        self.name = name
        self.log_path = log_path
        self.timeout_s = timeout_s
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict = self._answer(120.0)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace"))
        self._lines.put(None)

    def _answer(self, timeout: float) -> Any:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"{self.name}: no answer within {timeout:.0f} s; {self._log_tail()}") from None
        if line is None:
            raise BenchError(f"{self.name}: worker exited (rc {self.proc.wait(10)}); {self._log_tail()}")
        msg = json.loads(line)
        if not msg.get("ok"):
            raise BenchError(f"{self.name}: {msg.get('error')}")
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


def _ms(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(len(s) * q))] * 1000, 4)


class Suite:
    """Runs every measurement over a set of runners, interleaved so that the machine's noise
    falls on all systems alike. A peer that fails is recorded and dropped; a kvstore failure
    (or any failure with ``strict``) is raised."""

    def __init__(self, runners: list[Any], plan: Plan, *, strict: bool = False, progress: bool = True) -> None:
        self.runners = list(runners)
        self.plan = plan
        self.strict = strict
        self.progress = progress
        self.failed: dict[str, str] = {}

    def _each(self, fn: Callable[[Any], Any], order: Sequence[Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for r in list(order if order is not None else self.runners):
            if r not in self.runners:
                continue
            try:
                out[r.name] = fn(r)
            except Exception as e:
                if self.strict or r.name.startswith("kvstore"):
                    raise
                self.failed[r.name] = f"{type(e).__name__}: {e}"
                print(f"peers: {r.name} failed and is left out: {self.failed[r.name]}", file=sys.stderr)
                self.runners.remove(r)
                try:
                    r.close()
                except Exception:
                    pass
        return out

    def run(self) -> dict:
        from tqdm import tqdm

        p = self.plan
        sizes: dict[str, dict] = {}
        total = len(p.sizes) * (p.reps + 1 + p.rounds) + p.rounds
        with tqdm(total=total, desc="peers", unit="step", disable=not self.progress) as bar:
            for name, size in p.sizes.items():
                bar.set_postfix_str(name)
                n = max(1, p.batch_bytes // size)
                objs = Objects(size, n)
                self._each(lambda r: r.start_size(size, n, objs))
                put: dict[str, list[float]] = {r.name: [] for r in self.runners}
                get: dict[str, list[float]] = {r.name: [] for r in self.runners}
                for rep in range(p.reps + 1):  # rep 0 warms every path up and is not counted
                    k = rep % max(1, len(self.runners))
                    order = self.runners[k:] + self.runners[:k]
                    res = self._each(lambda r: r.rep(rep, keep=rep == p.reps), order)
                    if rep:
                        for sys_name, t in res.items():
                            put[sys_name].append(n * size / t["put_s"] / 1e9)
                            get[sys_name].append(n * size / t["get_s"] / 1e9)
                    bar.update(1)
                lat: dict[str, list[float]] = {r.name: [] for r in self.runners}
                per_round = max(1, p.latency_samples // p.rounds)
                for rnd in range(p.rounds):
                    for sys_name, xs in self._each(lambda r: r.latency(per_round, rnd)).items():
                        lat[sys_name] += xs
                    bar.update(1)
                self._each(lambda r: r.end_size())
                sizes[name] = {
                    "block_bytes": size,
                    "objects": n,
                    "batch_bytes": n * size,
                    "systems": {
                        r.name: {
                            "put_gbps": round(statistics.median(put[r.name]), 3),
                            "get_gbps": round(statistics.median(get[r.name]), 3),
                            "get_p50_ms": _ms(lat[r.name], 0.50),
                            "get_p99_ms": _ms(lat[r.name], 0.99),
                            "latency_samples": len(lat[r.name]),
                            "put_gbps_reps": [round(x, 3) for x in put[r.name]],
                            "get_gbps_reps": [round(x, 3) for x in get[r.name]],
                        }
                        for r in self.runners
                        if put[r.name] and lat[r.name]
                    },
                }
            bar.set_postfix_str("lookups")
            self._each(lambda r: r.lookup_start(p.lookup_keys, p.lookup_object_bytes))
            calls: dict[str, list[float]] = {r.name: [] for r in self.runners}
            ones: dict[str, list[float]] = {r.name: [] for r in self.runners}
            for _ in range(p.rounds):
                for sys_name, xs in self._each(lambda r: r.lookup(p.lookup_s / p.rounds)).items():
                    calls[sys_name] += xs
                for sys_name, xs in self._each(lambda r: r.lookup_one(max(1, p.latency_samples // p.rounds))).items():
                    ones[sys_name] += xs
                bar.update(1)
            self._each(lambda r: r.lookup_end())
        lookup = {
            r.name: {
                "keys_per_lookup": p.lookup_keys,
                "calls": len(calls[r.name]),
                "keys_per_s": round(len(calls[r.name]) * p.lookup_keys / sum(calls[r.name])),
                "p50_ms": _ms(calls[r.name], 0.50),
                "p99_ms": _ms(calls[r.name], 0.99),
                "one_key_p50_ms": _ms(ones[r.name], 0.50),
                "one_key_p99_ms": _ms(ones[r.name], 0.99),
            }
            for r in self.runners
            if calls.get(r.name) and ones.get(r.name)
        }
        return {"sizes": sizes, "lookup": lookup, "failed": dict(self.failed)}

    def close(self) -> None:
        for r in self.runners:
            try:
                r.close()
            except Exception as e:  # noqa: PERF203
                print(f"peers: closing {r.name}: {e}", file=sys.stderr)


# ---- servers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"{what} not listening on {port} after {timeout:.0f} s")


class KVStoreServer:
    """``kvstore serve`` (metadata service + daemon) on loopback ephemeral ports."""

    def __init__(self, tmp: Path, dram: str) -> None:
        self.log_path = tmp / "kvstore-serve.log"
        self._log = open(self.log_path, "ab")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--listen", "127.0.0.1:0", "--dram", dram,
             "--data-dir", str(tmp / "kvstore-data"), "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=self._log, cwd=REPO,
        )  # fmt: skip
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            for raw in self.p.stdout:  # type: ignore[union-attr]
                lines.put(raw.decode(errors="replace"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 60
        self.info: dict = {}
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith("READY "):
                self.info = json.loads(line[6:])
                break
        if not self.info:
            self.stop()
            raise BenchError(f"kvstore serve did not start; log: {self.log_path.read_text()[-2000:]}")
        self.meta: str = self.info["meta"]

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self._log.close()
        shm = self.info.get("shm_path", "")
        if shm and os.path.exists(shm):
            os.unlink(shm)

    def __enter__(self) -> KVStoreServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class RedisServer:
    """``redis-server`` on a loopback ephemeral port, persistence off (no RDB, no AOF)."""

    def __init__(self, tmp: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise Skip("redis-server is not installed (apt-get install -y redis-server)")
        self.version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
        self.log_path = tmp / "redis-server.log"
        err = ""
        for _ in range(5):  # the port is picked before redis binds it: retry if someone took it
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self.p = subprocess.Popen(
                    [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                     "--protected-mode", "yes", "--dir", str(tmp)],
                    stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            try:
                _wait_port(self.port, self.p, 20, "redis-server")
                return
            except BenchError as e:
                err = str(e)
                self.stop()
        raise BenchError(f"redis-server did not start: {err}; log: {self.log_path.read_text()[-1000:]}")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ---- Mooncake, inside a private network namespace ----------------------------------------------

MOONCAKE_DIST = "mooncake-transfer-engine-non-cuda"


def _mooncake_dir() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise Skip(
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
        raise Skip("unshare (util-linux) is not installed: Mooncake's data ports need a private network namespace")
    ns_cmd = [unshare, "-n"] if os.geteuid() == 0 else [unshare, "-r", "-n"]
    probe = subprocess.run([*ns_cmd, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise Skip(f"cannot create a private network namespace ({' '.join(ns_cmd)}): {probe.stderr.strip()}")
    cfg = {
        "segment_bytes": 4 * plan.batch_bytes + (64 << 20),
        "local_buffer_bytes": 16 << 20,
        "parent_netns": os.readlink("/proc/self/ns/net"),
        "log": str(tmp / "mooncake.log"),
    }
    log_path = tmp / "mooncake.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*ns_cmd, sys.executable, str(Path(__file__).resolve()), "--mooncake-worker", json.dumps(cfg)],
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

    procs: list[subprocess.Popen] = []
    runner: Runner | None = None
    try:
        _loopback_only(cfg["parent_netns"])
        # The transfer engine advertises the first non-loopback address unless told otherwise.
        os.environ.update(MC_TCP_BIND_ADDRESS="127.0.0.1", MC_FORCE_TCP="1")
        master_bin = _mooncake_dir() / "mooncake_master"
        rpc, http, metrics = free_port(), free_port(), free_port()
        master = subprocess.Popen(
            [str(master_bin), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={http}", f"--metrics_port={metrics}", "--metrics_host=127.0.0.1",
             "--enable_metric_reporting=false"],
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        procs.append(master)
        _wait_port(rpc, master, 30, "mooncake_master")
        _wait_port(http, master, 30, "mooncake_master (HTTP metadata)")
        metadata_url, master_addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        scfg = {"metadata": metadata_url, "master": master_addr, "segment_bytes": cfg["segment_bytes"]}
        storage = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--mooncake-storage", json.dumps(scfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=_die_with_parent,
        )  # fmt: skip
        procs.append(storage)
        line = storage.stdout.readline().decode().strip()  # type: ignore[union-attr]
        if line != "READY":
            raise BenchError(f"storage process did not start: {line or f'exited with {storage.wait(10)}'}")
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
        for p in reversed(procs):
            if p.stdin:
                p.stdin.close()  # the storage process ends when its stdin closes
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.terminate()
            if p.poll() is None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


def mooncake_storage(cfg: dict) -> int:
    """The process that contributes Mooncake's memory segment; ends when its stdin closes."""
    proto = _protocol_channel()
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", cfg["metadata"], cfg["segment_bytes"], 16 << 20, "tcp", "", cfg["master"])
    if rc != 0:
        proto.write(f"setup returned {rc}\n")
        return 1
    proto.write("READY\n")
    proto.flush()
    sys.stdin.buffer.read()
    store.close()
    return 0


# ---- the run ------------------------------------------------------------------------------------


def _redis_versions(server: RedisServer) -> str:
    from redis.utils import HIREDIS_AVAILABLE

    hi = f"hiredis {importlib.metadata.version('hiredis')}" if HIREDIS_AVAILABLE else "no hiredis"
    return f"{server.version.split(' sha=')[0]}, redis-py {importlib.metadata.version('redis')}, {hi}"


def run(
    quick: bool = False,
    *,
    out: Path | None = None,
    report: bool = True,
    skip: Sequence[str] = (),
    command: str | None = None,
    progress: bool = True,
) -> dict:
    """Runs the comparison; writes the JSON, the plot and (``report``) the RESULTS.md section.
    Returns the result."""
    from bench.report import machine

    plan = QUICK if quick else FULL
    out = out or RESULTS_DIR / "peers.json"
    systems: dict[str, dict] = {}
    runners: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-peers-") as tmpdir:
        tmp = Path(tmpdir)
        kv = KVStoreServer(tmp, "1GiB" if plan.batch_bytes > (64 << 20) else "512MiB")
        redis_server: RedisServer | None = None
        suite: Suite | None = None
        try:
            for t in ("shm", "tcp"):
                runners.append(Runner(KVStorePeer(kv.meta, t)))
                systems[f"kvstore-{t}"] = {
                    "status": "ok",
                    "version": f"kvstore {importlib.metadata.version('kvstore')}",
                    "how": f"`kvstore serve` on 127.0.0.1, SyncKVStoreClient(transport={t!r})",
                }
            if "redis" in skip:
                systems["redis"] = {"status": "skipped", "reason": "left out with --skip redis"}
            else:
                try:
                    importlib.import_module("redis")
                    redis_server = RedisServer(tmp)
                    runners.append(Runner(RedisPeer(redis_server.port)))
                    systems["redis"] = {
                        "status": "ok",
                        "version": _redis_versions(redis_server),
                        "how": "redis-server on 127.0.0.1 (--save '' --appendonly no); one key per block, "
                        "pipelined SET / GET, EXISTS of 1000 keys per lookup (LMCache also keeps a small "
                        "metadata key per block; left out here, which favours Redis)",
                    }
                except (Skip, ImportError, BenchError) as e:
                    reason = (
                        "redis-py is not installed (pip install redis hiredis)"
                        if isinstance(e, ImportError)
                        else str(e)
                    )
                    systems["redis"] = {"status": "skipped", "reason": reason}
                    print(f"peers: redis skipped: {reason}", file=sys.stderr)
            if "mooncake" in skip:
                systems["mooncake"] = {"status": "skipped", "reason": "left out with --skip mooncake"}
            else:
                try:
                    print("peers: starting Mooncake in a private network namespace ...", file=sys.stderr)
                    mc = start_mooncake(tmp, plan)
                    runners.append(mc)
                    systems["mooncake"] = {
                        "status": "ok",
                        "version": mc.info["version"],
                        "how": "mooncake_master + a storage process (segment "
                        f"{mc.info['segment_bytes'] >> 20} MiB) + client, TCP transport, all in a private "
                        "network namespace (`unshare -n`, loopback only); batch_put_from / batch_get_into on "
                        "registered buffers, get_into per object, batch_is_exist of 1000 keys per lookup",
                    }
                except (Skip, BenchError) as e:
                    systems["mooncake"] = {"status": "skipped", "reason": str(e)}
                    print(f"peers: mooncake skipped: {e}", file=sys.stderr)
            suite = Suite(runners, plan, progress=progress)
            measured = suite.run()
        finally:
            if suite is not None:
                suite.close()
            else:
                for r in runners:
                    r.close()
            if redis_server is not None:
                redis_server.stop()
            kv.stop()
    for name, reason in measured["failed"].items():
        systems[name].update(status="failed", reason=reason)
    result = {
        "command": command or "python bench/peers.py" + (" --quick" if quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "seed": SEED,
        "plan": asdict(plan),
        "systems": systems,
        "sizes": measured["sizes"],
        "lookup": measured["lookup"],
    }
    result["comparisons"] = compare(result)
    result["losses"] = losses(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = out.with_name("peers_throughput.png")
    has_plot = plot(result, png)
    if report:
        from bench.report import update_section

        update_section("peers", render(result, png.name if has_plot else None))
    return result


# ---- comparisons and the report ----------------------------------------------------------------

# (metric, label, unit, higher is better)
METRICS = (
    ("put_gbps", "put", "GB/s", True),
    ("get_gbps", "get", "GB/s", True),
    ("get_p50_ms", "get p50", "ms", False),
    ("get_p99_ms", "get p99", "ms", False),
)
LABELS = {"kvstore-shm": "kvstore shm", "kvstore-tcp": "kvstore tcp", "redis": "Redis", "mooncake": "Mooncake"}


def compare(r: dict) -> list[dict]:
    """kvstore (each path) against each peer, per metric and size. ``advantage`` > 1 means
    kvstore is better (higher throughput, lower latency)."""
    rows = []

    def add(kv: str, peer: str, metric: str, size: str, a: float, b: float, higher: bool) -> None:
        if a <= 0 or b <= 0:
            return
        rows.append({"kvstore": kv, "peer": peer, "metric": metric, "size": size, "kvstore_value": a,
                     "peer_value": b, "advantage": round(a / b if higher else b / a, 3)})  # fmt: skip

    for kv in KVSTORE:
        for peer in PEERS:
            for size, s in r["sizes"].items():
                a, b = s["systems"].get(kv), s["systems"].get(peer)
                if a and b:
                    for metric, _, _, higher in METRICS:
                        add(kv, peer, metric, size, a[metric], b[metric], higher)
            a, b = r["lookup"].get(kv), r["lookup"].get(peer)
            if a and b:
                add(kv, peer, "lookup_keys_per_s", "1000 keys", a["keys_per_s"], b["keys_per_s"], True)
    return rows


def _fmt(v: float, unit: str) -> str:
    if unit == "keys/s":
        return f"{v / 1e6:.2f} M keys/s" if v >= 1e6 else f"{v / 1e3:.0f} k keys/s"
    return f"{v:.2f} {unit}" if unit == "GB/s" else f"{v:.3g} {unit}"


def losses(r: dict) -> list[str]:
    """One sentence per (kvstore path, peer) naming every metric where kvstore is behind, and by
    how much."""
    units = {m: (label, unit) for m, label, unit, _ in METRICS}
    units["lookup_keys_per_s"] = ("lookups", "keys/s")
    out = []
    for kv in KVSTORE:
        for peer in PEERS:
            parts = []
            for c in r["comparisons"]:
                if c["kvstore"] != kv or c["peer"] != peer or c["advantage"] >= 1:
                    continue
                label, unit = units[c["metric"]]
                higher = c["metric"] not in ("get_p50_ms", "get_p99_ms")
                a, b = c["kvstore_value"], c["peer_value"]
                if c["advantage"] <= 0.5:  # the peer is at least twice as good: say how many times
                    how = f"{1 / c['advantage']:.1f}x {'less' if higher else 'longer'}"
                else:
                    pct = (1 - a / b) * 100 if higher else (a / b - 1) * 100
                    how = f"{pct:.{1 if pct < 1 else 0}f}% {'lower' if higher else 'longer'}"
                where = "" if c["metric"] == "lookup_keys_per_s" else f" at {c['size']}"
                parts.append(f"{label}{where} ({_fmt(a, unit)} vs {_fmt(b, unit)}, {how})")
            if parts:
                out.append(f"{LABELS[kv]} is behind {LABELS[peer]} on " + "; ".join(parts) + ".")
    return out


def _latency_note(r: dict) -> str:
    """Where kvstore's single-object gets lose, the measured reason: each one starts with a
    metadata round trip, whose bare cost is the one-key lookup."""
    if not any(c["metric"] in ("get_p50_ms", "get_p99_ms") and c["advantage"] < 1 for c in r["comparisons"]):
        return ""
    lk = r["lookup"]
    kv = [lk[k]["one_key_p50_ms"] for k in KVSTORE if k in lk]
    peers = [f"{LABELS[p]} {lk[p]['one_key_p50_ms']:.3f} ms" for p in PEERS if p in lk]
    if not kv or not peers:
        return ""
    return (
        "Single-object gets: every kvstore `get_into` begins with a round trip to the metadata service "
        "(gRPC `Acquire`, for the read lease and the placement) before the copy, and ends with a `Release`; "
        "a Redis GET or a Mooncake `get_into` is one request on an open connection. The bare round trip "
        f"shows in the one-key lookup: p50 {min(kv):.3f} ms for kvstore against " + ", ".join(peers) + ". "
        "A batch pays it once per call, which is why the batch GB/s above do not show it."
    )


def plot(r: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(r["sizes"])
    x = np.arange(len(names))
    systems = [s for s in (*KVSTORE, *PEERS) if any(s in r["sizes"][n]["systems"] for n in names)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, metric, title in ((axes[0], "get_gbps", "get"), (axes[1], "put_gbps", "put")):
        for s in systems:
            ys = [r["sizes"][n]["systems"].get(s, {}).get(metric, np.nan) for n in names]
            ax.plot(x, ys, marker="o", label=LABELS[s])
        ax.set_xticks(x, names)
        ax.set_xlabel("object size")
        ax.set_title(f"{title} throughput (batch of {r['plan']['batch_bytes'] >> 20} MiB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle("kvstore vs peers on identical objects, same host, one run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(r: dict, png: str | None) -> str:
    p = r["plan"]
    ok = [s for s in (*KVSTORE, *PEERS) if r["systems"].get(s, {}).get("status") == "ok"]
    lines = [
        "## kvstore vs Redis and Mooncake Store (`bench/peers.py`)",
        "",
        f"- Command: `{r['command']}`",
        f"- Date: {r['date']}",
        f"- Machine: {r['machine']}",
        f"- Objects: seeded random bytes (seed {r['seed']}), identical for every system; batches of "
        f"{p['batch_bytes'] >> 20} MiB per size; put and get GB/s are medians of {p['reps']} interleaved "
        "repetitions after one uncounted warm-up; every get lands in a zeroed, pre-touched buffer and is "
        f"compared byte for byte with the source. Latency: {p['latency_samples']} single-object gets per "
        f"system and size after warm-up. Lookups: {p['lookup_keys']} existence checks per call, one caller, "
        f"{p['lookup_s']:g} s per system.",
        "",
        "| system | version | how |",
        "|---|---|---|",
    ]
    for s in (*KVSTORE, *PEERS):
        info = r["systems"].get(s)
        if info is None:
            continue
        if info["status"] == "ok":
            lines.append(f"| {LABELS[s]} | {info['version']} | {info['how']} |")
        else:
            lines.append(f"| {LABELS[s]} | {info['status']} | {info['reason']} |")
    lines += [
        "",
        "| object | system | put GB/s | get GB/s | get p50 ms | get p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for size, s in r["sizes"].items():
        for name in ok:
            m = s["systems"].get(name)
            if m:
                lines.append(
                    f"| {size} | {LABELS[name]} | {m['put_gbps']:.2f} | {m['get_gbps']:.2f} "
                    f"| {m['get_p50_ms']:.3f} | {m['get_p99_ms']:.3f} |"
                )
    lines += [
        "",
        "| lookups | 1000 keys per call: keys/s | p50 ms per call | p99 ms per call | one key per call: p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for name in ok:
        lk = r["lookup"].get(name)
        if lk:
            lines.append(
                f"| {LABELS[name]} | {lk['keys_per_s']:,} | {lk['p50_ms']:.3f} | {lk['p99_ms']:.3f} "
                f"| {lk['one_key_p50_ms']:.3f} | {lk['one_key_p99_ms']:.3f} |"
            )
    pairs = [(kv, peer) for peer in PEERS for kv in KVSTORE if any(c["kvstore"] == kv and c["peer"] == peer for c in r["comparisons"])]  # fmt: skip
    if pairs:
        lines += [
            "",
            "kvstore's advantage over each peer (> 1: kvstore better; throughput kvstore / peer, latency peer / kvstore):",
            "",
            "| metric | " + " | ".join(f"{LABELS[kv]} vs {LABELS[peer]}" for kv, peer in pairs) + " |",
            "|---|" + "---|" * len(pairs),
        ]
        adv = {(c["kvstore"], c["peer"], c["metric"], c["size"]): c["advantage"] for c in r["comparisons"]}
        rows = [(m, label, size) for size in r["sizes"] for m, label, _, _ in METRICS]
        rows.append(("lookup_keys_per_s", "lookups keys/s", "1000 keys"))
        for m, label, size in rows:
            cells = [adv.get((kv, peer, m, size)) for kv, peer in pairs]
            name = label if m == "lookup_keys_per_s" else f"{label} {size}"
            lines.append(f"| {name} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    lines.append("")
    if r["losses"]:
        lines.append("Where kvstore is behind:")
        lines.append("")
        lines += [f"- {s}" for s in r["losses"]]
        why = _latency_note(r)
        if why:
            lines += ["", why]
    elif pairs:
        lines.append("kvstore is ahead of every measured peer on every metric in this run.")
    missing = [s for s in PEERS if r["systems"].get(s, {}).get("status") != "ok"]
    if missing:
        lines += [
            "",
            "Not measured in this run: "
            + "; ".join(f"{LABELS[s]} ({r['systems'].get(s, {}).get('reason', 'not run')})" for s in missing)
            + ". The tables compare kvstore with the remaining systems only.",
        ]
    if png:
        lines += ["", f"![kvstore vs peers](results/{png})"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller batches and fewer repetitions (about a minute)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "peers.json")
    ap.add_argument("--no-report", action="store_true", help="do not rewrite bench/RESULTS.md")
    ap.add_argument("--skip", action="append", default=[], choices=PEERS, help="leave a peer out")
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rebuild the plot and the RESULTS.md section from --out, measure nothing",
    )
    ap.add_argument("--mooncake-worker", help=argparse.SUPPRESS)
    ap.add_argument("--mooncake-storage", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.mooncake_worker:
        return mooncake_worker(json.loads(ns.mooncake_worker))
    if ns.mooncake_storage:
        return mooncake_storage(json.loads(ns.mooncake_storage))
    if ns.render_only:
        r = json.loads(ns.out.read_text())
        r["comparisons"] = compare(r)
        r["losses"] = losses(r)
        ns.out.write_text(json.dumps(r, indent=2) + "\n")
        png = ns.out.with_name("peers_throughput.png")
        has_plot = plot(r, png)
        if not ns.no_report:
            from bench.report import update_section

            update_section("peers", render(r, png.name if has_plot else None))
        return 0
    cmd = "python bench/peers.py" + (" --quick" if ns.quick else "") + "".join(f" --skip {s}" for s in ns.skip)
    r = run(ns.quick, out=ns.out, report=not ns.no_report, skip=ns.skip, command=cmd)
    for size, s in r["sizes"].items():
        for name, m in s["systems"].items():
            print(f"{size:>7} {name:<12} put {m['put_gbps']:6.2f} GB/s  get {m['get_gbps']:6.2f} GB/s  "
                  f"p50 {m['get_p50_ms']:7.3f} ms  p99 {m['get_p99_ms']:7.3f} ms")  # fmt: skip
    for name, lk in r["lookup"].items():
        print(
            f"lookup  {name:<12} {lk['keys_per_s']:>12,} keys/s  p50 {lk['p50_ms']:.3f} ms  p99 {lk['p99_ms']:.3f} ms"
        )
    for name, info in r["systems"].items():
        if info["status"] != "ok":
            print(f"{name}: {info['status']}: {info['reason']}")
    for s in r["losses"]:
        print(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
