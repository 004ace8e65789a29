"""``--batch-invariant`` on the real stack (tiny model, 1 prefill + 2 decode, every service its
own process): kill -9 the decode instance mid-stream, and the client's completion -- tokens
and every log probability, bit for bit -- is the one an uninterrupted engine gives.

The entrypoint continues by sending prompt + the tokens already sent to prefill again, so
those tokens' KV is recomputed by a prompt pass instead of the decode steps that first made
it; only a batch-invariant engine gives the same numbers both ways."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import grpc
import nats
import pytest

from deepserve.up import Stack
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.proto.deepserve.v1 import common_pb2, control_pb2, generate_pb2, generate_pb2_grpc

from .conftest import dump_logs

pytestmark = pytest.mark.timeout(300)

MODEL = "deepseek-tiny-invariant"
PROMPT = [(i * 104729) % 120000 + 100 for i in range(150)]
MAX_TOKENS = 100
LOGPROBS = 3
INVARIANT = ["--batch-invariant"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        tmp_path_factory.mktemp("invariant"),
        prefill=1,
        decode=2,
        model="tiny",
        model_name=MODEL,
        ready_timeout=180,
        drain_seconds=3.0,
        extra_args={
            "prefill": INVARIANT,
            "decode": INVARIANT,
            "entrypoint": ["--instance-dead-after", "2.0"],
        },
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def uninterrupted(tiny_loaded) -> list[tuple]:
    """The completion one batch-invariant engine gives in this process."""
    engine = Engine(
        EngineConfig(model="tiny", block_size=128, num_kv_blocks=64, batch_invariant=True),
        loaded=tiny_loaded,
    )
    sp = SamplingParams(max_tokens=MAX_TOKENS, logprobs=LOGPROBS)
    engine.add_request("x", PROMPT, sp)
    out = []
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                lp = ev.logprobs
                out.append((ev.token_id, lp.logprob, lp.top_ids, lp.top_logprobs))
    return out


async def test_decode_killed_mid_stream_continues_with_the_same_logprobs(
    stack: Stack, tiny_loaded
) -> None:
    want = uninterrupted(tiny_loaded)
    assert len(want) == MAX_TOKENS
    got: list[tuple] = []
    nc = await nats.connect(stack.nats_url)
    try:
        tasks = await nc.subscribe("ds.prefill.*.task")
        await nc.flush()
        async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
            call = generate_pb2_grpc.GenerateStub(ch).Generate(
                generate_pb2.GenerateRequest(
                    prompt_token_ids=PROMPT,
                    model=MODEL,
                    sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, logprobs=LOGPROBS),
                ),
                timeout=120,
                metadata=stack.call_metadata,
            )

            async def consume() -> grpc.StatusCode | None:
                try:
                    async for ev in call:
                        if ev.WhichOneof("event") == "tokens":
                            for tok, lp in zip(
                                ev.tokens.token_ids, ev.tokens.logprobs, strict=True
                            ):
                                got.append(
                                    (tok, lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs))
                                )
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return None

            consumer = asyncio.create_task(consume())
            task = control_pb2.PrefillTask.FromString((await tasks.next_msg(timeout=30)).data)
            while len(got) < 10 and not consumer.done():
                await asyncio.sleep(0.005)
            assert not consumer.done(), "the request finished before decode was killed"
            (victim,) = [c for c in stack.children if c.instance_id == task.decode_instance]
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed_at, sent = time.monotonic(), len(got)
            code = await asyncio.wait_for(consumer, 90)
    finally:
        await nc.close()
    assert code is None, (code, dump_logs(stack))
    print(f"killed after {sent} tokens; done {time.monotonic() - killed_at:.1f}s later")
    assert sent < MAX_TOKENS
    assert [t for t, *_ in got] == [t for t, *_ in want]
    assert got == want, "a log probability changed across the continuation"
