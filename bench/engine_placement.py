"""Placement: goodput on a skewed many-prefix workload, where the router's knowledge of the
device tier (which worker's own cache holds which prefix) decides how much is recomputed.

Part of ``bench/engine_reuse.py`` (its ``placement`` section; ``--part placement`` runs it
alone). Three colocated workers of the ``small`` model; ``PREFIXES`` distinct 384-token prefixes
(a few-shot or system prompt each) drawn with Zipf(1) popularity, each request one of them plus a
16-32 token question, 8 output tokens. Each worker's paged cache holds about four prefixes and
the store's DRAM about two, so no single cache holds the working set, and the workers' caches
together hold about half of it: where a prefix is matters, and only the device tier says where. Routings compared,
each on its own fresh deployment (same processes, same requests, rates in increasing order):
cache-aware (the device tier, pulls), round-robin and least-loaded with the same store; and,
labelled as what they are, the same three workers without a store (each its own prefix cache,
cache-aware on what the router sent where).
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from engine.router import RouterConfig
from engine.serve import Deployment, DeploymentSpec

PREFIXES = 24
PREFIX_TOKENS = 384
VOCAB = 256
ROUTINGS = ("cache_aware", "round_robin", "least_loaded")


def prefixes(seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, PREFIX_TOKENS).tolist() for _ in range(PREFIXES)]


def placement_requests(n: int, seed: int, heads: list[list[int]]) -> list[list[int]]:
    """``n`` prompts: a Zipf(1)-popular prefix plus a fresh question each."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, len(heads) + 1)
    pick = rng.choice(len(heads), size=n, p=w / w.sum())
    return [heads[i] + rng.integers(0, VOCAB, int(rng.integers(16, 33))).tolist() for i in pick]


CONFIGS = {
    **{f"kvstore, {r.replace('_', '-')}": dict(store="embedded", dram="16MiB", routing=r) for r in ROUTINGS},
    "no store (each worker's own prefix cache), cache-aware": dict(store="none", routing="cache_aware"),
}


async def part_placement(quick: bool, ttft_t: float, tpot_t: float) -> dict:
    from bench.engine_reuse import open_loop, summarize, sustained, warm

    rates = [2.0, 4.0] if quick else [1.0, 2.0, 3.0, 4.0, 6.0, 8.0]
    n = 12 if quick else 40
    heads = prefixes()
    out: dict = {
        "workload": f"{PREFIXES} prefixes of {PREFIX_TOKENS} tokens, Zipf(1) popularity, + 16-32 token question,"
        f" {n} requests per rate, 8 output tokens; 3 colocated workers of 128 blocks (about 4 prefixes each),"
        " store DRAM 16 MiB (about 2 prefixes)",
        "ttft_target_ms": ttft_t * 1000,
        "tpot_target_ms": tpot_t * 1000,
        "rates": rates,
        "configs": {},
    }
    for name, c in tqdm(CONFIGS.items(), desc="placement", unit="config"):
        spec = DeploymentSpec(
            model="small", colocated=3, store=c["store"], dram=c.get("dram", "512MiB"), num_blocks=128,
            router=RouterConfig(routing=c["routing"], ttft_target_s=1e9),
        )  # fmt: skip
        per_rate = []
        rows_all: list[dict] = []
        async with Deployment(spec) as d:
            await warm(d.url)
            for i, rate in enumerate(tqdm(rates, desc=name, unit="rate", leave=False)):
                rows = await open_loop(d.url, placement_requests(n, 1000 + i, heads), rate, 8, seed=1000 + i)
                rows_all += rows
                ok = [r for r in rows if r["status"] == 200]
                good = sum(1 for r in ok if r["ttft_ms"] <= ttft_t * 1000 and (r["tpot_ms"] or 0) <= tpot_t * 1000)
                per_rate.append({"rate": rate, "attainment": good / len(rows), **summarize(rows)})
        s = summarize(rows_all)
        out["configs"][name] = {
            "goodput_rps": sustained(per_rate),
            "per_rate": per_rate,
            "device_tier_hit_share": round(s["tokens_cached"] / max(1, s["prompt_tokens"]), 3),
            "store_hit_share": round(s["tokens_loaded"] / max(1, s["prompt_tokens"]), 3),
            "computed_share": round(s["tokens_computed"] / max(1, s["prompt_tokens"]), 3),
            "pulls": sum(1 for r in rows_all if r.get("pulled_from")),
        }
    g = {k: v["goodput_rps"] for k, v in out["configs"].items()}
    ca, rr, ll = g["kvstore, cache-aware"], g["kvstore, round-robin"], g["kvstore, least-loaded"]
    out["goodput_cache_aware_over_rr"] = round(ca / rr, 3) if rr else None
    out["goodput_cache_aware_over_least_loaded"] = round(ca / ll, 3) if ll else None
    return out


def render(p: dict) -> list[str]:
    lines = [
        "",
        f"### Placement ({p['workload']}; targets TTFT {p['ttft_target_ms']:.0f} ms, TPOT {p['tpot_target_ms']:.0f} ms)",
        "",
        *([f"Run alone: `{p['command']}`, {p['date']}.", ""] if p.get("command") else []),
        "Each configuration on its own fresh deployment, rates in increasing order on the same processes."
        " Device-tier hits are prompt tokens found in the serving worker's own cache; store hits were loaded"
        " from the store; pulls: requests whose prefix the router had a busy holder export to the store first.",
        "",
        "| configuration | goodput req/s | "
        + " | ".join(f"{x:g} req/s" for x in p["rates"])
        + " | device-tier hits | store hits | computed | pulls |",
        "|---|---|" + "---|" * (len(p["rates"]) + 4),
    ]
    for name, c in p["configs"].items():
        lines.append(
            f"| {name} | **{c['goodput_rps']:g}** | "
            + " | ".join(f"{x['attainment']:.2f}" for x in c["per_rate"])
            + f" | {c['device_tier_hit_share']:.2f} | {c['store_hit_share']:.2f} | {c['computed_share']:.2f}"
            f" | {c['pulls']} |"
        )
    ratio = p.get("goodput_cache_aware_over_rr")
    lines += [
        "",
        f"`goodput_cache_aware_over_rr` = **{ratio}** (target >= 1.5);"
        f" cache-aware over least-loaded {p.get('goodput_cache_aware_over_least_loaded')}.",
    ]
    return lines
