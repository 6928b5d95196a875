"""A segment's committed blocks as columns: what a scan of a DRAM arena and an SSD segment's
journal give, and what an inventory message carries (``common_pb2.Inventory``: keys N x 16
bytes, then little-endian u64 arrays). Millions of blocks are a few arrays, not millions of
Python objects."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES
from kvstore.v1 import common_pb2

U64 = np.dtype("<u8")


def oldest_first(gen: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The order of rows by generation, then offset. Generations are unique but for rare
    repeats: one plain argsort (a stable sort or a lexsort takes two to three times as long at
    millions of rows), then a lexsort only where two rows share a generation."""
    order = np.argsort(gen)
    g = gen[order]
    if g.size > 1 and bool((g[1:] == g[:-1]).any()):
        order = np.lexsort((offset, gen))
    return order


class Block(NamedTuple):
    """One committed block (a row of :class:`BlockCols`)."""

    key: bytes
    offset: int
    size: int  # extent bytes
    length: int  # raw payload bytes
    checksum: int  # xxh3-64 of the raw payload
    gen: int  # the placement's generation (also write order)


class BlockCols:
    """Blocks as columns: ``keys`` (n, 16) uint8, ``offset``, ``size``, ``length``,
    ``checksum`` and ``gen`` (n,) little-endian u64. Equal when every column is."""

    __slots__ = ("keys", "offset", "size", "length", "checksum", "gen")
    FIELDS = ("offset", "size", "length", "checksum", "gen")

    def __init__(
        self,
        keys: np.ndarray,
        offset: np.ndarray,
        size: np.ndarray,
        length: np.ndarray,
        checksum: np.ndarray,
        gen: np.ndarray,
    ) -> None:
        self.keys = np.ascontiguousarray(keys, np.uint8).reshape(-1, KEY_BYTES)
        n = len(self.keys)
        for name, col in zip(self.FIELDS, (offset, size, length, checksum, gen)):
            a = np.ascontiguousarray(col, U64)
            if a.shape != (n,):
                raise InvalidArgument(f"column {name} has shape {a.shape}, expected ({n},)")
            setattr(self, name, a)

    @classmethod
    def empty(cls) -> BlockCols:
        z = np.zeros(0, U64)
        return cls(np.zeros((0, KEY_BYTES), np.uint8), z, z, z, z, z)

    @classmethod
    def concat(cls, parts: list[BlockCols]) -> BlockCols:
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls(
            np.concatenate([p.keys for p in parts]),
            *(np.concatenate([getattr(p, f) for p in parts]) for f in cls.FIELDS),
        )

    @classmethod
    def from_rows(cls, rows: list[Block]) -> BlockCols:
        """From a few :class:`Block` rows (tests, small sets)."""
        if not rows:
            return cls.empty()
        keys = np.frombuffer(b"".join(r.key for r in rows), np.uint8)
        cols = list(zip(*(r[1:] for r in rows)))
        return cls(keys, *(np.array(c, U64) for c in cols))

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, idx: np.ndarray) -> BlockCols:
        """The rows ``idx`` (indices or a boolean mask), in that order."""
        return BlockCols(self.keys[idx], *(getattr(self, f)[idx] for f in self.FIELDS))

    def by_gen(self) -> BlockCols:
        """Oldest first: by generation, then offset."""
        return self.take(oldest_first(self.gen, self.offset))

    def by_offset(self) -> BlockCols:
        """By offset (as they are, if they are already)."""
        if len(self) < 2 or bool((self.offset[1:] >= self.offset[:-1]).all()):
            return self
        return self.take(np.argsort(self.offset, kind="stable"))

    def key_bytes(self) -> list[bytes]:
        """The keys as 16-byte strings (for small sets)."""
        return [bytes(k) for k in self.keys]

    def rows(self) -> list[Block]:
        """As :class:`Block` rows (for small sets: tests, logs)."""
        cols = [getattr(self, f).tolist() for f in self.FIELDS]
        return [Block(k, *vals) for k, *vals in zip(self.key_bytes(), *cols)]

    def to_pb(self, segment_id: int, with_size: bool = False) -> common_pb2.Inventory:
        """The inventory message of these blocks (``size`` only ``with_size``: SSD segments)."""
        return common_pb2.Inventory(
            segment_id=segment_id,
            keys=self.keys.tobytes(),
            offset=self.offset.tobytes(),
            length=self.length.tobytes(),
            checksum=self.checksum.tobytes(),
            gen=self.gen.tobytes(),
            size=self.size.tobytes() if with_size else b"",
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockCols):
            return NotImplemented
        return np.array_equal(self.keys, other.keys) and all(
            np.array_equal(getattr(self, f), getattr(other, f)) for f in self.FIELDS
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockCols({len(self)} blocks)"
