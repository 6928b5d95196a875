from kvstore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_ALLOCATED: _ClassVar[PutStatus]
    PUT_SKIP_EXISTS: _ClassVar[PutStatus]
    PUT_SKIP_INFLIGHT: _ClassVar[PutStatus]
    PUT_NO_SPACE: _ClassVar[PutStatus]
    PUT_NOT_ADMITTED: _ClassVar[PutStatus]
PUT_ALLOCATED: PutStatus
PUT_SKIP_EXISTS: PutStatus
PUT_SKIP_INFLIGHT: PutStatus
PUT_NO_SPACE: PutStatus
PUT_NOT_ADMITTED: PutStatus

class RegisterDaemonRequest(_message.Message):
    __slots__ = ("daemon", "inventory", "ticket_key", "registration")
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    TICKET_KEY_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    daemon: _common_pb2.DaemonInfo
    inventory: _containers.RepeatedCompositeFieldContainer[_common_pb2.Inventory]
    ticket_key: bytes
    registration: int
    def __init__(self, daemon: _Optional[_Union[_common_pb2.DaemonInfo, _Mapping]] = ..., inventory: _Optional[_Iterable[_Union[_common_pb2.Inventory, _Mapping]]] = ..., ticket_key: _Optional[bytes] = ..., registration: _Optional[int] = ...) -> None: ...

class RegisterDaemonResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "lease_ttl_ms", "rejected", "tickets", "shard", "shards", "epoch")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    lease_ttl_ms: int
    rejected: int
    tickets: bool
    shard: int
    shards: int
    epoch: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., rejected: _Optional[int] = ..., tickets: _Optional[bool] = ..., shard: _Optional[int] = ..., shards: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("daemon_id", "acked_batch", "registration")
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_BATCH_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    daemon_id: str
    acked_batch: int
    registration: int
    def __init__(self, daemon_id: _Optional[str] = ..., acked_batch: _Optional[int] = ..., registration: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "invalidations", "batch", "epoch")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    INVALIDATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    known: bool
    invalidations: _containers.RepeatedCompositeFieldContainer[_common_pb2.Invalidation]
    batch: int
    epoch: int
    def __init__(self, known: _Optional[bool] = ..., invalidations: _Optional[_Iterable[_Union[_common_pb2.Invalidation, _Mapping]]] = ..., batch: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class DrainDaemonRequest(_message.Message):
    __slots__ = ("daemon_id",)
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    daemon_id: str
    def __init__(self, daemon_id: _Optional[str] = ...) -> None: ...

class DrainDaemonResponse(_message.Message):
    __slots__ = ("dropped", "lease_wait_ms", "leases")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LEASE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    lease_wait_ms: int
    leases: int
    def __init__(self, dropped: _Optional[int] = ..., lease_wait_ms: _Optional[int] = ..., leases: _Optional[int] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("keys", "sizes", "chain", "host_id", "timeout_ms", "exclude_daemons")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_DAEMONS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    sizes: bytes
    chain: bool
    host_id: str
    timeout_ms: int
    exclude_daemons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[bytes] = ..., sizes: _Optional[bytes] = ..., chain: _Optional[bool] = ..., host_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., exclude_daemons: _Optional[_Iterable[str]] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("put_id", "status", "placements", "deadline_unix_ms")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    status: bytes
    placements: _common_pb2.Locations
    deadline_unix_ms: int
    def __init__(self, put_id: _Optional[int] = ..., status: _Optional[bytes] = ..., placements: _Optional[_Union[_common_pb2.Locations, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ...) -> None: ...

class PutCommitRequest(_message.Message):
    __slots__ = ("put_id", "checksums", "written")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    checksums: bytes
    written: bytes
    def __init__(self, put_id: _Optional[int] = ..., checksums: _Optional[bytes] = ..., written: _Optional[bytes] = ...) -> None: ...

class PutCommitResponse(_message.Message):
    __slots__ = ("committed", "status")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    committed: int
    status: bytes
    def __init__(self, committed: _Optional[int] = ..., status: _Optional[bytes] = ...) -> None: ...

class PutAbortRequest(_message.Message):
    __slots__ = ("put_id",)
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    def __init__(self, put_id: _Optional[int] = ...) -> None: ...

class PutAbortResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "per_key", "with_locations", "per_tier")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PER_KEY_FIELD_NUMBER: _ClassVar[int]
    WITH_LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    PER_TIER_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    per_key: bool
    with_locations: bool
    per_tier: bool
    def __init__(self, keys: _Optional[bytes] = ..., per_key: _Optional[bool] = ..., with_locations: _Optional[bool] = ..., per_tier: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_count", "exists", "locations", "tiers", "engines", "lookup_port", "lookup_port_id")
    HIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PORT_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PORT_ID_FIELD_NUMBER: _ClassVar[int]
    hit_count: int
    exists: bytes
    locations: _common_pb2.Locations
    tiers: bytes
    engines: _containers.RepeatedCompositeFieldContainer[EngineHeld]
    lookup_port: int
    lookup_port_id: int
    def __init__(self, hit_count: _Optional[int] = ..., exists: _Optional[bytes] = ..., locations: _Optional[_Union[_common_pb2.Locations, _Mapping]] = ..., tiers: _Optional[bytes] = ..., engines: _Optional[_Iterable[_Union[EngineHeld, _Mapping]]] = ..., lookup_port: _Optional[int] = ..., lookup_port_id: _Optional[int] = ...) -> None: ...

class EngineHeld(_message.Message):
    __slots__ = ("engine_id", "url", "held")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    url: str
    held: bytes
    def __init__(self, engine_id: _Optional[str] = ..., url: _Optional[str] = ..., held: _Optional[bytes] = ...) -> None: ...

class ReportEngineBlocksRequest(_message.Message):
    __slots__ = ("engine_id", "url", "added", "removed", "reset", "ttl_ms", "leave")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    url: str
    added: bytes
    removed: bytes
    reset: bool
    ttl_ms: int
    leave: bool
    def __init__(self, engine_id: _Optional[str] = ..., url: _Optional[str] = ..., added: _Optional[bytes] = ..., removed: _Optional[bytes] = ..., reset: _Optional[bool] = ..., ttl_ms: _Optional[int] = ..., leave: _Optional[bool] = ...) -> None: ...

class ReportEngineBlocksResponse(_message.Message):
    __slots__ = ("held", "ttl_ms")
    HELD_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    held: int
    ttl_ms: int
    def __init__(self, held: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("keys", "ttl_ms", "host_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    ttl_ms: int
    host_id: str
    def __init__(self, keys: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ..., host_id: _Optional[str] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("hit_count", "lease_id", "locations", "ttl_ms")
    HIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    hit_count: int
    lease_id: int
    locations: _common_pb2.Locations
    ttl_ms: int
    def __init__(self, hit_count: _Optional[int] = ..., lease_id: _Optional[int] = ..., locations: _Optional[_Union[_common_pb2.Locations, _Mapping]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "corrupt", "unread", "asked_again")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    UNREAD_FIELD_NUMBER: _ClassVar[int]
    ASKED_AGAIN_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    corrupt: bytes
    unread: int
    asked_again: bool
    def __init__(self, lease_id: _Optional[int] = ..., corrupt: _Optional[bytes] = ..., unread: _Optional[int] = ..., asked_again: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("chains", "interval_ms", "tiers")
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    chains: _containers.RepeatedScalarFieldContainer[bytes]
    interval_ms: int
    tiers: bytes
    def __init__(self, chains: _Optional[_Iterable[bytes]] = ..., interval_ms: _Optional[int] = ..., tiers: _Optional[bytes] = ...) -> None: ...

class TouchResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys", "tenant")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    tenant: str
    def __init__(self, keys: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class CountResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SegmentStats(_message.Message):
    __slots__ = ("daemon_id", "segment_id", "tier", "capacity_bytes", "used_bytes", "blocks", "pinned_blocks", "leased_blocks")
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    daemon_id: str
    segment_id: int
    tier: _common_pb2.Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    pinned_blocks: int
    leased_blocks: int
    def __init__(self, daemon_id: _Optional[str] = ..., segment_id: _Optional[int] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., leased_blocks: _Optional[int] = ...) -> None: ...

class DaemonStats(_message.Message):
    __slots__ = ("info", "alive", "last_heartbeat_age_s")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.DaemonInfo
    alive: bool
    last_heartbeat_age_s: float
    def __init__(self, info: _Optional[_Union[_common_pb2.DaemonInfo, _Mapping]] = ..., alive: _Optional[bool] = ..., last_heartbeat_age_s: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("daemons", "segments", "counters", "keys", "pending_puts", "active_leases", "touch_interval_ms")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DAEMONS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    TOUCH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    daemons: _containers.RepeatedCompositeFieldContainer[DaemonStats]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentStats]
    counters: _containers.ScalarMap[str, int]
    keys: int
    pending_puts: int
    active_leases: int
    touch_interval_ms: int
    def __init__(self, daemons: _Optional[_Iterable[_Union[DaemonStats, _Mapping]]] = ..., segments: _Optional[_Iterable[_Union[SegmentStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., keys: _Optional[int] = ..., pending_puts: _Optional[int] = ..., active_leases: _Optional[int] = ..., touch_interval_ms: _Optional[int] = ...) -> None: ...

class AdvanceClockRequest(_message.Message):
    __slots__ = ("seconds",)
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    def __init__(self, seconds: _Optional[float] = ...) -> None: ...

class AdvanceClockResponse(_message.Message):
    __slots__ = ("now",)
    NOW_FIELD_NUMBER: _ClassVar[int]
    now: float
    def __init__(self, now: _Optional[float] = ...) -> None: ...
