"""The scheduler side of the vLLM connector, without vLLM: which blocks to load and which to save.

Keys are kvstore's own chained block keys (:class:`kvstore.keys.KeySpace`) over a request's
token ids, scoped by the model's fingerprint, never vLLM's process-seeded block hashes: separate
vLLM instances compute the same keys for the same tokens and so share blocks. A request's LoRA
adapter, multimodal inputs and cache salt are folded into every one of its keys.

Per request the planner keeps the keys computed so far, how many leading blocks the store holds
(the lookup's answer), how far blocks were handed to the workers to save, and the request's
block ids in vLLM's paged cache. Each step it turns what vLLM scheduled into :class:`Transfer`
lists: loads (stored blocks into freshly allocated ones, before the forward pass) and saves
(blocks this step completes, after it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvstore.integrations.cost import LoadCost
from kvstore.keys import KEY_BYTES, KeySpace

log = logging.getLogger("kvstore.vllm")
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0


@dataclass(slots=True)
class Transfer:
    """Blocks of one request to move between the store and vLLM's paged cache."""

    req_id: str
    keys: bytes  # packed, 16 bytes per block
    block_ids: list[int]
    first: int = 0  # index in the request of its first block

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(slots=True)
class _Request:
    request: Any  # vllm.v1.request.Request: all_token_ids grows as it decodes
    extra: bytes
    keys: list[bytes] = field(default_factory=list)
    stored: int = 0  # leading blocks the store holds (the last lookup)
    saved: int = 0  # leading blocks handed to the workers to save, or stored
    local: int = 0  # tokens vLLM had computed (its own prefix cache) when it asked
    load: int = 0  # tokens to load, decided at the last ask, until the step that loads them
    block_ids: list[int] = field(default_factory=list)
    off: bool = False  # its KV cannot be keyed by its tokens (prompt embeddings, inputs that changed)


@dataclass
class PlannerStats:
    lookups: int = 0
    lookup_failures: int = 0
    lookups_skipped: int = 0  # not asked: the store failed the last one, less than a backoff ago
    tokens_matched: int = 0  # tokens vLLM was told to load
    loads_skipped: int = 0  # recomputing judged cheaper
    blocks_planned_to_save: int = 0


