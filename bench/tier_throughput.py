#!/usr/bin/env python3
"""SSD tier: throughput through the client against raw direct I/O, compression on KV, and
warm-restart time.

    python bench/tier_throughput.py            # full size
    python bench/tier_throughput.py --quick    # about a minute

In one run, on the filesystem of the data folder (``--dir``, default a temporary folder under
the repository's filesystem):

- SSD-tier ``put`` and ``get_into`` GB/s through the client (a daemon whose DRAM segment is too
  small for any block, so every block is written to and read from its SSD segment through the
  data port; the daemon reads with O_DIRECT into its staging region and verifies there, the
  client copies once), against raw O_DIRECT writes and reads of the same byte count in the same
  block size, with as many reads in flight as kvstore keeps. Each repetition reads the raw file
  just before and just after kvstore's get and compares the get with their mean (this device's
  speed drifts within seconds); ``ssd_read_over_raw`` is the median of those ratios. The share of
  each read's time the device was busy (io_ticks of /proc/diskstats) says whether the disk or
  kvstore was the limit;
- lz4 ratio and GB/s with and without byte-shuffle, on KV produced by a real forward pass of the
  engine's model when the engine is importable (else on normally distributed bf16 and fp16
  tensors, and the report says so);
- warm restart: a daemon is stopped with SIGKILL while its SSD segment holds 100k blocks, then
  started again; seconds until it is ready (journal replay plus header and checksum of every
  block) and until the metadata service serves all of them.

Writes bench/results/tiers.json and the "tiers" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import machine, update_section  # noqa: E402
from kvstore import (  # noqa: E402
    KeySpace,
    ModelFingerprint,
    SyncKVStoreClient,
    procs,  # noqa: E402
)
from kvstore.config import ClientConfig  # noqa: E402
from kvstore.daemon.arena import remove_files  # noqa: E402
from kvstore.daemon.reads import IO_WORKERS, READ_AHEAD  # noqa: E402

# Direct reads kvstore keeps in flight for one large get from SSD: READ_AHEAD submitted per
# data-port connection, one connection per client I/O thread, run by at most IO_WORKERS threads.
# The raw baseline reads with as many.
INFLIGHT = min(READ_AHEAD * ClientConfig().io_threads, IO_WORKERS)


def start(args: list[str]) -> tuple[subprocess.Popen, dict]:
    child = procs.start([*args, "--log-level", "warning"], cwd=REPO)
    return child.proc, child.info


def aligned(size: int) -> np.ndarray:
    m = mmap.mmap(-1, size)
    a = np.frombuffer(m, np.uint8)
    a[:] = 1
    return a


def io_ticks(path: Path):  # noqa: ANN201 - a function, or None
    """A function giving the milliseconds the block device under ``path`` has been busy (the
    io_ticks of /proc/diskstats), or None where that is not known."""
    st = os.stat(path)
    dev = (os.major(st.st_dev), os.minor(st.st_dev))

    def ticks() -> int | None:
        try:
            with open("/proc/diskstats") as f:
                for line in f:
                    parts = line.split()
                    if (int(parts[0]), int(parts[1])) == dev:
                        return int(parts[12])
        except (OSError, ValueError, IndexError):
            return None
        return None

    return ticks if ticks() is not None else None


class RawFile:
    """The baseline: the same bytes in the same block size, in a file of its own on the same
    filesystem, written with O_DIRECT (no fsync: the same durability as the daemon's default
    ``fast`` mode, whose direct writes also skip the page cache) and read with O_DIRECT, one
    read at a time or ``inflight`` at a time (threads, each with its own aligned buffer), as
    many as kvstore keeps in flight."""

    def __init__(self, path: Path, blocks: list[np.ndarray], inflight: int) -> None:
        self.path, self.blocks, self.inflight = path, blocks, inflight
        self.size = blocks[0].size
        self.buf = aligned(self.size)
        self.bufs = [aligned(self.size) for _ in range(inflight)]
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, self.size * len(blocks))

    def write(self) -> None:
        for i, b in enumerate(self.blocks):
            self.buf[:] = b  # the same staging copy the daemon makes
            os.pwrite(self.fd, self.buf, i * self.size)

    def read_sequential(self) -> None:
        for i in range(len(self.blocks)):
            os.preadv(self.fd, [self.buf], i * self.size)

    def read(self) -> None:
        n, k_in = len(self.blocks), self.inflight

        def lane(k: int) -> None:  # reads k, k + inflight, ... into its own buffer
            for i in range(k, n, k_in):
                os.preadv(self.fd, [self.bufs[k]], i * self.size)

        with ThreadPoolExecutor(k_in) as ex:
            list(ex.map(lane, range(k_in)))

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


def measure_throughput(work: Path, total: int, block: int, reps: int, direct: bool = True) -> dict:
    meta, minfo = start(["meta", "--listen", "127.0.0.1:0"])
    daemon, dinfo = start(["daemon", "--meta", minfo["meta"], "--dram", "1MiB", "--data-dir", str(work / ("d-direct" if direct else "d-buffered")),
                           "--set", f"daemon.ssd_bytes={total * 2 + (64 << 20)}", "--set", "daemon.ssd_compress=off",
                           "--set", f"daemon.ssd_direct_io={str(direct).lower()}"])  # fmt: skip
    n = total // block
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, block - 4096, dtype=np.uint8) for _ in range(n)]  # extent = block with header
    dests = [np.ones(b.size, np.uint8) for b in blocks]
    ks = KeySpace(ModelFingerprint("bench-ssd", "bf16", 32, 8, 128))
    out: dict = {"block_bytes": blocks[0].size, "blocks": n, "bytes": n * blocks[0].size}
    samples: dict[str, list[float]] = {
        k: [] for k in ("raw_write", "raw_read_seq", "raw_read", "ssd_put", "ssd_get", "read_ratio", "write_ratio")
    }
    busy: dict[str, list[float]] = {"raw_read": [], "ssd_get": []}
    ticks = io_ticks(work)
    out["raw_inflight"] = INFLIGHT

    def timed(fn):  # noqa: ANN001, ANN202 - its answer, seconds, and the device's busy share meanwhile
        k0 = ticks() if ticks else None
        t = time.perf_counter()
        ret = fn()
        dt = time.perf_counter() - t
        k1 = ticks() if ticks else None
        share = (k1 - k0) / 1000 / dt if k0 is not None and k1 is not None else float("nan")
        return ret, dt, share

    try:
        with SyncKVStoreClient(minfo["meta"], ClientConfig(rpc_timeout_s=120, io_timeout_s=120)) as c:
            for rep in tqdm(range(reps + 1), desc="ssd throughput", unit="rep"):
                keys = ks.block_keys(np.arange(rep * n * 16, (rep + 1) * n * 16))
                # Every read, kvstore's and the baseline's, is the first read of bytes just
                # written (a re-read of the same file comes faster on this virtual disk).
                raw = RawFile(work / "raw.bin", blocks, INFLIGHT)
                try:
                    _, tw, _ = timed(raw.write)
                    _, tp0, busy_raw0 = timed(raw.read)
                finally:
                    raw.close()
                res, t_put, _ = timed(lambda: c.put(keys, blocks))  # noqa: B023
                assert res.stored == n, f"stored {res.stored} of {n}"
                tiers = {s.tier: s.blocks for s in c.stats().segments}
                assert tiers.get(2, 0) >= n, f"blocks not on SSD: {tiers}"
                got, t_get, busy_get = timed(lambda: c.get_into(keys, dests))  # noqa: B023
                assert got == n and np.array_equal(dests[-1], blocks[-1])
                # The raw reads again, after: kvstore's get is bracketed by two baseline runs and
                # compared with their mean, since this device's speed drifts within seconds.
                raw = RawFile(work / "raw.bin", blocks, INFLIGHT)
                try:
                    raw.write()
                    _, tp1, busy_raw1 = timed(raw.read)
                finally:
                    raw.close()
                raw = RawFile(work / "raw.bin", blocks, 1)
                try:
                    raw.write()
                    _, tr, _ = timed(raw.read_sequential)
                finally:
                    raw.close()
                c.remove(keys)
                if rep:
                    nbytes = out["bytes"]
                    tp = (tp0 + tp1) / 2
                    samples["raw_write"].append(nbytes / tw / 1e9)
                    samples["raw_read_seq"].append(nbytes / tr / 1e9)
                    samples["raw_read"].append(nbytes / tp / 1e9)
                    samples["ssd_put"].append(nbytes / t_put / 1e9)
                    samples["ssd_get"].append(nbytes / t_get / 1e9)
                    samples["read_ratio"].append(tp / t_get)
                    samples["write_ratio"].append(tw / t_put)
                    busy["raw_read"].append((busy_raw0 + busy_raw1) / 2)
                    busy["ssd_get"].append(busy_get)
    finally:
        for p in (daemon, meta):
            p.terminate()
            p.wait(10)
        remove_files(dinfo["shm_path"])
    for k, v in samples.items():
        if not k.endswith("_ratio"):
            out[f"{k}_gbps"] = round(statistics.median(v), 3)
    # Each repetition's ratio pairs measurements seconds apart; the figure is their median.
    out["ssd_read_over_raw"] = round(statistics.median(samples["read_ratio"]), 3)
    out["ssd_read_over_raw_reps"] = [round(x, 3) for x in samples["read_ratio"]]
    out["ssd_write_over_raw"] = round(statistics.median(samples["write_ratio"]), 3)
    # The share of the get's time the device was busy (io_ticks): below the raw reads' share,
    # the disk waited on kvstore; at it, the disk itself is the limit.
    for k, v in busy.items():
        if v and all(x == x for x in v):  # NaN: the device's busy time is not known
            out[f"{k}_device_busy"] = round(statistics.median(v), 3)
    return out


def kv_samples() -> tuple[str, dict[str, np.ndarray]]:
    """KV bytes to compress: from a real forward pass of the engine's model when available."""
    try:
        return "the engine's `small` model (random weights, std 0.1): KV of a 1,024-token prefill", _engine_kv()
    except ImportError as e:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(8 << 20).astype(np.float32)
        bf16 = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return f"normal-distributed stand-in (engine not available: {e})", {
            "bf16": bf16,
            "fp16": x.astype(np.float16).view(np.uint8),
        }


