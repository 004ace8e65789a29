"""The shared error kinds and the one SamplingParams: checks, wire round trip, edge mappings."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
import pytest

from libs.common import grpc_errors
from libs.common.errors import (
    AlreadyExists,
    DeadlineExceeded,
    DeepserveError,
    FatalError,
    InstanceFailed,
    Internal,
    InvalidArgument,
    NotFound,
    Overloaded,
    RetryableError,
    Unauthenticated,
    Unavailable,
)
from libs.common.sampling import SamplingParams
from libs.gateway.policy import Limits
from libs.proto.deepserve.v1 import common_pb2, generate_pb2
from libs.serving.convert import error_event
from services.entrypoint.handlers import EntrypointHandlers, HandlerConfig
from services.recipe.events import api_error

# -- SamplingParams ------------------------------------------------------------------------------


def test_proto_round_trip_keeps_every_field() -> None:
    sp = SamplingParams(
        temperature=0.5,
        top_p=0.25,
        top_k=40,
        seed=2**63 - 1,
        max_tokens=7,
        stop_token_ids=(3, 9),
        ignore_eos=True,
        min_p=0.125,
        min_tokens=5,
        repetition_penalty=1.25,
        presence_penalty=-0.5,
        frequency_penalty=1.5,
    )
    assert SamplingParams.from_proto(sp.to_proto()) == sp
    # A proto byte round trip too: what another process reads is what was sent.
    wire = common_pb2.SamplingParams.FromString(sp.to_proto().SerializeToString())
    assert SamplingParams.from_proto(wire) == sp
    unseeded = SamplingParams(max_tokens=3)
    assert not unseeded.to_proto().HasField("seed")
    assert SamplingParams.from_proto(unseeded.to_proto()).seed is None


def test_from_proto_reads_wire_defaults_and_the_max_tokens_override() -> None:
    msg = common_pb2.SamplingParams(max_tokens=10, seed=0)
    sp = SamplingParams.from_proto(msg)
    assert (sp.top_p, sp.seed, sp.greedy) == (1.0, 0, True)  # top_p 0 on the wire means 1
    assert SamplingParams.from_proto(msg, max_tokens=4).max_tokens == 4
    assert SamplingParams.from_proto(msg).stop_token_ids == ()
    # An older sender sets none of the newer fields: each means "off".
    assert (sp.min_p, sp.min_tokens, sp.repetition_penalty) == (0.0, 0, 1.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.uses_penalties) == (0.0, 0.0, False)


@pytest.mark.parametrize(
    ("kw", "field", "message"),
    [
        ({"temperature": -0.5}, "sampling.temperature", "must be a finite number >= 0"),
        ({"temperature": float("inf")}, "sampling.temperature", "got inf"),
        ({"temperature": float("nan")}, "sampling.temperature", "got nan"),
        ({"top_p": 0.0}, "sampling.top_p", r"must lie in \(0, 1\]"),
        ({"top_p": 1.5}, "sampling.top_p", r"got 1\.5"),
        ({"top_k": -1}, "sampling.top_k", r"must be >= 0 \(0 = off\), got -1"),
        ({"seed": 2**63}, "sampling.seed", r"must lie in \[0, 2\*\*63\)"),
        ({"seed": -3}, "sampling.seed", "got -3"),
        ({"max_tokens": 0}, "sampling.max_tokens", "must be > 0, got 0"),
        ({"stop_token_ids": (4, -1)}, "sampling.stop_token_ids[1]", "token id -1 is negative"),
        ({"min_p": 1.5}, "sampling.min_p", r"must lie in \[0, 1\]"),
        ({"min_p": -0.1}, "sampling.min_p", r"got -0\.1"),
        ({"min_tokens": -1}, "sampling.min_tokens", r"must lie in \[0, max_tokens\]"),
        ({"min_tokens": 17}, "sampling.min_tokens", r"\[0, 16\], got 17"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty", "must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, "sampling.repetition_penalty", "got inf"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty", r"must lie in \[-2, 2\]"),
        ({"frequency_penalty": -2.1}, "sampling.frequency_penalty", r"got -2\.1"),
        ({"frequency_penalty": float("nan")}, "sampling.frequency_penalty", "got nan"),
    ],
)
def test_each_check_names_its_proto_field(kw: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as info:
        SamplingParams(**kw)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do


def test_replace_checks_again() -> None:
    with pytest.raises(InvalidArgument, match="sampling.max_tokens"):
        dataclasses.replace(SamplingParams(), max_tokens=0)


# -- the entrypoint refuses a bad field through the one class ------------------------------------


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    trailing: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return []

    def set_trailing_metadata(self, md: tuple[tuple[str, str], ...]) -> None:
        self.trailing = md

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


class _NoBus:
    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        raise AssertionError("a refused request must not be routed")

    async def publish(self, subject: str, data: bytes) -> None:
        raise AssertionError("a refused request must not be published")

    async def subscribe(self, subject: str) -> Any:
        raise AssertionError("a refused request must not subscribe")


class _NoLookup:
    async def lookup(self, hashes: list[bytes]) -> int:
        raise AssertionError("a refused request must not be looked up")


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (common_pb2.SamplingParams(max_tokens=4, top_p=2.0), "sampling.top_p"),
        (common_pb2.SamplingParams(max_tokens=4, top_k=-2), "sampling.top_k"),
        (
            common_pb2.SamplingParams(max_tokens=4, stop_token_ids=[-7]),
            "sampling.stop_token_ids[0]",
        ),
        (common_pb2.SamplingParams(max_tokens=4, min_tokens=5), "sampling.min_tokens"),
        (common_pb2.SamplingParams(max_tokens=4, min_p=2.0), "sampling.min_p"),
        (
            common_pb2.SamplingParams(max_tokens=4, repetition_penalty=-1.0),
            "sampling.repetition_penalty",
        ),
        (
            common_pb2.SamplingParams(max_tokens=4, presence_penalty=3.0),
            "sampling.presence_penalty",
        ),
        (
            common_pb2.SamplingParams(max_tokens=4, frequency_penalty=-3.0),
            "sampling.frequency_penalty",
        ),
    ],
)
async def test_entrypoint_refuses_a_bad_sampling_field(
    sampling: common_pb2.SamplingParams, field: str
) -> None:
    limits = Limits(model_name="tiny", vocab_size=100, max_context=64, block_size=4)
    handlers = EntrypointHandlers(HandlerConfig(limits=limits), _NoBus(), _NoLookup())
    request = generate_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=sampling)
    with pytest.raises(_Aborted) as info:
        async for _ in handlers.Generate(request, _Context()):
            pass
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith(f"{field}: ")
    with pytest.raises(InvalidArgument) as direct:
        SamplingParams.from_proto(sampling)
    assert str(direct.value) == info.value.details  # the same check, the same words


# -- kinds and their gRPC codes ------------------------------------------------------------------

KINDS: list[tuple[DeepserveError, grpc.StatusCode, bool]] = [
    (Unavailable("down"), grpc.StatusCode.UNAVAILABLE, True),
    (Overloaded("full", 250), grpc.StatusCode.RESOURCE_EXHAUSTED, True),
    (InstanceFailed("died"), grpc.StatusCode.UNAVAILABLE, True),
    (DeadlineExceeded("slow"), grpc.StatusCode.DEADLINE_EXCEEDED, True),
    (InvalidArgument("bad", field="x"), grpc.StatusCode.INVALID_ARGUMENT, False),
    (NotFound("gone"), grpc.StatusCode.NOT_FOUND, False),
    (AlreadyExists("twice"), grpc.StatusCode.ALREADY_EXISTS, False),
    (Unauthenticated("who"), grpc.StatusCode.UNAUTHENTICATED, False),
    (Internal("bug"), grpc.StatusCode.INTERNAL, False),
]


@pytest.mark.parametrize(("exc", "code", "retryable"), KINDS)
def test_every_kind_has_a_grpc_code_and_a_side(
    exc: DeepserveError, code: grpc.StatusCode, retryable: bool
) -> None:
    assert grpc_errors.status_code(exc) == code
    assert exc.retryable is retryable
    assert isinstance(exc, RetryableError if retryable else FatalError)


def test_a_subclass_maps_like_its_kind() -> None:
    class Special(NotFound):
        pass

    assert grpc_errors.status_code(Special("x")) == grpc.StatusCode.NOT_FOUND


async def test_abort_sends_the_code_message_and_retry_hint() -> None:
    ctx = _Context()
    with pytest.raises(_Aborted) as info:
        await grpc_errors.abort(ctx, Overloaded("at capacity", 250))
    assert (info.value.code, info.value.details) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "at capacity",
    )
    assert ctx.trailing == (("retry-after-ms", "250"),)
    ctx = _Context()
    with pytest.raises(_Aborted):
        await grpc_errors.abort(ctx, InvalidArgument("must be > 0", field="sampling.max_tokens"))
    assert ctx.trailing == ()


@pytest.mark.parametrize(("exc", "code", "retryable"), KINDS)
def test_from_status_reads_back_the_kind(
    exc: DeepserveError, code: grpc.StatusCode, retryable: bool
) -> None:
    back = grpc_errors.from_status(code, str(exc), grpc_errors.trailing_metadata(exc) or None)
    assert grpc_errors.status_code(back) == code and back.retryable is retryable
    if isinstance(exc, Overloaded):
        assert isinstance(back, Overloaded) and back.retry_after_ms == 250


def test_from_status_of_a_code_without_a_kind_is_internal_and_names_it() -> None:
    back = grpc_errors.from_status(grpc.StatusCode.DATA_LOSS, "oops")
    assert isinstance(back, Internal) and str(back) == "DATA_LOSS: oops"


# -- the other edges -----------------------------------------------------------------------------


@pytest.mark.parametrize(("exc", "code", "retryable"), KINDS)
def test_error_event_takes_retryable_from_the_kind(
    exc: DeepserveError, code: grpc.StatusCode, retryable: bool
) -> None:
    ev = error_event("r1", exc, index=2)
    assert (ev.request_id, ev.index, ev.finished) == ("r1", 2, True)
    assert ev.error == str(exc) and ev.retryable is retryable


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidArgument("bad"), 400),
        (Unauthenticated("who"), 401),
        (NotFound("gone"), 404),
        (Overloaded("full", 0), 429),  # no hint of its own: the recipe's default
        (Internal("bug"), 502),
        (AlreadyExists("twice"), 502),
        (Unavailable("down"), 503),
        (InstanceFailed("died"), 503),
        (DeadlineExceeded("slow"), 504),
    ],
)
def test_recipe_maps_each_kind_to_one_http_status(exc: DeepserveError, status: int) -> None:
    err = api_error(exc, retry_after=3)
    assert err.status == status
    assert (err.retry_after == 3) == (status in (429, 503))
