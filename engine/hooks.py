"""The two seams through which KV enters and leaves the engine (a store connector plugs in here).

- :data:`LoadHook` runs once each time a sequence is admitted, after its blocks are allocated
  and the local prefix cache has supplied what it had, before any of it is computed. It may
  fill further leading blocks of the sequence (write their KV into
  ``KVCache.block_view(block_ids[i])``) and returns how many leading tokens are now present.
  A load that fails or comes up short simply reports fewer tokens: the engine computes the rest.
- :data:`SaveHook` runs after a forward pass that completed full blocks (prefill; decode too
  with ``EngineConfig.save_decode_blocks``), with their keys and block ids. Blocks that came
  from the local cache or from a load are not reported again.

Both run synchronously on the engine's thread, between forward passes: the KV they see is
stable for the duration of the call. Block ids are valid only during the call (the blocks may
be freed and reused afterwards): copy out before returning. The defaults do nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvstore.keys import BlockKey


class LoadRequest(NamedTuple):
    """What a load hook gets. ``keys[i]`` names the KV of ``block_ids[i]``."""

    request_id: int
    token_ids: Sequence[int]  # the tokens about to be prefilled (prompt, or prompt + output after preemption)
    keys: Sequence[BlockKey]  # keys of the full blocks of token_ids
    block_ids: Sequence[int]  # the sequence's block table, covering all of token_ids
    num_cached_tokens: int  # leading tokens already present from the local prefix cache
    max_tokens: int  # the most a load may report: a multiple of block_size, < len(token_ids)


class SavedBlocks(NamedTuple):
    """What a save hook gets: newly computed full blocks of one sequence, in chain order."""

    request_id: int
    keys: Sequence[BlockKey]
    block_ids: Sequence[int]
    first_block: int  # index of keys[0] in the sequence's chain (keys[0] is block first_block)
    phase: str  # "prefill" or "decode"


LoadHook = Callable[[LoadRequest], int]
"""Returns the number of leading tokens present after the call: a multiple of block_size in
``[request.num_cached_tokens, request.max_tokens]``. May write only blocks
``num_cached_tokens // block_size .. max_tokens // block_size - 1`` (the leading ones are shared
cached blocks); whatever it wrote past the count it reports is recomputed and overwritten."""

SaveHook = Callable[[SavedBlocks], None]


def no_load(request: LoadRequest) -> int:
    return request.num_cached_tokens


def no_save(blocks: SavedBlocks) -> None:
    return None
