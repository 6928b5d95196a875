"""engine: a small torch inference engine over a paged KV cache (Llama architecture).

One file per noun: ``config`` (ModelConfig, EngineConfig), ``model`` (LlamaForCausalLM),
``attention`` (paged attention), ``kv_cache`` (KVCache), ``block_manager`` (BlockManager),
``sequence``, ``scheduler``, ``sampler``, ``tokenizer``, ``hooks`` (the store seam) and ``llm``
(LLMEngine). Names are imported lazily: ``import engine`` does not load torch; using a
torch-backed name does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ModelConfig": "engine.config",
    "EngineConfig": "engine.config",
    "KV_BLOCK_LAYOUT": "engine.config",
    "InvalidRequest": "engine.errors",
    "InvalidModelFolder": "engine.errors",
    "BlockManager": "engine.block_manager",
    "NoFreeBlocks": "engine.block_manager",
    "LoadRequest": "engine.hooks",
    "SavedBlocks": "engine.hooks",
    "SamplingParams": "engine.sequence",
    "ByteTokenizer": "engine.tokenizer",
    "load_tokenizer": "engine.tokenizer",
    "KVCache": "engine.kv_cache",
    "AttentionMetadata": "engine.attention",
    "LlamaForCausalLM": "engine.model",
    "LLMEngine": "engine.llm",
    "RequestOutput": "engine.llm",
}

__all__ = [
    "AttentionMetadata",
    "BlockManager",
    "ByteTokenizer",
    "EngineConfig",
    "InvalidModelFolder",
    "InvalidRequest",
    "KVCache",
    "KV_BLOCK_LAYOUT",
    "LLMEngine",
    "LlamaForCausalLM",
    "LoadRequest",
    "ModelConfig",
    "NoFreeBlocks",
    "RequestOutput",
    "SamplingParams",
    "SavedBlocks",
    "load_tokenizer",
]

if TYPE_CHECKING:
    from engine.attention import AttentionMetadata
    from engine.block_manager import BlockManager, NoFreeBlocks
    from engine.config import KV_BLOCK_LAYOUT, EngineConfig, ModelConfig
    from engine.errors import InvalidModelFolder, InvalidRequest
    from engine.hooks import LoadRequest, SavedBlocks
    from engine.kv_cache import KVCache
    from engine.llm import LLMEngine, RequestOutput
    from engine.model import LlamaForCausalLM
    from engine.sequence import SamplingParams
    from engine.tokenizer import ByteTokenizer, load_tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
