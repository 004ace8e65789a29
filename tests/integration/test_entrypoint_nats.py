"""The entrypoint and balancer processes over real NATS and gRPC, with scripted instances.

The prefill/decode twins here heartbeat like real instances and answer a PrefillTask with
token events (prefill: index 0; decode: the rest, deliberately out of order), so the test
checks the entrypoint's wiring -- route, task dispatch, relay, aborts, health, drain --
without a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import nats
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepserve import procs
from libs.common import subjects
from libs.proto.deepserve.v1 import common_pb2, control_pb2, generate_pb2, generate_pb2_grpc

from .svc import service

MODEL = "deepseek-tiny"
HANG = 999  # a prompt starting with this token never finishes (decode goes quiet)


@contextlib.contextmanager
def run_entrypoint(
    nats_url: str, tmp_path: Path, *extra: str
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    grpc_port = procs.free_port()
    with (
        service("balancer", ["--nats-url", nats_url, "--warmup-seconds", "0"], tmp_path),
        service(
            "entrypoint",
            [
                "--nats-url",
                nats_url,
                "--grpc-port",
                str(grpc_port),
                "--model-name",
                MODEL,
                "--drain-seconds",
                "2",
                *extra,
            ],
            tmp_path,
        ) as proc,
    ):
        yield proc, f"127.0.0.1:{grpc_port}"


@pytest.fixture
def entrypoint(nats_url: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    with run_entrypoint(nats_url, tmp_path) as ep:
        yield ep


class Instances:
    """Scripted prefill p1 and decode d1; records the tasks and aborts they see. With
    ``decode_blocks`` d1 reports a KV cache of that many 128-token blocks, all free."""

    def __init__(self, nc: nats.aio.client.Client, decode_blocks: int = 0) -> None:
        self.nc = nc
        self.decode_blocks = decode_blocks
        self.tasks: list[control_pb2.PrefillTask] = []
        self.aborts: list[control_pb2.Abort] = []

    async def on_task(self, msg: nats.aio.msg.Msg) -> None:
        task = control_pb2.PrefillTask.FromString(msg.data)
        self.tasks.append(task)
        n, last = task.sampling.max_tokens, task.prompt_token_ids[-1]
        out = [(last + 1 + i) % 1000 for i in range(n)]

        def ev(i: int) -> bytes:
            return control_pb2.TokenEvent(
                request_id=task.request_id,
                index=i,
                token_ids=[out[i]],
                finished=i == n - 1,
                finish_reason="length" if i == n - 1 else "",
                prompt_tokens=len(task.prompt_token_ids),
            ).SerializeToString()

        subject = task.events_subject
        if task.prompt_token_ids[0] == HANG:
            await self.nc.publish(subject, ev(0))
            return
        order = [0] + ([2, 1] if n >= 3 else []) + list(range(3 if n >= 3 else 1, n))
        for i in order:
            await self.nc.publish(subject, ev(i))

    async def on_abort(self, msg: nats.aio.msg.Msg) -> None:
        self.aborts.append(control_pb2.Abort.FromString(msg.data))

    async def heartbeat_until(self, stop: asyncio.Event) -> None:
        # Ends on ``stop``, not only on cancel: Python 3.11's wait_for (inside nats-py) can
        # swallow a cancellation, and then the fixture would wait on this task forever.
        while not stop.is_set():
            for name, role, r in (
                ("p1", control_pb2.ROLE_PREFILL, "prefill"),
                ("d1", control_pb2.ROLE_DECODE, "decode"),
            ):
                blocks = self.decode_blocks if r == "decode" else 0
                status = control_pb2.InstanceStatus(
                    instance_id=name,
                    role=role,
                    model=MODEL,
                    address="127.0.0.1:1",
                    free_kv_blocks=blocks,
                    total_kv_blocks=blocks,
                )
                await self.nc.publish(subjects.heartbeat(r, name), status.SerializeToString())
            await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def scripted(nats_url: str, decode_blocks: int = 0) -> AsyncIterator[Instances]:
    nc = await nats.connect(nats_url)
    inst = Instances(nc, decode_blocks)
    await nc.subscribe(subjects.prefill_task("p1"), cb=inst.on_task)
    await nc.subscribe(subjects.ABORT, cb=inst.on_abort)
    stop = asyncio.Event()
    beat = asyncio.create_task(inst.heartbeat_until(stop))
    try:
        await asyncio.sleep(0.3)  # the balancer hears both before the first request
        yield inst
    finally:
        stop.set()
        beat.cancel()
        await asyncio.wait({beat}, timeout=5)
        await nc.close()


@pytest.fixture
async def instances(nats_url: str) -> AsyncIterator[Instances]:
    async with scripted(nats_url) as inst:
        yield inst


def request(prompt: list[int], max_tokens: int, rid: str = "") -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        model=MODEL,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


async def test_generate_over_nats_and_grpc(
    entrypoint: tuple[subprocess.Popen[bytes], str], instances: Instances
) -> None:
    proc, address = entrypoint
    async with grpc.aio.insecure_channel(address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        stub = generate_pb2_grpc.GenerateStub(channel)
        events = [ev async for ev in stub.Generate(request([5, 6, 7], 5, "rid-1"), timeout=10)]
        kinds = [e.WhichOneof("event") for e in events]  # events already there go as one
        assert kinds[0] == "ready" and kinds[-1] == "finish" and set(kinds[1:-1]) == {"tokens"}
        assert [t for e in events[1:-1] for t in e.tokens.token_ids] == [8, 9, 10, 11, 12]
        assert events[-1].finish.reason == "length"
        assert events[-1].finish.usage.completion_tokens == 5
        (task,) = instances.tasks
        assert task.request_id.startswith("rid-1-")  # this attempt's upstream id
        assert (task.decode_instance, task.decode_address) == ("d1", "127.0.0.1:1")

        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(request([5, 6, 7], 0), timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.max_tokens" in (info.value.details() or "")

        call = stub.Generate(request([HANG, 1], 5, "rid-hang"), timeout=10)
        got = [await call.read(), await call.read()]
        assert [e.WhichOneof("event") for e in got] == ["ready", "tokens"]
        call.cancel()  # the client goes away mid-stream
        for _ in range(50):
            if instances.aborts:
                break
            await asyncio.sleep(0.05)
        assert [a.request_id for a in instances.aborts] == [
            t.request_id for t in instances.tasks if t.request_id.startswith("rid-hang-")
        ]

    proc.terminate()  # SIGTERM: drains and exits cleanly
    assert await asyncio.to_thread(proc.wait, 10) == 0


async def test_a_burst_beyond_decode_kv_gets_resource_exhausted_quickly(
    nats_url: str, tmp_path: Path
) -> None:
    """d1 reports 8 KV blocks; each request needs 4 (2 prompt + 500 max tokens). Two run (and
    hang: decode goes quiet), one more may wait --admit-wait, the rest are refused at once:
    all with RESOURCE_EXHAUSTED and a retry hint within a second, not a 60 s timeout."""
    extra = ("--admit-wait", "0.3", "--max-waiting", "1")
    with run_entrypoint(nats_url, tmp_path, *extra) as (_, address):
        async with (
            scripted(nats_url, decode_blocks=8) as instances,
            grpc.aio.insecure_channel(address) as channel,
        ):
            stub = generate_pb2_grpc.GenerateStub(channel)
            running = [stub.Generate(request([HANG, i], 500), timeout=30) for i in range(2)]
            for call in running:  # admitted: Ready, then the prefill's token
                assert (await call.read()).WhichOneof("event") == "ready"
            started = time.monotonic()

            async def refused(i: int) -> tuple[grpc.StatusCode, str, dict[str, str]]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(request([HANG, 10 + i], 500), timeout=30):
                        pass
                trailing = {k: str(v) for k, v in err.value.trailing_metadata() or ()}
                return err.value.code(), err.value.details() or "", trailing

            results = await asyncio.gather(*(refused(i) for i in range(3)))
            assert time.monotonic() - started < 2.0
            for code, details, trailing in results:
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
                assert "no decode instance has 4 free KV blocks" in details
                assert int(trailing["retry-after-ms"]) > 0
            assert len(instances.tasks) == 2  # the refused never reached an instance
            for call in running:
                call.cancel()
