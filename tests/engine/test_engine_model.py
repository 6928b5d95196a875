"""The model against Hugging Face transformers, and its save/load round trip.

Tolerance: float32 on both sides, same weights, logits of magnitude ~5. The two
implementations differ only in operation order (fused vs separate attention, table vs on-the-fly
RoPE), so they agree to a few 1e-6; ATOL = 1e-4 leaves room for other BLAS builds, while a real bug
(wrong RoPE half, wrong GQA head mapping, a missed norm) moves logits by > 1e-1.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from engine_testlib import single_threaded_torch, tiny_model  # noqa: E402, F401

from engine.attention import AttentionMetadata  # noqa: E402
from engine.config import KV_BLOCK_LAYOUT, ModelConfig  # noqa: E402
from engine.errors import InvalidModelFolder  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.model import LlamaForCausalLM  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402

ATOL = 1e-4
BS = 16


def _hf_model(folder):
    transformers = pytest.importorskip("transformers", reason="transformers is only needed for this comparison")
    return transformers.LlamaForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class PagedRunner:
    """Drives the model over one sequence in a paged cache with a scrambled block table."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 32) -> None:
        self.model = model
        self.cache = KVCache.for_model(model.config, num_blocks, BS)
        self.table = list(range(num_blocks))[::-1][: num_blocks // 2]  # blocks need not be in order
        self.done = 0

    @torch.inference_mode()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of the new tokens, attending over everything fed so far."""
        meta = AttentionMetadata.build([self.done], [len(tokens)], [self.table], BS)
        pos = torch.arange(self.done, self.done + len(tokens))
        hidden = self.model(torch.tensor(tokens), pos, meta, self.cache)
        self.done += len(tokens)
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers_prefill_and_decode(tmp_path, tie):
    config = ModelConfig.tiny(tie_word_embeddings=tie)
    ours = LlamaForCausalLM.random(config, seed=3, std=0.1)
    ours.save_pretrained(tmp_path)
    hf = _hf_model(tmp_path)
    prompt = _prompt(37)
    runner = PagedRunner(ours)
    logits = runner.feed(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert logits.abs().max() > 1.0  # the comparison is not between near-zero tensors
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    seq = list(prompt)
    for _ in range(5):  # decode steps through the paged cache, one token each
        seq.append(int(logits[-1].argmax()))
        logits = runner.feed(seq[-1:])
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, -1:]
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


def test_reference_path_matches_paged_path():
    prompt = _prompt(40, seed=1)
    paged = PagedRunner(tiny_model()).feed(prompt)
    dense = tiny_model().reference_logits(torch.tensor(prompt))
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=0)


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = LlamaForCausalLM.load_pretrained(tmp_path)
    assert loaded.config == tiny_model().config
    assert loaded.weights_digest() == tiny_model().weights_digest()
    prompt = torch.tensor(_prompt(25, seed=2))
    assert torch.equal(loaded.reference_logits(prompt), tiny_model().reference_logits(prompt))


def test_safetensors_uses_hf_parameter_names(tmp_path):
    from safetensors import safe_open

    tiny_model().save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.3.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.2.post_attention_layernorm.weight"} <= names  # fmt: skip
    assert len(names) == 3 + 9 * tiny_model().config.num_layers


def test_config_round_trips_through_hf_dict(tmp_path):
    config = ModelConfig.small(dtype="bf16", rope_theta=500000.0, tie_word_embeddings=True)
    assert config.dtype == "bfloat16"
    raw = json.loads(json.dumps(config.to_hf_dict()))
    assert ModelConfig.from_hf_dict(raw) == config
    # the newer nested rope form and a list of EOS ids read the same
    raw2 = {**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "eos_token_id": [257, 1]}
    del raw2["rope_theta"]
    assert ModelConfig.from_hf_dict(raw2) == config


def test_config_refuses_what_the_model_does_not_implement():
    raw = ModelConfig.tiny().to_hf_dict()
    for change, word in (({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
                         ({"rope_scaling": {"rope_type": "yarn"}}, "rope"), ({"model_type": "gpt2"}, "model_type")):  # fmt: skip
        with pytest.raises(InvalidArgument, match=word):
            ModelConfig.from_hf_dict({**raw, **change})
    with pytest.raises(InvalidArgument, match="num_kv_heads"):
        ModelConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(InvalidArgument, match="dtype"):
        ModelConfig.tiny(dtype="int8")


def test_load_pretrained_names_missing_files_and_tensors(tmp_path):
    with pytest.raises(InvalidModelFolder, match="config.json"):
        LlamaForCausalLM.load_pretrained(tmp_path)
    tiny_model().save_pretrained(tmp_path)
    other = LlamaForCausalLM.random(ModelConfig.tiny(num_layers=2), seed=0)
    other.save_pretrained(tmp_path / "two")
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "two" / "model.safetensors").read_bytes())
    with pytest.raises(InvalidModelFolder, match="missing tensors"):
        LlamaForCausalLM.load_pretrained(tmp_path)


def test_fingerprint_describes_the_block_layout():
    fp = tiny_model().config.fingerprint("m@1", block_size=BS, tp_rank=1, tp_size=2)
    assert (fp.layout, fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype) == (KV_BLOCK_LAYOUT, 4, 2, 32, "float32")
    assert (fp.block_size, fp.tp_rank, fp.tp_size) == (BS, 1, 2)
    cache = KVCache.for_model(tiny_model().config, 4, BS)
    assert cache.block_shape == (fp.num_layers, 2, fp.block_size, fp.num_kv_heads, fp.head_dim)
    # two random models of one shape never share an id, so never share block keys
    other = LlamaForCausalLM.random(tiny_model().config, seed=1, std=0.1)
    assert other.default_model_id() != tiny_model().default_model_id()


def test_bfloat16_model_runs_and_tracks_float32():
    bf16 = LlamaForCausalLM.random(tiny_model().config.replace(dtype="bfloat16"), seed=0, std=0.1)
    runner = PagedRunner(bf16)
    assert runner.cache.dtype == torch.bfloat16
    prompt = _prompt(20, seed=4)
    logits = runner.feed(prompt)
    ref = tiny_model().reference_logits(torch.tensor(prompt))
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.25 * ref.abs().max()  # bf16 keeps ~3 significant digits
