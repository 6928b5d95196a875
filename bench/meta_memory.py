#!/usr/bin/env python3
"""Memory per block of a running metadata service, object index against compact index, and
what each costs a client's puts and lookups.

    python bench/meta_memory.py            # 1,000,000 blocks per index
    python bench/meta_memory.py --quick    # 200,000 blocks

For each index (``meta.index=object``, the default, with ``meta.cache_policy=lru`` so that both
evict alike; and ``meta.index=compact``) this starts a ``kvstore meta`` process and one
``kvstore daemon`` whose DRAM segment holds every block, and a client in this process puts N
blocks of random 16-byte keys (16-byte payloads, one 4 KiB extent each) in puts of 8,192 keys.
It reads the service's resident memory (VmRSS, /proc) once the daemon has registered and again
after the last put: their difference over N is the service's memory per block, everything
included (the index, the allocator, Python's own overheads). Then 200 lookups of 1,000 stored
keys drawn at random, over the lookup port (the client's default). Both services run the same
code on the same machine in the same run, one after the other; the ratios are the result.

Figures (``bench/results/meta_memory.json``): ``service_bytes_per_block`` per index,
``object_over_compact_bytes``, put throughput (blocks/s) and lookup p50/p99 per index.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.report import machine, update_section  # noqa: E402
from kvstore import SyncKVStoreClient, procs  # noqa: E402

BATCH = 8192
PAYLOAD = 16
LOOKUPS = 200
LOOKUP_KEYS = 1000
RESULTS = REPO / "bench" / "results" / "meta_memory.json"
INDEXES = {
    "object": ("meta.index=object", "meta.cache_policy=lru"),
    "compact": ("meta.index=compact", "meta.cache_policy=lru"),
}


def rss(pid: int) -> int:
    """Resident bytes of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def point(kind: str, n: int, tmp: Path) -> dict:
    sets = [a for s in INDEXES[kind] for a in ("--set", s)]
    with open(tmp / f"{kind}-meta.log", "ab") as log:
        meta = procs.start(["meta", "--listen", "127.0.0.1:0", *sets], name="kvstore meta", stderr=log, cwd=REPO)
    daemon = None
    try:
        dram = (n + 2 * BATCH) * 4096
        with open(tmp / f"{kind}-daemon.log", "ab") as log:
            daemon = procs.start(
                ["daemon", "--meta", meta.info["meta"], "--dram", str(dram), "--data-dir", str(tmp / f"{kind}-data"),
                 "--set", f"daemon.daemon_id=mem-{kind}"],
                name="kvstore daemon", stderr=log, cwd=REPO,
            )  # fmt: skip
        rng = np.random.default_rng(0)
        keys = rng.integers(0, 256, (n, 16), dtype=np.uint8)
        payload = [np.zeros(PAYLOAD, np.uint8)] * BATCH
        with SyncKVStoreClient(meta.info["meta"]) as c:
            warm = keys[:BATCH]
            assert c.put([k.tobytes() for k in warm], payload).stored == BATCH  # connections, code paths
            base = rss(meta.proc.pid)
            t0 = time.perf_counter()
            with tqdm(total=n, desc=f"puts ({kind})", unit="block", unit_scale=True, leave=False) as bar:
                stored = BATCH
                bar.update(BATCH)
                for i in range(BATCH, n, BATCH):
                    part = [k.tobytes() for k in keys[i : i + BATCH]]
                    stored += c.put(part, payload[: len(part)], chain=False).stored
                    bar.update(len(part))
            put_s = time.perf_counter() - t0
            if stored != n:
                raise RuntimeError(f"{kind}: stored {stored} of {n} blocks (the daemon's DRAM was sized for all)")
            after = rss(meta.proc.pid)
            lat = []
            for _ in range(LOOKUPS):
                pick = keys[rng.integers(0, n, LOOKUP_KEYS)]
                q = [k.tobytes() for k in pick]
                t = time.perf_counter()
                hit = c.lookup(q)
                lat.append(time.perf_counter() - t)
                if hit != LOOKUP_KEYS:
                    raise RuntimeError(f"{kind}: a lookup of stored keys hit {hit} of {LOOKUP_KEYS}")
            st = c.stats()
            if st.keys != n:
                raise RuntimeError(f"{kind}: the service counts {st.keys} blocks, not {n}")
    finally:
        if daemon is not None:
            daemon.stop(20)
        meta.stop(20)
    ms = np.array(lat) * 1000
    return {
        "index": kind,
        "blocks": n,
        "rss_base_bytes": base,
        "rss_after_bytes": after,
        "service_bytes_per_block": round((after - base) / (n - BATCH), 1),
        "put_blocks_per_s": round((n - BATCH) / put_s),
        "lookup_1000_p50_ms": round(float(np.percentile(ms, 50)), 3),
        "lookup_1000_p99_ms": round(float(np.percentile(ms, 99)), 3),
    }


