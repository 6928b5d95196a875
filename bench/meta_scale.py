#!/usr/bin/env python3
"""The metadata service and one cache daemon, as separate processes, holding 10k to 10M blocks:
fill rate, resident memory per block, lookup latency, and how long a restart of either takes.

    python bench/meta_scale.py                          # 10k, 1M and 10M blocks
    python bench/meta_scale.py --sizes 10000,1000000    # any sizes
    python bench/meta_scale.py --sizes 10000,100000 --timeout 120 --no-report

For each N this starts a ``kvstore meta`` process on a fixed loopback port (default settings, or
``meta.index`` from ``--index`` on versions that have both indexes) and one ``kvstore
daemon`` whose DRAM arena holds N extents of 256 bytes with headroom (no SSD, nothing evicted),
and a client in this process (``SyncKVStoreClient``) puts N blocks of 192 bytes (one 256-byte
extent each) in puts of 4,096 blocks. Keys are chains of 64 blocks made by
``kvstore.keys.KeySpace`` (chain c: tokens 1024c .. 1024c+1023), all computed before the fill.
Then, in order:

- **fill**: blocks committed per second over the whole fill (``fill_blocks_per_s``), and the CPU
  time each process spent on it per block (this process, the service, the daemon, from /proc);
- **memory**: each process's resident memory (VmRSS, /proc/<pid>/status) after the fill less
  before it, over N (``meta_rss_bytes_per_block``, ``daemon_rss_bytes_per_block``; the daemon's
  includes the arena pages its commits touch, RssShmem, so its anonymous share is given too);
- **lookups**: 1,000 lookups of 1,000 keys (16 stored chains drawn at random, in chain order), each
  timed, from one caller, on the service's lookup port (the client's default): p50 and p99; then
  20,000 one-key lookups of random stored keys, one after the other: lookups per second;
- **service restart**: ``kill -9`` of the service while its daemon holds the N blocks, a new one
  started on the same address, and the time from the kill until every key of a sample of 2,000
  random stored keys is found again by lookups (the daemon registers again with its inventory
  and the service rebuilds its index from it). ``daemons_dropped`` counts what the new service
  counted as lost daemons (its ``daemons_lost`` counter) plus registrations of the daemon beyond
  the one a restart takes (the daemon's ``registrations`` counter, from its /metrics), read also
  when the sample was not found in time;
- **daemon restart**: ``kill -9`` of the daemon (its arena stays in /dev/shm), a new one started
  with the same identity and arena, and the time from the kill until the new process has
  registered and the same sample is found by lookups; the sample is then read back through a
  new client.

Throughout, the service's own gauge of its event loop (``kvstore_event_loop_lag_max_seconds``:
the longest the loop was held in the last minute, :mod:`kvstore.loop_watch`) is read every two
seconds: the longest hold per phase (``loop_max_hold_ms_<phase>``) and over the point
(``loop_max_hold_ms``), which the service's work at scale (a registration of N blocks, a lost
daemon's drop) is to keep within 50 ms.

Every phase waits at most ``--timeout`` seconds (600 by default); one that runs out is recorded
as ``null`` and named in ``timed_out``, and the point's later phases are skipped when the fill
did not finish. Every process started here is killed, and the daemon's shared-memory files
removed, at the end, on an error or on an interrupt.

No external baseline: the figures asked for are ratios of the same system at 10M blocks over
10k (``lookup1000_p99_10m_over_10k``, ``one_key_lookups_10m_over_10k``), measured in one run;
each pair of largest over smallest size is given likewise.

Figures (``bench/results/meta_scale.json``): per point and at top level, with <n> the size as
10k, 1m, 10m: ``fill_blocks_per_s`` (top level: the largest N), ``meta_rss_bytes_per_block_<n>``,
``daemon_rss_bytes_per_block_<n>``, ``lookup1000_p99_<n>`` (ms), ``one_key_lookups_<n>`` (per
second), ``restart_<n>_s``, ``daemon_restart_<n>_s``, ``loop_max_hold_ms_<n>``, ``daemons_dropped``,
``timed_out``.
``--profile DIR`` also records the largest N with py-spy (collapsed stacks): the fill (this
process, the service, the daemon), the service restart (the new service and the daemon) and the
daemon restart (the service, until the new daemon is ready). It slows what it records, so the
figures of such a run are not comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.report import machine, update_section  # noqa: E402
from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient, procs  # noqa: E402
from kvstore.config import ClientConfig  # noqa: E402
from kvstore.daemon.arena import remove_files  # noqa: E402
from kvstore.errors import KVStoreError  # noqa: E402
from kvstore.extent import extent_size  # noqa: E402
from kvstore.keys import KEY_BYTES  # noqa: E402

RESULTS = REPO / "bench" / "results" / "meta_scale.json"
SIZES = (10_000, 1_000_000, 10_000_000)
BATCH = 4096  # blocks per put
PAYLOAD = 192  # bytes per block: one 256-byte extent with its 64-byte header
CHAIN = 64  # blocks per chain
TOKENS = 16  # tokens per block
LOOKUPS = 1000
LOOKUP_KEYS = 1000
ONE_KEY = 20_000
SAMPLE = 2000
COUNTER_TRIES = 6  # reads of the counters after a restart (each up to the 10 s call deadline)
SETTLE_S = 4.0  # after a restart: watched this long more for a daemon dropped late
POLL_S = 0.02
SHM_DIR = "/dev/shm"
CLK = os.sysconf("SC_CLK_TCK")


class Timeout(Exception):
    """A phase ran past its deadline."""


def label(n: int) -> str:
    """10000 -> 10k, 1000000 -> 1m (the figures' suffixes)."""
    for div, unit in ((1_000_000, "m"), (1000, "k")):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssShmem"):
            out[name] = int(rest.split()[0]) * 1024
    return out


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def metric(port: int, name: str) -> float:
    """One counter from a /metrics page (summed over its label sets)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    pat = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(v) for v in pat.findall(text))


class LoopHolds:
    """The longest the service's event loop was held, per phase: the service's own gauge
    (``kvstore_event_loop_lag_max_seconds``, the longest hold of its last minute) read every
    ``POLL_S`` from a thread, from whichever service process runs at the time."""

    POLL_S = 2.0

    def __init__(self, cl: Cluster) -> None:
        self.cl = cl
        self.phase = "start"
        self.max_s: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loop-holds", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        meta = self.cl.meta
        port = meta.info.get("metrics_port") if meta is not None and meta.alive() else None
        if not port:
            return
        try:
            v = metric(port, "kvstore_event_loop_lag_max_seconds")
        except OSError:  # not answering this round (restarting, busy)
            return
        self.max_s[self.phase] = max(self.max_s.get(self.phase, 0.0), v)

    def _run(self) -> None:
        while not self._stop.wait(self.POLL_S):
            self._read()

    def enter(self, phase: str) -> None:
        self._read()  # what the phase before ended with
        self.phase = phase

    def close(self) -> dict:
        self._read()
        self._stop.set()
        self._thread.join(10)
        out = {f"loop_max_hold_ms_{ph}": round(v * 1000, 1) for ph, v in self.max_s.items()}
        out["loop_max_hold_ms"] = round(max(self.max_s.values(), default=0.0) * 1000, 1)
        return out


def make_keys(n: int) -> np.ndarray:
    """N block keys, chains of CHAIN blocks in order, as an (N, 16) uint8 array."""
    ks = KeySpace(ModelFingerprint("meta-scale", "bf16", 1, 1, 64, block_size=TOKENS), namespace="meta-scale")
    out = np.empty((n, KEY_BYTES), np.uint8)
    per = CHAIN * TOKENS
    with tqdm(total=n, desc="keys", unit="key", unit_scale=True, leave=False) as bar:
        for c, lo in enumerate(range(0, n, CHAIN)):
            m = min(CHAIN, n - lo)
            packed = ks.packed_block_keys(np.arange(c * per, c * per + m * TOKENS, dtype=np.uint32))
            out[lo : lo + m] = np.frombuffer(packed, np.uint8).reshape(m, KEY_BYTES)
            if c % 256 == 255:
                bar.update(256 * CHAIN)
        bar.update(n - bar.n)
    return out


class Cluster:
    """One service on a fixed port and one daemon of a fixed identity; both can be killed and
    started again. ``close`` kills whatever runs and removes the daemon's shared-memory files."""

    def __init__(self, tmp: Path, n: int, index: str) -> None:
        self.tmp = tmp
        self.addr = f"127.0.0.1:{procs.free_port()}"
        self.daemon_id = f"scale-{os.getpid()}-{label(n)}"
        self.dram = max(64 << 20, int(n * extent_size(PAYLOAD) / 0.75) + (64 << 20))
        self.sets = ["--set", f"meta.index={index}"] if index != "default" else []
        self.meta: procs.Child | None = None
        self.daemon: procs.Child | None = None

    def start_meta(self, timeout: float) -> procs.Child:
        with open(self.tmp / "meta.log", "ab") as log:
            self.meta = procs.start(
                ["meta", "--listen", self.addr, "--metrics-port", "0", *self.sets],
                name="kvstore meta", stderr=log, cwd=REPO, timeout=timeout,
            )  # fmt: skip
        return self.meta

    def start_daemon(self, timeout: float) -> procs.Child:
        with open(self.tmp / "daemon.log", "ab") as log:
            self.daemon = procs.start(
                ["daemon", "--meta", self.addr, "--dram", str(self.dram), "--data-dir", str(self.tmp / "data"),
                 "--metrics-port", "0", "--set", f"daemon.daemon_id={self.daemon_id}",
                 "--set", f"daemon.shm_dir={SHM_DIR}"],
                name="kvstore daemon", stderr=log, cwd=REPO, timeout=timeout,
            )  # fmt: skip
        return self.daemon

    def close(self) -> None:
        for child in (self.daemon, self.meta):
            if child is not None:
                try:
                    child.kill()
                except (OSError, subprocess.TimeoutExpired):
                    pass
        remove_files(f"{SHM_DIR}/kvstore-{self.daemon_id}-dram")
        staging = Path(f"{SHM_DIR}/kvstore-{self.daemon_id}-staging")
        if staging.exists():
            staging.unlink()

    def log_tail(self, chars: int = 2000) -> str:
        out = []
        for name in ("meta.log", "daemon.log"):
            p = self.tmp / name
            if p.exists():
                out.append(f"--- {name}\n{p.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)


def client(addr: str, rpc_timeout: float = 10.0) -> SyncKVStoreClient:
    return SyncKVStoreClient(addr, ClientConfig(meta=addr, rpc_timeout_s=rpc_timeout))


def fill(c: SyncKVStoreClient, keys: np.ndarray, deadline: float, pids: dict[str, int]) -> dict:
    n = len(keys)
    packed = keys.tobytes()
    payload = [np.zeros(PAYLOAD, np.uint8)] * BATCH
    cpu0 = {"client": sum(os.times()[:2]), **{k: cpu_s(p) for k, p in pids.items()}}
    stored = 0
    t0 = time.perf_counter()
    with tqdm(total=n, desc=f"fill {label(n)}", unit="block", unit_scale=True, leave=False) as bar:
        for i in range(0, n, BATCH):
            m = min(BATCH, n - i)
            stored += c.put(packed[i * KEY_BYTES : (i + m) * KEY_BYTES], payload[:m], chain=False).stored
            bar.update(m)
            if time.monotonic() > deadline:
                raise Timeout(f"fill: {stored:,} of {n:,} blocks stored when the deadline passed")
    secs = time.perf_counter() - t0
    cpu1 = {"client": sum(os.times()[:2]), **{k: cpu_s(p) for k, p in pids.items()}}
    if stored != n:
        raise RuntimeError(f"fill: stored {stored:,} of {n:,} blocks (the arena was sized for all)")
    return {
        "fill_s": round(secs, 3),
        "fill_blocks_per_s": round(n / secs),
        "fill_cpu_us_per_block": {k: round((cpu1[k] - cpu0[k]) / n * 1e6, 2) for k in cpu0},
    }


def lookups(c: SyncKVStoreClient, keys: np.ndarray, rng: np.random.Generator) -> dict:
    n = len(keys)
    chains = max(1, n // CHAIN)
    per = -(-LOOKUP_KEYS // CHAIN)
    lat = []
    for i in range(LOOKUPS + LOOKUPS // 10):  # the first tenth untimed (warm-up)
        pick = rng.choice(chains, size=min(per, chains), replace=False)
        q = np.concatenate([keys[p * CHAIN : (p + 1) * CHAIN] for p in pick])[:LOOKUP_KEYS].tobytes()
        t = time.perf_counter()
        hit = c.lookup(q)
        if i >= LOOKUPS // 10:
            lat.append(time.perf_counter() - t)
        if hit != len(q) // KEY_BYTES:
            raise RuntimeError(f"a lookup of stored chains hit {hit} of {len(q) // KEY_BYTES} keys")
    ones = [keys[i].tobytes() for i in rng.integers(0, n, ONE_KEY)]
    t = time.perf_counter()
    hits = sum(c.lookup([k]) for k in ones)
    one_s = time.perf_counter() - t
    if hits != ONE_KEY:
        raise RuntimeError(f"one-key lookups of stored keys hit {hits} of {ONE_KEY}")
    ms = np.array(lat) * 1000
    return {
        "lookup1000_p50_ms": round(float(np.percentile(ms, 50)), 3),
        "lookup1000_p99_ms": round(float(np.percentile(ms, 99)), 3),
        "one_key_lookups_per_s": round(ONE_KEY / one_s),
    }


def wait_found(addr: str, sample: list[bytes], deadline: float, on_poll=None) -> float:  # noqa: ANN001
    """Polls lookups of ``sample`` (new clients while the service does not answer) until every
    key is found; returns the time it was. ``on_poll`` runs at every round."""
    c = None
    try:
        while True:
            if on_poll is not None:
                on_poll()
            if time.monotonic() > deadline:
                raise Timeout("the sample was not found again before the deadline")
            try:
                if c is None:
                    c = client(addr, rpc_timeout=2.0)
                if all(c.exists(sample)):
                    return time.monotonic()
            except KVStoreError:
                if c is not None:
                    c.close()
                c = None
            time.sleep(POLL_S)
    finally:
        if c is not None:
            c.close()


def stats(addr: str, what: str):  # noqa: ANN201 - a StatsResponse, or None
    """The service's stats, asked again while it is too busy to answer in time (None at last)."""
    for _ in range(COUNTER_TRIES):
        try:
            with client(addr) as c:
                return c.stats()
        except KVStoreError as e:
            print(f"{what}: stats not read yet ({e})", flush=True)
    return None


def read_back(addr: str, sample: list[bytes]) -> int:
    out = [np.empty(PAYLOAD, np.uint8) for _ in sample]
    with client(addr) as c:
        return c.get_into(sample, out)


def restart_meta(cl: Cluster, sample: list[bytes], timeout: float, r: dict, tag: str, spies: Spies) -> None:
    """kill -9 of the service, a new one on the same address, until the sample is found. The
    daemon's drops are counted also when the sample is not found in time."""
    port = cl.daemon.info["metrics_port"]
    regs0 = metric(port, "kvstore_daemon_registrations_total")
    fails0 = metric(port, "kvstore_daemon_heartbeat_failures_total")
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    cl.meta.kill()
    cl.start_meta(max(1.0, deadline - time.monotonic()))
    r[f"restart_{tag}_meta_ready_s"] = round(time.monotonic() - t0, 3)
    spies.start("restart", {"meta": cl.meta.proc.pid, "daemon": cl.daemon.proc.pid})
    registered: list[float] = []
    asked = [0.0]

    def poll() -> None:  # the daemon's registrations, every 0.2 s (a scrape costs the daemon)
        if registered or time.monotonic() - asked[0] < 0.2:
            return
        asked[0] = time.monotonic()
        try:
            if metric(port, "kvstore_daemon_registrations_total") > regs0:
                registered.append(time.monotonic())
        except OSError:  # the daemon's /metrics did not answer this round
            pass

    try:
        t1 = wait_found(cl.addr, sample, deadline, poll)
        r[f"restart_{tag}_s"] = round(t1 - t0, 3)
        asked[0] = 0.0
        poll()
        if registered:
            r[f"restart_{tag}_registered_s"] = round(registered[0] - t0, 3)
        time.sleep(SETTLE_S)
    finally:
        spies.stop()
        r["daemons_dropped"] = None  # unknown until read
        st = stats(cl.addr, f"{tag:>5}: restart")  # what the new service and the daemon counted, found in time or not
        for _ in range(COUNTER_TRIES if st is not None else 0):
            try:
                regs = int(metric(port, "kvstore_daemon_registrations_total") - regs0)
                fails = int(metric(port, "kvstore_daemon_heartbeat_failures_total") - fails0)
            except OSError as e:  # a daemon too busy to answer
                print(f"{tag:>5}: restart: daemon counters not read yet ({e})", flush=True)
                continue
            r[f"restart_{tag}_keys"] = int(st.keys)
            r[f"restart_{tag}_registrations"] = regs
            r[f"restart_{tag}_daemon_call_failures"] = fails
            r["daemons_dropped"] = int(st.counters.get("daemons_lost", 0)) + max(0, regs - 1)
            break
    r[f"restart_{tag}_read_back"] = read_back(cl.addr, sample)


def restart_daemon(cl: Cluster, sample: list[bytes], timeout: float, r: dict, tag: str, spies: Spies) -> None:
    """kill -9 of the daemon (arena kept), a new one with the same identity, until the sample
    is found (lookups answer from the index, which still lists the killed daemon's blocks until
    its lease lapses, so the clock stops only once the new process has registered)."""
    st = stats(cl.addr, f"{tag:>5}: daemon restart")
    lost0 = None if st is None else int(st.counters.get("daemons_lost", 0))
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    cl.daemon.kill()
    spies.start("daemon_restart", {"meta": cl.meta.proc.pid})
    try:
        try:
            cl.start_daemon(max(1.0, deadline - time.monotonic()))  # READY once registered
        finally:
            spies.stop()
        r[f"daemon_restart_{tag}_ready_s"] = round(time.monotonic() - t0, 3)
        t1 = wait_found(cl.addr, sample, deadline)
        r[f"daemon_restart_{tag}_s"] = round(t1 - t0, 3)
    finally:
        st = stats(cl.addr, f"{tag:>5}: daemon restart")  # found in time or not
        if st is not None:
            r[f"daemon_restart_{tag}_keys"] = int(st.keys)
            if lost0 is not None:
                r[f"daemon_restart_{tag}_daemons_lost"] = int(st.counters.get("daemons_lost", 0)) - lost0
    r[f"daemon_restart_{tag}_read_back"] = read_back(cl.addr, sample)


class Spies:
    """py-spy recordings (collapsed stacks, ``<dir>/<phase>-<who>-<n>.txt``) of some processes
    for the length of a phase; nothing without a folder."""

    def __init__(self, folder: Path | None, tag: str) -> None:
        self.folder, self.tag = folder, tag
        self.exe = Path(sys.executable).with_name("py-spy")
        self.running: list[subprocess.Popen] = []
        if folder is not None and not self.exe.exists():
            print(f"--profile: {self.exe} not found (pip install py-spy)", file=sys.stderr)
            self.folder = None

    def start(self, phase: str, pids: dict[str, int]) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        for who, pid in pids.items():
            out = self.folder / f"{phase}-{who}-{self.tag}.txt"
            cmd = [str(self.exe), "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--output", str(out)]
            with open(out.with_suffix(".log"), "wb") as log:
                self.running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log))
        time.sleep(1.0)  # attached

    def stop(self) -> None:
        """Ends the recordings (SIGINT: py-spy writes what it has)."""
        for spy in self.running:
            if spy.poll() is None:
                spy.send_signal(signal.SIGINT)
        for spy in self.running:
            try:
                spy.wait(60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait(10)
        self.running = []


def point(
    n: int, tmp: Path, index: str, timeout: float, profile: Path | None = None, restarts: bool = True, seed: int = 0
) -> dict:
    tag = label(n)
    r: dict = {"blocks": n, "timed_out": []}
    keys = make_keys(n)
    rng = np.random.default_rng(seed)
    sample = [keys[i].tobytes() for i in rng.choice(n, size=min(SAMPLE, n), replace=False)]
    cl = Cluster(tmp, n, index)
    spies = Spies(profile, tag)
    holds = None
    try:
        cl.start_meta(timeout)
        holds = LoopHolds(cl)
        cl.start_daemon(timeout)
        r["dram_bytes"] = cl.dram
        pids = {"meta": cl.meta.proc.pid, "daemon": cl.daemon.proc.pid}
        with client(cl.addr) as c:
            assert c.lookup(keys[:1].tobytes()) == 0  # connections made, lookup port known
            before = {k: status(p) for k, p in pids.items()}
            holds.enter("fill")
            spies.start("fill", {"client": os.getpid(), **pids})
            try:
                r.update(fill(c, keys, time.monotonic() + timeout, pids))
            except Timeout as e:
                print(f"{tag}: {e}", flush=True)
                r["fill_blocks_per_s"] = None
                r["errors"] = {"fill": str(e)}
                r["timed_out"] += ["fill", "lookups", "restart", "daemon_restart"]
                return r
            finally:
                spies.stop()
            after = {k: status(p) for k, p in pids.items()}
            for who in pids:
                r[f"{who}_rss_before_bytes"] = before[who]["VmRSS"]
                r[f"{who}_rss_after_bytes"] = after[who]["VmRSS"]
                r[f"{who}_rss_bytes_per_block"] = round((after[who]["VmRSS"] - before[who]["VmRSS"]) / n, 1)
                r[f"{who}_anon_bytes_per_block"] = round((after[who]["RssAnon"] - before[who]["RssAnon"]) / n, 1)
            st = c.stats()
            if st.keys != n:
                raise RuntimeError(f"the service counts {st.keys:,} blocks, not {n:,}")
            r["fill_daemons_lost"] = int(st.counters.get("daemons_lost", 0))
            holds.enter("lookups")
            r.update(lookups(c, keys, rng))
        print(
            f"{tag:>5}: fill {r['fill_blocks_per_s']:,} blocks/s, service {r['meta_rss_bytes_per_block']:,.1f} "
            f"B/block, daemon {r['daemon_rss_bytes_per_block']:,.1f} B/block, lookup1000 p99 "
            f"{r['lookup1000_p99_ms']} ms, {r['one_key_lookups_per_s']:,} one-key lookups/s",
            flush=True,
        )
        for phase, fn in (("restart", restart_meta), ("daemon_restart", restart_daemon)) if restarts else ():
            holds.enter(phase)
            try:
                fn(cl, sample, timeout, r, tag, spies)
                print(f"{tag:>5}: {phase} {r[f'{phase}_{tag}_s']} s", flush=True)
            except (Timeout, RuntimeError, KVStoreError, OSError) as e:  # not ready, not answering
                print(f"{tag:>5}: {phase} timed out ({e})", flush=True)
                r[f"{phase}_{tag}_s"] = None
                r["timed_out"].append(phase)
                r.setdefault("errors", {})[phase] = str(e)
                if cl.meta is None or not cl.meta.alive() or cl.daemon is None or not cl.daemon.alive():
                    break
        return r
    except BaseException:
        print(cl.log_tail(), file=sys.stderr)
        raise
    finally:
        spies.stop()
        if holds is not None:
            r.update(holds.close())
        cl.close()


def summary(points: list[dict]) -> dict:
    """The top-level figures, named by size, and the largest over smallest ratios."""
    out: dict = {}
    by = {p["blocks"]: p for p in points}
    for n, p in sorted(by.items()):
        t = label(n)
        out[f"fill_blocks_per_s_{t}"] = p.get("fill_blocks_per_s")
        out[f"meta_rss_bytes_per_block_{t}"] = p.get("meta_rss_bytes_per_block")
        out[f"daemon_rss_bytes_per_block_{t}"] = p.get("daemon_rss_bytes_per_block")
        out[f"lookup1000_p50_{t}"] = p.get("lookup1000_p50_ms")
        out[f"lookup1000_p99_{t}"] = p.get("lookup1000_p99_ms")
        out[f"one_key_lookups_{t}"] = p.get("one_key_lookups_per_s")
        out[f"restart_{t}_s"] = p.get(f"restart_{t}_s")
        out[f"daemon_restart_{t}_s"] = p.get(f"daemon_restart_{t}_s")
        out[f"loop_max_hold_ms_{t}"] = p.get("loop_max_hold_ms")
    big = max(by)
    out["fill_blocks_per_s"] = by[big].get("fill_blocks_per_s")
    dropped = [p.get("daemons_dropped", 0) for p in points]
    out["daemons_dropped"] = None if None in dropped else sum(dropped)  # None: not read after a restart
    out["timed_out"] = [f"{ph}_{label(p['blocks'])}" for p in points for ph in p["timed_out"]]
    pairs = {(big, min(by))}
    if 10_000 in by:
        pairs |= {(n, 10_000) for n in by if n > 10_000}
    for hi, lo in sorted(pairs):
        if hi == lo:
            continue
        a, b = by[hi], by[lo]
        suffix = f"{label(hi)}_over_{label(lo)}"
        if a.get("lookup1000_p99_ms") and b.get("lookup1000_p99_ms"):
            out[f"lookup1000_p99_{suffix}"] = round(a["lookup1000_p99_ms"] / b["lookup1000_p99_ms"], 2)
        if a.get("one_key_lookups_per_s") and b.get("one_key_lookups_per_s"):
            out[f"one_key_lookups_{suffix}"] = round(a["one_key_lookups_per_s"] / b["one_key_lookups_per_s"], 2)
    return out


def plot(points: list[dict], path: Path, timeout: float) -> bool:
    """Lookup latency and restart times against N; a restart that ran out of time is an x at
    the limit."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ps = sorted(points, key=lambda p: p["blocks"])
    ns = [p["blocks"] for p in ps]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, name in (("lookup1000_p50_ms", "1000-key lookup p50"), ("lookup1000_p99_ms", "1000-key lookup p99")):
        a.plot(ns, [p.get(key) or np.nan for p in ps], "o-", label=name)
    a.set(xscale="log", xlabel="blocks held", ylabel="ms", ylim=(0, None))
    for (key, name), color in zip(
        (("restart", "service kill -9 to sample found"), ("daemon_restart", "daemon kill -9 to sample found")),
        ("tab:blue", "tab:orange"),
    ):
        ys = [p.get(f"{key}_{label(p['blocks'])}_s") for p in ps]
        b.plot(ns, [np.nan if y is None else y for y in ys], "o-", color=color, label=name)
        late = [n for n, p, y in zip(ns, ps, ys) if y is None and key in p["timed_out"]]
        if late:
            b.plot(
                late, [timeout] * len(late), "x", color=color, ms=10, mew=2, label=f"{name}: not within {timeout:g} s"
            )
    b.set(xscale="log", yscale="log", xlabel="blocks held", ylabel="seconds")
    for ax, where in ((a, "best"), (b, "lower right")):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc=where)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def commit() -> str | None:
    """The checkout's commit, with -dirty when tracked files differ from it; None outside git."""
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=REPO, capture_output=True, text=True,
            check=True, timeout=30,
        ).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def _num(p: dict, key: str, fmt: str = ",") -> str:
    if key not in p:
        return "-"
    return "timed out" if p[key] is None else format(p[key], fmt)


def report(result: dict) -> str:
    index = "default settings" if result["index"] == "default" else f"`meta.index={result['index']}`, else defaults"
    lines = [
        "## Metadata service and daemon at 10k to 10M blocks (`bench/meta_scale.py`)",
        "",
        f"- Command: `{result['command']}`",
        f"- Date: {result['date']}",
        f"- Machine: {result['machine']}",
        f"- Code: {result.get('commit') or 'unknown'}",
        f"- Setup: `kvstore meta` ({index}) and one `kvstore daemon` "
        f"(DRAM arena for every block with a quarter spare, no SSD) as separate processes on loopback; the "
        f"client (`SyncKVStoreClient`) in the bench process puts N blocks of {PAYLOAD} bytes (256-byte extents) "
        f"in puts of {BATCH:,}, keys in chains of {CHAIN} (`KeySpace`). Memory: VmRSS after the fill less before, "
        f"over N. Lookups: {LOOKUPS:,} of {LOOKUP_KEYS:,} keys (16 random stored chains), then {ONE_KEY:,} one-key "
        f"lookups, one caller, lookup port. Restarts: `kill -9`, a new process (the service on the same "
        f"address; the daemon on its arena), timed until all of {SAMPLE:,} random stored keys are found by "
        "lookups. No external baseline: the ratios compare the same system at two sizes in one run.",
        "",
        "| blocks | fill blocks/s | CPU us/block client / service / daemon | service B/block | daemon B/block "
        "(anon) | lookup 1000 p50 / p99 ms | one-key lookups/s | service restart s | daemon restart s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(result["points"], key=lambda p: p["blocks"]):
        t = label(p["blocks"])
        cpu = p.get("fill_cpu_us_per_block") or {}
        lines.append(
            f"| {p['blocks']:,} | {_num(p, 'fill_blocks_per_s')} | "
            f"{cpu.get('client', '-')} / {cpu.get('meta', '-')} / {cpu.get('daemon', '-')} | "
            f"{_num(p, 'meta_rss_bytes_per_block', ',.1f')} | {_num(p, 'daemon_rss_bytes_per_block', ',.1f')} "
            f"({_num(p, 'daemon_anon_bytes_per_block', ',.1f')}) | "
            f"{p.get('lookup1000_p50_ms', '-')} / {p.get('lookup1000_p99_ms', '-')} | "
            f"{_num(p, 'one_key_lookups_per_s')} | {_num(p, f'restart_{t}_s')} | {_num(p, f'daemon_restart_{t}_s')} |"
        )
    lines.append("")
    for k, v in result.items():
        if "_over_" in k:
            lines.append(f"- `{k}` = **{v}**")
    for p in sorted(result["points"], key=lambda p: p["blocks"]):
        phases = ", ".join(
            f"{k.removeprefix('loop_max_hold_ms_')} {v}" for k, v in p.items() if k.startswith("loop_max_hold_ms_")
        )
        if phases:
            lines.append(
                f"- {p['blocks']:,} blocks: the service's event loop held at most **{p['loop_max_hold_ms']} ms** "
                f"at a time (ms per phase: {phases}; the service's own `kvstore_event_loop_lag_max_seconds`)"
            )
    dropped = "not read" if result["daemons_dropped"] is None else result["daemons_dropped"]
    late = ", ".join(result["timed_out"]) or "none"
    lines.append(f"- `daemons_dropped` = **{dropped}**; timed out: {late}")
    if result.get("plot"):
        lines += ["", "![meta scale](results/meta_scale.png)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="blocks per point, comma-separated")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each phase may take (default 600)")
    ap.add_argument(
        "--index", default="default", help="meta.index for the service (on versions that have it); default: none set"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-report", action="store_true", help="print the section instead of rewriting RESULTS.md")
    ap.add_argument("--profile", type=Path, help="py-spy the largest size's phases into this folder")
    ap.add_argument("--no-restarts", action="store_true", help="fill and lookups only")
    ap.add_argument("--logs", type=Path, help="keep the logs and the daemon data folder under this folder")
    args = ap.parse_args(argv)
    sizes = sorted({int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()})
    if not sizes or sizes[0] < LOOKUP_KEYS:
        ap.error(f"--sizes: at least {LOOKUP_KEYS} blocks each")

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, interrupted)
    points = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvstore-meta-scale-") as tmp:
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix="kvstore-meta-scale-", dir=args.logs)
            for n in sizes:
                d = Path(tmp) / label(n)
                d.mkdir()
                prof = args.profile if n == sizes[-1] else None
                points.append(point(n, d, args.index, args.timeout, prof, not args.no_restarts))
    finally:
        signal.signal(signal.SIGTERM, old)
    cmd = "python bench/meta_scale.py" + ("" if args.sizes == ",".join(map(str, SIZES)) else f" --sizes {args.sizes}")
    if args.timeout != 600.0:
        cmd += f" --timeout {args.timeout:g}"
    if args.index != "default":
        cmd += f" --index {args.index}"
    cmd += " --no-restarts" if args.no_restarts else ""
    result = {
        "command": cmd,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "commit": commit(),
        "index": args.index,
        "batch": BATCH,
        "payload_bytes": PAYLOAD,
        "chain_blocks": CHAIN,
        "sample_keys": SAMPLE,
        "timeout_s": args.timeout,
        "points": points,
        **summary(points),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(points, args.out.with_suffix(".png"), args.timeout)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.no_report:
        print(report(result))
    else:
        update_section("meta_scale", report(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