def request_extra(request: Any) -> bytes:
    """What, besides the tokens, makes a request's KV differ: LoRA adapter, multimodal inputs
    (their content hashes) and the cache salt."""
    parts: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}")
    for f in getattr(request, "mm_features", None) or []:
        parts.append(f"mm={getattr(f, 'identifier', '')}@{getattr(getattr(f, 'mm_position', None), 'offset', '')}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    return "\n".join(parts).encode()


class Planner:
    """Decides loads and saves for one vLLM scheduler. Not thread-safe (vLLM's scheduler is one
    thread)."""

    def __init__(
        self,
        keyspace: KeySpace,
        lookup: Callable[[bytes], int],
        *,
        block_bytes: int,
        load: bool = True,
        save: bool = True,
        save_decode: bool = True,
        policy: str = "auto",
        cost: LoadCost | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in ("auto", "always", "never"):
            raise ValueError(f"load policy must be auto, always or never, got {policy!r}")
        self.keyspace = keyspace
        self.block_size = keyspace.block_size
        self.block_bytes = block_bytes
        self.lookup = lookup
        self.load = load and policy != "never"
        self.save = save
        self.save_decode = save_decode
        self.policy = policy
        self.cost = cost or LoadCost()
        self.stats = PlannerStats()
        self.requests: dict[str, _Request] = {}
        # A store that cannot answer is not asked again for a while (doubling, up to a limit), so
        # that vLLM's scheduler, which waits for each lookup, is not held up request after request.
        self.clock = clock
        self._quiet_until = 0.0
        self._backoff = 0.0

    # ---- asked by vLLM's scheduler --------------------------------------------------------

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from the store (0 if none, or
        if recomputing them is judged cheaper). One lookup RPC for all of the prompt's blocks."""
        r = self._state(request)
        r.local = num_computed_tokens
        r.load = 0
        prompt = request.prompt_token_ids or []
        bs = self.block_size
        full = len(prompt) // bs
        if getattr(request, "prompt_embeds", None) is not None:
            r.off = True  # the tokens do not say what the KV was computed from
        if not self.load or full == 0 or r.off:
            return 0
        if self.clock() < self._quiet_until:
            self.stats.lookups_skipped += 1
            return 0
        self.stats.lookups += 1
        try:
            keys = self._keys(r, prompt, full)
            hit = self.lookup(b"".join(keys[:full]))
        except Exception as e:  # noqa: BLE001 - a store that cannot answer is a miss, never vLLM's crash
            self.stats.lookup_failures += 1
            self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, 2 * self._backoff))
            self._quiet_until = self.clock() + self._backoff
            log.warning(
                "event=lookup_failed request=%s reason=%r next_lookup_in_s=%.1f",
                request.request_id, str(e), self._backoff,
            )  # fmt: skip
            return 0
        self._backoff = 0.0
        r.stored = hit
        # At least the prompt's last token is computed: its logits start the decode.
        can = min(hit, (len(prompt) - 1) // bs) * bs - num_computed_tokens
        if can <= 0:
            return 0
        if self.policy == "auto" and not self.cost.worth_loading((can // bs) * self.block_bytes, can):
            self.stats.loads_skipped += 1
            return 0
        r.load = can
        self.stats.tokens_matched += can
        return can

    def allocated(self, request: Any, num_external_tokens: int) -> None:
        """vLLM allocated blocks for the request and will load ``num_external_tokens``."""
        r = self._state(request)
        r.load = num_external_tokens if num_external_tokens > 0 else 0

    def step(self, scheduler_output: Any) -> tuple[list[Transfer], list[Transfer]]:
        """This step's (loads, saves) from vLLM's SchedulerOutput."""
        loads: list[Transfer] = []
        saves: list[Transfer] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            r = self.requests.get(new.req_id)
            if r is None:
                continue
            r.block_ids = list(new.block_ids[0])
            self._plan(r, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0), loads, saves)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self.requests.get(req_id)
            if r is None:
                continue
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.block_ids = list(ids[0]) if ids is not None else []
            elif ids is not None:
                r.block_ids.extend(ids[0])
            self._plan(r, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0), loads, saves)
        return loads, saves

    def finished(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def failed(self, loads: list[tuple[str, int]], saves: list[tuple[str, int]]) -> None:
        """What a worker could not do: loads that stopped at block ``upto`` of their request (the
        store holds less than the lookup said), and saves from block ``first`` on that it dropped
        (computed in a step whose load failed): they are planned again."""
        for req_id, upto in loads:
            r = self.requests.get(req_id)
            if r is not None:
                r.stored = min(r.stored, upto)
                r.saved = min(r.saved, upto)
        for req_id, first in saves:
            r = self.requests.get(req_id)
            if r is not None:
                r.saved = min(r.saved, first)

    # ---- inside ----------------------------------------------------------------------------

    def _state(self, request: Any) -> _Request:
        r = self.requests.get(request.request_id)
        if r is None:
            r = self.requests[request.request_id] = _Request(request, request_extra(request))
        return r

    def _keys(self, r: _Request, tokens: Sequence[int], n: int) -> list[bytes]:
        """The request's first ``n`` block keys (computed once, extended along the chain)."""
        have = len(r.keys)
        if n > have:
            bs = self.block_size
            parent = r.keys[-1] if have else None
            r.keys.extend(self.keyspace.block_keys(list(tokens[have * bs : n * bs]), r.extra, parent))
        return r.keys

    def _plan(
        self, r: _Request, req_id: str, computed: int, scheduled: int, loads: list[Transfer], saves: list[Transfer]
    ) -> None:
        bs = self.block_size
        if not r.off and r.extra != request_extra(r.request):
            r.off = True  # inputs added after it started (a streaming session): its keys no longer hold
        if r.off:
            return
        if r.load > 0:
            first = r.local // bs
            last = (r.local + r.load) // bs
            r.load = 0
            if last > first and last <= len(r.block_ids) and last <= len(r.keys):
                loads.append(Transfer(req_id, b"".join(r.keys[first:last]), r.block_ids[first:last], first))
        if not self.save:
            return
        tokens = r.request.all_token_ids
        if not self.save_decode:
            tokens = r.request.prompt_token_ids or []
        # Blocks whose KV this step completes; scheduled tokens beyond the known ones (drafts of
        # speculative decoding) may be rejected, so they never count.
        done = min(computed + scheduled, len(tokens)) // bs
        start = max(r.saved, r.stored)
        done = min(done, len(r.block_ids))
        if done <= start:
            return
        keys = self._keys(r, tokens, done)
        saves.append(Transfer(req_id, b"".join(keys[start:done]), r.block_ids[start:done], start))
        self.stats.blocks_planned_to_save += done - start
        r.saved = done


def split_keys(packed: bytes, shard: str = "") -> list[bytes]:
    """The keys of a packed run; with ``shard`` (a worker's tensor/pipeline-parallel rank, when
    there is more than one), each key is rehashed with it: every rank stores its own part of a
    block under its own key."""
    keys = [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]
    if not shard:
        return keys
    tag = shard.encode()
    return [xxhash.xxh3_128_digest(k + tag) for k in keys]
