"""Picks the next token of each sequence from its logits: greedy, or temperature sampling with a
per-request ``torch.Generator`` so that a seeded request draws the same tokens in any batch."""

from __future__ import annotations

import torch

from engine.sequence import Sequence

_SEED_MIX = 1_000_003


def request_generator(seq: Sequence, engine_seed: int) -> torch.Generator:
    """The request's generator: seeded by ``params.seed``, else by (engine seed, request id)."""
    seed = seq.params.seed
    if seed is None:
        seed = (engine_seed * _SEED_MIX + seq.request_id) % 2**63
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, seqs: list[Sequence], engine_seed: int = 0) -> list[int]:
    """One token per row of ``logits`` ([N, vocab], float32), row i for ``seqs[i]``.

    Mutates only the sequences' generators (created on first use).
    """
    out = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        t = seq.params.temperature
        if t == 0:
            continue
        if seq.generator is None:
            seq.generator = request_generator(seq, engine_seed)
        probs = torch.softmax(logits[i].float().cpu() / t, dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=seq.generator).item())  # type: ignore[arg-type]
    return out
