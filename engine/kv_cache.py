"""The paged KV cache: one tensor, one contiguous chunk per block holding every layer.

::

    tensor: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
               │          │          │   └ token slot within the block
               │          │          └ 0 = K, 1 = V
               │          └ all layers of a block sit together ...
               └ ... so block b is tensor[b]: one contiguous buffer of block_nbytes

This is the payload layout named ``layer,kv,token,head,dim`` in the block keys' fingerprint:
the store puts and gets ``block_view(b)`` as is, with no reshuffling. The model reads and writes
one layer at a time through ``layer(l)``, a strided view of the same memory.

The cache is zero-initialised, so a slot that was never written holds finite values (masked
attention multiplies unused slots by zero, which would still turn NaN garbage into NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequest

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class KVCache:
    """Owns the cache tensor. Not thread-safe; the engine is its only writer during a step."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, v in (("num_blocks", num_blocks), ("num_layers", num_layers), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidRequest(f"KVCache {name} must be a positive int, got {v!r}")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.tensor = torch.zeros(
            (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, block_size: int = 16, device: torch.device | str = "cpu"
    ) -> KVCache:
        return cls(num_blocks, config.num_layers, block_size, config.num_kv_heads, config.head_dim,
                   torch_dtype(config.dtype), device)  # fmt: skip

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: (num_layers, 2, block_size, num_kv_heads, head_dim)."""
        return tuple(self.tensor.shape[1:])

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (all layers, K and V)."""
        return self.tensor[0].numel() * self.tensor.element_size()

    @property
    def nbytes(self) -> int:
        return self.block_nbytes * self.num_blocks

    def layer(self, layer: int) -> torch.Tensor:
        """[num_blocks, 2, block_size, num_kv_heads, head_dim]: a strided view (writes land in the cache)."""
        return self.tensor[:, layer]

    def block_view(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` as a contiguous view of the cache (no copy): reading it reads the
        cache, writing it (``copy_``, or a buffer-protocol fill on CPU) writes the cache."""
        if not 0 <= block_id < self.num_blocks:
            raise InvalidRequest(f"block id {block_id} is outside [0, {self.num_blocks})")
        return self.tensor[block_id]

    def gather(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """A new contiguous tensor [n, *block_shape] holding copies of the blocks, in order."""
        return self.tensor.index_select(0, self._ids(block_ids))

    def scatter(self, block_ids: Sequence[int] | torch.Tensor, blocks: torch.Tensor) -> None:
        """Writes ``blocks`` ([n, *block_shape], same dtype) into the given blocks of the cache."""
        ids = self._ids(block_ids)
        if tuple(blocks.shape) != (ids.numel(), *self.block_shape):
            raise InvalidRequest(
                f"scatter expects blocks of shape {(ids.numel(), *self.block_shape)}, got {tuple(blocks.shape)}"
            )
        if blocks.dtype != self.dtype:
            raise InvalidRequest(f"scatter expects dtype {self.dtype}, got {blocks.dtype}")
        self.tensor.index_copy_(0, ids, blocks.to(self.device))

    def _ids(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise InvalidRequest(f"block ids must lie in [0, {self.num_blocks})")
        return ids
