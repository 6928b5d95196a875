"""The engine's ``kvstore demo``: multi-turn chat through the torch engine, with kvstore and
without any cache, on the same prompts (plugged into ``kvstore`` by the ``kvstore.commands``
entry point: the store's package does not import the engine)."""

from __future__ import annotations

import numpy as np


def run(sessions: int = 3, turns: int = 3, seed: int = 0) -> int | None:
    """Runs the engine demo; None when torch or aiohttp is missing (the caller then runs the
    store-only demo)."""
    try:
        import aiohttp  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        print("(torch or aiohttp missing: running the store-only demo)")
        return None
    import asyncio

    return asyncio.run(_engine_demo(sessions, turns, seed))


async def _engine_demo(sessions: int, turns: int, seed: int) -> int:
    """Multi-turn chat through the engine, twice: with the store (the workers' local prefix
    caches off, so every reuse comes through kvstore) and without any cache; same prompts."""
    import aiohttp

    from engine.serve import Deployment, DeploymentSpec

    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 768).tolist()
    convs = []  # per session, per turn: the prompt
    for _ in range(sessions):
        history, prompts = list(system), []
        for _ in range(turns):
            history += rng.integers(0, 256, int(rng.integers(32, 96))).tolist()
            prompts.append(list(history))
            history += rng.integers(0, 256, 24).tolist()  # the answer, carried by the next turn
        convs.append(prompts)
    order = [(t, s) for t in range(turns) for s in range(sessions)]
    print(
        f"kvstore demo: {sessions} chat sessions x {turns} turns sharing a {len(system)}-token system prompt, "
        "served by the engine (`small` model: 26 M parameters, CPU) with 1 prefill + 1 decode worker process",
        flush=True,
    )
    results = {}
    for label, store in (("with kvstore", "embedded"), ("recompute", "none")):
        spec = DeploymentSpec(model="small", prefill=1, decode=1, store=store, prefix_cache=False)
        async with Deployment(spec) as d, aiohttp.ClientSession() as http:
            body = {"prompt": list(range(32)), "max_tokens": 2, "temperature": 0}
            async with http.post(d.url + "/v1/completions", json=body) as r:  # warm-up
                await r.read()
            rows = []
            for t, s in order:
                body = {"prompt": convs[s][t], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
                async with http.post(d.url + "/v1/completions", json=body) as r:
                    data = await r.json()
                if r.status != 200:
                    print(f"request failed: {data}")
                    return 1
                rows.append(data["kvstore"])
            results[label] = rows
            if store == "embedded":
                print(f"store: {d.store_addr}; router: {d.url}\n")
    reuse, base = results["with kvstore"], results["recompute"]
    print(
        f"{'turn':>4} {'session':>7} {'prompt':>7} {'from store':>10} {'computed':>8} {'TTFT kvstore ms':>16} {'TTFT recompute ms':>18} {'same tokens':>11}"
    )
    same_all = True
    for (t, s), a, b in zip(order, reuse, base):
        same = a["output_ids"] == b["output_ids"]
        same_all &= same
        print(f"{t + 1:>4} {s:>7} {len(convs[s][t]):>7} {a['tokens_loaded']:>10} {a['tokens_computed']:>8} "
              f"{a['ttft_ms']:>16.1f} {b['ttft_ms']:>18.1f} {'yes' if same else 'NO':>11}")  # fmt: skip
    p50 = lambda rows: float(np.median([r["ttft_ms"] for r in rows]))  # noqa: E731
    loaded = sum(r["tokens_loaded"] for r in reuse)
    total = sum(len(convs[s][t]) for t, s in order)
    print(
        f"\nprefix reuse: {loaded} of {total} prompt tokens ({100 * loaded / total:.0f}%) loaded from kvstore instead of computed"
    )
    print(
        f"TTFT p50: {p50(reuse):.1f} ms with kvstore vs {p50(base):.1f} ms recomputing ({p50(base) / p50(reuse):.1f}x)"
    )
    print(f"greedy output identical with and without the store: {'yes' if same_all else 'NO'}")
    return 0 if same_all and loaded > 0 else 1
