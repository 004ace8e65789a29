from libs.proto.deepserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("num_present",)
    NUM_PRESENT_FIELD_NUMBER: _ClassVar[int]
    num_present: int
    def __init__(self, num_present: _Optional[int] = ...) -> None: ...

class PutBlock(_message.Message):
    __slots__ = ("hash", "parent_hash", "data", "tenant", "traffic_class")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    parent_hash: bytes
    data: bytes
    tenant: str
    traffic_class: _common_pb2.TrafficClass
    def __init__(self, hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[_Union[_common_pb2.TrafficClass, str]] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("stored", "skipped")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    skipped: int
    def __init__(self, stored: _Optional[int] = ..., skipped: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("hash", "data")
    HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    data: bytes
    def __init__(self, hash: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("blocks", "bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...
