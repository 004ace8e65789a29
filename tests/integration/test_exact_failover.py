"""Exact failover on the real stack (every service its own process, the tiny model, 1 prefill
+ 2 decode): the decode instance serving a request is killed with SIGKILL mid-stream, the
entrypoint resumes the request elsewhere with the tokens the client already has as prior
output, and the client's whole output equals an uninterrupted run's -- for a JSON-schema
constrained request (the grammar goes on mid-JSON) and a seeded, penalized one with a min_tokens
larger than what remains after the kill (the penalties remember the earlier completion, the
seed's draws go on, min_tokens counts the prior output). The killed decode is started again
after each case (Stack.supervise), so every case has a survivor to fail over to.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import grpc
import nats
import pytest

from deepserve.up import RestartPolicy, Stack
from libs.common import subjects
from libs.engine.tokenizer import load_tokenizer
from libs.proto.deepserve.v1 import common_pb2, control_pb2, generate_pb2, generate_pb2_grpc

from .conftest import dump_logs

pytestmark = pytest.mark.timeout(900)

MODEL = "deepseek-tiny"
KILL_AFTER_TOKENS = 20
SCHEMA = {
    "type": "object",
    "properties": {
        "xs": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9999},
            "minItems": 40,
            "maxItems": 40,
        },
        "tag": {"type": "string", "pattern": "^[a-z]{4}$"},
    },
    "required": ["xs", "tag"],
    "additionalProperties": False,
}
PROMPT = [(i * 7919) % 120000 + 100 for i in range(200)]
CASES = {
    # greedy: about 170 tokens, the failure falls inside the array
    "constrained": common_pb2.SamplingParams(
        max_tokens=400,
        constraint=common_pb2.OutputConstraint(kind="json_schema", spec=json.dumps(SCHEMA)),
    ),
    # seeded sampling, penalties that remember the earlier completion, and a min_tokens above
    # what remains after the kill (once refused with INVALID_ARGUMENT mid-stream)
    "penalized_seeded_min_tokens": common_pb2.SamplingParams(
        max_tokens=300,
        min_tokens=290,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        temperature=0.9,
        seed=11,
    ),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        tmp_path_factory.mktemp("exact_failover"),
        prefill=1,
        decode=2,
        model="tiny",
        model_name=MODEL,
        ready_timeout=300,
        drain_seconds=3.0,
        env=dict(os.environ),
        # Only to start a killed decode again between cases: supervise() runs when we call it.
        restart=RestartPolicy(first_delay=0.5, max_delay=1.0),
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


async def generate(
    stack: Stack, sampling: common_pb2.SamplingParams, kill_decode_after: int = 0
) -> tuple[list[int], grpc.StatusCode | None, str, str]:
    """One Generate of PROMPT; with ``kill_decode_after``, the decode instance serving it is
    killed with SIGKILL once that many tokens reached the client. Returns (tokens, error
    code, error details, the killed instance or "")."""
    nc = await nats.connect(stack.nats_url)
    try:
        tasks = await nc.subscribe("ds.prefill.*.task")
        await nc.flush()
        got: list[int] = []
        req = generate_pb2.GenerateRequest(prompt_token_ids=PROMPT, model=MODEL, sampling=sampling)
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            call = generate_pb2_grpc.GenerateStub(ch).Generate(
                req, timeout=300, metadata=stack.call_metadata
            )

            async def consume() -> tuple[grpc.StatusCode | None, str]:
                try:
                    async for ev in call:
                        if ev.WhichOneof("event") == "tokens":
                            got.extend(ev.tokens.token_ids)
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details() or ""
                return None, ""

            consumer = asyncio.create_task(consume())
            victim = ""
            if kill_decode_after:
                msg = await tasks.next_msg(timeout=60)
                victim = control_pb2.PrefillTask.FromString(msg.data).decode_instance
                while len(got) < kill_decode_after and not consumer.done():
                    await asyncio.sleep(0.002)
                assert not consumer.done(), "the request finished before decode was killed"
                kill(stack, victim)
            code, details = await asyncio.wait_for(consumer, 240)
            return got, code, details, victim
    finally:
        await nc.close()


def kill(stack: Stack, instance_id: str) -> None:
    (child,) = [c for c in stack.children if c.instance_id == instance_id]
    assert child.proc is not None
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait(10)


async def revive(stack: Stack, instance_id: str, timeout: float = 300.0) -> None:
    """Start the killed instance again and wait for its heartbeat."""
    (child,) = [c for c in stack.children if c.instance_id == instance_id]
    deadline = time.monotonic() + timeout
    while not (child.running() and child.healthy):
        assert time.monotonic() < deadline, f"{instance_id} did not come back: {dump_logs(stack)}"
        stack.supervise()
        await asyncio.sleep(0.3)
    nc = await nats.connect(stack.nats_url)
    try:
        beats = await nc.subscribe(subjects.HEARTBEAT_ALL)
        while True:
            msg = await beats.next_msg(timeout=max(1.0, deadline - time.monotonic()))
            if control_pb2.InstanceStatus.FromString(msg.data).instance_id == instance_id:
                return
    finally:
        await nc.close()


@pytest.mark.parametrize("name", list(CASES))
async def test_decode_killed_mid_stream_the_client_gets_the_uninterrupted_output(
    stack: Stack, name: str
) -> None:
    sampling = CASES[name]
    want, code, details, _ = await generate(stack, sampling)
    assert code is None, (code, details, dump_logs(stack))
    assert len(want) > 2 * KILL_AFTER_TOKENS
    got, code, details, victim = await generate(stack, sampling, KILL_AFTER_TOKENS)
    try:
        assert code is None, (code, details, dump_logs(stack))
        assert got == want, "the resumed completion differs from the uninterrupted one"
        if name == "constrained":
            doc = json.loads(load_tokenizer(None).decode(got, skip_special_tokens=True))
            assert len(doc["xs"]) == 40 and len(doc["tag"]) == 4
    finally:
        await revive(stack, victim)
