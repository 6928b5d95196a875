"""Helpers shared by the engine tests: a tiny random Llama in float32 on the CPU.

A plain module rather than a ``conftest.py``: other test folders import ``tests/conftest.py``
by the name ``conftest``, which a second conftest here would shadow.

Torch runs single-threaded in these tests (the autouse fixture, imported by every module): the
models are far too small to gain from threads, and on a busy two-core machine OpenMP's spinning
threads make every matmul many times slower.
"""

from __future__ import annotations

import functools

import pytest

try:
    import torch
except ImportError:  # every module that needs torch skips itself
    torch = None  # type: ignore[assignment]

INIT_STD = 0.1  # sharper attention than 0.02: greedy output stays varied, so mismatches show


@pytest.fixture(autouse=True)
def single_threaded_torch():
    """Applies to the tests of each module that imports it; restores the setting afterwards."""
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def tiny_model():
    """The shared tiny model (seed 0). Tests must not modify it."""
    from engine.config import ModelConfig
    from engine.model import LlamaForCausalLM

    return LlamaForCausalLM.random(ModelConfig.tiny(), seed=0, std=INIT_STD)


def make_engine(model=None, **fields):
    """A fresh LLMEngine over ``model`` (default: the tiny model); ``fields`` go to EngineConfig."""
    from engine.config import EngineConfig
    from engine.llm import LLMEngine

    fields.setdefault("num_blocks", 64)
    return LLMEngine(model or tiny_model(), EngineConfig(**fields))


_REFERENCE: dict = {}


def greedy_reference(prompt: list[int], max_tokens: int, model=None) -> list[int]:
    """Greedy tokens by full recompute each step (no cache, plain causal attention), memoised."""
    model = model or tiny_model()
    key = (id(model), tuple(prompt), max_tokens)
    if key not in _REFERENCE:
        ids = list(prompt)
        for _ in range(max_tokens):
            logits = model.reference_logits(torch.tensor(ids))
            ids.append(int(logits[-1].argmax()))
        _REFERENCE[key] = (model, ids[len(prompt) :])  # holding the model keeps its id unique
    return _REFERENCE[key][1]
