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

Requests that arrive while NATS is down wait for it (within a bound): the route request and
the PrefillTask are sent once the entrypoint is connected again, and sent again while the
restarted server says nobody listens yet (the balancer or the prefill instance has not
subscribed again); the prefill instance acknowledges a task on receipt and ignores copies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import nats
import pytest

from deepserve import procs
from deepserve.up import Stack
from libs.common.natsutil import connect_nats
from libs.proto.deepserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from libs.serving.fake_engine import fake_completion
from services.entrypoint.delivery import Delivery, deliver
from services.entrypoint.transport import NatsBus

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


def request(prompt: list[int], max_tokens: int = MAX_TOKENS) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        model=MODEL,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def stream(
    stub: generate_pb2_grpc.GenerateStub,
    prompt: list[int],
    md: tuple[tuple[str, str], ...],
    received: list[int] | None = None,
    max_tokens: int = MAX_TOKENS,
) -> tuple[list[int], generate_pb2.Finish | None]:
    """(tokens, finish) of one call, tokens also appended to ``received`` as they come;
    raises AioRpcError if the call ends in an error."""
    got = [] if received is None else received
    finish = None
    async for ev in stub.Generate(request(prompt, max_tokens), timeout=60, metadata=md):
        kind = ev.WhichOneof("event")
        if kind == "tokens":
            got.extend(ev.tokens.token_ids)
        elif kind == "finish":
            finish = ev.finish
    return got, finish


def kill_nats(stack: Stack) -> float:
    """SIGKILL nats-server (whatever it held in flight is gone); returns when it died."""
    assert stack.nats_proc is not None
    os.kill(stack.nats_proc.pid, signal.SIGKILL)
    stack.nats_proc.wait(10)
    return time.monotonic()


def start_nats(stack: Stack) -> None:
    """nats-server again on the same port and data dir."""
    port = int(stack.nats_url.rsplit(":", 1)[1])
    logs = stack.run_dir / "logs"
    stack.nats_proc = procs.start_nats(
        port, stack.run_dir / "nats", logs / "nats.log", config=stack.run_dir / "nats.conf"
    )


def restart_nats(stack: Stack, outage_s: float) -> float:
    """SIGKILL nats-server, wait ``outage_s``, start it on the same port and data dir."""
    killed = kill_nats(stack)
    time.sleep(outage_s)
    start_nats(stack)
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


SENT_TOKENS = 60  # ~1 s of decode each: the requests end soon after NATS is back


async def test_requests_sent_while_nats_is_down_complete_exactly(stack: Stack) -> None:
    """Requests that reach the entrypoint while NATS is down wait for it: each route request
    and PrefillTask goes out once NATS is back, again while the restarted server has nobody
    subscribed yet, and every request ends exactly as an undisturbed one would."""
    prompts = [[(i * 3571 + k * 7907) % 120000 + 100 for i in range(150)] for k in range(STREAMS)]
    want = [fake_completion(p, SENT_TOKENS) for p in prompts]
    md = stack.call_metadata
    async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerateStub(ch)
        killed = await asyncio.to_thread(kill_nats, stack)
        calls = [asyncio.create_task(stream(stub, p, md, max_tokens=SENT_TOKENS)) for p in prompts]
        await asyncio.sleep(OUTAGE_S)
        assert not any(c.done() for c in calls), [c.result() for c in calls if c.done()]
        await asyncio.to_thread(start_nats, stack)
        back = time.monotonic()
        results = await asyncio.gather(*calls, return_exceptions=True)
        took = time.monotonic() - killed
    print(f"outage {back - killed:.1f}s; requests done {took:.1f}s after the kill")
    for k, res in enumerate(results):
        assert not isinstance(res, BaseException), (k, res, dump_logs(stack))
        got, finish = res
        assert got == want[k], (k, len(got), dump_logs(stack))
        assert finish is not None and finish.reason == "length", finish
    assert took < OUTAGE_S + 15, f"requests took {took:.1f}s after the kill"
    assert not stack.exited(), dump_logs(stack)
    entrypoint = log_of(stack, "entrypoint")
    assert "stopped heartbeating" not in entrypoint, "an instance was declared dead"
    assert not re.search(r"attempt \d+ failed", entrypoint), "a request was retried elsewhere"


async def test_a_task_sent_before_its_subscriber_is_back_is_sent_again(tmp_path: Path) -> None:
    """The transport alone, on a nats-server of its own: while NATS is down a task and a
    route request wait for it; on the restarted server the task finds nobody subscribed
    ("no responders") until the prefill side subscribes again 1 s later, and goes out again
    until that subscriber confirms it; the route request is answered once its responder is
    back."""
    port = procs.free_port()
    url = f"nats://127.0.0.1:{port}"
    server = procs.start_nats(port, tmp_path / "nats", tmp_path / "nats.log")
    stop = asyncio.Event()
    nc = await connect_nats(url, "entrypoint", stop, logging.getLogger("test"))
    assert nc is not None
    bus = NatsBus(nc, outage_wait=10.0)
    got: list[bytes] = []

    async def on_task(msg: nats.aio.msg.Msg) -> None:
        got.append(msg.data)
        await msg.respond(b"")

    try:
        assert await bus.send("ds.prefill.p1.task", b"t0", 1.0) is Delivery.NOBODY
        server.kill()
        server.wait(10)
        sending = asyncio.create_task(
            deliver(
                bus, "ds.prefill.p1.task", b"t1", instance="p1", ack_timeout=1.0, gone_after=3.0
            )
        )
        routing = asyncio.create_task(bus.request("ds.balancer.route", b"r", 2.0))
        await asyncio.sleep(1.5)
        assert not sending.done() and not routing.done()  # waiting for NATS, not failing
        server = procs.start_nats(port, tmp_path / "nats", tmp_path / "nats.log")
        back = time.monotonic()
        while not nc.is_connected:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the prefill side is not subscribed yet
        assert not sending.done()
        prefill = await nats.connect(url)
        await prefill.subscribe("ds.prefill.p1.task", cb=on_task)

        async def on_route(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"decision")

        await prefill.subscribe("ds.balancer.route", cb=on_route)
        await prefill.flush()
        outcome, copies = await asyncio.wait_for(sending, 5)
        assert outcome is Delivery.ACKED and copies > 2 and got == [b"t1"]
        assert await asyncio.wait_for(routing, 5) == b"decision"
        assert time.monotonic() - back < 4
        await prefill.close()
    finally:
        stop.set()
        await nc.close()
        procs.stop(server)
