"""The records the index is made of: typed values (specs, inventory items, tombstones, results,
limits, the cache policy's parameters) and the mutable per-segment and per-daemon state that
:class:`kvstore.meta.index.Index` keeps (per-block state is columns of its table,
:mod:`kvstore.meta.table`). No behaviour beyond small accessors: the index owns every change.
"""

from __future__ import annotations

import heapq
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np

from kvstore import tickets
from kvstore.extent import ALIGN, SSD_ALIGN
from kvstore.meta.allocator import Allocator


class Clock:
    """Monotonic seconds, plus a skew that tests may advance (``AdvanceClock``)."""

    def __init__(self) -> None:
        self.skew = 0.0

    def now(self) -> float:
        return time.monotonic() + self.skew

    def advance(self, seconds: float) -> float:
        self.skew += seconds
        return self.now()


class Tier(IntEnum):  # mirrors kvstore.v1.Tier
    DRAM = 1
    SSD = 2
    GPU = 3


class PutStatus(IntEnum):  # mirrors kvstore.v1.PutStatus
    ALLOCATED = 0
    SKIP_EXISTS = 1
    SKIP_INFLIGHT = 2
    NO_SPACE = 3
    NOT_ADMITTED = 4


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    segment_id: int
    tier: Tier
    capacity: int
    shm_path: str = ""


@dataclass(frozen=True, slots=True)
class DaemonSpec:
    daemon_id: str
    host_id: str
    data_addr: str
    control_addr: str
    segments: tuple[SegmentSpec, ...]
    # The key this daemon's data-port tickets are signed with (kvstore.tickets); empty: none.
    ticket_key: bytes = b""
    # The number the daemon made for this registration, carried by every control call made for
    # it (the daemon refuses those of an earlier one); 0: a daemon that checks none.
    registration: int = 0


class InventoryItem(NamedTuple):
    key: bytes
    offset: int
    length: int  # payload bytes (uncompressed)
    checksum: int  # xxh3-64 of the payload
    size: int = 0  # extent bytes in the segment; 0 = computed from length
    gen: int = 0  # the generation in the block's header


class Tombstone(NamedTuple):
    """A committed block a daemon must drop: exactly this generation of ``key`` at ``offset``."""

    segment_id: int
    key: bytes
    offset: int
    gen: int


SEGMENT_ALIGN = {Tier.DRAM: ALIGN, Tier.SSD: SSD_ALIGN, Tier.GPU: ALIGN}


ROW = struct.Struct("<IIQQQQ")  # segment ref | reserved | offset | length | checksum | gen (common.proto)

# Generations. The index hands out max(last + 1, wall clock in ns): about 1.7e18 today, 2**63 in
# the year 2262. A daemon's inventory may name only generations below GEN_LIMIT (a registration
# naming one at or past it is refused whole: no index or daemon made it), which leaves 2**63
# generations of headroom below GEN_MAX, the most the wire's u64 columns (location rows, block
# headers, tickets) can carry; the index never hands out one past GEN_MAX.
GEN_LIMIT = 1 << 63
GEN_MAX = (1 << 64) - 1

# Write tickets for a put's extents (kvstore.tickets) expire at int(wall clock + the put's timeout)
# + 1 and are honoured SKEW_S longer by the daemon's clock, which may itself be up to SKEW_S behind
# this one (that is what the skew allows for): extents of a put that ends without its blocks
# committed (aborted, expired, not written, refused), and those of its committed blocks dropped
# while its tickets live, go back to the allocator only this long after the put's deadline
# (IndexLimits.write_ticket_grace_s), so that a late or replayed write can never land in another
# put's block (kvstore.meta.quarantine).
WRITE_TICKET_GRACE_S = 2 * tickets.SKEW_S + 2


