"""A NATS outage is not an instance's death: streams in flight over gRPC finish, exactly.

The real stack (nats-server with JetStream, redis-server, every service its own process,
fake engine: deterministic and quick to start on two cores): greedy Generate streams run, the
NATS server is killed (SIGKILL: whatever it held in flight is gone) for 3 s and started again
on the same port with the same JetStream directory. Every stream must end with the same
tokens as an undisturbed run of the same request, with no error, no retry on other
instances, and no instance declared dead -- although 3 s of silence is longer than the
entrypoint's ``--instance-dead-after`` here.

Token events are core NATS (no persistence): those published while the entrypoint is not
subscribed on the restarted server are gone, and the entrypoint asks the decode instance to
publish them again from the first missing index (``ResendRequest``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deepserve import procs
from deepserve.up import Stack
from libs.proto.deepserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from libs.serving.fake_engine import fake_completion

from .conftest import dump_logs

pytestmark = pytest.mark.timeout(120)

MODEL = "deepseek-fake"
DEAD_AFTER = 2.0  # the entrypoint's --instance-dead-after: shorter than the outage
OUTAGE_S = 3.0
STREAMS = 3
MAX_TOKENS = 400  # ~6 s at 15 ms a step: the outage falls in the middle


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        tmp_path_factory.mktemp("nats-outage"),
        prefill=1,
        decode=1,
        model="fake",
        model_name=MODEL,
        ready_timeout=120,
        drain_seconds=3.0,
        extra_args={
            "decode": ["--fake-step-ms", "15"],
            "entrypoint": ["--instance-dead-after", str(DEAD_AFTER)],
        },
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def request(prompt: list[int]) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        model=MODEL,
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
    )


async def stream(
    stub: generate_pb2_grpc.GenerateStub,
    prompt: list[int],
    md: tuple[tuple[str, str], ...],
    received: list[int] | None = None,
) -> tuple[list[int], generate_pb2.Finish | None]:
    """(tokens, finish) of one call, tokens also appended to ``received`` as they come;
    raises AioRpcError if the call ends in an error."""
    got = [] if received is None else received
    finish = None
    async for ev in stub.Generate(request(prompt), timeout=60, metadata=md):
        kind = ev.WhichOneof("event")
        if kind == "tokens":
            got.extend(ev.tokens.token_ids)
        elif kind == "finish":
            finish = ev.finish
    return got, finish


def restart_nats(stack: Stack, outage_s: float) -> float:
    """SIGKILL nats-server, wait ``outage_s``, start it on the same port and data dir."""
    assert stack.nats_proc is not None
    port = int(stack.nats_url.rsplit(":", 1)[1])
    os.kill(stack.nats_proc.pid, signal.SIGKILL)
    stack.nats_proc.wait(10)
    killed = time.monotonic()
    time.sleep(outage_s)
    logs = stack.run_dir / "logs"
    stack.nats_proc = procs.start_nats(port, stack.run_dir / "nats", logs / "nats.log")
    return time.monotonic() - killed


def log_of(stack: Stack, service: str) -> str:
    (child,) = [c for c in stack.children if c.service == service]
    return Path(child.log_path).read_text(errors="replace")


async def test_streams_in_flight_finish_exactly_through_a_nats_restart(stack: Stack) -> None:
    prompts = [[(i * 7919 + k * 104729) % 120000 + 100 for i in range(200)] for k in range(STREAMS)]
    want = [fake_completion(p, MAX_TOKENS) for p in prompts]
    md = stack.call_metadata
    async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerateStub(ch)
        # An undisturbed run of the first request: the stack answers what the fake model says.
        undisturbed, _ = await stream(stub, prompts[0], md)
        assert undisturbed == want[0]

        received: list[list[int]] = [[] for _ in prompts]
        started = time.monotonic()
        calls = [asyncio.create_task(stream(stub, p, md, r)) for p, r in zip(prompts, received)]
        while min(len(r) for r in received) < 40:  # every stream is decoding
            assert not any(c.done() for c in calls), "a stream ended before the outage"
            await asyncio.sleep(0.01)
        before = [len(r) for r in received]
        outage = await asyncio.to_thread(restart_nats, stack, OUTAGE_S)
        during = [len(r) for r in received]
        results = await asyncio.gather(*calls, return_exceptions=True)
        took = time.monotonic() - started

    print(
        f"tokens at the kill {before}, at the restart {during}; outage {outage:.1f}s; "
        f"streams took {took:.1f}s"
    )
    for k, res in enumerate(results):
        assert not isinstance(res, BaseException), (k, res, dump_logs(stack))
        got, finish = res
        assert got == want[k], (k, len(got), dump_logs(stack))
        assert finish is not None and finish.reason == "length", finish
        assert finish.usage.completion_tokens == MAX_TOKENS
    assert not stack.exited(), dump_logs(stack)
    entrypoint = log_of(stack, "entrypoint")
    assert "stopped heartbeating" not in entrypoint, "an instance was declared dead"
    assert not re.search(r"attempt \d+ failed", entrypoint), "a stream was retried elsewhere"
    # the stack is whole again: a new request is served
    async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
        again, _ = await stream(generate_pb2_grpc.GenerateStub(ch), prompts[1], md)
    assert again == want[1]
