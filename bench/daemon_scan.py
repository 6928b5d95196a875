#!/usr/bin/env python3
"""A cache daemon's restart at millions of blocks: the scan that rebuilds its DRAM inventory
and the recovery of its SSD segment from the journal.

    python bench/daemon_scan.py            # DRAM 1M and 10M blocks, SSD 1M (10M: the journal only)
    python bench/daemon_scan.py --quick    # DRAM and SSD 100k

DRAM: a shared-memory arena made with the daemon's own code (:class:`kvstore.daemon.arena.
ShmArena`, its secret through :meth:`kvstore.extent.Sealer.load_or_create`) holds N committed
blocks of 192 random bytes, one 256-byte extent each, their sealed headers written as the
daemon's commit writes them (:meth:`Sealer.pack_many`: the same bytes as :meth:`Sealer.pack`),
in generations shuffled against the offsets (extents reused out of order). Then
:func:`kvstore.extent.scan` runs on it with payload checksums verified and without, and the
inventory message is packed from its columns.

SSD: a segment (:class:`kvstore.daemon.ssd.SsdSegment`, direct I/O, compression off) whose data
file holds N blocks of 192 bytes (one 4 KiB extent each), and a journal of their N ADD records
then DEL records of a tenth of them, as commits and removals append them. Timed: the replay of
the journal alone (:func:`kvstore.daemon.journal.replay`), and :meth:`SsdSegment.recover`
with and without verification (replay, every block's header read and checked, checksums,
compaction of the journal), each from the same journal. The data file takes 4 KiB per block:
a size whose data file would pass ``--max-disk-gib`` (default 8) is measured on its journal
alone.

Every measured step runs in a process of its own (this script with ``--step``), ``--repeat``
times (default 3; the fastest run is reported, with the seconds of each), so that its peak
memory is its own: ``peak_rss_mib`` (VmHWM: the arena pages it touched included, which
are shared memory and the arena's size at most) and ``peak_anon_mib`` (the largest private
memory seen, sampled every 5 ms: the step's own arrays). The load average before and after is
recorded: the steps use every core. Results: printed and written to
``bench/results/daemon_scan.json``. Files are removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.report import machine  # noqa: E402
from kvstore.batch import checksums  # noqa: E402
from kvstore.blocks import BlockCols  # noqa: E402
from kvstore.daemon import journal  # noqa: E402
from kvstore.daemon.arena import ShmArena, remove_files  # noqa: E402
from kvstore.daemon.ssd import SsdSegment  # noqa: E402
from kvstore.extent import ALIGN, HEADER_SIZE, SSD_ALIGN, Sealer, scan  # noqa: E402
from kvstore.transport import native  # noqa: E402

PAYLOAD = 192
CHUNK = 1 << 20  # DRAM blocks made per pass
SSD_CHUNK = 1 << 16  # SSD blocks made per pass (256 MiB of extents)
RESULTS = REPO / "bench" / "results" / "daemon_scan.json"
SSD_ID = 2
MIB = 1 << 20


class Peak:
    """Samples this process's private resident memory (RssAnon) while it runs."""

    def __init__(self) -> None:
        self.anon = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.anon = max(self.anon, self.status("RssAnon"))

    def done(self) -> dict:
        self._stop.set()
        self._t.join()
        self.anon = max(self.anon, self.status("RssAnon"))
        return {"peak_rss_mib": round(self.status("VmHWM") / MIB, 1), "peak_anon_mib": round(self.anon / MIB, 1)}


