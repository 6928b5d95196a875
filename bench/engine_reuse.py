#!/usr/bin/env python3
"""System level: the engine served with and without the store, on prefix-heavy workloads.

    python bench/engine_reuse.py            # full size
    python bench/engine_reuse.py --quick    # a few minutes on 2 cores

Each configuration is a real deployment (``engine.serve.Deployment``: store process, worker
processes, router) driven over HTTP. Three parts, one run:

1. **Reuse vs recompute** on a multi-turn chat workload (a shared system prompt, growing
   histories), requests one at a time in arrival order, for: no cache; the engine's local
   prefix cache only; kvstore DRAM (local caches off, so all reuse goes through the store);
   kvstore DRAM + SSD (a DRAM segment too small for the working set). TTFT p50/p99, TPOT, and
   ``ttft_over_bound`` = TTFT with reuse / (compute time of the uncached tokens + cached bytes /
   measured store bandwidth), with the compute time measured by the same engine on each
   request's uncached tokens after its cached prefix and the bandwidth by the workers (target
   <= 1.25); ``bench/engine_bound.py`` says how, and why the flat estimate (no-cache tokens per
   second) is reported beside it.
2. **Goodput** on a shared few-shot prefix workload, open-loop Poisson arrivals at increasing
   rates: the highest rate at which 90 % of requests meet both the TTFT and the TPOT target
   (DistServe's definition), for disaggregated (2 prefill + 1 decode) vs colocated (3 workers),
   each with the cache-aware router and with round-robin.
3. **Sessions**: how many concurrent multi-turn sessions stay under the TTFT target at p95,
   with kvstore vs without any cache.
4. **Placement** (``bench/engine_placement.py``): goodput on a skewed many-prefix workload that
   no single cache holds, cache-aware routing on the device tier vs round-robin vs
   least-loaded, and the device-tier hit share.

The no-cache baseline is one colocated worker without a store; the disaggregated deployment
without a store (whose decode worker recomputes the whole prompt) is reported beside it,
labelled as such.

Writes bench/results/engine.json, PNG plots (TTFT CDF, goodput vs rate) and the "engine"
section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.engine_bound import ttft_over_bound  # noqa: E402
from bench.engine_placement import part_placement  # noqa: E402
from bench.engine_report import plot, render  # noqa: E402
from bench.report import machine, update_section  # noqa: E402
from bench.workloads import make  # noqa: E402
from engine.router import RouterConfig  # noqa: E402
from engine.serve import Deployment, DeploymentSpec  # noqa: E402

VOCAB = 256  # the byte range of the engine's tokenizer


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(xs, p)) if xs else float("nan")


async def one(session: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int) -> dict:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        data = await r.json()
    if r.status != 200:
        return {"status": r.status, "error": data.get("error", {}).get("message", ""), "e2e_s": time.perf_counter() - t}
    info = data["kvstore"]
    return {
        "status": 200,
        "prompt": len(ids),
        "e2e_s": time.perf_counter() - t,
        **{k: v for k, v in info.items() if k != "output_ids"},
    }


def chat_requests(quick: bool) -> list[tuple[float, list[int], int]]:
    w = make(
        "chat", seed=0, scale=1.0, quiet=True, sessions=4 if quick else 8, duration_s=5.0,
        system_tokens=384 if quick else 512, turns=(3, 3) if quick else (4, 4), user_tokens=(24, 64),
        answer_tokens=(16, 32), think_s=2.0,
    )  # fmt: skip
    return [(r.arrival_s, (np.asarray(r.prompt) % VOCAB).tolist(), 8) for r in w.requests()]


def fewshot_requests(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, 768).tolist()
    return [prefix + rng.integers(0, VOCAB, int(rng.integers(16, 48))).tolist() for _ in range(n)]


async def run_sequential(url: str, reqs, desc: str) -> list[dict]:
    async with aiohttp.ClientSession() as s:
        out = []
        for _, ids, n in tqdm(reqs, desc=desc, unit="req", leave=False):
            out.append(await one(s, url, ids, n))
    return out


async def warm(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        await one(s, url, list(range(40)), 2)


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["status"] == 200]
    ttft = [r["ttft_ms"] for r in ok]
    tpot = [r["tpot_ms"] for r in ok if r.get("tpot_ms") is not None]
    return {
        "requests": len(rows), "ok": len(ok),
        "ttft_p50_ms": round(pct(ttft, 50), 2), "ttft_p99_ms": round(pct(ttft, 99), 2),
        "tpot_p50_ms": round(pct(tpot, 50), 2),
        "prompt_tokens": sum(r["prompt"] for r in ok),
        "tokens_loaded": sum(r.get("tokens_loaded", 0) for r in ok),
        "tokens_cached": sum(r.get("tokens_cached", 0) for r in ok),
        "tokens_computed": sum(r.get("tokens_computed", 0) for r in ok),
    }  # fmt: skip


REUSE_CONFIGS = {
    # The baseline: one worker doing both phases, no store, no prefix cache.
    "no cache": dict(store="none", prefix_cache=False, colocated=1),
    # Kept for comparison, labelled: without a store the decode worker recomputes the whole
    # prompt the prefill worker already computed.
    "no cache, disaggregated (decode recomputes the prompt)": dict(store="none", prefix_cache=False),
    "local prefix cache": dict(store="none", prefix_cache=True),
    "kvstore DRAM": dict(store="embedded", prefix_cache=False),
    "kvstore DRAM+SSD": dict(
        store="embedded", prefix_cache=False, dram="24MiB", store_args=["--set", "daemon.ssd_bytes=1GiB"]
    ),
}


async def part_reuse_and_sessions(quick: bool) -> tuple[dict, dict]:
    """Reuse vs recompute for every configuration; the sessions sweep in the no-cache and the
    kvstore DRAM deployments (the same processes, fresh prompts)."""
    reqs = chat_requests(quick)
    names = ["no cache", "kvstore DRAM"] if quick else list(REUSE_CONFIGS)  # no cache first: it sets the targets
    res: dict = {"workload": f"chat, {len(reqs)} requests in arrival order, one at a time", "configs": {}}
    sessions: dict = {"counts": [1, 2, 4] if quick else [1, 2, 4, 6, 8], "turns": 3 if quick else 4, "configs": {}}
    rows_by: dict[str, list[dict]] = {}
    for name in names:
        async with Deployment(DeploymentSpec(model="small", **REUSE_CONFIGS[name])) as d:
            await warm(d.url)
            rows = await run_sequential(d.url, reqs, name)
            rows_by[name] = rows
            res["configs"][name] = {**summarize(rows), "ttft_ms": [r["ttft_ms"] for r in rows if r["status"] == 200]}
            await d.router._poll_once()
            if name == "kvstore DRAM":
                res["store_health"] = [w.health for w in d.router.workers]
            if name == "no cache":
                sessions["ttft_target_ms"] = ttft_target(res) * 1000
            if name in ("no cache", "kvstore DRAM"):
                sessions["configs"][name] = await sessions_sweep(d.url, sessions, name)
    # The flat compute speed from the no-cache run: prompt tokens / TTFT (prefill is nearly all of it).
    base = [r for r in rows_by["no cache"] if r["status"] == 200]
    tps = statistics.median(r["prompt"] / (r["ttft_ms"] / 1000) for r in base)
    prefill = next(h for h in res["store_health"] if h.get("role") == "prefill")
    bw = prefill.get("store_effective_bandwidth") or float("nan")  # round trips included
    res["compute_tokens_per_s"] = round(tps, 1)
    res["store_bandwidth_gbps"] = round(bw / 1e9, 3)
    res.update(ttft_over_bound(rows_by["kvstore DRAM"], [ids for _, ids, _ in reqs], tps, bw, prefill["block_bytes"]))
    return res, sessions


def ttft_target(reuse: dict) -> float:
    """The TTFT target, relative to this machine: twice an idle full recompute of a chat prompt."""
    return max(0.2, 2 * reuse["configs"]["no cache"]["ttft_p50_ms"] / 1000)


TPOT_TARGET_S = 0.15


async def open_loop(url: str, prompts: list[list[int]], rate: float, max_tokens: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(prompts))
    async with aiohttp.ClientSession() as s:
        tasks = []
        for gap, ids in zip(gaps, prompts):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(s, url, ids, max_tokens)))
        return await asyncio.gather(*tasks)


async def part_goodput(quick: bool, ttft_t: float, tpot_t: float) -> dict:
    rates = [2.0, 6.0] if quick else [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]
    n = 10 if quick else 40
    deployments = {"disagg": dict(prefill=2, decode=1), "colocated": dict(colocated=3)}
    out: dict = {"workload": f"few-shot: 768-token shared prefix + 16-48 token question, {n} requests per rate, 16 output tokens",
                 "ttft_target_ms": ttft_t * 1000, "tpot_target_ms": tpot_t * 1000, "rates": rates, "configs": {}}  # fmt: skip
    seed = 0
    for mode, c in deployments.items():
        spec = DeploymentSpec(model="small", store="embedded", router=RouterConfig(ttft_target_s=1e9), **c)
        per: dict[str, list[dict]] = {"cache_aware": [], "round_robin": []}
        async with Deployment(spec) as d:
            await warm(d.url)
            for i, rate in enumerate(tqdm(rates, desc=mode, unit="rate", leave=False)):
                # Both routings at each rate on the same processes, alternating which goes first,
                # so that neither gets the benefit of the other's warm-up; every run a fresh prefix.
                order = ("cache_aware", "round_robin") if i % 2 == 0 else ("round_robin", "cache_aware")
                for routing in order:
                    d.router.cfg.routing = routing
                    seed += 1
                    rows = await open_loop(d.url, fewshot_requests(n, seed=seed), rate, 16, seed=seed)
                    ok = [r for r in rows if r["status"] == 200]
                    good = sum(1 for r in ok if r["ttft_ms"] <= ttft_t * 1000 and (r["tpot_ms"] or 0) <= tpot_t * 1000)
                    per[routing].append({"rate": rate, "attainment": good / len(rows), **summarize(rows)})
        for routing, per_rate in per.items():
            goodput = sustained(per_rate)
            out["configs"][f"{mode}, {routing.replace('_', '-')}"] = {"goodput_rps": goodput, "per_rate": per_rate}
    return out


def sustained(per_rate: list[dict], slo: float = 0.9) -> float:
    """Goodput: the highest rate at which, and at every lower rate, at least ``slo`` of the
    requests met both targets (a noisy curve does not get credit for a lucky high point)."""
    best = 0.0
    for p in sorted(per_rate, key=lambda p: p["rate"]):
        if p["attainment"] < slo:
            break
        best = p["rate"]
    return best


async def session(
    s: aiohttp.ClientSession, url: str, system: list[int], turns: int, seed: int, think_s: float
) -> list[dict]:
    """One closed-loop conversation: each turn is sent after the previous answer (plus think time)."""
    rng = np.random.default_rng(seed)
    history = list(system)
    rows = []
    await asyncio.sleep(float(rng.uniform(0, think_s)))
    for _ in range(turns):
        history += rng.integers(0, VOCAB, int(rng.integers(24, 64))).tolist()
        rows.append(await one(s, url, history, 8))
        history += rng.integers(0, VOCAB, int(rng.integers(16, 32))).tolist()  # the answer
        await asyncio.sleep(float(rng.exponential(think_s)))
    return rows


async def sessions_sweep(url: str, cfg: dict, name: str) -> dict:
    system = np.random.default_rng(5).integers(0, VOCAB, 512).tolist()
    p95s = []
    async with aiohttp.ClientSession() as s:
        for k in tqdm(cfg["counts"], desc=f"sessions {name}", leave=False):
            groups = await asyncio.gather(*(session(s, url, system, cfg["turns"], 100 * k + i, 1.0) for i in range(k)))
            rows = [r for g in groups for r in g]
            p95s.append(round(pct([r["ttft_ms"] for r in rows if r["status"] == 200], 95), 2))
    ok = [k for k, p in zip(cfg["counts"], p95s) if p <= cfg["ttft_target_ms"]]
    return {"p95_ttft_ms": p95s, "max_sessions": max(ok, default=0)}


async def amain(quick: bool) -> dict:
    cmd = "python bench/engine_reuse.py" + (" --quick" if quick else "")
    r: dict = {"command": cmd, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine()}
    r["reuse"], r["sessions"] = await part_reuse_and_sessions(quick)
    r["goodput"] = await part_goodput(quick, ttft_target(r["reuse"]), TPOT_TARGET_S)
    r["placement"] = await part_placement(quick, ttft_target(r["reuse"]), TPOT_TARGET_S)
    r["ttft_over_bound"] = r["reuse"]["ttft_over_bound"]
    r["goodput_cache_aware_over_rr"] = r["placement"]["goodput_cache_aware_over_rr"]
    return r


async def amain_reuse(quick: bool) -> dict:
    """Only the reuse and sessions parts, merged into the recorded engine.json."""
    r = json.loads((REPO / "bench" / "results" / "engine.json").read_text())
    r["reuse"], r["sessions"] = await part_reuse_and_sessions(quick)
    r["reuse"]["command"] = "python bench/engine_reuse.py --part reuse" + (" --quick" if quick else "")
    r["reuse"]["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    r["ttft_over_bound"] = r["reuse"]["ttft_over_bound"]
    return r


async def amain_placement(quick: bool) -> dict:
    """Only the placement part, merged into the recorded engine.json (its targets from there)."""
    r = json.loads((REPO / "bench" / "results" / "engine.json").read_text())
    r["placement"] = await part_placement(quick, ttft_target(r["reuse"]), TPOT_TARGET_S)
    r["placement"]["command"] = "python bench/engine_reuse.py --part placement" + (" --quick" if quick else "")
    r["placement"]["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    r["goodput_cache_aware_over_rr"] = r["placement"]["goodput_cache_aware_over_rr"]
    return r


def run(quick: bool, report: bool = True, part: str = "all") -> dict:
    parts = {"placement": amain_placement, "reuse": amain_reuse, "all": amain}
    r = asyncio.run(parts[part](quick))
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(r, indent=2) + "\n")
    pngs = plot(r, out)
    if report:
        update_section("engine", render(r, pngs))
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--render-only", action="store_true", help="rebuild plots and the report from engine.json")
    ap.add_argument(
        "--part",
        choices=("all", "reuse", "placement"),
        default="all",
        help="reuse (with sessions) or placement: run only that part, merged into engine.json",
    )
    ns = ap.parse_args()
    if ns.render_only:
        out = REPO / "bench" / "results"
        r = json.loads((out / "engine.json").read_text())
        for c in r["goodput"]["configs"].values():
            c["goodput_rps"] = sustained(c["per_rate"])
        (out / "engine.json").write_text(json.dumps(r, indent=2) + "\n")
        update_section("engine", render(r, plot(r, out)))
    else:
        r = run(ns.quick, not ns.no_report, ns.part)
    print(json.dumps({"ttft_over_bound": r["ttft_over_bound"],
                      "goodput": {k: v["goodput_rps"] for k, v in r["goodput"]["configs"].items()},
                      "goodput_cache_aware_over_rr": r.get("goodput_cache_aware_over_rr")}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
