"""The records the index is made of: typed values (specs, inventory items, tombstones, results,
limits) and the mutable per-block, per-segment and per-daemon state that
:class:`kvstore.meta.index.Index` keeps. No behaviour beyond small accessors: the index owns
every change.
"""

from __future__ import annotations

import heapq
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

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


class Replica:
    __slots__ = (
        "segment", "offset", "size", "length", "checksum", "leases", "entry", "live", "ready", "row", "gen", "written",
    )  # fmt: skip

    def __init__(self, segment: Segment, offset: int, size: int, length: int, entry: Entry, gen: int) -> None:
        self.segment = segment
        self.gen = gen
        self.offset = offset
        self.size = size  # extent bytes in the segment
        self.length = length  # payload bytes
        self.checksum = 0
        self.leases = 0
        self.entry = entry
        self.live = True  # False once dropped from the index (freed when the last lease goes)
        self.ready = False  # bytes written and committed: readable
        # The daemon may hold a committed header for it (a commit or move was attempted):
        # dropping it then needs a tombstone even if it never became ready.
        self.written = False
        self.row = ROW.pack(segment.ref, 0, offset, length, 0, gen)

    @property
    def tier(self) -> Tier:
        return self.segment.spec.tier

    @property
    def key(self) -> bytes:
        return self.entry.key

    def set_checksum(self, csum: int) -> None:
        self.checksum = csum
        self.row = ROW.pack(self.segment.ref, 0, self.offset, self.length, csum, self.gen)

    def evictable(self) -> bool:
        return self.live and self.ready and self.leases == 0 and not self.entry.pinned and self.entry.complete


class Entry:
    __slots__ = ("key", "complete", "replicas", "pinned", "put_id", "moving", "freq", "again")

    def __init__(self, key: bytes, put_id: int) -> None:
        self.key = key
        self.freq = 0  # the cache policy's access count (kvstore.meta.policy)
        self.again = 0  # second-chance mode's mark: the spell in which it was last read again
        self.complete = False
        self.replicas: list[Replica] = []
        self.pinned = False
        self.put_id = put_id
        self.moving = False  # a demotion or promotion of this block is under way

    @property
    def replica(self) -> Replica | None:
        """The replica a reader gets: a ready DRAM one first, else any ready one (a pending
        entry: its reservation)."""
        best = None
        for r in self.replicas:
            if r.ready:
                if r.segment.spec.tier == Tier.DRAM:
                    return r
                best = best or r
        if best is None and self.replicas and not self.complete:
            return self.replicas[0]
        return best

    def on(self, tier: Tier) -> Replica | None:
        for r in self.replicas:
            if r.segment.spec.tier == tier:
                return r
        return None


class Segment:
    __slots__ = (
        "daemon", "spec", "alloc", "lru", "blocks", "pinned", "leased", "ref", "replicas", "pb_ref", "quarantined",
    )  # fmt: skip

    def __init__(self, daemon: Daemon, spec: SegmentSpec, ref: int, alloc: Allocator | None = None) -> None:
        self.daemon = daemon
        self.ref = ref  # names this segment in location rows
        self.spec = spec
        self.alloc = alloc or Allocator(spec.capacity, SEGMENT_ALIGN[spec.tier])
        # Evictable replicas only, oldest first.
        self.lru: OrderedDict[bytes, Replica] = OrderedDict()
        self.blocks = 0
        self.pinned = 0
        self.leased = 0
        # Every live replica (ready or reserved), so that losing a daemon costs its own blocks,
        # not a walk of the whole index.
        self.replicas: set[Replica] = set()
        # How location messages describe it (kvstore.wire.locations_to_pb), built once.
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
class Put:
    put_id: int
    deadline: float
    keys: list[bytes]  # the whole request, for touching the chain on commit
    entries: list[Entry]  # the allocated ones, in placement order


@dataclass(slots=True)
class Lease:
    lease_id: int
    deadline: float
    replicas: list[Replica]


@dataclass(slots=True)
class PendingCommit:
    """A put between PutCommit's start and the daemons' answer (see :meth:`Index.put_commit_begin`)."""

    put: Put
    # Per allocated block, in placement order: its replica (None: not to be committed) and
    # its status so far (a CommitStatus).
    replicas: list[Replica | None]
    status: list[int]
    checksums: list[int]


class CommitStatus(IntEnum):  # mirrors kvstore.v1.CommitStatus
    OK = 0
    NOT_WRITTEN = 1
    MISMATCH = 2
    NO_SPACE = 3
    UNAVAILABLE = 4


@dataclass(slots=True)
class Move:
    """A copy of one block between two segments of one daemon (demotion or promotion)."""

    move_id: int
    src: Replica  # leased for the duration
    dst: Replica  # reserved, not ready
    demote: bool


class PutStartResult(NamedTuple):
    put_id: int
    status: list[int]
    placements: list[Replica]
    deadline: float


class AcquireResult(NamedTuple):
    hit_count: int
    lease_id: int
    locations: list[Replica]
    ttl: float


INDEXES = ("object", "compact")  # meta.index: kvstore.meta.index.Index, kvstore.meta.compact.CompactIndex


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
    # Eviction and admission (kvstore.meta.policy): "adaptive" or "lru".
    cache_policy: str = "adaptive"
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