class Segment:
    __slots__ = ("daemon", "spec", "alloc", "blocks", "pinned", "leased", "ref", "pb_ref", "quarantined")

    def __init__(self, daemon: Daemon, spec: SegmentSpec, ref: int, alloc: Allocator | None = None) -> None:
        self.daemon = daemon
        self.ref = ref  # names this segment in location rows
        self.spec = spec
        self.alloc = alloc or Allocator(spec.capacity, SEGMENT_ALIGN[spec.tier])
        self.blocks = 0  # replicas here (committed or reserved)
        self.pinned = 0  # replicas here of pinned blocks
        self.leased = 0  # blocks whose primary replica is here with a lease on it
        # How location messages describe it (kvstore.wire.places_to_pb), built once.
        self.pb_ref = None
        # Bytes of extents freed but held back from the allocator while write tickets for them
        # may still be honoured (kvstore.meta.quarantine); counted in alloc.used.
        self.quarantined = 0

    @property
    def align(self) -> int:
        return self.alloc.align

    def trim(self, offset: int, size: int, stored: int) -> int:
        """An extent of ``size`` bytes at ``offset`` whose daemon stored its block in ``stored``
        bytes (compressed; 0: as it was) gives back the rest; returns the extent's size now."""
        if 0 < stored < size and stored % self.align == 0:
            self.alloc.release(offset + stored, size - stored)
            return stored
        return size


@dataclass(slots=True)
class Daemon:
    spec: DaemonSpec
    deadline: float
    last_heartbeat: float
    segments: dict[int, Segment] = field(default_factory=dict)
    # Its inventory is still being adopted: no puts or moves are placed on it yet.
    adopting: bool = False

    def tier(self, tier: Tier) -> Segment | None:
        for s in self.segments.values():
            if s.spec.tier == tier:
                return s
        return None


@dataclass(slots=True)
class Places:
    """Where blocks are, spelled out in columns at one moment (a row may hold another block by
    the time an answer goes out or the daemons answer): what a put's placements, a lookup's or
    a lease's locations and a pending commit's blocks are packed from, one entry a block."""

    index: np.ndarray  # the block's position in the request (the put's placements, the run)
    refs: np.ndarray  # its segment's ref (``segments[ref]``)
    offset: np.ndarray
    size: np.ndarray
    length: np.ndarray
    checksum: np.ndarray
    gen: np.ndarray
    keys: bytes  # packed, 16 bytes a block
    segments: dict  # ref -> Segment, for the refs above

    def __len__(self) -> int:
        return len(self.index)


@dataclass(slots=True)
class PendingCommit:
    """A put between PutCommit's start and the daemons' answer (see
    :meth:`kvstore.meta.index.Index.put_commit_begin`)."""

    put: Any  # kvstore.meta.writes.Put
    places: Places  # the blocks the daemons are to commit
    status: list[int]  # per allocated block, in placement order: its CommitStatus so far
    checksums: list[int]

    @property
    def replicas(self) -> list[Any]:
        """Per allocated block, its location (kvstore.meta.index.Location) if the daemons are to
        commit it, else None: :attr:`places` spelled out, one object a block (for tests and tools)."""
        from kvstore.meta.index import Location

        p = self.places
        out: list[Any] = [None] * len(self.status)
        for j, i in enumerate(p.index.tolist()):
            key = p.keys[16 * j : 16 * j + 16]
            seg = p.segments[int(p.refs[j])]
            out[i] = Location(
                seg, int(p.offset[j]), int(p.size[j]), int(p.length[j]), int(p.checksum[j]), int(p.gen[j]), key
            )
        return out


class CommitStatus(IntEnum):  # mirrors kvstore.v1.CommitStatus
    OK = 0
    NOT_WRITTEN = 1
    MISMATCH = 2
    NO_SPACE = 3
    UNAVAILABLE = 4


class PutStartResult(NamedTuple):
    put_id: int
    status: list[int]
    placements: np.ndarray  # rows of the block table, in placement order (Index.locations spells them out)
    deadline: float