def _engine_kv() -> dict[str, np.ndarray]:
    import torch

    from engine.config import EngineConfig, ModelConfig
    from engine.llm import LLMEngine
    from engine.model import LlamaForCausalLM

    torch.set_num_threads(1)
    out = {}
    ids = np.random.default_rng(0).integers(0, 256, 1024).tolist()
    for dtype, name in (("bfloat16", "bf16"), ("float32", "fp32")):
        model = LlamaForCausalLM.random(ModelConfig.small(dtype=dtype), seed=0, std=0.1)
        eng = LLMEngine(model, EngineConfig(num_blocks=80, enable_prefix_caching=False))
        eng.generate([ids], max_tokens=1)
        kv = eng.kv_cache.tensor[: 1024 // 16].contiguous()
        out[name] = kv.view(torch.uint8).reshape(-1).numpy().copy()
    # fp16 KV: the fp32 model's KV rounded, as an fp16 engine would hold it.
    out["fp16"] = out["fp32"].view(np.float32).astype(np.float16).view(np.uint8)
    return out


def measure_compression() -> tuple[str, dict]:
    import lz4.block

    from kvstore.daemon.codec import shuffle2

    source, samples = kv_samples()
    res = {}
    for name, raw in samples.items():
        row = {}
        for shuffle in (False, True):
            t = time.perf_counter()
            src = shuffle2(raw) if shuffle else raw
            c = lz4.block.compress(src, mode="fast", store_size=False)
            dt = time.perf_counter() - t
            row["shuffle" if shuffle else "plain"] = {
                "ratio": round(raw.size / len(c), 3),
                "gbps": round(raw.size / dt / 1e9, 3),
            }
        res[name] = row
    return source, res


def measure_restart(work: Path, blocks: int, block_bytes: int) -> dict:
    from kvstore.daemon.ssd import SsdSegment
    from kvstore.extent import SSD_ALIGN, Sealer, checksum, extent_size

    data_dir = work / "restart"
    data_dir.mkdir(parents=True, exist_ok=True)
    seg_bytes = blocks * extent_size(block_bytes, SSD_ALIGN) + (16 << 20)
    # Written as the daemon would (sealed with its secret, committed), then recovered by it.
    sealer = Sealer.load_or_create(data_dir / "daemon.secret")
    seg = SsdSegment(data_dir / "ssd", 2, seg_bytes, compress_policy="off", sealer=sealer)
    rng = np.random.default_rng(3)
    payload = rng.integers(0, 256, block_bytes, dtype=np.uint8)
    csum = checksum(payload)
    step = extent_size(block_bytes, SSD_ALIGN)
    for i in tqdm(range(blocks), desc="filling SSD segment", unit="block", miniters=5000):
        seg.write(i * step, i.to_bytes(16, "little"), payload, csum, i + 1)
        seg.commit(i * step, i.to_bytes(16, "little"), i + 1)
    seg.close()
    meta, minfo = start(["meta", "--listen", "127.0.0.1:0"])
    args = ["daemon", "--meta", minfo["meta"], "--dram", "16MiB", "--data-dir", str(data_dir),
            "--set", f"daemon.ssd_bytes={seg_bytes}", "--set", "daemon.daemon_id=restart"]  # fmt: skip
    try:
        d, info = start(args)  # first start: recovers what was written
        d.send_signal(signal.SIGKILL)
        d.wait()
        t = time.perf_counter()
        d, info = start(args)
        ready = time.perf_counter() - t
        with SyncKVStoreClient(minfo["meta"]) as c:
            while c.stats().keys < blocks:
                time.sleep(0.01)
            served = time.perf_counter() - t
            keys = [i.to_bytes(16, "little") for i in range(0, blocks, max(1, blocks // 50))]
            out = [np.empty(block_bytes, np.uint8) for _ in keys]
            assert all(c.get_into([k], [o]) == 1 for k, o in zip(keys, out))
            assert all(np.array_equal(o, payload) for o in out)
        d.terminate()
        d.wait(10)
    finally:
        meta.terminate()
        meta.wait(10)
        remove_files("/dev/shm/kvstore-restart-dram")
    return {"blocks": blocks, "block_bytes": block_bytes, "ready_s": round(ready, 3), "all_served_s": round(served, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", type=Path, default=None, help="work folder (its filesystem is the one measured)")
    ap.add_argument("--no-report", action="store_true")
    ns = ap.parse_args()
    total = (128 << 20) if ns.quick else (512 << 20)
    reps = 2 if ns.quick else 8
    restart_blocks = 20_000 if ns.quick else 100_000
    base = ns.dir or Path(tempfile.gettempdir())
    cmd = "python bench/tier_throughput.py" + (" --quick" if ns.quick else "")
    with tempfile.TemporaryDirectory(dir=base, prefix="kvstore-tiers-") as tmp:
        work = Path(tmp)
        result: dict = {
            "command": cmd,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine(),
        }
        result["filesystem"] = subprocess.run(
            ["df", "-hT", str(work)], capture_output=True, text=True
        ).stdout.splitlines()[-1]
        result["throughput"] = measure_throughput(work, total, 2 << 20, reps)
        # The same through the page cache: does direct I/O pay? (Reads of recently written data
        # then come from memory, which is not what a cold SSD read is: see the report.)
        result["throughput_buffered"] = measure_throughput(work, total, 2 << 20, reps, direct=False)
        source, comp = measure_compression()
        result["compression_source"] = source
        result["compression"] = comp
        if restart_blocks != 100_000:
            print(f"warm restart scaled down: {restart_blocks} blocks instead of 100000 (--quick)", file=sys.stderr)
        result["restart"] = measure_restart(work, restart_blocks, 16 << 10)
    result["ssd_read_over_raw"] = result["throughput"]["ssd_read_over_raw"]
    result["warm_restart_s"] = result["restart"]["all_served_s"]
    out = REPO / "bench" / "results" / "tiers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("ssd_read_over_raw", "warm_restart_s")}))
    if not ns.no_report:
        update_section("tiers", render(result))
    return 0


def render(r: dict) -> str:
    t = r["throughput"]
    lines = [
        "## SSD tier (`bench/tier_throughput.py`)",
        "",
        f"- Command: `{r['command']}`",
        f"- Date: {r['date']}",
        f"- Machine: {r['machine']}; filesystem: `{r['filesystem']}`",
        "- Setup: a metadata service and a daemon whose DRAM segment is smaller than a block, so every block is"
        " written to and read from its SSD segment with O_DIRECT. The client is on the daemon's host: gets come"
        " through the daemon's staging region (the daemon reads each block into shared memory and verifies it"
        " there, the client copies it once; `kvstore/daemon/staging.py`). Baselines, same bytes, block size,"
        " filesystem and run: a sequential O_DIRECT write; O_DIRECT reads with "
        f"{t.get('raw_inflight', 1)} in flight (threads), as many as kvstore keeps (`READ_AHEAD` submitted per data-port"
        " connection x the client's I/O threads, run by at most the daemon's `IO_WORKERS` I/O threads), and the same reads one at a time. Every repetition reads the raw"
        " file just before and just after kvstore's get (each read, kvstore's too, is the first read of bytes just"
        " written: a re-read comes faster on this virtual disk) and compares the get with their mean, since this device's"
        " speed drifts within seconds; ratios are medians of those per-repetition ratios, GB/s medians of"
        " repetitions.",
        "",
        "| block | bytes | raw write GB/s | kvstore put GB/s | put/raw | raw read GB/s "
        f"({t.get('raw_inflight', 1)} in flight) | raw read GB/s (1 in flight) | kvstore get GB/s | get/raw |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {t['block_bytes'] // 1024} KiB | {t['bytes'] / 2**20:.0f} MiB | {t['raw_write_gbps']:.2f} | {t['ssd_put_gbps']:.2f} "
        f"| {t['ssd_write_over_raw']:.2f} | {t['raw_read_gbps']:.2f} | {t.get('raw_read_seq_gbps', float('nan')):.2f} "
        f"| {t['ssd_get_gbps']:.2f} | **{t['ssd_read_over_raw']:.2f}** |",
        "",
        f"Per-repetition get/raw ratios: {', '.join(f'{x:.2f}' for x in t.get('ssd_read_over_raw_reps', []))}."
        + (
            f" Share of the time the device was busy (io_ticks): {t['ssd_get_device_busy']:.2f} during kvstore's gets,"
            f" {t['raw_read_device_busy']:.2f} during the raw reads."
            if "ssd_get_device_busy" in t
            else ""
        ),
        "",
        f"Buffered I/O instead (`daemon.ssd_direct_io=false`, same run): put {r['throughput_buffered']['ssd_put_gbps']:.2f} GB/s,"
        f" get {r['throughput_buffered']['ssd_get_gbps']:.2f} GB/s (gets are then served from the page cache, memory that"
        " the DRAM tier already accounts for; direct I/O keeps the SSD tier's reads honest and its writes from"
        " evicting the host's page cache).",
        "",
        f"Compression (lz4 fast mode) on KV from: {r['compression_source']}.",
        "",
        "| KV dtype | ratio plain | GB/s plain | ratio byte-shuffled | GB/s shuffled (incl. shuffle) |",
        "|---|---|---|---|---|",
    ]
    for name, row in r["compression"].items():
        lines.append(
            f"| {name} | {row['plain']['ratio']:.3f} | {row['plain']['gbps']:.2f} | {row['shuffle']['ratio']:.3f} | {row['shuffle']['gbps']:.2f} |"
        )
    rs = r["restart"]
    lines += [
        "",
        f"Warm restart after SIGKILL with {rs['blocks']:,} blocks of {rs['block_bytes'] // 1024} KiB on SSD: ready (journal"
        f" replay, header and checksum of every block) in **{rs['ready_s']:.2f} s**; all blocks served again after"
        f" **{rs['all_served_s']:.2f} s**.",
        "",
        f"Target `ssd_read_over_raw >= 0.8` (raw with equal reads in flight): measured {r['ssd_read_over_raw']:.2f}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
