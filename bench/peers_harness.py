"""The measurement harness of bench/peers.py: the plan, the seeded objects and keys, and the code
that measures a system (:class:`Runner`, the same in this process and behind the Mooncake worker's
pipe) and interleaves every measurement over all systems (:class:`Suite`)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore import KeySpace, ModelFingerprint

SEED = 20261201
SIZES = {"64KiB": 64 << 10, "512KiB": 512 << 10, "2MiB": 2 << 20}
KVSTORE = ("kvstore-shm", "kvstore-tcp", "kvstore-tls")
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


class Unavailable(BenchError):
    """A system cannot run on this machine (not installed, no namespace); the message says why."""


class SystemFailed(BenchError):
    """A system could not be started or failed during the measurements: the run is void (no
    system is left out of a comparison behind the caller's back). ``system`` names it."""

    def __init__(self, system: str, why: str) -> None:
        super().__init__(f"{system}: {why}")
        self.system = system


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

    def latency(self, samples: int, seed: int, leased: bool = False) -> list[float]:
        """Single-object get round trips over the batch kept by the last rep, in a seeded random
        order, after a few uncounted ones; each result is checked. ``leased``: through the
        peer's ``get_one_leased`` (kvstore's path with a metadata round trip per get)."""
        get_one = self.peer.get_one_leased if leased else self.peer.get_one
        o = self._objs
        assert o is not None and self._kept is not None
        ones = self._kept[1]
        order = np.random.default_rng([SEED, seed, self.size]).integers(0, len(ones), samples + 5)
        out: list[float] = []
        for j, i in enumerate(order):
            d = o.dst.arrays[i]
            d.fill(0)
            t = time.perf_counter()
            get_one(ones[i], o.dst, int(i))
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


def _ms(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(len(s) * q))] * 1000, 4)


class Suite:
    """Runs every measurement over a set of runners, interleaved so that the machine's noise
    falls on all systems alike. A system that fails ends the run (:class:`SystemFailed`)."""

    def __init__(self, runners: list[Any], plan: Plan, *, progress: bool = True) -> None:
        self.runners = list(runners)
        self.plan = plan
        self.progress = progress

    def _each(self, fn: Callable[[Any], Any], order: Sequence[Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for r in order if order is not None else self.runners:
            try:
                out[r.name] = fn(r)
            except Exception as e:
                raise SystemFailed(r.name, f"failed during the measurements: {type(e).__name__}: {e}") from e
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
                leased: dict[str, list[float]] = {r.name: [] for r in self.runners}
                with_lease = [r for r in self.runners if hasattr(getattr(r, "peer", None), "get_one_leased")]
                per_round = max(1, p.latency_samples // p.rounds)
                for rnd in range(p.rounds):
                    for sys_name, xs in self._each(lambda r: r.latency(per_round, rnd)).items():
                        lat[sys_name] += xs
                    for sys_name, xs in self._each(lambda r: r.latency(per_round, rnd, True), with_lease).items():
                        leased[sys_name] += xs
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
                            **(
                                {
                                    "get_leased_p50_ms": _ms(leased[r.name], 0.50),
                                    "get_leased_p99_ms": _ms(leased[r.name], 0.99),
                                }
                                if leased[r.name]
                                else {}
                            ),  # fmt: skip
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
        return {"sizes": sizes, "lookup": lookup}

    def close(self) -> None:
        for r in self.runners:
            try:
                r.close()
            except Exception as e:  # noqa: PERF203
                print(f"peers: closing {r.name}: {e}", file=sys.stderr)
