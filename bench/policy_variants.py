#!/usr/bin/env python3
"""Cache-policy robustness: the adaptive policy on traffic it was not designed on.

    python bench/policy_variants.py             # every variant, capacities 1k..100k blocks
    python bench/policy_variants.py --quick     # capacities 1k..10k

``bench/policy.py`` measures the policy on four workloads; a production pool sees others. This
replays reshaped versions of them through the same index (``kvstore``, as in ``bench/policy.py``)
next to plain LRU, tail-first LRU and Belady's MIN, and checks the floor that must hold
everywhere: never more than ``LRU_FLOOR`` below plain LRU's prefix hit rate. Variants:

- ``trace_first_half`` / ``trace_second_half``: the production trace cut in two (each half
  starts cold, with its own hot prefixes);
- ``trace_two_tenants``: the trace interleaved with a copy of itself rotated by a third, the
  copy's keys in another tenant's namespace (twice the working set, two populations);
- ``trace_no_shared_head``: every request without its first hash block (no shared system
  prompt: only conversation reuse is left);
- ``trace_shuffled``: requests shuffled within windows of 500 (local order destroyed, the
  same blocks and counts);
- ``trace_counter_keys``: the trace with every block named by a counter (16 big-endian bytes
  in first-use order) instead of a hash: clients may name blocks as they like;
- ``chat_seed1`` / ``chat_seed2`` / ``docqa_seed1`` / ``docqa_seed2``: the synthetic workloads
  drawn with other seeds.

Writes bench/results/policy_variants.json, bench/results/policy_variants.png and the
"policy_variants" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import policy as P  # noqa: E402
from bench.report import machine, update_section  # noqa: E402
from bench.workloads import KEYSPACE, make  # noqa: E402

RESULTS = REPO / "bench" / "results"
POLICIES = ("kvstore", "lru", "tail_first_lru", "optimal")
SHUFFLE_WINDOW = 500


@cache
def _trace_keys() -> tuple[tuple[bytes, ...], ...]:
    """The trace's key lists as ``bench/policy.py`` replays them (built once; never mutated)."""
    w = make("trace", seed=P.SEED, **P.FULL["trace"])
    return tuple(tuple(ks) for ks in w.block_keys())


def _tenant(keys: Sequence[Sequence[bytes]], tag: bytes) -> list[list[bytes]]:
    memo: dict[bytes, bytes] = {}

    def name(k: bytes) -> bytes:
        v = memo.get(k)
        if v is None:
            v = memo[k] = hashlib.blake2b(k, digest_size=16, key=tag).digest()
        return v

    return [[name(k) for k in ks] for ks in keys]


def _counters(keys: Sequence[Sequence[bytes]]) -> list[list[bytes]]:
    ids: dict[bytes, bytes] = {}
    return [[ids.setdefault(k, (len(ids) + 1).to_bytes(16, "big")) for k in ks] for ks in keys]


