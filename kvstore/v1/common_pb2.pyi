from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]

class CommitStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMIT_OK: _ClassVar[CommitStatus]
    COMMIT_NOT_WRITTEN: _ClassVar[CommitStatus]
    COMMIT_MISMATCH: _ClassVar[CommitStatus]
    COMMIT_NO_SPACE: _ClassVar[CommitStatus]
    COMMIT_UNAVAILABLE: _ClassVar[CommitStatus]
TIER_UNSPECIFIED: Tier
TIER_DRAM: Tier
TIER_SSD: Tier
TIER_GPU: Tier
COMMIT_OK: CommitStatus
COMMIT_NOT_WRITTEN: CommitStatus
COMMIT_MISMATCH: CommitStatus
COMMIT_NO_SPACE: CommitStatus
COMMIT_UNAVAILABLE: CommitStatus

class Segment(_message.Message):
    __slots__ = ("segment_id", "tier", "capacity_bytes", "shm_path")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    tier: Tier
    capacity_bytes: int
    shm_path: str
    def __init__(self, segment_id: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., shm_path: _Optional[str] = ...) -> None: ...

class DaemonInfo(_message.Message):
    __slots__ = ("daemon_id", "host_id", "data_addr", "control_addr", "segments")
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDR_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDR_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    daemon_id: str
    host_id: str
    data_addr: str
    control_addr: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, daemon_id: _Optional[str] = ..., host_id: _Optional[str] = ..., data_addr: _Optional[str] = ..., control_addr: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class SegmentRef(_message.Message):
    __slots__ = ("ref", "daemon", "segment_id", "tier")
    REF_FIELD_NUMBER: _ClassVar[int]
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ref: int
    daemon: DaemonInfo
    segment_id: int
    tier: Tier
    def __init__(self, ref: _Optional[int] = ..., daemon: _Optional[_Union[DaemonInfo, _Mapping]] = ..., segment_id: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class Locations(_message.Message):
    __slots__ = ("rows", "segments", "tickets", "keys")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    segments: _containers.RepeatedCompositeFieldContainer[SegmentRef]
    tickets: bytes
    keys: bytes
    def __init__(self, rows: _Optional[bytes] = ..., segments: _Optional[_Iterable[_Union[SegmentRef, _Mapping]]] = ..., tickets: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("segment_id", "keys", "offset", "length", "checksum", "gen", "size")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    keys: bytes
    offset: bytes
    length: bytes
    checksum: bytes
    gen: bytes
    size: bytes
    def __init__(self, segment_id: _Optional[int] = ..., keys: _Optional[bytes] = ..., offset: _Optional[bytes] = ..., length: _Optional[bytes] = ..., checksum: _Optional[bytes] = ..., gen: _Optional[bytes] = ..., size: _Optional[bytes] = ...) -> None: ...

class Invalidation(_message.Message):
    __slots__ = ("segment_id", "keys", "offset", "gen")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    keys: bytes
    offset: bytes
    gen: bytes
    def __init__(self, segment_id: _Optional[int] = ..., keys: _Optional[bytes] = ..., offset: _Optional[bytes] = ..., gen: _Optional[bytes] = ...) -> None: ...
