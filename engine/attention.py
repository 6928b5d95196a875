"""Paged attention over the block tables of a batch (torch, vectorised, no custom kernels).

A batch is B sequences; sequence b brings ``q_lens[b]`` new tokens that sit at positions
``starts[b] .. starts[b] + q_lens[b] - 1``; its K/V for positions ``< starts[b]`` are already in
the cache. The new tokens are packed along one axis of T = sum(q_lens) rows.

Per layer: the new K/V rows are written into their slots, then every sequence's context is
gathered from its blocks (``index_select``) into a padded batch and one
``scaled_dot_product_attention`` call runs with a mask::

    key j of sequence b is visible to its i-th new token  iff  j <= starts[b] + i

which is causal attention over the cached prefix plus the new tokens. Padded query rows and
padded key columns (slots past a sequence's context, or block 0 standing in for a missing
table entry) are computed and thrown away, never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Index tensors shared by every layer of one forward pass (build once per step)."""

    slot_blocks: torch.Tensor  # [T] block id where each new token's K/V goes
    slot_offsets: torch.Tensor  # [T] slot within that block
    block_tables: torch.Tensor  # [B, max_blocks] blocks holding each context, padded with 0
    query_index: torch.Tensor  # [B, max_q] packed row of each padded query (padding -> 0)
    token_rows: torch.Tensor  # [T] batch row of each packed token
    token_cols: torch.Tensor  # [T] column of each packed token within its padded row
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] True = attend

    @classmethod
    def build(
        cls,
        starts: Sequence[int],
        q_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Index tensors for one batch. Each table must cover ``starts[b] + q_lens[b]`` tokens."""
        if not (len(starts) == len(q_lens) == len(block_tables)) or not starts:
            raise ValueError("starts, q_lens and block_tables must be non-empty and of equal length")
        need = [-(-(s + n) // block_size) for s, n in zip(starts, q_lens)]
        for b, (n, table, q) in enumerate(zip(need, block_tables, q_lens)):
            if q <= 0 or len(table) < n:
                raise ValueError(f"sequence {b}: {q} new tokens, table of {len(table)} blocks, needs {n}")
        max_blocks, max_q = max(need), max(q_lens)
        tables = [list(t[:n]) + [0] * (max_blocks - n) for t, n in zip(block_tables, need)]
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        for b, (s, n, table) in enumerate(zip(starts, q_lens, block_tables)):
            for p in range(s, s + n):
                slot_blocks.append(table[p // block_size])
                slot_offsets.append(p % block_size)
            rows += [b] * n
            cols += range(n)

        def long(x: object) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        token_rows, token_cols = long(rows), long(cols)
        query_index = torch.zeros((len(starts), max_q), dtype=torch.long, device=device)
        query_index[token_rows, token_cols] = torch.arange(len(rows), device=device)
        q_pos = long(starts)[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, max_q]
        k_pos = torch.arange(max_blocks * block_size, device=device)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
        return cls(long(slot_blocks), long(slot_offsets), long(tables), query_index, token_rows, token_cols, mask)

    @property
    def num_tokens(self) -> int:
        return self.slot_blocks.numel()


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Stores the new tokens' K and V ([T, kv_heads, head_dim]) into their cache slots."""
    kv_layer[meta.slot_blocks, 0, meta.slot_offsets] = k.to(kv_layer.dtype)
    kv_layer[meta.slot_blocks, 1, meta.slot_offsets] = v.to(kv_layer.dtype)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Writes k, v into ``kv_layer`` (one layer's cache view), then attends.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; returns [T, heads * head_dim].
    Mutates ``kv_layer`` at the batch's slots only.
    """
    write_kv(kv_layer, k, v, meta)
    batch, max_blocks = meta.block_tables.shape
    _, _, block_size, kv_heads, head_dim = kv_layer.shape
    ctx = kv_layer.index_select(0, meta.block_tables.reshape(-1))  # [B * max_blocks, 2, bs, kvh, d]
    ctx = ctx.view(batch, max_blocks, 2, block_size, kv_heads, head_dim)
    keys = ctx[:, :, 0].reshape(batch, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
    values = ctx[:, :, 1].reshape(batch, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
    queries = q[meta.query_index].transpose(1, 2)  # [B, heads, max_q, d]
    out = F.scaled_dot_product_attention(
        queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.mask, scale=scale, enable_gqa=True
    )
    out = out.transpose(1, 2)[meta.token_rows, meta.token_cols]  # [T, heads, d]
    return out.reshape(out.shape[0], -1)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention over one sequence with no cache (the reference path).

    q: [S, heads, d]; k, v: [S, kv_heads, d]; returns [S, heads * d].
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)
