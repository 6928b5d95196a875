"""Argument checks of the index (:class:`kvstore.meta.index.Index`), made one way:
batches of keys, timeouts, a put's sizes, a daemon's registration. A mixin over ``limits``; each
raises :class:`~kvstore.errors.InvalidArgument` saying what is wrong, having changed nothing.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument, NotFound
from kvstore.keys import KEY_BYTES, unpack_keys
from kvstore.meta.inventory import check_gens
from kvstore.meta.records import DaemonSpec, Tier


class Checks:
    """Validation of the index's inputs (needs ``self.limits``, an IndexLimits)."""

    def _count_keys(self, packed: bytes, what: str = "keys") -> int:
        if len(packed) % KEY_BYTES:
            raise InvalidArgument(
                f"{what}: packed keys must be a multiple of {KEY_BYTES} bytes, got {len(packed)} bytes"
            )
        n = len(packed) // KEY_BYTES
        if n == 0:
            raise InvalidArgument(f"{what}: empty batch")
        if n > self.limits.max_batch_keys:
            raise InvalidArgument(f"{what}: batch of {n} keys is over the limit of {self.limits.max_batch_keys}")
        return n

    def _keys(self, packed: bytes, what: str = "keys") -> list[bytes]:
        self._count_keys(packed, what)
        return unpack_keys(packed)

    def _timeout(self, value_s: float, default: float, limit: float, what: str) -> float:
        if math.isnan(value_s):
            raise InvalidArgument(f"{what} must be a finite number, got {value_s}")
        if value_s < 0:
            raise InvalidArgument(f"{what} must not be negative, got {value_s}")
        if value_s == 0:
            return default
        if value_s > limit:
            raise InvalidArgument(f"{what} of {value_s:.3f} s is over the limit of {limit:.0f} s")
        return value_s

    def _put_args(self, keys: list[bytes], sizes: list[int], timeout_s: float) -> float:
        """Checks a put's sizes against its keys; returns its timeout."""
        if len(sizes) != len(keys):
            raise InvalidArgument(f"sizes: {len(sizes)} sizes for {len(keys)} keys")
        for i, s in enumerate(sizes):
            if s <= 0 or s > self.limits.max_block_bytes:
                raise InvalidArgument(f"sizes[{i}]: block size {s} must be in [1, {self.limits.max_block_bytes}]")
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys: a batch must not repeat a key")
        return self._timeout(timeout_s, self.limits.put_timeout_s, self.limits.max_put_timeout_s, "put timeout")

    def _release_args(self, lease_id: int, corrupt: Iterable[int], run: str) -> tuple[Any, list[int]]:
        """The lease a Release ends (NotFound if there is none) and its ``corrupt`` run indexes,
        distinct and in order, each within the leased run (the lease's ``run`` attribute)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id} is unknown (already released or expired)")
        n = len(getattr(lease, run))
        bad = sorted(set(corrupt))
        for i in bad:
            if not 0 <= i < n:
                raise InvalidArgument(f"corrupt index {i} is outside the leased run of {n}")
        return lease, bad

    @staticmethod
    def _commit_args(put_id: int, n: int, checksums: list[int], written: list[bool] | None) -> None:
        """Checks a commit's checksums (one 64-bit value per allocated block) and written flags."""
        if len(checksums) != n:
            raise InvalidArgument(f"checksums: {len(checksums)} for {n} allocated blocks of put {put_id}")
        for i, c in enumerate(checksums):
            try:
                ok = 0 <= operator.index(c) < 1 << 64
            except TypeError:
                ok = False
            if not ok:
                raise InvalidArgument(f"checksums[{i}]: {c!r} is not a 64-bit checksum")
        if written is not None and len(written) != n:
            raise InvalidArgument(f"written: {len(written)} flags for {n} allocated blocks of put {put_id}")

    @staticmethod
    def _daemon_args(spec: DaemonSpec, inventory: dict[int, np.ndarray]) -> None:
        """Checks a registration: its daemon id, its segments, and that its inventory names
        only those segments and only generations below ``GEN_LIMIT`` (2**63; see
        :mod:`kvstore.meta.records`). Generation 0 passes here: such an item is refused on its
        own (the index never hands it out); a generation at or past the limit is no block any
        index made, and the index's counter, kept above every generation it has seen, would
        run out of the wire's 64 bits."""
        if not spec.daemon_id:
            raise InvalidArgument("daemon_id must not be empty")
        seg_ids = [s.segment_id for s in spec.segments]
        if len(set(seg_ids)) != len(seg_ids):
            raise InvalidArgument(f"daemon {spec.daemon_id}: duplicate segment ids {seg_ids}")
        for s in spec.segments:
            if s.capacity <= 0:
                raise InvalidArgument(f"segment {s.segment_id}: capacity must be positive, got {s.capacity}")
            if s.tier not in (Tier.DRAM, Tier.SSD):
                raise InvalidArgument(f"segment {s.segment_id}: tier {int(s.tier)} cannot hold blocks (DRAM=1, SSD=2)")
        for seg_id, items in inventory.items():
            if seg_id not in seg_ids:
                raise InvalidArgument(f"inventory names unknown segment {seg_id}")
            check_gens(seg_id, items)