def variants() -> dict[str, Callable[[], tuple[list[list[bytes]], str]]]:
    """Name -> a builder of the variant's key lists (in arrival order) and a one-line description."""

    def trace_half(second: bool) -> tuple[list[list[bytes]], str]:
        keys = [list(ks) for ks in _trace_keys()]
        n = len(keys) // 2
        return (keys[n:] if second else keys[:n]), f"{'second' if second else 'first'} half of the trace's requests"

    def two_tenants() -> tuple[list[list[bytes]], str]:
        keys = [list(ks) for ks in _trace_keys()]
        third = len(keys) // 3
        other = _tenant(keys[third:] + keys[:third], b"tenant-b")
        mixed = [ks for pair in zip(keys, other) for ks in pair]
        return mixed, "the trace interleaved with a copy rotated by a third, the copy in another key namespace"

    def no_head() -> tuple[list[list[bytes]], str]:
        keys = [list(ks) for ks in _trace_keys()]
        per_hash = P.FULL["trace"]["tokens_per_hash_block"] // KEYSPACE.block_size
        return [ks[per_hash:] for ks in keys if len(ks) > per_hash], "each request without its first hash block"

    def shuffled() -> tuple[list[list[bytes]], str]:
        keys = [list(ks) for ks in _trace_keys()]
        rng = random.Random(P.SEED)
        out: list[list[bytes]] = []
        for i in range(0, len(keys), SHUFFLE_WINDOW):
            win = keys[i : i + SHUFFLE_WINDOW]
            rng.shuffle(win)
            out += win
        return out, f"requests shuffled within windows of {SHUFFLE_WINDOW}"

    def counter_keys() -> tuple[list[list[bytes]], str]:
        return _counters(_trace_keys()), "every block named by a 16-byte big-endian counter, not a hash"

    def synthetic(name: str, seed: int) -> Callable[[], tuple[list[list[bytes]], str]]:
        def build() -> tuple[list[list[bytes]], str]:
            w = make(name, seed=seed, **P.FULL[name])
            return [list(ks) for ks in w.block_keys()], f"{name} drawn with seed {seed}"

        return build

    return {
        "trace_first_half": lambda: trace_half(False),
        "trace_second_half": lambda: trace_half(True),
        "trace_two_tenants": two_tenants,
        "trace_no_shared_head": no_head,
        "trace_shuffled": shuffled,
        "trace_counter_keys": counter_keys,
        "chat_seed1": synthetic("chat", 1),
        "chat_seed2": synthetic("chat", 2),
        "docqa_seed1": synthetic("docqa", 1),
        "docqa_seed2": synthetic("docqa", 2),
    }


def run(names: Sequence[str], caps: Sequence[int], jobs: int, progress: bool = True) -> dict:
    builders = variants()
    result: dict = {"capacities": list(caps), "lru_floor": P.LRU_FLOOR, "variants": {}}
    try:
        for name in tqdm(names, desc="streams", unit="variant", disable=not progress):
            keys, what = builders[name]()
            P._STREAMS[name] = s = P.Stream.from_keys(name, keys)
            result["variants"][name] = {"what": what, **s.profile()}
        tasks = [(n, c, p) for n in names for c in caps for p in POLICIES]
        raw: dict[tuple[str, int], dict[str, dict]] = {}
        for n, c, p, out, _ in P.replay_tasks(tasks, jobs, progress):
            raw.setdefault((n, c), {})[p] = out
        worst = None
        for name in names:
            refs = P._STREAMS[name].refs
            rows = [_row(c, raw[(name, c)], refs) for c in caps]
            for row in rows:
                if worst is None or row["below_lru"] > worst["below_lru"]:
                    worst = {"variant": name, "capacity": row["capacity"], "below_lru": row["below_lru"]}
            result["variants"][name]["rows"] = rows
    finally:
        P._STREAMS.clear()
    result["worst_below_lru"] = worst
    result["floor_met_everywhere"] = all(r["meets_lru_floor"] for v in result["variants"].values() for r in v["rows"])
    return result


