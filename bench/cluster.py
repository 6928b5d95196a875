#!/usr/bin/env python3
"""The sharded control plane: lookup cost and throughput with 1, 2 and 4 metadata shards, the
time a shard's failover takes, and the fault suite's figures.

    python bench/cluster.py            # 4 s per point, 3 failovers, the fault suite (root)
    python bench/cluster.py --quick    # 1.5 s per point, 2 failovers
    python bench/cluster.py --skip-faults

Setup: a testbed on loopback (kvstore.cluster.testbed): Redis, S metadata shard processes (one
primary each; a standby too for the failover runs), one daemon; 20,000 blocks of 1 KiB put once.
A client in this process keeps ``--inflight`` lookups per shard outstanding (asyncio, one connection per
shard) for the point's time, of one key each or of 1000-key chains (keys drawn in a seeded random
order; every lookup is a full hit). Figures per point: lookups/s and keys/s (wall clock, on this
2-core machine shared by the shards, the daemon, Redis and the client), p50/p99 latency, and the
shards' CPU time per key (``/proc/<pid>/stat``, all shard processes together): that is what a
machine with more cores multiplies, since shards are separate processes.

``shard_cpu_per_key_ratio`` = CPU per key with 4 shards / with 1, for 1000-key lookups (target
<= 1.2: sharding must not cost CPU); ``shard_cpu_per_key_ratio_1key`` for one-key lookups.
``failover_s``: the median time from ``kill -9`` of a shard's leader until a lookup of a block
it indexed is answered with a hit again (target <= 3, the default 2 s lease). ``wrong_bytes``:
the fault suite's (bench/cluster_faults.py, needs root for network namespaces; must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "results" / "cluster.json"
BLOCKS = 20_000
BLOCK = 1024
CHAIN = 1000


def _cpu(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


async def _load(meta: str, keys: list[bytes]) -> None:
    from kvstore.client import KVStoreClient
    from kvstore.config import ClientConfig

    async with KVStoreClient(config=ClientConfig(meta=meta)) as c:
        bufs = [np.full(BLOCK, i % 251, dtype=np.uint8) for i in range(CHAIN)]
        for i in range(0, len(keys), CHAIN):
            part = keys[i : i + CHAIN]
            await c.put(part, bufs[: len(part)], chain=False)


async def _measure(meta: str, keys: list[bytes], per: int, secs: float, inflight: int, pids: list[int]) -> dict:
    from kvstore.client import KVStoreClient
    from kvstore.config import ClientConfig

    rng = np.random.default_rng(per)
    async with KVStoreClient(config=ClientConfig(meta=meta)) as c:
        batches = []
        for _ in range(512):
            lo = int(rng.integers(0, len(keys) - per + 1))
            batches.append(keys[lo : lo + per])
        for b in batches[:8]:  # connections up
            await c.lookup(b)
        lat: list[float] = []
        hits = 0
        stop = time.monotonic() + secs
        cpu0, t0 = _cpu(pids), time.monotonic()

        async def caller(j: int) -> None:
            nonlocal hits
            i = j
            while time.monotonic() < stop:
                b = batches[i % len(batches)]
                i += inflight
                s = time.perf_counter()
                h = await c.lookup(b)  # (not `hits += await ...`: that reads hits before the await)
                hits += h
                lat.append(time.perf_counter() - s)

        await asyncio.gather(*(caller(j) for j in range(inflight)))
        wall, cpu = time.monotonic() - t0, _cpu(pids) - cpu0
    n = len(lat)
    assert hits == n * per, f"lookups missed: {hits} of {n * per} keys"
    return {
        "lookups_per_s": round(n / wall, 1),
        "keys_per_s": round(n * per / wall, 1),
        "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
        "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
        "shard_cpu_us_per_key": round(cpu / (n * per) * 1e6, 3),
        "shard_cpu_s": round(cpu, 3),
        "lookups": n,
    }


def _shard_point(shards: int, secs: float, inflight: int, bar) -> dict:  # noqa: ANN001
    from kvstore.cluster.testbed import Testbed

    rng = np.random.default_rng(0)
    keys = [rng.bytes(16) for _ in range(BLOCKS)]
    with tempfile.TemporaryDirectory() as tmp, Testbed(Path(tmp), name=f"bench{shards}") as tb:
        tb.start_redis()
        tb.start_shards(shards, standby=False)
        tb.start_daemon(0, "bench", "256MiB")
        asyncio.run(_load(tb.client_meta, keys))
        pids = [child.proc.pid for child in tb.shards.values()]
        out = {}
        # Offered load grows with the shards (inflight per shard), so that each shard is offered
        # as much as the one of a single-shard cluster. "1key_alone": one lookup in flight per
        # shard, so that no two lookups share a call at any shard count (the client coalesces
        # concurrent lookups to a shard into one message, which at 1 shard with 8 in flight
        # amortizes a call over several keys, and less so with more shards on this 2-core machine).
        for name, per, load in (("1key", 1, inflight), ("1key_alone", 1, 1), ("1000key", CHAIN, inflight)):
            out[name] = asyncio.run(_measure(tb.client_meta, keys, per, secs, load * shards, pids))
            bar.update(1)
        return out


def _failovers(n: int, bar) -> list[float]:  # noqa: ANN001
    from kvstore.client import SyncKVStoreClient
    from kvstore.cluster.slots import SlotMap
    from kvstore.cluster.testbed import Testbed

    rng = np.random.default_rng(1)
    out = []
    with tempfile.TemporaryDirectory() as tmp, Testbed(Path(tmp), name="benchfail") as tb:
        tb.start_redis()
        tb.start_shards(2)
        tb.start_daemon(0, "benchf", "64MiB")
        smap = SlotMap.even(2)
        with SyncKVStoreClient(config=tb.client_config(location_cache=0)) as c:
            for i in range(n):
                shard = i % 2
                key = next(k for k in (rng.bytes(16) for _ in range(1000)) if smap.shard_of(k) == shard)
                c.put([key], [np.zeros(BLOCK, dtype=np.uint8)])
                k, r = tb.leader_process(shard)
                old = tb.leaders()[shard]
                tb.shards[(k, r)].kill()
                t0 = time.monotonic()
                while True:
                    try:
                        if c.lookup([key]) == 1 and tb.leaders()[shard] != old:
                            break
                    except Exception:  # noqa: BLE001 - Unavailable while no leader answers
                        pass
                    time.sleep(0.01)
                out.append(round(time.monotonic() - t0, 3))
                tb.start_shard(k, r, 0)
                bar.update(1)
    return out


def render(r: dict) -> str:
    lines = [
        "## Sharded metadata: lookup cost, throughput and failover (`bench/cluster.py`)",
        "",
        f"- Command: `{r['command']}`",
        f"- Date: {r['date']}",
        f"- Machine: {r['machine']}",
        "- Setup: a testbed on loopback: Redis, S metadata shard processes (one leader each), one daemon, "
        f"{BLOCKS:,} blocks of 1 KiB. One client process keeps {r['inflight']} lookups outstanding per shard "
        f"for {r['seconds']} s per point, of one key or of {CHAIN}-key chains (all hits), and one-key lookups "
        "with one in flight per shard (`1key_alone`). CPU = the shard processes' "
        "user + system time during the point, per key looked up. All processes share this machine's 2 cores, so "
        "wall-clock throughput cannot grow with shards here; CPU per key is what more cores multiply.",
        "",
        "| shards | lookup | lookups/s | keys/s | p50 ms | p99 ms | shard CPU µs/key |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, point in r["points"].items():
        for name, m in point.items():
            lines.append(
                f"| {s} | {name} | {m['lookups_per_s']:,.0f} | {m['keys_per_s']:,.0f} | {m['p50_ms']} | {m['p99_ms']} | "
                f"{m['shard_cpu_us_per_key']} |"
            )
    lines += [
        "",
        f"- `shard_cpu_per_key_ratio` (1000-key lookups, 4 shards / 1) = **{r['shard_cpu_per_key_ratio']}** "
        f"(target <= 1.2: {'met' if r['shard_cpu_per_key_ratio'] <= 1.2 else 'missed'})",
        f"- `shard_cpu_per_key_ratio_1key` (one-key lookups, {r['inflight']} in flight per shard) = "
        f"**{r['shard_cpu_per_key_ratio_1key']}**: one client process coalesces concurrent lookups to a shard into one "
        "message; with 1 shard all 8 share it, with 4 shards on these 2 cores the client offers each shard fewer at "
        "once, so fewer keys share a call. `shard_cpu_per_key_ratio_1key_alone` (one lookup in flight per shard, "
        f"no sharing at any count) = **{r.get('shard_cpu_per_key_ratio_1key_alone', 'n/a')}**.",
        f"- `failover_s` (median of {len(r['failovers_s'])} kills of a shard leader, until a lookup hits again) = "
        f"**{r['failover_s']}** (runs: {r['failovers_s']}; target <= 3: {'met' if r['failover_s'] <= 3 else 'missed'})",
    ]
    if r.get("faults"):
        f = r["faults"]
        lines += [
            f"- Fault suite (`bench/cluster_faults.py`, 3 network-namespace hosts, 2 shards x (primary, standby), "
            f"Redis + Sentinel): `wrong_bytes` = **{r['wrong_bytes']}**, untyped errors {f['untyped_errors']}, "
            f"blocks lost per fault {json.dumps({k: v['lost_blocks'] for k, v in f['faults'].items()})}, lookups "
            f"served again after {json.dumps(f['lookup_recovery_s'])} s, stale leader {json.dumps(f['stale_leader'])}.",
        ]
    else:
        lines.append(f"- Fault suite: not run ({r.get('faults_skipped', 'skipped')}).")
    lines += ["", "![cluster](results/cluster.png)"]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shards = [int(s) for s in r["points"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("1key", "1key_alone", "1000key"):
        base = r["points"][str(shards[0])][name]["shard_cpu_us_per_key"]
        axes[0].plot(
            shards, [r["points"][str(s)][name]["shard_cpu_us_per_key"] / base for s in shards], "o-", label=name
        )
        axes[1].plot(shards, [r["points"][str(s)][name]["keys_per_s"] for s in shards], "o-", label=name)
    axes[0].axhline(1.2, color="grey", ls="--", lw=1, label="target (1000-key)")
    axes[0].set(
        xlabel="shards",
        ylabel="shard CPU per key / with 1 shard",
        title="metadata CPU per key looked up",
        xticks=shards,
    )
    axes[1].set(
        xlabel="shards", ylabel="keys/s (wall clock, 2 cores)", title="lookup throughput", xticks=shards, yscale="log"
    )
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--skip-faults", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--report-only", action="store_true", help="redraw the plot and section from --out's JSON")
    ns = ap.parse_args()
    if ns.report_only:
        from bench.report import update_section

        result = json.loads(ns.out.read_text())
        plot(result, ns.out.with_suffix(".png"))
        update_section("cluster", render(result))
        return 0
    from tqdm import tqdm

    from bench.report import machine, update_section

    secs = ns.seconds or (1.5 if ns.quick else 4.0)
    nfail = 2 if ns.quick else 3
    shard_counts = (1, 2, 4)
    result: dict = {
        "command": "python bench/cluster.py" + (" --quick" if ns.quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "seconds": secs,
        "inflight": ns.inflight,
        "points": {},
    }
    with tqdm(total=len(shard_counts) * 3 + nfail, desc="cluster", unit="point") as bar:
        for s in shard_counts:
            result["points"][str(s)] = _shard_point(s, secs, ns.inflight, bar)
        result["failovers_s"] = _failovers(nfail, bar)
    p = result["points"]
    result["shard_cpu_per_key_ratio"] = round(
        p["4"]["1000key"]["shard_cpu_us_per_key"] / p["1"]["1000key"]["shard_cpu_us_per_key"], 3
    )
    result["shard_cpu_per_key_ratio_1key"] = round(
        p["4"]["1key"]["shard_cpu_us_per_key"] / p["1"]["1key"]["shard_cpu_us_per_key"], 3
    )
    result["shard_cpu_per_key_ratio_1key_alone"] = round(
        p["4"]["1key_alone"]["shard_cpu_us_per_key"] / p["1"]["1key_alone"]["shard_cpu_us_per_key"], 3
    )
    result["failover_s"] = statistics.median(result["failovers_s"])
    from kvstore.cluster.testbed import netns_available

    why = "--skip-faults" if ns.skip_faults else netns_available()
    if not why:
        from bench.cluster_faults import run

        with tempfile.TemporaryDirectory() as tmp:
            result["faults"] = run(Path(tmp), chains=40 if ns.quick else 60, log=lambda m: tqdm.write(m))
        result["wrong_bytes"] = result["faults"]["wrong_bytes"]
    else:
        result["faults_skipped"] = why
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2))
    plot(result, ns.out.with_suffix(".png"))
    update_section("cluster", render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
