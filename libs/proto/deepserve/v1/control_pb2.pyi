from libs.proto.deepserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role

class InstanceStatus(_message.Message):
    __slots__ = ("instance_id", "role", "model", "address", "running", "waiting", "queued_tokens", "free_kv_blocks", "total_kv_blocks", "bucket", "resident_prefixes", "sent_unix_ms", "draining", "block_size", "compute_tokens_per_s", "busy_fraction", "promised_kv_blocks", "held_requests", "reports_held")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PROMISED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_HELD_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: Role
    model: str
    address: str
    running: int
    waiting: int
    queued_tokens: int
    free_kv_blocks: int
    total_kv_blocks: int
    bucket: str
    resident_prefixes: _containers.RepeatedScalarFieldContainer[bytes]
    sent_unix_ms: int
    draining: bool
    block_size: int
    compute_tokens_per_s: float
    busy_fraction: float
    promised_kv_blocks: int
    held_requests: _containers.RepeatedScalarFieldContainer[int]
    reports_held: bool
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., model: _Optional[str] = ..., address: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., bucket: _Optional[str] = ..., resident_prefixes: _Optional[_Iterable[bytes]] = ..., sent_unix_ms: _Optional[int] = ..., draining: _Optional[bool] = ..., block_size: _Optional[int] = ..., compute_tokens_per_s: _Optional[float] = ..., busy_fraction: _Optional[float] = ..., promised_kv_blocks: _Optional[int] = ..., held_requests: _Optional[_Iterable[int]] = ..., reports_held: _Optional[bool] = ...) -> None: ...

class LoadStatus(_message.Message):
    __slots__ = ("instance_id", "role", "model", "source", "shards_done", "shards_total", "bytes_done", "bytes_total", "bytes_read", "seconds", "done", "error", "sent_unix_ms")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_DONE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    model: str
    source: str
    shards_done: int
    shards_total: int
    bytes_done: int
    bytes_total: int
    bytes_read: int
    seconds: float
    done: bool
    error: str
    sent_unix_ms: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., source: _Optional[str] = ..., shards_done: _Optional[int] = ..., shards_total: _Optional[int] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., bytes_read: _Optional[int] = ..., seconds: _Optional[float] = ..., done: _Optional[bool] = ..., error: _Optional[str] = ..., sent_unix_ms: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_tokens", "cached_blocks", "block_hashes", "exclude")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_tokens: int
    cached_blocks: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    exclude: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., exclude: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteDecision(_message.Message):
    __slots__ = ("prefill_instance", "decode_instance", "decode_address", "error")
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    prefill_instance: str
    decode_instance: str
    decode_address: str
    error: str
    def __init__(self, prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ..., decode_address: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class PrefillTask(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "traffic_class", "cached_blocks", "decode_instance", "decode_address", "events_subject", "traceparent", "num_prior_outputs", "tenant_weight")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_SUBJECT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    NUM_PRIOR_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: bytes
    traffic_class: _common_pb2.TrafficClass
    cached_blocks: int
    decode_instance: str
    decode_address: str
    events_subject: str
    traceparent: str
    num_prior_outputs: int
    tenant_weight: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., traffic_class: _Optional[_Union[_common_pb2.TrafficClass, str]] = ..., cached_blocks: _Optional[int] = ..., decode_instance: _Optional[str] = ..., decode_address: _Optional[str] = ..., events_subject: _Optional[str] = ..., traceparent: _Optional[str] = ..., num_prior_outputs: _Optional[int] = ..., tenant_weight: _Optional[float] = ...) -> None: ...

class DecodeTask(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling", "cache_salt", "events_subject", "cached_tokens", "traceparent", "traffic_class", "first_logprobs", "draft_token_ids", "draft_confidences")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_SUBJECT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    cache_salt: bytes
    events_subject: str
    cached_tokens: int
    traceparent: str
    traffic_class: _common_pb2.TrafficClass
    first_logprobs: _common_pb2.TokenLogprobs
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_confidences: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., events_subject: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ..., traffic_class: _Optional[_Union[_common_pb2.TrafficClass, str]] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_confidences: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "finished", "finish_reason", "prompt_tokens", "cached_tokens", "error", "retryable", "logprobs", "speculative", "invalid_argument")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    INVALID_ARGUMENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    error: str
    retryable: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    speculative: SpecCounts
    invalid_argument: bool
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., retryable: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., speculative: _Optional[_Union[SpecCounts, _Mapping]] = ..., invalid_argument: _Optional[bool] = ...) -> None: ...

class SpecCounts(_message.Message):
    __slots__ = ("drafted", "verified", "accepted")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    drafted: int
    verified: int
    accepted: int
    def __init__(self, drafted: _Optional[int] = ..., verified: _Optional[int] = ..., accepted: _Optional[int] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
