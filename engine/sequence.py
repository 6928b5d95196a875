"""A request's state inside the engine: its tokens, how many have KV in the cache, its blocks.

::

    token_ids:  [ prompt ............................ | output ......... ]
                 └─ num_computed_tokens have KV ─┘└ pending: computed next ┘
    block_table covers at least num_computed_tokens + (tokens scheduled this step)
    block_keys[i] = key of token_ids[i*B:(i+1)*B] (extended lazily, only for full blocks)
    num_registered_blocks: leading blocks already in the prefix cache / loaded / saved

A sequence is WAITING (no blocks), RUNNING (has blocks; ``in_prefill`` until its first
``len(token_ids)`` tokens are computed after admission) or FINISHED (blocks freed).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from engine.errors import InvalidRequest
from kvstore.keys import BlockKey


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy; ``seed`` makes
    temperature sampling reproducible per request (default: derived from the engine seed)."""

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {t!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest(f"seed must be None or a non-negative int, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


class Sequence:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "params", "status", "finish_reason",
                 "num_computed_tokens", "block_table", "block_keys", "num_registered_blocks", "in_prefill",
                 "num_cached_tokens", "num_loaded_tokens", "generator")  # fmt: skip

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_keys: list[BlockKey] = []
        self.num_registered_blocks = 0
        self.in_prefill = False
        self.num_cached_tokens = 0  # prompt tokens found in the local prefix cache (first admission)
        self.num_loaded_tokens = 0  # prompt tokens the load hook filled (first admission)
        self.generator: object | None = None  # torch.Generator for temperature sampling

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not yet in the cache."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.request_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")  # fmt: skip
