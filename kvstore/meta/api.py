"""The index's interface: what the metadata service (:mod:`kvstore.meta.servicer`,
:mod:`kvstore.meta.daemon_calls`), the daemon link (:mod:`kvstore.meta.daemons`), the metrics
(:class:`kvstore.metrics.MetaCollector`), the benchmarks and
the tests hold :class:`kvstore.meta.index.Index` by. One implementation; the protocol says
which of its names are the contract (everything else, underscored or not listed, is its own).

Keys travel packed (N x 16 bytes); blocks come back as rows of the index's table (numpy int64
arrays), which :meth:`IndexApi.locations` spells out and :meth:`IndexApi.location_rows` packs
for the wire. Every method validates first and raises a :class:`kvstore.errors.KVStoreError`
having changed nothing; a miss is data, never an error.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from typing import Any, Protocol

import numpy as np

from kvstore.meta.records import (
    AcquireResult,
    Clock,
    Daemon,
    DaemonSpec,
    IndexLimits,
    PendingCommit,
    PutStartResult,
    Segment,
    Tombstone,
)


class IndexApi(Protocol):
    limits: IndexLimits
    clock: Clock
    counters: dict[str, int]
    daemons: dict[str, Daemon]
    segments: dict[int, Segment]
    puts: dict[int, Any]  # put id -> kvstore.meta.writes.Put
    leases: dict[int, Any]  # lease id -> kvstore.meta.reads.Lease
    moves: dict[int, Any]  # move id -> kvstore.meta.tiers.Move
    tombstones: dict[str, list[Tombstone]]
    policy: Any  # kvstore.meta.policy.Lru or Adaptive

    def __len__(self) -> int: ...

    # ---- reads ----
    def lookup(
        self, packed_keys: bytes, per_key: bool = False, with_locations: bool = False
    ) -> tuple[int, list[bool], np.ndarray]: ...
    def acquire(self, packed_keys: bytes, ttl_s: float = 0.0) -> AcquireResult: ...
    def release(
        self, lease_id: int, corrupt: Iterable[int] = (), unread: int = 0, asked_again: bool = False
    ) -> None: ...
    def touch(self, chains: list[bytes], interval_s: float = 0.0, tiers: bytes = b"") -> int: ...
    @property
    def touch_interval_s(self) -> float: ...
    def tiers(self, packed_keys: bytes) -> tuple[bytes, dict[str, tuple[str, bytearray]]]: ...
    def locations(self, rows: Iterable[int]) -> list[Any]: ...
    def location_rows(self, rows: np.ndarray) -> bytes: ...
    def places(self, rows: np.ndarray) -> Any: ...

    # ---- writes ----
    def put_start(
        self,
        packed_keys: bytes,
        sizes: list[int],
        host_id: str = "",
        timeout_s: float = 0.0,
        exclude: Iterable[str] = (),
    ) -> PutStartResult: ...
    def put_commit_begin(
        self, put_id: int, checksums: list[int], written: list[bool] | None = None
    ) -> PendingCommit: ...
    def put_commit_end(
        self, pc: PendingCommit, outcome: dict[int, tuple[int, int]] | None = None
    ) -> tuple[int, list[int]]: ...
    def put_commit(self, put_id: int, checksums: list[int], written: list[bool] | None = None) -> int: ...
    def put_abort(self, put_id: int) -> int: ...

    # ---- management ----
    def remove(self, packed_keys: bytes) -> int: ...
    def pin(self, packed_keys: bytes, pinned: bool = True) -> int: ...
    def pin_candidates(self, packed_keys: bytes) -> dict[bytes, int]: ...
    def is_pinned(self, key: bytes) -> bool: ...
    def report_engine(
        self,
        engine_id: str,
        url: str,
        added: bytes,
        removed: bytes,
        reset: bool = False,
        ttl_s: float = 0.0,
        leave: bool = False,
        owner: str = "",
    ) -> int: ...

    # ---- daemons ----
    def register_daemon(self, spec: DaemonSpec, inventory: dict[int, Any]) -> int: ...
    def plan_registration(self, spec: DaemonSpec, inventory: dict[int, Any]) -> list[Any]: ...
    def register_daemon_steps(
        self, spec: DaemonSpec, inventory: dict[int, Any], chunk: int = 65_536, plan: list[Any] | None = None
    ) -> Generator[None, None, int]: ...
    def heartbeat(self, daemon_id: str, registration: int = 0) -> bool: ...
    def drain_daemon(self, daemon_id: str, stepwise: bool = False) -> tuple[int, int, float]: ...
    def drop_step(self) -> bool: ...
    def take_tombstones(self, daemon_ids: Iterable[str] | None = None) -> dict[str, list[Tombstone]]: ...
    def return_tombstones(self, daemon_id: str, items: list[Tombstone]) -> None: ...

    # ---- time and tiers ----
    def expire(self, stepwise: bool = False) -> dict[str, int]: ...
    def grace(self, seconds: float) -> None: ...
    def plan_moves(self, max_bytes: int = 64 << 20, skip: Iterable[str] = ()) -> dict[str, list[Any]]: ...
    def finish_move(self, move_id: int, ok: bool, stored_size: int = 0) -> None: ...

    def check_integrity(self) -> None: ...
