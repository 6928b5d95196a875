#!/usr/bin/env python3
"""How the metadata index scales with the blocks it holds: memory per block, 1000-key lookup
latency and put+commit throughput of the index (``kvstore.meta.index.Index``), in-process (no
gRPC), with the ``lru`` cache policy and with ``adaptive`` (its count columns and history).

    python bench/index_scale.py             # lru at 10k, 1M, 10M; adaptive at 1M
    python bench/index_scale.py --quick     # 10k and 200k, both policies

Each point runs in its own process: one daemon with one DRAM segment of exactly N extents of
4 KiB, filled with N blocks of random keys by ``put_start`` + ``put_commit`` in batches of 1,000
(memory traced meanwhile: tracemalloc's count of Python and numpy allocations after the fill,
less before, over N); then 300 lookups of 1,000 keys drawn at random from what is stored (no
locality: each key is a cold cache line at scale), timed one by one, in turn with the same
lookups on a reference index of 10,000 blocks of the same kind built in the same process (so
that the ratio of the two is measured under one machine load); then 100,000 more new
blocks put and committed into the full segment, each evicting the least recently used block
(steady-state put throughput at N); then the daemon is drained, its N blocks leaving the table
in steps (``drain_daemon(stepwise=True)``, ``drop_step()``), each step timed: what a step holds the
service's event loop for (target: 50 ms).

Figures (``bench/results/index_scale.json``): ``index_bytes_per_block`` (lru, largest N;
target <= 128), ``lookup_10m_over_10k`` (lru lookup p50 at 10M over its 10k reference; target <= 1.5),
``put_commit_10m_blocks_per_s``, ``drop_step_max_ms_10m``, and per point the same.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.report import machine, update_section  # noqa: E402

RESULTS = REPO / "bench" / "results" / "index_scale.json"
PLOT = REPO / "bench" / "results" / "index_scale.png"
BATCH = 1000
LOOKUPS = 300
LOOKUP_KEYS = 1000
STEADY = 100_000
REF = 10_000  # blocks in the reference index each point's lookups are timed against
BLOCK = 4096  # extent bytes


def _make(kind: str, n: int):  # noqa: ANN202
    from kvstore.extent import HEADER_SIZE
    from kvstore.meta.index import DaemonSpec, Index, IndexLimits, SegmentSpec, Tier

    # kind: the cache policy ("adaptive": with its count columns and history).
    ix = Index(IndexLimits(cache_policy=kind), rows=n)
    seg = SegmentSpec(1, Tier.DRAM, n * BLOCK, "/dev/shm/kvstore-index-scale")
    ix.register_daemon(DaemonSpec("d1", "h1", "d1:data", "d1:ctl", (seg,)), {})
    return ix, BLOCK - HEADER_SIZE


def _put(ix, keys: np.ndarray, payload: int) -> None:  # noqa: ANN001
    packed = keys.tobytes()
    n = len(keys)
    r = ix.put_start(packed, [payload] * n)
    ix.put_commit(r.put_id, [7] * len(r.placements))


def point(kind: str, n: int, seed: int = 0) -> dict:
    """One index of ``n`` blocks, measured (run in a process of its own)."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**63, size=(n + STEADY, 2), dtype=np.uint64)
    warm, payload = _make(kind, 64)  # imports and first-call set-up, outside what is traced
    _put(warm, keys[:32], payload)
    warm.lookup(keys[:32].tobytes())
    del warm
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ix, payload = _make(kind, n)
    t0 = time.perf_counter()
    for i in range(0, n, BATCH):
        _put(ix, keys[i : i + BATCH], payload)
    fill_s = time.perf_counter() - t0
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    # The same lookups on a reference index of REF blocks of the same kind, built here and
    # timed in turn with the big one's: their ratio is measured under the same load.
    ref, _ = _make(kind, REF)
    ref_keys = rng.integers(0, 2**63, size=(REF, 2), dtype=np.uint64)
    for i in range(0, REF, BATCH):
        _put(ref, ref_keys[i : i + BATCH], payload)
    lat, ref_lat = [], []
    for _ in range(LOOKUPS):
        for index, pool, m, out in ((ix, keys, n, lat), (ref, ref_keys, REF, ref_lat)):
            packed = pool[rng.integers(0, m, size=LOOKUP_KEYS)].tobytes()
            t = time.perf_counter()
            hits = index.lookup(packed)[0]
            out.append(time.perf_counter() - t)
            assert hits == LOOKUP_KEYS, f"a stored key was not found ({hits} of {LOOKUP_KEYS})"
    del ref
    t0 = time.perf_counter()
    for i in range(n, n + STEADY, BATCH):
        _put(ix, keys[i : i + BATCH], payload)
    steady_s = time.perf_counter() - t0
    # Each new block evicts one, or (adaptive policy in frequency mode) is declined.
    placed = ix.counters["evictions"] + ix.counters["not_admitted_keys"]
    assert placed == STEADY, (ix.counters["evictions"], ix.counters["not_admitted_keys"])
    out = {
        "index": kind,
        "blocks": n,
        "bytes_per_block": traced / n,
        "fill_blocks_per_s_traced": n / fill_s,
        "lookup_p50_ms": float(np.percentile(lat, 50) * 1e3),
        "lookup_p99_ms": float(np.percentile(lat, 99) * 1e3),
        "ref_lookup_p50_ms": float(np.percentile(ref_lat, 50) * 1e3),
        "lookup_over_ref": float(np.percentile(lat, 50) / np.percentile(ref_lat, 50)),
        "put_commit_blocks_per_s": STEADY / steady_s,
    }
    out["not_admitted"] = ix.counters["not_admitted_keys"]
    out["table_bytes_per_block"] = ix.table.nbytes() / n
    # The daemon leaves (a drain): at once for lookups, its N blocks out of the table in steps,
    # each of which the service runs between other calls on its event loop.
    left = len(ix)
    t0 = time.perf_counter()
    ix.drain_daemon("d1", stepwise=True)
    steps = [time.perf_counter() - t0]
    while True:
        t = time.perf_counter()
        more = ix.drop_step()
        steps.append(time.perf_counter() - t)
        if not more:
            break
    assert len(ix) == 0 and ix.table.live == 0, f"{ix.table.live} of {left} blocks left after the drop"
    out["drop_steps"] = len(steps)
    out["drop_step_p50_ms"] = float(np.percentile(steps, 50) * 1e3)
    out["drop_step_max_ms"] = float(max(steps) * 1e3)
    out["drop_s"] = float(sum(steps))
    return out


