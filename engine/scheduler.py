"""Continuous batching: admits requests, picks each step's batch, preempts under block pressure,
and does the block bookkeeping after a forward pass (prefix-cache registration, save hook).

Each step is either a prefill step or a decode step, never both (a decode row padded to a
prefill chunk's length would waste the attention call):

1. admit waiting requests, oldest first, while there are sequence slots and blocks for their
   whole current token list: local prefix-cache hits first, then the load hook;
2. if any running sequence is still in prefill, compute up to ``max_num_batched_tokens`` of
   their pending tokens (a long prompt is chunked over several steps);
3. otherwise decode one token for every running sequence, taking a new block where the next
   token starts one; if none is free, the newest running sequence is preempted (its blocks
   freed, cached ones stay findable) and re-admitted later, recomputing what it lost.

A prefix-cache hit never covers the last token of the sequence: that token must be computed to
get its logits, and cached blocks are never written.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.hooks import LoadHook, LoadRequest, SavedBlocks, SaveHook, no_load, no_save
from engine.sequence import Sequence, SequenceStatus
from kvstore.keys import BlockKey, KeySpace

log = logging.getLogger("engine.scheduler")


class ScheduledBatch(NamedTuple):
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens computed for seqs[i] this step
    is_prefill: bool


@dataclass(slots=True)
class SchedulerStats:
    """Counters since the engine started (tokens of every admission, re-admissions included)."""

    admitted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # from the local prefix cache
    loaded_tokens: int = 0  # filled by the load hook
    prefill_tokens: int = 0  # computed in prefill steps
    decode_tokens: int = 0
    preemptions: int = 0
    saved_blocks: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, keyspace: KeySpace, max_model_len: int, eos_token_id: int | None) -> None:
        self.config = config
        self.keyspace = keyspace
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.load_hook: LoadHook = no_load
        self.save_hook: SaveHook = no_save
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- picking a batch ----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when there is nothing to run."""
        self._admit()
        prefill = [s for s in self.running if s.in_prefill]
        if prefill:
            budget = self.config.max_num_batched_tokens
            seqs, counts = [], []
            for s in prefill:
                n = min(s.num_pending_tokens, budget)
                if n == 0:
                    break
                seqs.append(s)
                counts.append(n)
                budget -= n
            return ScheduledBatch(seqs, counts, True)
        seqs = []
        i = 0
        while i < len(self.running):
            s = self.running[i]
            if s.num_computed_tokens // self.block_size >= len(s.block_table):
                while self.block_manager.num_free_blocks == 0 and s.status is SequenceStatus.RUNNING:
                    self.preempt(self.running[-1])
                if s.status is not SequenceStatus.RUNNING:
                    break  # s was the newest: everything after it is gone too
                s.block_table.append(self.block_manager.append_block())
            seqs.append(s)
            i += 1
        return ScheduledBatch(seqs, [1] * len(seqs), False) if seqs else None

    def _admit(self) -> None:
        bm, bs = self.block_manager, self.block_size
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            keys = self.keys(seq, seq.num_tokens // bs)
            max_hit = (seq.num_tokens - 1) // bs  # leave the last token to compute
            hits = bm.match_prefix(keys[:max_hit], seq.token_ids)
            num_blocks = -(-seq.num_tokens // bs)
            if not bm.can_allocate(num_blocks - len(hits), hits):
                return
            seq.block_table = bm.allocate(num_blocks - len(hits), hits)
            cached = len(hits) * bs
            try:
                present = self._load(seq, keys, cached, max_hit * bs)
            except BaseException:
                bm.free(seq.block_table)
                seq.block_table = []
                raise
            for i in range(len(hits), present // bs):
                bm.cache_block(seq.block_table[i], keys[i], seq.block_tokens(i, bs))
            seq.num_computed_tokens = present
            seq.num_registered_blocks = present // bs
            seq.num_cached_tokens, seq.num_loaded_tokens = cached, present - cached
            seq.in_prefill = True
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            st = self.stats
            st.admitted += 1
            st.prompt_tokens += seq.num_tokens
            st.cached_tokens += cached
            st.loaded_tokens += present - cached

    def _load(self, seq: Sequence, keys: list[BlockKey], cached: int, max_tokens: int) -> int:
        request = LoadRequest(
            seq.request_id, tuple(seq.token_ids), tuple(keys), tuple(seq.block_table), cached, max_tokens
        )
        try:
            present = self.load_hook(request)
        except Exception as e:  # a failed load is a shorter hit, not a failed request
            log.warning("load_hook_failed request=%d error=%r", seq.request_id, e)
            return cached
        if isinstance(present, bool) or not isinstance(present, int) or not cached <= present <= max_tokens \
                or present % self.block_size:  # fmt: skip
            raise ValueError(
                f"load hook returned {present!r} for request {seq.request_id}: expected a multiple of "
                f"{self.block_size} in [{cached}, {max_tokens}]"
            )
        return present

    # -- after the forward pass ---------------------------------------------------------------

    def commit(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[Sequence]:
        """Records a finished forward pass: ``sampled`` maps request id -> new token for the
        sequences whose last pending token was computed. Registers completed full blocks (and
        reports them to the save hook), appends tokens, finishes and frees. Returns the
        sequences that got a token."""
        progressed = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self._register_blocks(seq, "prefill" if batch.is_prefill else "decode")
            if batch.is_prefill:
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += n
            if seq.request_id not in sampled:
                continue
            seq.in_prefill = False
            tok = sampled[seq.request_id]
            seq.token_ids.append(tok)
            progressed.append(seq)
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                self.finish(seq, reason)
        return progressed

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and tok == self.eos_token_id:
            return "eos"
        if tok in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens:
            return "max_tokens"
        if seq.num_tokens > self.max_model_len:  # the newest token would need a position past the table
            return "length"
        return None

    def _register_blocks(self, seq: Sequence, phase: str) -> None:
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        first = seq.num_registered_blocks
        if full <= first:
            return
        keys = self.keys(seq, full)
        for i in range(first, full):
            self.block_manager.cache_block(seq.block_table[i], keys[i], seq.block_tokens(i, bs))
        seq.num_registered_blocks = full
        if phase == "prefill" or self.config.save_decode_blocks:
            self.stats.saved_blocks += full - first
            saved = SavedBlocks(seq.request_id, keys[first:full], seq.block_table[first:full], first, phase)
            try:
                self.save_hook(saved)
            except Exception as e:  # the KV is still here; the store just lacks a copy
                log.warning("save_hook_failed request=%d blocks=%d error=%r", seq.request_id, full - first, e)

    def keys(self, seq: Sequence, n: int) -> list[BlockKey]:
        """Keys of the first ``n`` full blocks of ``seq`` (computed once, chained from the last)."""
        have = len(seq.block_keys)
        if n > have:
            bs = self.block_size
            parent = seq.block_keys[-1] if have else None
            seq.block_keys += self.keyspace.block_keys(seq.token_ids[have * bs : n * bs], parent=parent)
        return seq.block_keys[:n]

    # -- leaving ------------------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def preempt(self, seq: Sequence) -> None:
        """Frees ``seq``'s blocks and puts it first in line; it recomputes (or re-hits) later."""
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def abort(self, request_id: int) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                if seq.status is SequenceStatus.WAITING:
                    self.waiting.remove(seq)
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                else:
                    self.finish(seq, "abort")
                return seq
        return None

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.in_prefill = False

    def check_integrity(self) -> None:
        """Block accounting (see ``BlockManager.check_integrity``) against the live tables."""
        self.block_manager.check_integrity([s.block_table for s in self.running])
        for s in self.waiting:
            if s.block_table:
                raise AssertionError(f"waiting request {s.request_id} holds blocks")
