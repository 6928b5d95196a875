"""Real vLLM engines for the integration tests and ``bench/engine_integrations.py``.

No model hub is reachable, so the model is a tiny random-weight Llama saved in Hugging Face
format with its own word-level tokenizer (``make_tiny_llama``). ``generate`` runs one offline
vLLM engine in this process (vLLM starts its own engine-core and worker processes) and is also
the command line ``python -m bench.vllm_engine`` that tests run in separate processes::

    python -m bench.vllm_engine --model DIR --prompts prompts.json [--meta HOST:PORT] [--role kv_both] [--single-process]

It prints one line ``RESULT {json}``: per prompt the generated token ids and vLLM's
``num_cached_tokens``, and the connector worker's counters (``stats``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvstore.procs import free_port, start_listening

# What makes vLLM run on a small CPU machine (see the README's vLLM section).
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}
REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 32  # vLLM's CPU backend takes multiples of 32
MODEL_ID = "tiny-llama"  # the connector's model_id: instances that share blocks use the same


def vllm_available() -> str:
    """'' if vLLM can be imported here, else why not."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
        return f"vllm cannot be imported: {e!r}"
    return ""


def make_tiny_llama(
    path: str | Path, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2, vocab_words: int = 509
) -> Path:
    """A random Llama (head_dim 64) with a 512-word tokenizer ("w0" .. "w508"), in HF format.
    Weights are drawn with a large spread so that its output depends on the whole context."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "config.json").exists():
        return path
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(vocab_words):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        path
    )
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def prompt(n: int, seed: int = 0) -> str:
    """n words of the tiny vocabulary (one token each, no BOS is added by its tokenizer)."""
    return " ".join(f"w{(i * 7 + seed * 13) % 500 + 3}" for i in range(n))


def connector_config(meta: str, role: str = "kv_both", **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"meta": meta, "model_id": MODEL_ID, **extra},
    )


def lmcache_config(port: int) -> Any:
    """vLLM's own LMCache connector, talking to an ``lmcache server`` on this host."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="LMCacheMPConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": int(port)},
    )


def lmcache_server_args(port: int, http_port: int, meta: str, l1_gb: float = 0.25, chunk: int = 64) -> list[str]:
    """``lmcache server`` with kvstore as its second tier (kvstore.integrations.lmcache); without
    ``meta``, LMCache alone (its first tier in DRAM)."""
    l2 = {
        "type": "plugin",
        "module_path": "kvstore.integrations.lmcache",
        "class_name": "KVStoreL2Adapter",
        "adapter_params": {"meta": meta},
    }
    tail = ["--l2-adapter", json.dumps(l2)] if meta else []
    return [
        "lmcache", "server", "--host", "127.0.0.1", "--port", str(port), "--l1-size-gb", str(l1_gb),
        "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--chunk-size", str(chunk),
        "--http-host", "127.0.0.1", "--http-port", str(http_port), *tail,
    ]  # fmt: skip