class AcquireResult(NamedTuple):
    hit_count: int
    lease_id: int
    locations: np.ndarray  # rows of the leased run
    ttl: float


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """The adaptive cache policy's parameters (:mod:`kvstore.meta.policy`, :mod:`kvstore.meta.duel`),
    all in one value handed to the index (``IndexLimits.policy``). The defaults come from the
    literature, not from fitting a workload; benchmarks that study them make indexes with others."""

    # Blocks a sampled eviction looks at (hyperbolic caching, Redis' LFU).
    sample: int = 64
    # Counts halve every age_factor x the cache size accesses (TinyLFU's reset period).
    age_factor: float = 10
    # Counts of blocks not stored are kept for history_factor x the cache size blocks.
    history_factor: float = 10
    # The duel weighs its evidence (shadow hits, calibration) with a half-life of window_factor x
    # a shadow's size in sampled accesses (0: 4 x age_factor): the span over which the frequency
    # mode's state is built and forgotten. A count halves every aging period, so the counts that
    # set a hot prefix apart from a one-time tail (up to 2**4) are made over four periods, and a
    # switch into that mode pays off, or not, over as long. One aging period is also too few
    # requests to judge by: hits come in runs (a request's leading hits, hundreds of blocks at
    # once where requests are long), and at 10 x the cache size a document-QA window held about
    # 16 requests, so a few of them decided the mode.
    window: float = 0
    # Sampled blocks a shadow holds (set dueling: 32 sets of a few thousand lines), and the least.
    shadow_blocks: int = 2048
    min_shadow: int = 64
    # A switch to or from frequency needs a lead of `margin` and a difference above `significance`
    # standard deviations of the sampling noise (the two-sided 95 % level).
    margin: float = 0.05
    significance: float = 2.0
    # The history of blocks not stored holds at most history_max keys; counts age as if the index
    # held at least min_population blocks.
    history_max: int = 1 << 20
    min_population: int = 1024
    # A mode held whatever the duel says ("recency", "frequency", "second_chance"; "": the duel
    # chooses). For measurements.
    fixed_mode: str = ""

    @property
    def window_factor(self) -> float:
        return self.window or 4 * self.age_factor

    @property
    def prior_hits(self) -> float:
        """A calibration ratio's prior, in shadow hits: the count at which a difference of
        ``margin`` is ``significance`` standard deviations of Poisson noise ((2 / 0.05) ** 2):
        evidence weaker than what could justify a switch does not move the estimate much."""
        return (self.significance / self.margin) ** 2


@dataclass(frozen=True, slots=True)
class IndexLimits:
    max_batch_keys: int = 16384
    max_block_bytes: int = 1 << 30
    put_timeout_s: float = 30.0
    max_put_timeout_s: float = 600.0
    lease_ttl_s: float = 10.0
    max_lease_ttl_s: float = 300.0
    daemon_ttl_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    # DRAM fill above which the coldest blocks are demoted to SSD, and the fill to demote down to.
    dram_high_watermark: float = 0.9
    dram_low_watermark: float = 0.8
    # Eviction and admission (kvstore.meta.policy): "adaptive" or "lru", and the parameters.
    cache_policy: str = "adaptive"
    policy: PolicyParams = PolicyParams()
    # The device tier (kvstore.meta.engines): engines reporting their caches' blocks.
    engine_ttl_s: float = 3.0
    max_engine_ttl_s: float = 60.0
    max_engines: int = 1024
    max_engines_per_tenant: int = 64
    max_engine_blocks: int = 1 << 20
    # In a sharded cluster (kvstore.cluster): this index is shard `shard` of `shards`, and
    # allocates only in its arena of each segment (kvstore.cluster.slots.arena).
    shard: int = 0
    shards: int = 1
    # How long past a put's deadline the extents of its uncommitted blocks are held back, while
    # its write tickets may still be honoured (WRITE_TICKET_GRACE_S: the daemons' default
    # ticket skew plus the rounding of the expiry; a daemon configured with a longer
    # daemon.ticket_skew_s needs as much more here).
    write_ticket_grace_s: float = WRITE_TICKET_GRACE_S


COUNTERS = (  # the index's counters (Stats, metrics)
    "lookups", "lookup_keys", "lookup_hit_keys", "acquires", "hit_keys", "miss_keys", "hit_bytes",
    "ssd_hit_keys", "puts", "put_keys", "put_bytes", "put_ssd_keys", "dedup_keys", "no_space_keys",
    "evictions", "evicted_bytes", "dropped_clean", "demoted", "demoted_bytes", "promoted",
    "promoted_bytes", "moves_failed", "removed", "expired_puts", "expired_leases", "corrupt_reported",
    "daemons_lost", "daemons_drained", "commit_failed_keys", "tombstones", "tombstones_dropped", "stall_grace",
    "not_admitted_keys", "touches", "touched_keys",
)  # fmt: skip


def expired(heap: list[tuple[float, int]], table: dict, now: float) -> list[int]:
    """Pops the (deadline, id) entries of ``heap`` that passed; returns the ids still in
    ``table`` whose deadline passed (the others ended earlier)."""
    out = []
    while heap and heap[0][0] < now:
        _, i = heapq.heappop(heap)
        item = table.get(i)
        if item is not None and item.deadline < now:
            out.append(i)
    return out
