"""Which metadata shard owns a key, and which bytes of a daemon's segment a shard may allocate.

Keys are split over a fixed number of slots (``SLOTS``), each owned by one shard; the slot map
(kept in Redis, :mod:`kvstore.cluster.coord`) can change the number of shards by moving slots
without changing any key's slot. A key's slot is its first four bytes, little-endian, modulo
``SLOTS``: block keys are 128-bit hashes (:mod:`kvstore.keys`), so slots fill evenly.

Two shards must never hand out the same bytes of a daemon, so each segment is split into one
*arena* per shard: shard ``k`` of ``S`` allocates only in ``[k * span, (k + 1) * span)`` with
``span = capacity // S`` rounded down to the segment's alignment. The daemon reports to each shard
the blocks of its arena only (:func:`arena_of`), so each shard rebuilds exactly its part.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES

SLOTS = 1024
MAX_SHARDS = 256


def check_shards(shards: int) -> int:
    if not 1 <= shards <= MAX_SHARDS:
        raise InvalidArgument(f"cluster.shards must be between 1 and {MAX_SHARDS}, got {shards}")
    return shards


def slot_of(key: bytes) -> int:
    return int.from_bytes(key[:4], "little") % SLOTS


def arena(capacity: int, align: int, shard: int, shards: int) -> tuple[int, int]:
    """Shard ``shard``'s part of a segment of ``capacity`` bytes: (first byte, size)."""
    if shards <= 1:
        return 0, capacity - capacity % align
    span = capacity // shards
    span -= span % align
    return shard * span, span


def arena_of(offset: int, capacity: int, align: int, shards: int) -> int:
    """The shard whose arena holds ``offset`` (-1: past the last arena)."""
    if shards <= 1:
        return 0
    span = capacity // shards
    span -= span % align
    if span <= 0:
        return -1
    k = offset // span
    return k if k < shards else -1


class SlotMap:
    """Slot -> shard, and the shard of every key of a packed batch in one vectorized step."""

    def __init__(self, owners: Sequence[int]) -> None:
        if len(owners) != SLOTS:
            raise InvalidArgument(f"a slot map has {SLOTS} slots, got {len(owners)}")
        self.owners = np.asarray(owners, dtype=np.int32)
        self.shards = int(self.owners.max()) + 1

    @classmethod
    def even(cls, shards: int) -> SlotMap:
        """Contiguous slot ranges of (nearly) equal size, one per shard."""
        check_shards(shards)
        return cls([s * shards // SLOTS for s in range(SLOTS)])

    def encode(self) -> str:
        return ",".join(str(int(v)) for v in self.owners)

    @classmethod
    def decode(cls, text: str) -> SlotMap:
        try:
            owners = [int(v) for v in text.split(",")]
        except ValueError as e:
            raise InvalidArgument(f"slot map is not a list of shard numbers: {e}") from None
        return cls(owners)

    def shard_of(self, key: bytes) -> int:
        return int(self.owners[slot_of(key)])

    def shards_of(self, packed: bytes) -> np.ndarray:
        """The owning shard of each key of ``packed`` (N x 16 bytes)."""
        if len(packed) % KEY_BYTES:
            raise InvalidArgument(f"keys: {len(packed)} bytes is not a whole number of {KEY_BYTES}-byte keys")
        if not packed:
            return np.zeros(0, dtype=np.int32)
        heads = np.frombuffer(packed, dtype="<u4").reshape(-1, KEY_BYTES // 4)[:, 0]
        return self.owners[heads % SLOTS]

    def split(self, packed: bytes) -> dict[int, np.ndarray]:
        """Positions of the keys of ``packed`` per owning shard (each in key order)."""
        owners = self.shards_of(packed)
        if owners.size and (owners == owners[0]).all():
            return {int(owners[0]): np.arange(owners.size)}
        return {int(s): np.flatnonzero(owners == s) for s in np.unique(owners)}
