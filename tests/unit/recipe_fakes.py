"""A deterministic in-process Generate backend for the recipe tests (no servers).

It answers with scripted token ids that spell, in the DeepSeek V4 encoding, what a test wants
the model to have said (thinking, tool calls, JSON, plain text), then EOS.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc

from libs.common.errors import DeepserveError
from libs.common.grpc_auth import ANONYMOUS, OnBehalf
from libs.common.grpc_errors import from_status
from libs.proto.deepserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.recipe.encoding import PromptEncoder

MODEL = "deepseek-tiny"
ANSWER = "Hello, 世界! ünï 🎉 done."
REASONING = "Let me think."
TOOL_CALL = (
    'Calling.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


class FakeCall:
    def __init__(self, events: list[Any], hang_after: int | None = None) -> None:
        self.events, self.hang_after = events, hang_after
        self.cancelled = False
        self.consumed = 0

    async def __aiter__(self) -> AsyncIterator[generate_pb2.GenerateEvent]:
        for i, ev in enumerate(self.events):
            if self.hang_after is not None and i >= self.hang_after:
                await asyncio.Event().wait()  # a generation that never ends by itself
            await asyncio.sleep(0)
            if self.cancelled:
                return
            if isinstance(ev, Exception):
                raise ev
            self.consumed += 1
            yield ev

    def cancel(self) -> None:
        self.cancelled = True


class FakeBackend:
    """Answers ``script`` (default: ANSWER, after REASONING when the prompt opened ``<think>``)
    one token per event, then EOS -- or stops at max_tokens."""

    def __init__(self, encoder: PromptEncoder) -> None:
        self.encoder = encoder
        self.think_id = encoder.full.token_to_id("<think>")
        self.script: str | None = None
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.on_behalf: list[OnBehalf] = []  # what each call told the entrypoint
        self.calls: list[FakeCall] = []
        self.fail_at_start: DeepserveError | None = None
        self.fail_after: int | None = None  # raise UNAVAILABLE after this many token events
        self.hang_after: int | None = None
        self.healthy = True

    def answer_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        text = self.script if self.script is not None else ANSWER
        if request.prompt_token_ids[-1] == self.think_id:
            text = REASONING + "</think>" + text
        return self.encoder.full.encode(text, add_special_tokens=False).ids + [self.encoder.eos]

    def generate(
        self,
        request: generate_pb2.GenerateRequest,
        traceparent: str = "",
        on_behalf: OnBehalf = ANONYMOUS,
    ) -> FakeCall:
        self.requests.append(request)
        self.on_behalf.append(on_behalf)
        events: list[Any] = []
        if self.fail_at_start:
            events.append(self.fail_at_start)
        n_prompt = len(request.prompt_token_ids)
        cached = (n_prompt - 1) // 128 * 128
        events.append(
            generate_pb2.GenerateEvent(
                ready=generate_pb2.Ready(
                    request_id=request.request_id, prompt_tokens=n_prompt, cached_tokens=cached
                )
            )
        )
        out = self.answer_ids(request)[: request.sampling.max_tokens]
        for k, t in enumerate(out):
            if self.fail_after is not None and k == self.fail_after:
                events.append(from_status(grpc.StatusCode.UNAVAILABLE, "decode instance died"))
            events.append(generate_pb2.GenerateEvent(tokens=generate_pb2.Tokens(token_ids=[t])))
        reason = "stop" if out[-1] == self.encoder.eos else "length"
        use = common_pb2.Usage(
            prompt_tokens=n_prompt, cached_tokens=cached, completion_tokens=len(out)
        )
        events.append(
            generate_pb2.GenerateEvent(finish=generate_pb2.Finish(reason=reason, usage=use))
        )
        call = FakeCall(events, self.hang_after)
        self.calls.append(call)
        return call

    async def check(self) -> tuple[bool, str]:
        return self.healthy, "fake entrypoint " + ("serving" if self.healthy else "down")

    async def close(self) -> None:
        pass


@contextlib.contextmanager
def generate_server(servicer: generate_pb2_grpc.GenerateServicer) -> Iterator[str]:
    """``servicer`` as a real gRPC Generate server (threads) on a free port: its address."""
    server = grpc.server(futures.ThreadPoolExecutor(8))
    generate_pb2_grpc.add_GenerateServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
