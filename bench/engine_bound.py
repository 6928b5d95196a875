"""The TTFT bound of a request that reuses a stored prefix, for ``bench/engine_reuse.py``.

The best a store can do for a request whose first ``c`` prompt tokens it holds is: move their KV
at the store's bandwidth, then compute the other ``n`` tokens. So

    bound = compute(n tokens after c cached ones) + c tokens' KV bytes / store bandwidth

Two estimates of the compute term are reported:

- **measured** (``ttft_over_bound``): the same engine (same model, one torch thread, like every
  worker) computes each request's uncached tokens with its cached prefix already in the paged
  cache, timed in this process after the deployments have stopped. A fresh engine per request
  holds exactly the prefix the store served; the prefix is computed untimed first.
- **flat** (``ttft_over_flat_bound``): ``n / tokens-per-second`` of the no-cache run's whole
  prompts. It undercounts: the uncached tokens of a reuse request sit at the end of a long
  context (their attention reads the whole prefix, about 20 % of a step here), and a short
  prefill runs its matrix products at lower efficiency than a long one.
"""

from __future__ import annotations

import statistics
import time

from tqdm import tqdm


def measured_compute_s(prompts: list[list[int]], present: list[int], model: str = "small") -> list[float]:
    """Seconds to compute ``prompt[present:]`` (and sample its first token) with ``prompt[:present]``
    already cached, for each request, on one torch thread."""
    import torch

    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.worker import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = build_model(model)
    try:
        out = []
        warm = LLMEngine(m, EngineConfig(num_blocks=128))
        warm.generate([list(range(64))], max_tokens=1)
        for ids, c in tqdm(list(zip(prompts, present)), desc="compute bound", unit="req", leave=False):
            eng = LLMEngine(m, EngineConfig(num_blocks=-(-len(ids) // 16) * 2 + 8))
            if c:
                eng.generate([ids[:c]], max_tokens=1)
            before = eng.scheduler.stats.cached_tokens
            t = time.perf_counter()
            eng.generate([ids], max_tokens=1, ignore_eos=True)
            out.append(time.perf_counter() - t)
            got = eng.scheduler.stats.cached_tokens - before
            if got != c:
                raise RuntimeError(f"the bound's engine found {got} cached tokens, expected {c}")
        return out
    finally:
        torch.set_num_threads(threads)


def ttft_over_bound(
    rows: list[dict], prompts: list[list[int]], flat_tps: float, bw: float, block_bytes: int, model: str = "small"
) -> dict:
    """Both ratios (sum of TTFTs / sum of bounds, and the per-request median) for the reuse rows."""
    ok = [(r, p) for r, p in zip(rows, prompts) if r["status"] == 200]
    present = [r["tokens_loaded"] + r.get("tokens_cached", 0) for r, _ in ok]
    compute = measured_compute_s([p for _, p in ok], present, model)
    ttft = [r["ttft_ms"] / 1000 for r, _ in ok]
    load = [(r["tokens_loaded"] // 16) * block_bytes / bw for r, _ in ok]
    bound = [c + x for c, x in zip(compute, load)]
    flat = [r["tokens_computed"] / flat_tps + x for (r, _), x in zip(ok, load)]
    return {
        "ttft_over_bound": round(sum(ttft) / sum(bound), 3),
        "ttft_over_bound_p50": round(statistics.median(t / b for t, b in zip(ttft, bound)), 3),
        "ttft_over_flat_bound": round(sum(ttft) / sum(flat), 3),
        "ttft_over_flat_bound_p50": round(statistics.median(t / b for t, b in zip(ttft, flat)), 3),
        "bound_compute_ms_mean": round(statistics.fmean(compute) * 1000, 2),
        "bound_load_ms_mean": round(statistics.fmean(load) * 1000, 2),
        "ttft_ms_mean": round(statistics.fmean(ttft) * 1000, 2),
        "load_ms_mean": round(statistics.fmean(r.get("load_ms", 0.0) for r, _ in ok), 2),
        "worker_ttft_ms_mean": round(statistics.fmean(r.get("worker_ttft_ms", 0.0) for r, _ in ok), 2),
    }
