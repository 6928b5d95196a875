"""On a GPU: greedy tokens with KV loaded through the store (staged by the copy kernels) equal
tokens computed without the store. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


def test_gpu_greedy_tokens_through_the_store_equal_no_store(tmp_path):
    from engine.config import EngineConfig, ModelConfig
    from engine.connector import StoreConnector
    from engine.llm import LLMEngine
    from engine.model import LlamaForCausalLM
    from kvstore.client import SyncKVStoreClient
    from kvstore.procs import start

    model = LlamaForCausalLM.random(ModelConfig.tiny(), seed=0, std=0.1, device="cuda")
    cfg = EngineConfig(num_blocks=256, enable_prefix_caching=False)
    prompts = [list(range(1, 1 + n)) for n in (1, 15, 16, 17, 83)]
    ref = LLMEngine(model, cfg).generate(prompts, max_tokens=10, ignore_eos=True)
    store = start(["serve", "--listen", "127.0.0.1:0", "--dram", "256MiB", "--data-dir", str(tmp_path)])
    try:
        with SyncKVStoreClient(store.info["meta"]) as client:
            writer = LLMEngine(model, cfg)
            wc = StoreConnector(client, writer.kv_cache, policy="always")
            writer.load_hook, writer.save_hook = wc.load, wc.save
            assert writer.generate(prompts, max_tokens=10, ignore_eos=True) == ref
            for rid in range(len(prompts)):
                wc.wait_saved(rid)
            reader = LLMEngine(model, cfg)
            rc = StoreConnector(client, reader.kv_cache, policy="always")
            reader.load_hook, reader.save_hook = rc.load, rc.save
            assert reader.generate(prompts, max_tokens=10, ignore_eos=True) == ref
            assert rc.stats.tokens_loaded > 0
    finally:
        store.stop()
