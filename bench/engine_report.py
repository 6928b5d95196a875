"""The engine benchmark's report: plots and the "engine" section of bench/RESULTS.md, from the
results ``bench/engine_reuse.py`` writes (bench/results/engine.json)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.engine_placement import render as placement_render


def plot(r: dict, outdir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in r["reuse"]["configs"].items():
        xs = np.sort(c["ttft_ms"])
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF, multi-turn chat (small model, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(outdir / "engine_ttft_cdf.png", dpi=110)
    names.append("engine_ttft_cdf.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    g = r["goodput"]
    for name, c in g["configs"].items():
        ax.plot([p["rate"] for p in c["per_rate"]], [p["attainment"] for p in c["per_rate"]], marker="o", label=name)
    ax.axhline(0.9, color="grey", ls="--", lw=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("fraction meeting TTFT and TPOT targets")
    ax.set_title("SLO attainment vs rate (goodput = last rate above 0.9)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(outdir / "engine_goodput.png", dpi=110)
    names.append("engine_goodput.png")
    return names


def bound_lines(ru: dict) -> list[str]:
    """The TTFT bound of the kvstore DRAM run: measured compute (the target) and the flat estimate."""
    if "ttft_over_flat_bound" not in ru:  # a record from before the measured bound
        return [
            f"`ttft_over_bound` (kvstore DRAM, flat compute estimate) = **{ru['ttft_over_bound']}**"
            f" (per-request median {ru['ttft_over_bound_p50']}; target <= 1.25)."
        ]
    return [
        f"`ttft_over_bound` (kvstore DRAM) = **{ru['ttft_over_bound']}** (per-request median"
        f" {ru['ttft_over_bound_p50']}; target <= 1.25). Bound = the same engine's time to compute each request's"
        f" uncached tokens with its cached prefix in place (measured in the benchmark process on one torch thread,"
        f" mean {ru['bound_compute_ms_mean']} ms) + the cached blocks' bytes at the store bandwidth the workers"
        f" measured ({ru['store_bandwidth_gbps']} GB/s, round trips included; mean {ru['bound_load_ms_mean']} ms).",
        "",
        f"Measured per request (means): TTFT at the router {ru['ttft_ms_mean']} ms, at the worker"
        f" {ru['worker_ttft_ms_mean']} ms, of which the store load {ru['load_ms_mean']} ms.",
        "",
        f"With the flat compute estimate instead (uncached tokens at the no-cache run's {ru['compute_tokens_per_s']}"
        f" tokens/s of whole prompts): `ttft_over_flat_bound` = {ru['ttft_over_flat_bound']} (per-request median"
        f" {ru['ttft_over_flat_bound_p50']}). That estimate undercounts the compute of a reuse request: its uncached"
        " tokens attend to the whole cached prefix, and a short prefill runs its matrix products less efficiently"
        " than a long one.",
        *local_line(ru),
    ]


def local_line(ru: dict) -> list[str]:
    local, store = ru["configs"].get("local prefix cache"), ru["configs"].get("kvstore DRAM")
    if not local or not store:
        return []
    return [
        "",
        f"For comparison, the local prefix cache (the prefix's KV already in the worker's cache, no load at all)"
        f" had TTFT p50 {local['ttft_p50_ms']} ms against kvstore DRAM's {store['ttft_p50_ms']} ms on the same"
        f" requests ({local['tokens_computed']} vs {store['tokens_computed']} tokens computed).",
    ]


def render(r: dict, pngs: list[str]) -> str:
    ru = r["reuse"]
    lines = [
        "## Engine: TTFT with reuse, goodput, sessions (`bench/engine_reuse.py`)",
        "",
        f"- Command: `{r['command']}`",
        f"- Date: {r['date']}",
        f"- Machine: {r['machine']}",
        "- Model: the engine's `small` preset (26 M parameters, float32, random weights), one torch thread per"
        " worker process, every worker a separate process, requests over HTTP through the router.",
        "",
        *(
            [f"- The reuse and sessions parts were rerun alone: `{ru['command']}`, {ru['date']}", ""]
            if ru.get("command")
            else []
        ),
        f"### Reuse vs recompute ({ru['workload']})",
        "",
        "| configuration | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | prompt tokens | loaded from store | local cache | computed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in ru["configs"].items():
        lines.append(
            f"| {name} | {c['ttft_p50_ms']} | {c['ttft_p99_ms']} | {c['tpot_p50_ms']} | {c['prompt_tokens']} "
            f"| {c['tokens_loaded']} | {c['tokens_cached']} | {c['tokens_computed']} |"
        )
    lines += [
        "",
        *bound_lines(ru),
        "",
        f"### Goodput ({r['goodput']['workload']}; targets TTFT {r['goodput']['ttft_target_ms']:.0f} ms, TPOT {r['goodput']['tpot_target_ms']:.0f} ms)",
        "",
        "Goodput = the highest rate at which, and at every lower rate, >= 90 % of requests met both targets."
        " Each rate ran both routings on the same processes, alternating which went first; every run had a"
        " fresh prefix. On 2 cores shared by 4 processes the attainment curves are noisy (+-0.3 at one rate).",
        "",
        "| configuration | goodput req/s | " + " | ".join(f"{x:g} req/s" for x in r["goodput"]["rates"]) + " |",
        "|---|---|" + "---|" * len(r["goodput"]["rates"]),
    ]
    for name, c in r["goodput"]["configs"].items():
        lines.append(
            f"| {name} | **{c['goodput_rps']:g}** | "
            + " | ".join(f"{p['attainment']:.2f}" for p in c["per_rate"])
            + " |"
        )
    se = r["sessions"]
    lines += ["", f"### Concurrent closed-loop sessions ({se['turns']} turns, 512-token system prompt, 1 s think time) under p95 TTFT {se['ttft_target_ms']:.0f} ms", "",
              "| configuration | " + " | ".join(f"{k} sessions" for k in se["counts"]) + " | max sessions |",
              "|---|" + "---|" * (len(se["counts"]) + 1)]  # fmt: skip
    for name, c in se["configs"].items():
        lines.append(f"| {name} | " + " | ".join(f"{p} ms" for p in c["p95_ttft_ms"]) + f" | **{c['max_sessions']}** |")
    if r.get("placement"):
        lines += placement_render(r["placement"])
    lines += [""] + [f"![{p}](results/{p})" for p in pngs]
    return "\n".join(lines)
