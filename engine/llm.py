"""The single-process engine: requests in, tokens out, over a paged KV cache.

    engine = LLMEngine(LlamaForCausalLM.random(ModelConfig.tiny()), EngineConfig(num_blocks=256))
    outputs = engine.generate([[1, 2, 3], "hello"], max_tokens=8)        # list of token lists

or drive it yourself: ``add_request`` then ``step`` until ``has_unfinished()`` is False. Each
step runs one forward pass (a prefill step or a decode step, see ``engine.scheduler``).

Store integration goes through two hooks (``engine.hooks``): ``load_hook`` may fill a request's
leading blocks before its prefill, ``save_hook`` receives newly computed full blocks; both do
nothing by default. Block keys come from ``engine.keyspace``, the same ``KeySpace`` the store
uses, so "these tokens' KV" means the same thing on both sides.

Not thread-safe: one thread calls ``add_request``/``step`` (a server puts a queue in front).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.hooks import LoadHook, SaveHook
from engine.kv_cache import KVCache
from engine.model import LlamaForCausalLM
from engine.sampler import sample
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerStats
from engine.sequence import SamplingParams
from engine.sequence import Sequence as Seq
from engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from kvstore.keys import KeySpace


class RequestOutput(NamedTuple):
    request_id: int
    output_ids: list[int]  # every token generated so far
    finished: bool
    finish_reason: str | None  # "eos", "stop", "max_tokens", "length", "abort"


class LLMEngine:
    """Owns the model, its KV cache (``kv_cache``), the scheduler and block manager
    (``block_manager``), and the key space (``keyspace``) that names this model's blocks."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        load_hook: LoadHook | None = None,
        save_hook: SaveHook | None = None,
    ) -> None:
        self.model = model.eval()
        self.model_config = model.config
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer or ByteTokenizer(model.config.vocab_size)
        self.model_id = config.model_id or model.default_model_id()
        self.keyspace = KeySpace(
            model.config.fingerprint(self.model_id, config.block_size),
            namespace=config.namespace,
            algo=config.hash_algo,
        )
        self.kv_cache = KVCache.for_model(model.config, config.num_blocks, config.block_size, device=model.device)
        eos = model.config.eos_token_id if model.config.eos_token_id is not None else self.tokenizer.eos_token_id
        self.scheduler = Scheduler(config, self.keyspace, model.config.max_position_embeddings, eos)
        self.block_manager = self.scheduler.block_manager
        if load_hook is not None:
            self.load_hook = load_hook
        if save_hook is not None:
            self.save_hook = save_hook
        self._next_id = 0
        self._finished: dict[int, Seq] = {}

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, config: EngineConfig | None = None, dtype: str | None = None, device: str = "cpu"
    ) -> LLMEngine:
        """Model, and ``tokenizer.json`` if the folder has one (else the byte tokenizer)."""
        model = LlamaForCausalLM.load_pretrained(folder, dtype=dtype, device=device)
        return cls(model, config, load_tokenizer(folder, model.config.vocab_size))

    # -- hooks --------------------------------------------------------------------------------

    @property
    def load_hook(self) -> LoadHook:
        return self.scheduler.load_hook

    @load_hook.setter
    def load_hook(self, hook: LoadHook) -> None:
        self.scheduler.load_hook = hook

    @property
    def save_hook(self) -> SaveHook:
        return self.scheduler.save_hook

    @save_hook.setter
    def save_hook(self, hook: SaveHook) -> None:
        self.scheduler.save_hook = hook

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> int:
        """Queues a request; returns its id. A str prompt is encoded with the engine's tokenizer.

        Raises :class:`InvalidRequest` (a ValueError), queueing nothing, for an empty prompt, a
        prompt longer than ``max_position_embeddings``, a token id outside the vocabulary, bad
        sampling parameters, or a request whose KV could never fit in the cache.
        """
        params = SamplingParams(max_tokens, temperature, seed, ignore_eos, tuple(stop_token_ids))
        seq = self._new_sequence(prompt, params)
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, prompt: str | Sequence[int], params: SamplingParams) -> Seq:
        ids = self._check_ids(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
        cfg = self.model_config
        if not ids:
            raise InvalidRequest("prompt is empty: a request needs at least one token")
        if len(ids) > cfg.max_position_embeddings:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens, more than max_position_embeddings={cfg.max_position_embeddings}"
            )
        worst = min(len(ids) + params.max_tokens - 1, cfg.max_position_embeddings)  # tokens that ever need KV
        blocks = -(-worst // self.config.block_size)
        if blocks > self.config.num_blocks:
            raise InvalidRequest(
                f"request needs up to {blocks} KV blocks ({worst} tokens) but the cache has {self.config.num_blocks}"
            )
        rid = self._next_id
        self._next_id += 1
        return Seq(rid, ids, params)

    def _check_ids(self, prompt: Sequence[int]) -> list[int]:
        try:
            ids = list(prompt)
        except TypeError:
            raise InvalidRequest(
                f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}"
            ) from None
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InvalidRequest(f"token at index {i} is {t!r}, not an int")
            if not 0 <= t < vocab:
                raise InvalidRequest(f"token id {t} at index {i} is outside the vocabulary [0, {vocab})")
        return [int(t) for t in ids]

    def abort(self, request_id: int) -> bool:
        """Drops a queued or running request (its output so far is kept for ``take_output``)."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._finished[request_id] = seq
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def take_output(self, request_id: int) -> RequestOutput | None:
        """The finished request's output (once; later calls return None)."""
        seq = self._finished.pop(request_id, None)
        return None if seq is None else RequestOutput(request_id, seq.output_ids, True, seq.finish_reason)

    # -- running ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One forward pass. Returns an output for every request that got a token this step
        (finished ones are also kept for ``take_output``); [] when nothing ran."""
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.has_unfinished():  # admission checks make this unreachable
                raise RuntimeError(f"scheduler stalled with {len(self.scheduler.waiting)} waiting requests")
            return []
        logits, sampling_seqs = self._run(batch)
        tokens = sample(logits, sampling_seqs, self.config.seed) if sampling_seqs else []
        progressed = self.scheduler.commit(batch, {s.request_id: t for s, t in zip(sampling_seqs, tokens)})
        outs = []
        for seq in progressed:
            if seq.is_finished:
                self._finished[seq.request_id] = seq
            outs.append(RequestOutput(seq.request_id, seq.output_ids, seq.is_finished, seq.finish_reason))
        return outs

    def _run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Seq]]:
        """Forward over the batch; logits only for sequences whose last pending token ran."""
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        sampling: list[Seq] = []
        starts = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            starts.append(start)
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            if start + n == seq.num_tokens:
                last_rows.append(len(input_ids) - 1)
                sampling.append(seq)
        meta = AttentionMetadata.build(
            starts, batch.num_new_tokens, [s.block_table for s in batch.seqs], self.config.block_size, device
        )
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)
        hidden = self.model(ids_t, pos_t, meta, self.kv_cache)
        if not last_rows:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32), sampling
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=device)])
        return logits, sampling

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[list[int]]:
        """Generated token ids for each prompt, in order (prompts are batched together).

        Every prompt gets the same ``seed`` (so equal prompts sample equal tokens); with None
        each request's stream derives from the engine seed and its request id.
        """
        params = SamplingParams(max_tokens, temperature, seed, ignore_eos)
        seqs = [self._new_sequence(p, params) for p in prompts]  # all valid before any is queued
        for seq in seqs:
            self.scheduler.add(seq)
        ids = [seq.request_id for seq in seqs]
        pending = set(ids)
        while pending & self._finished.keys() != pending:
            if not self.step() and not self.has_unfinished():
                break
        return [self._finished.pop(i).output_ids for i in ids]

    # -- introspection ------------------------------------------------------------------------

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def check_integrity(self) -> None:
        """Raises AssertionError if block accounting is broken (see ``BlockManager.check_integrity``)."""
        self.scheduler.check_integrity()
