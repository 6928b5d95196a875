"""A Llama-architecture decoder in torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj``, ..., ``model.norm``, ``lm_head``), so ``state_dict()`` is
the safetensors file and a folder written by :meth:`LlamaForCausalLM.save_pretrained` loads in
transformers unchanged (and the other way round).

Activations are packed: the new tokens of every sequence in a batch lie along one axis [T, ...]
with their absolute positions alongside. :meth:`forward` runs over the paged KV cache;
:meth:`reference_logits` is the plain full-recompute path that tests compare it with.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import xxhash
from torch import nn

from engine.attention import AttentionMetadata, dense_causal_attention, paged_attention
from engine.config import ModelConfig
from engine.errors import InvalidModelFolder
from engine.kv_cache import KVCache, torch_dtype

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, exactly as transformers does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, in float32; ``rotate_half`` convention (HF Llama)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata | None,
        kv_layer: torch.Tensor | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if meta is None:
            out = dense_causal_attention(q, k, v, self.scale)
        else:
            assert kv_layer is not None
            out = paged_attention(q, k, v, kv_layer, meta, self.scale)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv_layer) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head. Build with :meth:`random` or :meth:`load_pretrained`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.name = "llama"

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def random(
        cls, config: ModelConfig, seed: int = 0, std: float = 0.02, device: torch.device | str = "cpu"
    ) -> LlamaForCausalLM:
        """Weights ~ N(0, std) (norms 1), drawn in float32 from ``seed`` in parameter order, so
        the same (config, seed, std) gives bit-identical weights on every machine. A larger
        ``std`` (0.1) gives sharper attention and less repetitive greedy output: better tests."""
        model = cls(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        model.name = f"llama-random-h{config.hidden_size}-l{config.num_layers}-seed{seed}-std{std:g}"
        return model.to(device=device, dtype=torch_dtype(config.dtype)).eval()

    @classmethod
    def load_pretrained(
        cls, folder: str | Path, dtype: str | None = None, device: torch.device | str = "cpu"
    ) -> LlamaForCausalLM:
        """Loads ``config.json`` and ``model.safetensors`` (or a sharded index) from ``folder``.

        ``dtype`` overrides the config's. Refuses missing or unexpected tensors, naming them.
        """
        from safetensors.torch import load_file

        folder = Path(folder)
        try:
            raw = json.loads((folder / CONFIG_FILE).read_text())
        except (OSError, ValueError) as e:
            raise InvalidModelFolder(f"cannot read {folder / CONFIG_FILE}: {e}") from None
        config = ModelConfig.from_hf_dict(raw)
        if dtype is not None:
            config = config.replace(dtype=dtype)
        if (folder / WEIGHTS_FILE).exists():
            files = [folder / WEIGHTS_FILE]
        elif (folder / WEIGHTS_INDEX_FILE).exists():
            index = json.loads((folder / WEIGHTS_INDEX_FILE).read_text())
            files = [folder / f for f in sorted(set(index["weight_map"].values()))]
        else:
            raise InvalidModelFolder(f"{folder} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        model = cls(config)
        expected = dict(model.named_parameters())
        if config.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
            state.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise InvalidModelFolder(f"{folder}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
        with torch.no_grad():
            for name, p in expected.items():
                if tuple(state[name].shape) != tuple(p.shape):
                    raise InvalidModelFolder(
                        f"{folder}: {name} has shape {tuple(state[name].shape)}, expected {tuple(p.shape)}"
                    )
                p.copy_(state[name].float())
        model.name = folder.resolve().name
        return model.to(device=device, dtype=torch_dtype(config.dtype)).eval()

    def save_pretrained(self, folder: str | Path) -> Path:
        """Writes ``config.json`` and ``model.safetensors`` (HF names; a tied head is not written)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(json.dumps(self.config.to_hf_dict(), indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.named_parameters()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        return folder

    def weights_digest(self) -> str:
        """xxh3-128 over every parameter's name, dtype, shape and bytes (hex, 32 chars)."""
        h = xxhash.xxh3_128()
        for name, p in self.named_parameters():
            t = p.detach().contiguous().cpu()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def default_model_id(self) -> str:
        """``name@digest``: names these exact weights, so two random models never share block keys."""
        return f"{self.name}@{self.weights_digest()[:16]}"

    # -- compute ------------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed new tokens of a batch.

        ``input_ids`` and ``positions`` are [T] (long); ``meta`` says where each token's K/V go and
        which blocks hold each sequence's context. Writes the new K/V into ``kv_cache``; reads
        the cached prefix. Positions must be < ``max_position_embeddings``.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, meta, kv_cache.layer(i))
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def reference_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits [S, vocab] of one sequence by plain causal attention, no cache."""
        x = self.model.embed_tokens(token_ids)
        cos, sin = self.model.rotary_emb(torch.arange(token_ids.shape[0], device=token_ids.device), x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, None, None)
        return self.compute_logits(self.model.norm(x))

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device