def blocks_of(rng: np.random.Generator, n: int, gen0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random keys, payloads and distinct generations (shuffled) for n blocks."""
    keys = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    payload = rng.integers(0, 256, (n, PAYLOAD), dtype=np.uint8)
    gens = (gen0 + rng.permutation(n)).astype(np.uint64)
    return keys, payload, gens


# ---- steps (each in its own process) ---------------------------------------------------------


def fill_dram(path: str, n: int, secret: str) -> dict:
    sealer = Sealer.load_or_create(secret)
    arena = ShmArena(path, n * ALIGN, create=True)
    rows = arena.array.reshape(n, ALIGN)
    rng = np.random.default_rng(1)
    gen_order = rng.permutation(n).astype(np.uint64) + np.uint64(1_700_000_000_000_000_000)
    t = time.perf_counter()
    for lo in range(0, n, CHUNK):
        m = min(CHUNK, n - lo)
        keys, payload, _ = blocks_of(rng, m, 0)
        offs = np.arange(lo, lo + m, dtype=np.uint64) * np.uint64(ALIGN)
        rows[lo : lo + m, HEADER_SIZE : HEADER_SIZE + PAYLOAD] = payload  # the writer's copy
        sums = checksums(arena.array, offs + np.uint64(HEADER_SIZE), np.full(m, PAYLOAD, np.uint64))
        rows[lo : lo + m, :HEADER_SIZE] = sealer.pack_many(
            keys, np.full(m, PAYLOAD), sums, gen_order[lo : lo + m], offs
        )
    seconds = time.perf_counter() - t
    one = sealer.parse(arena.view, (n // 2) * ALIGN)  # the scalar path agrees with the vectorised one
    assert one is not None and one.gen == int(gen_order[n // 2]) and one.length == PAYLOAD
    arena.close()
    return {"fill_seconds": round(seconds, 3)}


def scan_dram(path: str, n: int, secret: str, verify: bool) -> dict:
    sealer = Sealer.load_or_create(secret)
    arena = ShmArena(path, n * ALIGN)  # mapped as a client maps it: the daemon that made it is gone
    peak = Peak()
    t = time.perf_counter()
    found, discarded = scan(arena.array, sealer, verify=verify)
    seconds = time.perf_counter() - t
    t = time.perf_counter()
    msg = found.to_pb(0)
    pack_seconds = time.perf_counter() - t
    out = {"n": n, "verify": verify, "found": len(found), "discarded": discarded, "seconds": round(seconds, 3)}
    out["blocks_per_s"] = round(n / seconds)
    out |= {"message_mib": round(msg.ByteSize() / MIB, 1), "message_seconds": round(pack_seconds, 3)}
    assert len(found) == n and discarded == 0 and bool((found.gen[1:] > found.gen[:-1]).all())
    out |= peak.done()
    arena.close()
    return out


def fill_ssd(directory: str, n: int, data: bool) -> dict:
    d = Path(directory)
    sealer = Sealer.load_or_create(d / "ssd.secret")
    if data:  # the segment's own files: the data file fallocated, an empty journal
        SsdSegment(d, SSD_ID, n * SSD_ALIGN, sealer=sealer, compress_policy="off").close()
    fd = os.open(d / f"ssd-{SSD_ID}.data", os.O_WRONLY) if data else -1
    rng = np.random.default_rng(2)
    t = time.perf_counter()
    cols = []
    with open(d / f"ssd-{SSD_ID}.journal", "wb") as jf:
        for lo in range(0, n, SSD_CHUNK):
            m = min(SSD_CHUNK, n - lo)
            keys, payload, gens = blocks_of(rng, m, 1_700_000_000_000_000_000 + lo)
            offs = np.arange(lo, lo + m, dtype=np.uint64) * np.uint64(SSD_ALIGN)
            flat = payload.reshape(-1)
            sums = checksums(flat, np.arange(m, dtype=np.uint64) * np.uint64(PAYLOAD), np.full(m, PAYLOAD, np.uint64))
            if data:
                buf = np.zeros((m, SSD_ALIGN), np.uint8)
                buf[:, :HEADER_SIZE] = sealer.pack_many(keys, np.full(m, PAYLOAD), sums, gens, offs)
                buf[:, HEADER_SIZE : HEADER_SIZE + PAYLOAD] = payload
                os.pwrite(fd, buf, lo * SSD_ALIGN)
            size = np.full(m, SSD_ALIGN, np.uint64)
            blocks = BlockCols(keys, offs, size, np.full(m, PAYLOAD, np.uint64), sums, gens)
            jf.write(journal.pack_records(blocks).data)  # what the commits append
            cols.append(blocks.take(rng.random(m) < 0.1))
        gone = BlockCols.concat(cols)
        z = np.zeros(len(gone), np.uint64)  # a DEL names key, offset and generation only
        jf.write(journal.pack_records(BlockCols(gone.keys, gone.offset, z, z, z, gone.gen), journal.OP_DEL).data)
    if data:
        os.fsync(fd)
        os.close(fd)
    jpath = d / f"ssd-{SSD_ID}.journal"
    shutil.copyfile(jpath, d / "journal.orig")
    return {
        "fill_seconds": round(time.perf_counter() - t, 3),
        "deleted": len(gone),
        "journal_mib": round(jpath.stat().st_size / MIB, 1),
    }


def replay_ssd(directory: str, n: int) -> dict:
    d = Path(directory)
    peak = Peak()
    t = time.perf_counter()
    live, good = journal.replay(d / "journal.orig")
    seconds = time.perf_counter() - t
    records = good // journal.REC_SIZE
    out = {"n": n, "step": "journal replay", "records": records, "live": len(live), "seconds": round(seconds, 3)}
    return out | {"records_per_s": round(records / seconds)} | peak.done()


def recover_ssd(directory: str, n: int, verify: bool) -> dict:
    d = Path(directory)
    shutil.copyfile(d / "journal.orig", d / f"ssd-{SSD_ID}.journal")
    sealer = Sealer.load_or_create(d / "ssd.secret")
    seg = SsdSegment(d, SSD_ID, n * SSD_ALIGN, sealer=sealer, compress_policy="off")
    peak = Peak()
    t = time.perf_counter()
    found, discarded = seg.recover(verify=verify)
    seconds = time.perf_counter() - t
    t = time.perf_counter()
    msg = seg.inventory().to_pb(SSD_ID, with_size=True)
    pack_seconds = time.perf_counter() - t
    out = {"n": n, "step": "recover", "verify": verify, "direct_io": seg.direct, "found": len(found)}
    out |= {"discarded": discarded, "seconds": round(seconds, 3), "blocks_per_s": round(n / seconds)}
    out |= {"message_mib": round(msg.ByteSize() / MIB, 1), "message_seconds": round(pack_seconds, 3)}
    out |= {"journal_mib_after": round(seg.journal_bytes / MIB, 1)}
    seg.close()
    return out | peak.done()


STEPS = {"fill-dram": fill_dram, "scan-dram": scan_dram, "fill-ssd": fill_ssd, "replay-ssd": replay_ssd,
         "recover-ssd": recover_ssd}  # fmt: skip


def step(name: str, *args: object) -> dict:
    """Runs one step in a fresh process and returns what it printed (JSON)."""
    argv = [sys.executable, __file__, "--step", name, json.dumps(args)]
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"step {name} failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def best_of(repeat: int, name: str, *args: object) -> dict:
    """The fastest of ``repeat`` runs of a measured step (each in a fresh process), with the
    seconds of every run: on a machine other work shares, the least disturbed one."""
    runs = [step(name, *args) for _ in range(repeat)]
    return min(runs, key=lambda r: r["seconds"]) | {"seconds_each": [r["seconds"] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dram", default="1000000,10000000", help="DRAM block counts (comma-separated)")
    ap.add_argument("--ssd", default="1000000,10000000", help="SSD block counts (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="100k blocks of each")
    ap.add_argument("--max-disk-gib", type=float, default=8.0, help="largest SSD data file made")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measured step (the fastest is reported)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.step:
        print(json.dumps(STEPS[a.step](*json.loads(a.args))))
        return 0
    dram = [100_000] if a.quick else [int(x) for x in a.dram.split(",") if x]
    ssd = [100_000] if a.quick else [int(x) for x in a.ssd.split(",") if x]
    result = {"machine": machine(), "native": native.name(), "payload_bytes": PAYLOAD, "dram": [], "ssd": []}
    result["load_average_before"] = [round(x, 2) for x in os.getloadavg()]  # other work on the machine
    tmp = Path(tempfile.mkdtemp(prefix="daemon-scan-"))
    try:
        for n in dram:
            path = f"/dev/shm/kvstore-bench-scan-{os.getpid()}"
            if shutil.disk_usage("/dev/shm").free < n * ALIGN * 1.1:
                print(f"dram {n}: skipped, /dev/shm has no room for {n * ALIGN / 2**30:.1f} GiB", flush=True)
                continue
            try:
                made = step("fill-dram", path, n, str(tmp / "daemon.secret"))
                for verify in (True, False):
                    r = best_of(a.repeat, "scan-dram", path, n, str(tmp / "daemon.secret"), verify) | made
                    result["dram"].append(r)
                    print(f"dram scan  n={n:>10,} verify={verify!s:5} {r['seconds']:7.2f} s "
                          f"{r['blocks_per_s']:>12,} blocks/s  peak rss {r['peak_rss_mib']:8.1f} MiB "
                          f"(private {r['peak_anon_mib']:7.1f})  message {r['message_mib']} MiB "
                          f"in {r['message_seconds']} s  (runs: {r['seconds_each']} s)", flush=True)  # fmt: skip
            finally:
                remove_files(path)
        for n in ssd:
            d = tmp / f"ssd-{n}"
            d.mkdir()
            data = n * SSD_ALIGN <= a.max_disk_gib * 2**30
            need = (n * SSD_ALIGN if data else 0) + 3 * n * journal.REC_SIZE
            if shutil.disk_usage(d).free < need * 1.2:
                print(f"ssd {n}: skipped, {need / 2**30:.1f} GiB needed", flush=True)
                continue
            try:
                made = step("fill-ssd", str(d), n, data)
                runs = [best_of(a.repeat, "replay-ssd", str(d), n)]
                if data:
                    runs += [best_of(a.repeat, "recover-ssd", str(d), n, verify) for verify in (True, False)]
                else:
                    print(f"ssd {n}: journal only (its data file would take {n * SSD_ALIGN / 2**30:.0f} GiB)")
                for r in runs:
                    r |= made | {"data_file": data}
                    result["ssd"].append(r)
                    rate = r.get("blocks_per_s") or r["records_per_s"]
                    print(f"ssd {r['step']:14} n={n:>10,} verify={r.get('verify', '-')!s:5} {r['seconds']:7.2f} s "
                          f"{rate:>12,} /s  peak rss {r['peak_rss_mib']:8.1f} MiB "
                          f"(private {r['peak_anon_mib']:7.1f})  (runs: {r['seconds_each']} s)", flush=True)  # fmt: skip
            finally:
                shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