def _row(capacity: int, got: dict[str, dict], refs: int) -> dict:
    """One capacity's row: prefix hit rates, and kvstore against plain LRU from unrounded rates."""
    rates = {p: got[p]["hits"] / refs for p in POLICIES}
    below = rates["lru"] - rates["kvstore"]
    kv = got["kvstore"]
    freq, rec = kv.get("policy_frequency_keys", 0), kv.get("policy_recency_keys", 0)
    sc = kv.get("policy_second_chance_keys", 0)
    return {
        "capacity": capacity,
        "hit_rates": {p: round(v, 4) for p, v in rates.items()},
        "below_lru": round(below, 4),
        "hit_over_lru": round(rates["kvstore"] / rates["lru"], 4) if rates["lru"] else None,
        "meets_lru_floor": below <= P.LRU_FLOOR,
        "mode_switches": kv.get("policy_mode_switches", 0),
        "frequency_key_share": round(freq / max(1, freq + rec + sc), 3),
        "second_chance_key_share": round(sc / max(1, freq + rec + sc), 3),
    }


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, v in result["variants"].items():
        caps = [r["capacity"] for r in v["rows"]]
        ratios = [r["hit_over_lru"] for r in v["rows"]]  # None where LRU hits nothing: not drawn
        ax.plot(caps, [x if x else float("nan") for x in ratios], "o-", ms=3, label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("capacity (16-token blocks)")
    ax.set_ylabel("kvstore hit rate / plain LRU's")
    ax.set_title("adaptive policy on reshaped traffic (above 1: better than LRU)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(r: dict, png: str | None) -> str:
    lines = [
        "## Cache policy on reshaped traffic (`bench/policy_variants.py`)",
        "",
        f"`{r['command']}` on {r['machine']}, {r['date']} ({r['wall_s']} s). Each variant replayed through the",
        "metadata service's index (default adaptive policy) as in `bench/policy.py`, next to plain LRU,",
        "tail-first LRU and Belady's MIN (upper bound). Numbers are prefix hit rates (leading-hit blocks /",
        "blocks requested); the floor is kvstore's rate never more than",
        f"{r['lru_floor']} below plain LRU's (an absolute difference). Worst: {r['worst_below_lru']['variant']} at "
        f"{r['worst_below_lru']['capacity']:,} blocks, {r['worst_below_lru']['below_lru']:.4f} below LRU; "
        f"floor met everywhere: **{'yes' if r['floor_met_everywhere'] else 'no'}**.",
        "",
        "| variant | capacity | kvstore | LRU | tail-first LRU | optimal | kvstore / LRU | switches | keys in frequency mode "
        "| keys in second-chance mode |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in r["variants"].items():
        for row in v["rows"]:
            h = row["hit_rates"]
            ratio = f"{row['hit_over_lru']:.3f}" if row["hit_over_lru"] is not None else "-"
            flag = "" if row["meets_lru_floor"] else " **below floor**"
            lines.append(
                f"| {name} | {row['capacity']:,} | {h['kvstore']:.4f}{flag} | {h['lru']:.4f} | {h['tail_first_lru']:.4f} "
                f"| {h['optimal']:.4f} | {ratio} | {row['mode_switches']} | {row['frequency_key_share']:.0%} "
                f"| {row.get('second_chance_key_share', 0):.0%} |"
            )
    lines += ["", "Variants:", ""]
    lines += [
        f"- `{n}`: {v['what']} ({v['block_refs']:,} block refs, {v['distinct_blocks']:,} distinct)"
        for n, v in r["variants"].items()
    ]
    if png:
        lines += ["", f"![kvstore over LRU on reshaped traffic](results/{png})"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="capacities 1k..10k only")
    ap.add_argument("--variant", action="append", choices=sorted(variants()), help="only this variant (repeatable)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=RESULTS / "policy_variants.json")
    ap.add_argument("--no-report", action="store_true", help="do not rewrite bench/RESULTS.md")
    ns = ap.parse_args(argv)
    names = ns.variant or list(variants())
    caps = P.QUICK_CAPACITIES if ns.quick else P.FULL_CAPACITIES
    flags = (["--quick"] if ns.quick else []) + [f"--variant {v}" for v in ns.variant or []]
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.perf_counter()
    result = run(names, caps, ns.jobs)
    result = {
        "command": " ".join(["python bench/policy_variants.py", *flags]),
        "date": date,
        "machine": machine(),
        "wall_s": round(time.perf_counter() - t0, 1),
        **result,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    png = ns.out.with_name("policy_variants.png")
    has_plot = plot(result, png)
    for name, v in result["variants"].items():
        for row in v["rows"]:
            print(
                f"{name:22s} {row['capacity']:>7,}  kvstore {row['hit_rates']['kvstore']:.4f}  lru {row['hit_rates']['lru']:.4f}  below_lru {row['below_lru']:+.4f}"
            )
    print(f"worst below LRU: {result['worst_below_lru']}; floor met everywhere: {result['floor_met_everywhere']}")
    print(f"wrote {ns.out} in {result['wall_s']} s")
    if not ns.no_report:
        update_section("policy_variants", render(result, png.name if has_plot else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
