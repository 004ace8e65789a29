"""Proto <-> engine conversions shared by prefill and decode (no I/O, no torch)."""

from __future__ import annotations

import dataclasses

from libs.engine.sampling_params import SamplingParams
from libs.proto.deepserve.v1 import common_pb2, control_pb2


def sampling_from_proto(
    p: common_pb2.SamplingParams, *, max_tokens: int | None = None
) -> SamplingParams:
    """The engine's SamplingParams for a wire message; ``max_tokens`` overrides the message's.

    Raises ValueError (naming the field) for values the engine refuses.
    """
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,  # 0 on the wire means "not set"
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens if max_tokens is None else max_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        max_tokens=sp.max_tokens,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    return msg


def with_max_tokens(sp: SamplingParams, max_tokens: int) -> SamplingParams:
    return dataclasses.replace(sp, max_tokens=max_tokens)


def error_event(
    request_id: str, message: str, *, retryable: bool, index: int = 0
) -> control_pb2.TokenEvent:
    """A TokenEvent that fails the request (the entrypoint retries it elsewhere if retryable)."""
    return control_pb2.TokenEvent(
        request_id=request_id, index=index, finished=True, error=message, retryable=retryable
    )