class LMCacheServer:
    """An ``lmcache server`` process (kvstore as its second tier when given ``meta``), ready once
    its request port accepts connections."""

    def __init__(self, meta: str, log: Path, l1_gb: float = 0.25, chunk: int = 64, timeout: float = 120) -> None:
        import subprocess

        self.port = free_port()
        args = lmcache_server_args(self.port, free_port(), meta, l1_gb, chunk)
        args[0] = str(Path(sys.executable).parent / "lmcache")
        env = {**os.environ, "PYTHONPATH": str(REPO), "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
        self.log = Path(log)
        with open(self.log, "w") as out:
            self.child = start_listening(
                args, self.port, "lmcache server", timeout, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
            )

    def stop(self) -> None:
        self.child.stop(30)


def engine_args(model: str | Path, kv_transfer_config: Any = None, **kw: Any) -> dict[str, Any]:
    args = dict(
        model=str(model),
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        dtype="float32",
        max_model_len=2048,
        seed=0,
        disable_log_stats=True,
        kv_transfer_config=kv_transfer_config,
    )
    args.update(kw)
    return args


class Engine:
    """One vLLM engine (``LLM``) with kvstore's connector (given ``meta``), vLLM's LMCache one
    (given ``lmcache_port``) or none; ``single_process`` runs vLLM's engine core and worker in this
    process (much quicker to start; not with LMCache, whose import breaks vLLM's in-process worker
    start). ``engine`` adds vLLM engine arguments."""

    def __init__(
        self,
        model: str | Path,
        meta: str = "",
        role: str = "kv_both",
        extra: dict[str, Any] | None = None,
        engine: dict[str, Any] | None = None,
        lmcache_port: int = 0,
        single_process: bool = False,
    ) -> None:
        os.environ.update(CPU_ENV)
        more: dict[str, Any] = {}
        if single_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            more["distributed_executor_backend"] = "uni"
        from vllm import LLM

        self.stats_file = Path(tempfile.mkdtemp(prefix="kvstore-vllm-")) / "stats.json"
        kv = connector_config(meta, role, stats_file=str(self.stats_file), **(extra or {})) if meta else None
        if lmcache_port:
            kv = lmcache_config(lmcache_port)
        self.llm: Any = LLM(**engine_args(model, kv, **more, **(engine or {})))

    def close(self) -> dict[str, Any]:
        """Shuts the engine down (the worker's connector flushes its saves and writes its
        counters) and returns those counters."""
        import gc

        self.llm = None
        gc.collect()
        return json.loads(self.stats_file.read_text()) if self.stats_file.exists() else {}


def run(args: list[str], timeout: float | None = 400, progress: bool = False) -> dict[str, Any]:
    """``python -m bench.vllm_engine ARGS`` in a process of its own; its RESULT. With
    ``progress`` its stderr (progress bars) goes to ours. Raises RuntimeError with the run's output
    if it failed."""
    import subprocess

    env = {**os.environ, **CPU_ENV, "PYTHONPATH": str(REPO), "LMCACHE_TRACK_USAGE": "false"}
    p = subprocess.run(
        [sys.executable, "-m", "bench.vllm_engine", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=None if progress else subprocess.PIPE, text=True, timeout=timeout,
    )  # fmt: skip
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{(p.stderr or '')[-6000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def run_generate(model: str | Path, prompts: list[str], folder: Path, *args: str) -> dict[str, Any]:
    """:func:`generate` on ``prompts`` in a process of its own (``args``: more options of the
    command line); its RESULT."""
    import time

    f = Path(folder) / f"prompts-{time.monotonic_ns()}.json"
    f.write_text(json.dumps(prompts))
    return run(["--model", str(model), "--prompts", str(f), *args])


def generate(
    model: str | Path,
    prompts: list[str],
    max_tokens: int = 8,
    meta: str = "",
    role: str = "kv_both",
    extra: dict[str, Any] | None = None,
    single_process: bool = False,
    lmcache_port: int = 0,
) -> dict[str, Any]:
    """Generates greedily (see :class:`Engine` for the rest)."""
    from vllm import SamplingParams

    eng = Engine(model, meta, role, extra, None, lmcache_port, single_process)
    outs = eng.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "text": [o.outputs[0].text for o in outs],
        "cached": [int(o.num_cached_tokens or 0) for o in outs],
    }
    result["stats"] = eng.close()
    return result


def replay(
    model: str | Path,
    work: dict[str, Any],
    meta: str = "",
    extra: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    lmcache_port: int = 0,
    single_process: bool = False,
) -> dict[str, Any]:
    """Sends requests one at a time and takes vLLM's own time to first token of each (from its
    request metrics: queueing, prefill and loads until the first token).

    ``work`` is either ``{"requests": [token ids, ...]}`` (one token each) or a multi-turn chat,
    ``{"users": [[turn 0 of session 0, of session 1, ...], [turn 1 ...], ...], "assistant": N}``:
    turn t of a session is its history (earlier turns and the model's greedy answers of N tokens)
    plus its user message t; turns go round the sessions. ``engine`` adds vLLM engine arguments
    (num_gpu_blocks_override, enable_prefix_caching); ``lmcache_port`` puts vLLM's LMCache
    connector in front instead of kvstore's. Returns the prompts it sent too."""
    import time

    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # Per-request metrics (disable_log_stats off): the first token's latency.
    eng = Engine(
        model, meta, "kv_both", extra, {**(engine or {}), "disable_log_stats": False}, lmcache_port, single_process
    )
    llm = eng.llm
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=1), use_tqdm=False)
    ttft: list[float] = []
    cached: list[int] = []
    prompts: list[list[int]] = []

    def send(ids: list[int], n: int) -> list[int]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        m = out.metrics
        ttft.append(m.first_token_latency if m is not None and m.first_token_latency > 0 else wall)
        cached.append(int(out.num_cached_tokens or 0))
        prompts.append(list(ids))
        return list(out.outputs[0].token_ids)

    if "requests" in work:
        for ids in tqdm(work["requests"], desc="requests", unit="req", file=sys.stderr, mininterval=2.0):
            send(ids, 1)
    else:
        turns = work["users"]
        history = [[] for _ in turns[0]]
        bar = tqdm(total=sum(len(t) for t in turns), desc="requests", unit="req", file=sys.stderr, mininterval=2.0)
        for turn in turns:
            for s, user in enumerate(turn):
                history[s] = history[s] + list(user)
                history[s] = history[s] + send(history[s], work["assistant"])
                bar.update(1)
        bar.close()
    llm = None
    return {"ttft_s": ttft, "cached": cached, "prompts": prompts, "stats": eng.close()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_engine")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: a list of prompt strings")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--meta", default="", help="kvstore metadata service; none: vLLM without the connector")
    ap.add_argument("--role", default="kv_both")
    ap.add_argument("--extra", default="{}", help="JSON: more kv_connector_extra_config settings")
    ap.add_argument("--single-process", action="store_true", help="engine core and worker in this process")
    ap.add_argument("--lmcache-port", type=int, default=0, help="vLLM's LMCache connector to this lmcache server")
    ap.add_argument("--replay", action="store_true", help="--prompts holds a replay() workload: time first tokens")
    ap.add_argument("--engine", default="{}", help="JSON: more vLLM engine arguments (--replay)")
    a = ap.parse_args(argv)
    prompts = json.loads(Path(a.prompts).read_text())
    if a.replay:
        r = replay(
            a.model, prompts, a.meta, json.loads(a.extra), json.loads(a.engine), a.lmcache_port, a.single_process
        )
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    r = generate(a.model, prompts, a.max_tokens, a.meta, a.role, json.loads(a.extra), a.single_process, a.lmcache_port)
    print("RESULT " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
