"""vLLM's paged KV caches as kvstore blocks: one stored block is one vLLM block of every layer.

A stored block is the layers' bytes of that block one after another, in the order vLLM
registered the layers. Each layer's cache is a tensor whose block dimension is the first
(``[num_blocks, ...]``: vLLM's CPU backend, ``[num_blocks, kv_heads, block_size, 2*head_dim]``,
and FlashInfer's ``[num_blocks, 2, ...]``) or the second (``[2, num_blocks, ...]``: FlashAttention);
a block of a layer is then its rows of that dimension (for the second, K then V), treated as
opaque bytes. Both GPU layouts give the same bytes for a block; the CPU layout does not, which is
why the device type is part of the key's fingerprint.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.errors import InvalidArgument


class _Layer:
    __slots__ = ("dim", "dtype", "name", "nbytes", "offset", "row_shape", "tensor")

    def __init__(self, name: str, tensor: torch.Tensor, num_blocks: int, offset: int) -> None:
        shape = tuple(tensor.shape)
        if len(shape) >= 2 and shape[0] == num_blocks:
            self.dim = 0
            self.row_shape = shape[1:]
        elif len(shape) >= 3 and shape[1] == num_blocks:
            self.dim = 1
            self.row_shape = (shape[0],) + shape[2:]
        else:
            raise InvalidArgument(
                f"layer {name}: KV cache of shape {shape} has no dimension of {num_blocks} blocks in front"
            )
        self.name = name
        self.tensor = tensor
        self.dtype = tensor.dtype
        self.offset = offset
        self.nbytes = int(np.prod(self.row_shape)) * tensor.element_size()


class PagedBlocks:
    """Copies blocks between vLLM's per-layer paged caches and host buffers of whole blocks."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise InvalidArgument("no KV cache layers were registered")
        self.layers: list[_Layer] = []
        off = 0
        for name, t in kv_caches.items():
            layer = _Layer(name, t, num_blocks, off)
            self.layers.append(layer)
            off += layer.nbytes
        self.block_bytes = off
        self.num_blocks = num_blocks
        self.index = {layer.name: i for i, layer in enumerate(self.layers)}
        self.device = self.layers[0].tensor.device

    def buffer(self, n: int) -> np.ndarray:
        return np.empty((n, self.block_bytes), np.uint8)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise InvalidArgument(f"block ids must lie in [0, {self.num_blocks}), got {list(block_ids)[:8]}...")
        return ids.to(self.device)

    def gather(self, block_ids: Sequence[int]) -> np.ndarray:
        """The blocks' bytes, one row per block (a copy: the cache may change after it)."""
        out = self.buffer(len(block_ids))
        if not len(block_ids):
            return out
        ids = self._ids(block_ids)
        for layer in self.layers:
            x = layer.tensor.index_select(layer.dim, ids)
            if layer.dim == 1:
                x = x.transpose(0, 1)
            rows = x.contiguous().cpu().view(torch.uint8).reshape(len(block_ids), layer.nbytes)
            out[:, layer.offset : layer.offset + layer.nbytes] = rows.numpy()
        return out

    def scatter(self, layer_index: int, buf: np.ndarray, block_ids: Sequence[int]) -> None:
        """Writes one layer of ``buf``'s first ``len(block_ids)`` rows into those blocks."""
        n = len(block_ids)
        if not n:
            return
        layer = self.layers[layer_index]
        part = np.ascontiguousarray(buf[:n, layer.offset : layer.offset + layer.nbytes])
        x = torch.from_numpy(part).view(layer.dtype).reshape((n, *layer.row_shape))
        if layer.dim == 1:
            x = x.transpose(0, 1)
        layer.tensor.index_copy_(layer.dim, self._ids(block_ids), x.to(self.device))