def _child(kind: str, n: int, q) -> None:  # noqa: ANN001
    q.put(point(kind, n))


def run(points: list[tuple[str, int]]) -> list[dict]:
    from tqdm import tqdm

    ctx = mp.get_context("spawn")
    out = []
    with tqdm(points, desc="index scale", unit="point") as bar:
        for kind, n in bar:
            bar.set_postfix_str(f"{kind} {n:,}")
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=(kind, n, q))
            p.start()
            out.append(q.get())
            p.join()
            r = out[-1]
            tqdm.write(
                f"{kind:8s} {n:>11,} blocks: {r['bytes_per_block']:7.1f} B/block, lookup p50 "
                f"{r['lookup_p50_ms']:.3f} ms p99 {r['lookup_p99_ms']:.3f} ms, "
                f"put+commit {r['put_commit_blocks_per_s']:,.0f} blocks/s"
            )
    return out


def figures(rows: list[dict]) -> dict:
    by = {(r["index"], r["blocks"]): r for r in rows}
    f: dict = {}
    for kind in ("lru",):
        ns = sorted(n for k, n in by if k == kind)
        if not ns:
            continue
        big = by[(kind, ns[-1])]
        f["index_bytes_per_block"] = big["bytes_per_block"]
        f["lookup_largest_over_ref"] = big["lookup_over_ref"]
        f["drop_step_max_ms_largest"] = big["drop_step_max_ms"]
        if ns[-1] == 10_000_000:
            f["lookup_10m_over_10k"] = big["lookup_over_ref"]
            f["put_commit_10m_blocks_per_s"] = big["put_commit_blocks_per_s"]
            f["drop_step_max_ms_10m"] = big["drop_step_max_ms"]
    return f


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, color in (("lru", "tab:blue"), ("adaptive", "tab:orange")):
        rs = sorted((r for r in rows if r["index"] == kind), key=lambda r: r["blocks"])
        if not rs:
            continue
        ns = [r["blocks"] for r in rs]
        a.plot(ns, [r["lookup_over_ref"] for r in rs], "o-", color=color, label=kind)
        b.plot(ns, [r["bytes_per_block"] for r in rs], "o-", color=color, label=kind)
    a.set(xscale="log", xlabel="blocks indexed", ylabel="1000-key lookup p50 / 10k reference's", ylim=(0, None))
    a.axhline(1.5, color="red", lw=0.8, ls=":", label="target 1.5 (lru, 10M)")
    b.set(xscale="log", xlabel="blocks indexed", ylabel="memory per block (bytes)", ylim=(0, None))
    b.axhline(128, color="red", lw=0.8, ls=":", label="target 128")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(result: dict) -> str:
    f = result["figures"]
    lines = [
        "## Index scale: memory per block and lookup latency up to 10M blocks (`bench/index_scale.py`)",
        "",
        f"- Command: `{result['command']}`",
        f"- Date: {result['date']}",
        f"- Machine: {result['machine']}",
        "- Setup: in-process, no gRPC. One daemon, one DRAM segment of exactly N extents of 4 KiB, filled "
        "with N random keys by put_start + put_commit in batches of 1,000. Memory: tracemalloc's traced "
        "bytes (Python objects and numpy arrays) after the fill less before, over N. Lookup: 300 lookups "
        "of 1,000 stored keys drawn at random (no locality), each timed, in turn with the same lookups on a "
        "reference index of 10,000 blocks of the same kind built in the same process (the ratio to it is "
        "`lookup_10m_over_10k`: both measured under the same machine load). Put+commit: 100,000 new blocks "
        "into the full segment, each evicting the least recently used. The index is `kvstore.meta.index.Index` "
        "(columnar block table), **lru** = with `cache_policy=lru`; **adaptive** = with the adaptive policy "
        "(its count and mark columns; the history of blocks not stored stays empty here, as every key is new "
        "and stored; new blocks the policy declines count as placed). Drop: the daemon then leaves (a drain "
        "in steps, `drain_daemon(stepwise=True)` and `drop_step()`), each step timed: what one step holds "
        "the service's event loop for.",
        "- Targets: `index_bytes_per_block` <= 128 and `lookup_10m_over_10k` <= 1.5 (lru).",
        "",
        "| index | blocks | bytes/block | lookup p50 (ms) | lookup p99 (ms) | 10k reference p50 (ms) | p50 / reference | put+commit at N (blocks/s) | fill, traced (blocks/s) | drop: steps, p50 / max step (ms), total (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["points"], key=lambda r: (r["index"], r["blocks"])):
        lines.append(
            f"| {r['index']} | {r['blocks']:,} | {r['bytes_per_block']:.1f} | {r['lookup_p50_ms']:.3f} | "
            f"{r['lookup_p99_ms']:.3f} | {r['ref_lookup_p50_ms']:.3f} | {r['lookup_over_ref']:.2f} | "
            f"{r['put_commit_blocks_per_s']:,.0f} | {r['fill_blocks_per_s_traced']:,.0f} | "
            f"{r['drop_steps']:,}, {r['drop_step_p50_ms']:.1f} / {r['drop_step_max_ms']:.1f}, {r['drop_s']:.2f} |"
        )
    lines.append("")
    for name, target in (("index_bytes_per_block", "<= 128"), ("lookup_10m_over_10k", "<= 1.5")):
        if name in f:
            bound = float(target.split()[-1])
            lines.append(f"- `{name}` = **{f[name]:.2f}** (target {target}: {'met' if f[name] <= bound else 'missed'})")
    for name in ("put_commit_10m_blocks_per_s", "lookup_largest_over_ref", "drop_step_max_ms_10m"):
        if name in f:
            lines.append(f"- `{name}` = {f[name]:,.2f}")
    if result.get("plot"):
        lines += ["", "![index scale](results/index_scale.png)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k and 200k blocks, both policies")
    ap.add_argument("--no-report", action="store_true", help="do not rewrite bench/RESULTS.md")
    ns = ap.parse_args(argv)
    if ns.quick:
        points = [(k, n) for n in (10_000, 200_000) for k in ("lru", "adaptive")]
    else:
        points = [("lru", 10_000), ("lru", 1_000_000), ("adaptive", 1_000_000), ("lru", 10_000_000)]
    rows = run(points)
    result = {
        "command": "python bench/index_scale.py" + (" --quick" if ns.quick else ""),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "points": rows,
        "figures": figures(rows),
    }
    # The figures are read from the top level of the file too, under their own names.
    result.update(result["figures"])
    result["plot"] = plot(rows, PLOT)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["figures"], indent=2))
    if not ns.no_report:
        update_section("index_scale", report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
