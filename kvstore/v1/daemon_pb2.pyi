from kvstore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
