"""``kvstore demo``: the embedded store and a short multi-turn workload that shows prefix reuse.

Starts ``kvstore serve`` (metadata service + daemon) as a child process with its data in a
temporary folder, then plays several chat sessions that share one system prompt. For every
request it does what an inference engine's connector does: hash the prompt into block keys,
ask the store how long a prefix is cached, load it, compute the rest, store the new blocks.

The "model" here is a small NumPy network that turns each token into per-layer K/V vectors
(embedding, then a few dense layers): real arithmetic with the byte layout of a KV cache, so
load-versus-recompute times are honest, and every loaded block is checked against a fresh
recompute. Where the engine is installed, ``kvstore demo`` runs the same loop with its torch
transformer instead (``engine/demo.py``, plugged into the CLI by an entry point).
"""

from __future__ import annotations

import subprocess
import tempfile
import time

import numpy as np

from kvstore.client import SyncKVStoreClient
from kvstore.config import Config
from kvstore.daemon.arena import remove_files
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
            if info.get("shm_path"):
                remove_files(info["shm_path"])
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
