from kvstore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CommitRequest(_message.Message):
    __slots__ = ("keys", "segment", "offset", "length", "checksum", "gen", "shard", "epoch", "registration")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    segment: bytes
    offset: bytes
    length: bytes
    checksum: bytes
    gen: bytes
    shard: int
    epoch: int
    registration: int
    def __init__(self, keys: _Optional[bytes] = ..., segment: _Optional[bytes] = ..., offset: _Optional[bytes] = ..., length: _Optional[bytes] = ..., checksum: _Optional[bytes] = ..., gen: _Optional[bytes] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ..., registration: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("status", "stored_size")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STORED_SIZE_FIELD_NUMBER: _ClassVar[int]
    status: bytes
    stored_size: bytes
    def __init__(self, status: _Optional[bytes] = ..., stored_size: _Optional[bytes] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("invalidations", "shard", "epoch", "registration")
    INVALIDATIONS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    invalidations: _containers.RepeatedCompositeFieldContainer[_common_pb2.Invalidation]
    shard: int
    epoch: int
    registration: int
    def __init__(self, invalidations: _Optional[_Iterable[_Union[_common_pb2.Invalidation, _Mapping]]] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ..., registration: _Optional[int] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("cleared",)
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    cleared: int
    def __init__(self, cleared: _Optional[int] = ...) -> None: ...

class MoveRequest(_message.Message):
    __slots__ = ("keys", "src_segment", "src_offset", "dst_segment", "dst_offset", "length", "checksum", "src_gen", "dst_gen", "shard", "epoch", "registration")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SRC_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DST_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SRC_GEN_FIELD_NUMBER: _ClassVar[int]
    DST_GEN_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    src_segment: bytes
    src_offset: bytes
    dst_segment: bytes
    dst_offset: bytes
    length: bytes
    checksum: bytes
    src_gen: bytes
    dst_gen: bytes
    shard: int
    epoch: int
    registration: int
    def __init__(self, keys: _Optional[bytes] = ..., src_segment: _Optional[bytes] = ..., src_offset: _Optional[bytes] = ..., dst_segment: _Optional[bytes] = ..., dst_offset: _Optional[bytes] = ..., length: _Optional[bytes] = ..., checksum: _Optional[bytes] = ..., src_gen: _Optional[bytes] = ..., dst_gen: _Optional[bytes] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ..., registration: _Optional[int] = ...) -> None: ...

class MoveResponse(_message.Message):
    __slots__ = ("ok", "stored_size")
    OK_FIELD_NUMBER: _ClassVar[int]
    STORED_SIZE_FIELD_NUMBER: _ClassVar[int]
    ok: bytes
    stored_size: bytes
    def __init__(self, ok: _Optional[bytes] = ..., stored_size: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("verify",)
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    verify: bool
    def __init__(self, verify: _Optional[bool] = ...) -> None: ...

class InventoryResponse(_message.Message):
    __slots__ = ("inventory", "discarded")
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    inventory: _containers.RepeatedCompositeFieldContainer[_common_pb2.Inventory]
    discarded: int
    def __init__(self, inventory: _Optional[_Iterable[_Union[_common_pb2.Inventory, _Mapping]]] = ..., discarded: _Optional[int] = ...) -> None: ...
