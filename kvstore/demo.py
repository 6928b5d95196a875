"""``kvstore demo``: the embedded store and a short multi-turn workload that shows prefix reuse.

Starts ``kvstore serve`` (metadata service + daemon) as a child process with its data in a
temporary folder, then plays several chat sessions that share one system prompt. For every
request it does what an inference engine's connector does: hash the prompt into block keys,
ask the store how long a prefix is cached, load it, compute the rest, store the new blocks.

The "model" here is a small NumPy network that turns each token into per-layer K/V vectors
(embedding, then a few dense layers): real arithmetic with the byte layout of a KV cache, so
load-versus-recompute times are honest, and every loaded block is checked against a fresh
recompute. ``kvstore engine`` runs the same loop with the torch transformer of ``engine/``.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

import numpy as np

from kvstore.client import SyncKVStoreClient
from kvstore.config import Config
from kvstore.keys import KeySpace, ModelFingerprint


class ToyKVModel:
    """Per-token K/V for ``layers`` layers, ``kv_heads`` x ``head_dim``, as float16."""

    def __init__(self, layers: int = 8, kv_heads: int = 4, head_dim: int = 64, hidden: int = 512, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.embed = rng.standard_normal((4096, hidden), dtype=np.float32)
        self.mix = [rng.standard_normal((hidden, hidden), dtype=np.float32) / np.sqrt(hidden) for _ in range(layers)]
        kv = 2 * kv_heads * head_dim
        self.proj = [rng.standard_normal((hidden, kv), dtype=np.float32) / np.sqrt(hidden) for _ in range(layers)]

    def kv_block_bytes(self, block_size: int) -> int:
        return self.layers * 2 * block_size * self.kv_heads * self.head_dim * 2

    def prefill(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """KV of ``tokens``: shape (tokens, layers, 2 * kv_heads * head_dim), float16."""
        x = self.embed[tokens % 4096] + np.sin(positions[:, None] / 64.0)
        out = np.empty((len(tokens), self.layers, self.proj[0].shape[1]), np.float16)
        for layer in range(self.layers):
            x = np.tanh(x @ self.mix[layer])
            out[:, layer] = x @ self.proj[layer]
        return out


def _start_store(data_dir: str, cfg: Config) -> tuple[subprocess.Popen, dict]:
    from kvstore.procs import start

    child = start(["serve", "--listen", "127.0.0.1:0", "--data-dir", data_dir, "--dram", str(cfg.daemon.dram_bytes),
                   "--log-level", "warning"])  # fmt: skip
    return child.proc, child.info


def run_demo(cfg: Config, sessions: int = 3, turns: int = 3, seed: int = 0, engine: bool = True) -> int:
    """The engine demo when torch and aiohttp are installed, else the store-only demo."""
    if engine:
        try:
            import aiohttp  # noqa: F401
            import torch  # noqa: F401
        except ImportError:
            print("(torch or aiohttp missing: running the store-only demo)")
        else:
            import asyncio

            return asyncio.run(_engine_demo(sessions, turns, seed))
    return run_store_demo(cfg, sessions=sessions * 2, turns=turns + 1, seed=seed)


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


def run_store_demo(cfg: Config, sessions: int = 6, turns: int = 4, seed: int = 0, block_size: int = 16) -> int:
    """The store alone: a NumPy model computes per-token KV; no torch needed."""
    model = ToyKVModel(seed=seed)
    fp = ModelFingerprint("toy-kv-demo", "float16", model.layers, model.kv_heads, model.head_dim, block_size)
    ks = KeySpace(fp, namespace="demo")
    block_bytes = model.kv_block_bytes(block_size)
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 4096, 1024)
    histories = [system.copy() for _ in range(sessions)]
    if cfg.daemon.dram_bytes == Config().daemon.dram_bytes:
        cfg.daemon.dram_bytes = 512 << 20
    print(
        f"kvstore demo: {sessions} sessions x {turns} turns sharing a {len(system)}-token system prompt; "
        f"block = {block_size} tokens = {block_bytes // 1024} KiB of KV ({model.layers} layers)",
        flush=True,
    )
    totals = dict(prompt=0, loaded=0, computed=0, t_reuse=0.0, t_full=0.0, mismatches=0)
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        proc, info = _start_store(tmp, cfg)
        try:
            print(
                f"store: metadata service {info['meta']}, daemon {info['daemon_id']} (shared memory {info['shm_path']})\n"
            )
            print(
                f"{'turn':>4} {'session':>7} {'prompt':>7} {'loaded':>7} {'computed':>8} {'ttft reuse ms':>14} {'ttft no-store ms':>17}"
            )
            with SyncKVStoreClient(info["meta"]) as client:
                for turn in range(turns):
                    for s in range(sessions):
                        user = rng.integers(0, 4096, int(rng.integers(100, 300)))
                        prompt = np.concatenate([histories[s], user])
                        row = _request(client, ks, model, prompt, block_size, block_bytes, totals)
                        print(
                            f"{turn + 1:>4} {s:>7} {row[0]:>7} {row[1]:>7} {row[2]:>8} {row[3]:>14.1f} {row[4]:>17.1f}",
                            flush=True,
                        )
                        answer = rng.integers(0, 4096, 40)
                        histories[s] = np.concatenate([prompt, answer])
                st = client.stats()
        finally:
            proc.terminate()
            proc.wait(10)
            if os.path.exists(info.get("shm_path", "")):
                os.unlink(info["shm_path"])
    share = 100.0 * totals["loaded"] / max(1, totals["prompt"])
    speedup = totals["t_full"] / max(1e-9, totals["t_reuse"])
    print(
        f"\nprefix reuse: {totals['loaded']} of {totals['prompt']} prompt tokens ({share:.0f}%) loaded from the store, "
        f"{totals['computed']} computed"
    )
    print(
        f"prefill time: {totals['t_reuse']:.2f} s with the store vs {totals['t_full']:.2f} s recomputing everything "
        f"({speedup:.1f}x)"
    )
    print(
        f"store: {st.keys} blocks, {st.counters['hit_bytes'] / 2**20:.0f} MiB served, {st.counters['dedup_keys']} dedup skips"
    )
    ok = totals["mismatches"] == 0
    print(f"every loaded block equals its recompute: {'yes' if ok else 'NO (' + str(totals['mismatches']) + ')'}")
    return 0 if ok else 1


def _request(client, ks, model, prompt, block_size, block_bytes, totals) -> tuple:  # noqa: ANN001
    positions = np.arange(len(prompt))
    # Without the store: compute the whole prompt.
    t = time.perf_counter()
    full = model.prefill(prompt, positions)
    t_full = time.perf_counter() - t
    # With the store: load the cached prefix, compute the rest, store the new blocks.
    t = time.perf_counter()
    keys = ks.block_keys(prompt)
    kv = np.empty((len(prompt), model.layers, full.shape[2]), np.float16)
    blocks = [kv[i * block_size : (i + 1) * block_size] for i in range(len(keys))]
    hit = client.lookup(keys) if keys else 0
    loaded = client.get_into(keys[:hit], blocks[:hit]) if hit else 0
    start = loaded * block_size
    kv[start:] = model.prefill(prompt[start:], positions[start:])
    t_reuse = time.perf_counter() - t
    client.put(keys[loaded:], blocks[loaded:]) if loaded < len(keys) else None
    # A loaded block must equal what the model computes for it.
    totals["mismatches"] += int(not np.array_equal(kv[:start], full[:start]))
    totals["prompt"] += len(prompt)
    totals["loaded"] += start
    totals["computed"] += len(prompt) - start
    totals["t_reuse"] += t_reuse
    totals["t_full"] += t_full
    return len(prompt), start, len(prompt) - start, t_reuse * 1000, t_full * 1000
