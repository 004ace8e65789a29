from libs.proto.deepserve.v1 import control_pb2 as _control_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVPush(_message.Message):
    __slots__ = ("task", "chunk", "peer")
    TASK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    task: _control_pb2.DecodeTask
    chunk: bytes
    peer: PeerBlocks
    def __init__(self, task: _Optional[_Union[_control_pb2.DecodeTask, _Mapping]] = ..., chunk: _Optional[bytes] = ..., peer: _Optional[_Union[PeerBlocks, _Mapping]] = ...) -> None: ...

class PeerBlocks(_message.Message):
    __slots__ = ("pool", "block_ids", "first_block", "num_tokens", "block_hashes")
    POOL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    pool: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    num_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., num_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class KVPushReply(_message.Message):
    __slots__ = ("accepted", "error", "missing_prefix", "have_blocks", "send_bytes")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MISSING_PREFIX_FIELD_NUMBER: _ClassVar[int]
    HAVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEND_BYTES_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    missing_prefix: bool
    have_blocks: int
    send_bytes: bool
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ..., missing_prefix: _Optional[bool] = ..., have_blocks: _Optional[int] = ..., send_bytes: _Optional[bool] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MatchReply(_message.Message):
    __slots__ = ("blocks", "host")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    host: str
    def __init__(self, blocks: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class ResendRequest(_message.Message):
    __slots__ = ("request_id", "from_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_index: int
    def __init__(self, request_id: _Optional[str] = ..., from_index: _Optional[int] = ...) -> None: ...

class ResendReply(_message.Message):
    __slots__ = ("known", "events")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    events: _containers.RepeatedCompositeFieldContainer[_control_pb2.TokenEvent]
    def __init__(self, known: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[_control_pb2.TokenEvent, _Mapping]]] = ...) -> None: ...
