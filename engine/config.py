"""Model and engine configuration: frozen dataclasses, passed down, never mutated.

``ModelConfig`` describes a Llama-architecture decoder and converts to and from a Hugging Face
``config.json`` dict. ``EngineConfig`` sizes the paged KV cache and the scheduler. Neither
imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.keys import HASH_ALGOS, ModelFingerprint

DTYPES = ("float32", "bfloat16", "float16")

KV_BLOCK_LAYOUT = "layer,kv,token,head,dim"
"""Axis order of one KV block (``KVCache.block_view``): [num_layers, 2 (k, v), block_size,
num_kv_heads, head_dim], C-contiguous. Folded into every block key through the fingerprint."""

_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def canonical_dtype(name: str) -> str:
    """``"bf16"`` -> ``"bfloat16"``; refuses anything the engine cannot run."""
    if not isinstance(name, str):
        raise InvalidArgument(f"dtype must be a str, got {type(name).__name__}")
    name = name.removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise InvalidArgument(f"dtype {name!r} is not supported; expected one of {DTYPES}")
    return name


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU, no biases)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 256
    eos_token_id: int | None = 257

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgument(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgument(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise InvalidArgument(f"ModelConfig.{name} must be a positive finite number, got {v!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size):
                raise InvalidArgument(f"ModelConfig.{name} must be None or in [0, {self.vocab_size}), got {v!r}")

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """About 1 M parameters: fast enough for CPU unit tests. Vocab = 256 bytes + 64 specials."""
        base = dict(vocab_size=320, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                    intermediate_size=384, max_position_embeddings=1024)  # fmt: skip
        return cls(**{**base, **overrides})

    @classmethod
    def small(cls, **overrides: Any) -> ModelConfig:
        """About 26 M parameters (100 MB in float32): for demos and benchmarks on a CPU."""
        base = dict(vocab_size=320, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                    intermediate_size=1536, max_position_embeddings=4096)  # fmt: skip
        return cls(**{**base, **overrides})

    def replace(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size(self.dtype)

    def fingerprint(self, model_id: str, block_size: int = 16, tp_rank: int = 0, tp_size: int = 1) -> ModelFingerprint:
        """The store's fingerprint of this model's KV blocks (layout :data:`KV_BLOCK_LAYOUT`).

        ``model_id`` must name the weights, not only the architecture: two random models of the
        same shape must use different ids (see ``LlamaForCausalLM.default_model_id``).
        """
        return ModelFingerprint(
            model_id=model_id,
            dtype=self.dtype,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            layout=KV_BLOCK_LAYOUT,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``LlamaConfig``-style ``config.json`` dict."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Reads a Llama ``config.json`` dict; refuses features this engine does not implement."""
        if not isinstance(d, dict):
            raise InvalidArgument(f"config must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise InvalidArgument(f"config.json model_type {model_type!r} is not supported (only 'llama')")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if k not in d]  # fmt: skip
        if missing:
            raise InvalidArgument(f"config.json lacks {', '.join(missing)}")
        if d.get("hidden_act", "silu") != "silu":
            raise InvalidArgument(f"config.json hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise InvalidArgument(f"config.json {flag}=true is not supported")
        rope = d.get("rope_parameters") or {}
        if d.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise InvalidArgument("config.json rope scaling is not supported (only default RoPE)")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        if isinstance(eos, list):  # several stop ids: the first is the engine's EOS
            eos = eos[0] if eos else None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"],
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            dtype=d.get("torch_dtype") or d.get("dtype") or "float32",
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
        )


def dtype_size(name: str) -> int:
    return 4 if canonical_dtype(name) == "float32" else 2


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes of the paged KV cache and limits of the scheduler.

    ``max_num_batched_tokens`` bounds the tokens one prefill step computes: a longer prompt is
    prefilled in chunks of at most that many tokens. ``model_id`` names the weights in block
    keys; empty means "derive it from the weights" (name plus content digest).
    """

    block_size: int = 16
    num_blocks: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    save_decode_blocks: bool = False
    model_id: str = ""
    namespace: str = "default"
    hash_algo: str = "xxh3_128"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgument(f"EngineConfig.{name} must be a positive int, got {v!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise InvalidArgument(f"EngineConfig.hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgument(f"EngineConfig.seed must be a non-negative int, got {self.seed!r}")

    def replace(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