def report(result: dict) -> str:
    rows = {r["index"]: r for r in result["rows"]}
    lines = [
        "## Metadata service memory per block, object and compact index (`bench/meta_memory.py`)",
        "",
        f"- Command: `{result['command']}`",
        f"- Date: {result['date']}",
        f"- Machine: {result['machine']}",
        f"- Setup: for each index a `kvstore meta` process (`meta.index=object` or `compact`, both with "
        f"`meta.cache_policy=lru`) and one `kvstore daemon` whose DRAM holds every block; a client puts "
        f"{result['blocks']:,} blocks of random keys ({PAYLOAD}-byte payloads, one 4 KiB extent each) in puts of "
        f"{BATCH:,} keys. Memory per block = the service's resident memory (VmRSS) after the last put less "
        f"after the first, over the blocks put in between: everything the process holds for them. Lookups: "
        f"{LOOKUPS} of {LOOKUP_KEYS:,} stored keys drawn at random, on the lookup port. The two services run "
        "one after the other in the same run.",
        "",
        "| index | blocks | service bytes per block | puts, blocks/s | lookup of 1,000 keys p50 | p99 |",
        "|---|---|---|---|---|---|",
    ]
    for kind in INDEXES:
        r = rows[kind]
        lines.append(
            f"| {kind} | {r['blocks']:,} | **{r['service_bytes_per_block']:,.0f}** | {r['put_blocks_per_s']:,} | "
            f"{r['lookup_1000_p50_ms']} ms | {r['lookup_1000_p99_ms']} ms |"
        )
    lines += [
        "",
        f"Object index over compact index: **{result['object_over_compact_bytes']}x** the memory per block, "
        f"{result['compact_over_object_put_rate']}x the put rate (compact over object).",
        "",
        "The compact index's own columns and hash table take about 90 bytes per block (`bench/index_scale.py`, "
        "in process); the service's resident memory also counts their headroom (rows grow by half, the hash "
        "table doubles at 70 % fill) and what the process's allocators keep of the puts' transient buffers.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200,000 blocks per index")
    ap.add_argument("--blocks", type=int, default=0, help="blocks per index (default 1,000,000; --quick 200,000)")
    ap.add_argument("--no-report", action="store_true", help="do not rewrite bench/RESULTS.md")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    n = args.blocks or (200_000 if args.quick else 1_000_000)
    if n < 2 * BATCH:
        ap.error(f"--blocks: at least {2 * BATCH}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-meta-memory-") as tmp:
        for kind in INDEXES:
            rows.append(point(kind, n, Path(tmp)))
            r = rows[-1]
            print(
                f"{kind:8s} {n:>10,} blocks  {r['service_bytes_per_block']:>8,.1f} B/block  "
                f"{r['put_blocks_per_s']:>8,} puts/s  lookup p50 {r['lookup_1000_p50_ms']} ms",
                flush=True,
            )
    by = {r["index"]: r for r in rows}
    result = {
        "command": "python bench/meta_memory.py"
        + (" --quick" if args.quick else "")
        + (f" --blocks {args.blocks}" if args.blocks else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "blocks": n,
        "rows": rows,
        "object_over_compact_bytes": round(
            by["object"]["service_bytes_per_block"] / by["compact"]["service_bytes_per_block"], 2
        ),
        "compact_over_object_put_rate": round(by["compact"]["put_blocks_per_s"] / by["object"]["put_blocks_per_s"], 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_report:
        update_section("meta_memory", report(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
