from libs.proto.deepserve.v1 import control_pb2 as _control_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVPush(_message.Message):
    __slots__ = ("task", "chunk")
    TASK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    task: _control_pb2.DecodeTask
    chunk: bytes
    def __init__(self, task: _Optional[_Union[_control_pb2.DecodeTask, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class KVPushReply(_message.Message):
    __slots__ = ("accepted", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
