"""prefill and decode as real processes over a real nats-server and gRPC; this test plays the
entrypoint (publishes PrefillTasks, collects TokenEvents) and checks what a client would see:
the same tokens as one engine in this process, heartbeats with real numbers, and a graceful
SIGTERM that finishes the request in flight.

The processes start once for the module (two CPU cores: loading the model is most of the time).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import nats
import pytest

from deepserve import procs
from libs.common import subjects
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.llm import LLM
from libs.proto.deepserve.v1 import control_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc

from ..event_positions import first_positions

REPO = Path(__file__).resolve().parents[2]
PREFILL_ID, DECODE_ID = "prefill-it", "decode-it"
MODEL_NAME = "deepseek-tiny"
NUM_KV_BLOCKS = 64
READY_TIMEOUT = 180.0
PROMPT = [(i * 7919) % 120000 + 3 for i in range(150)]  # one full 128-token block and a tail
NATS_USER, NATS_PASSWORD = "ds", "p@ss:w0rd-hunter2"


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    http_port: int

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return f"--- {self.name} ({self.log})\n" + "\n".join(lines[-n:])


@dataclass
class Stack:
    nats_url: str
    decode_address: str
    prefill: Proc
    decode: Proc

    def logs(self) -> str:
        return self.prefill.tail() + "\n" + self.decode.tail()


def spawn(name: str, service: str, run_dir: Path, nats_url: str, extra: list[str]) -> Proc:
    http_port = procs.free_port()
    log = run_dir / f"{name}.log"
    argv = [
        sys.executable,
        "-m",
        f"services.{service}",
        "--nats-url",
        nats_url,
        "--http-port",
        str(http_port),
        "--instance-id",
        name,
        "--drain-seconds",
        "20",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--model-name",
        MODEL_NAME,
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        "--block-size",
        "128",
        "--weights-seed",
        "0",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Proc(name, popen, log, http_port)


def healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def wait_healthy(p: Proc, deadline: float) -> None:
    while time.monotonic() < deadline:
        if p.popen.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {p.popen.returncode}\n{p.tail()}")
        if healthz(p.http_port) == 200:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{p.name} not healthy after {READY_TIMEOUT:.0f}s\n{p.tail()}")


@contextlib.contextmanager
def running_pair(
    run_dir: Path, extra: Sequence[str] = (), user: str = "", password: str = ""
) -> Iterator[Stack]:
    """nats-server (a login when ``user`` is set), then decode and prefill with ``extra`` flags
    each, until they answer /healthz; stopped when the block ends."""
    nats_port = procs.free_port()
    nats_proc = procs.start_nats(
        nats_port, run_dir / "nats", run_dir / "nats.log", user=user, password=password
    )
    login = f"{user}:{password}@" if user else ""
    nats_url = f"nats://{login}127.0.0.1:{nats_port}"
    grpc_port = procs.free_port()
    started: list[Proc] = []
    try:
        decode = spawn(
            DECODE_ID, "decode", run_dir, nats_url, ["--grpc-port", str(grpc_port), *extra]
        )
        started.append(decode)
        prefill = spawn(PREFILL_ID, "prefill", run_dir, nats_url, ["--kvstore-address", "", *extra])
        started.append(prefill)
        deadline = time.monotonic() + READY_TIMEOUT
        wait_healthy(decode, deadline)
        wait_healthy(prefill, deadline)
        yield Stack(nats_url, f"127.0.0.1:{grpc_port}", prefill, decode)
    finally:
        for p in started:
            procs.stop(p.popen, timeout=30)
        procs.stop(nats_proc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A NATS that wants a password: every service logs in, and none may show it (issue 13).
    run_dir = tmp_path_factory.mktemp("prefill_decode")
    with running_pair(run_dir, user=NATS_USER, password=NATS_PASSWORD) as s:
        yield s


@pytest.fixture(scope="module")
def llm(tiny_loaded) -> LLM:
    engine = Engine(
        EngineConfig(model="tiny", block_size=128, num_kv_blocks=NUM_KV_BLOCKS), loaded=tiny_loaded
    )
    return LLM("tiny", engine=engine)


def prefill_task(
    stack: Stack, rid: str, prompt: list[int], sp: SamplingParams
) -> control_pb2.PrefillTask:
    return control_pb2.PrefillTask(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=sp.to_proto(),
        decode_instance=DECODE_ID,
        decode_address=stack.decode_address,
        events_subject=subjects.token_events(rid),
    )


async def generate(
    nc: nats.NATS,
    stack: Stack,
    rid: str,
    prompt: list[int],
    sp: SamplingParams,
    on_event: object = None,
    timeout: float = 120.0,
) -> list[control_pb2.TokenEvent]:
    """Act as the entrypoint: subscribe to the events, publish the task, collect until finished."""
    events: list[control_pb2.TokenEvent] = []
    done = asyncio.Event()

    async def on_msg(msg: object) -> None:
        ev = control_pb2.TokenEvent.FromString(msg.data)  # type: ignore[attr-defined]
        events.append(ev)
        if on_event is not None:
            await on_event(ev)  # type: ignore[operator]
        if ev.finished or ev.error:
            done.set()

    sub = await nc.subscribe(subjects.token_events(rid), cb=on_msg)
    await nc.flush()
    await nc.publish(
        subjects.prefill_task(PREFILL_ID), prefill_task(stack, rid, prompt, sp).SerializeToString()
    )
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        pytest.fail(
            f"request {rid} did not finish in {timeout:.0f}s; got {len(events)} events\n"
            f"{stack.logs()}"
        )
    finally:
        await sub.unsubscribe()
    return sorted(events, key=lambda e: e.index)


def check_matches(
    events: list[control_pb2.TokenEvent],
    llm: LLM,
    prompt: list[int],
    sp: SamplingParams,
    stack: Stack,
) -> None:
    assert not any(e.error for e in events), f"{[e.error for e in events]}\n{stack.logs()}"
    want = llm.generate([prompt], sp, decode_text=False)[0]
    assert [e.index for e in events] == first_positions(events)
    assert [t for e in events for t in e.token_ids] == list(want.token_ids)
    assert events[-1].finished and events[-1].finish_reason == want.finish_reason
    assert sum(e.finished for e in events) == 1
    assert events[0].prompt_tokens == len(prompt)


async def test_greedy_through_prefill_and_decode(stack: Stack, llm: LLM) -> None:
    nc = await nats.connect(stack.nats_url)
    try:
        sp = SamplingParams(max_tokens=8)
        check_matches(await generate(nc, stack, "greedy-1", PROMPT, sp), llm, PROMPT, sp, stack)
    finally:
        await nc.close()


async def test_seeded_sampling_survives_the_handoff(stack: Stack, llm: LLM) -> None:
    nc = await nats.connect(stack.nats_url)
    try:
        sp = SamplingParams(
            temperature=0.8, top_p=0.95, top_k=50, seed=1234, max_tokens=8, ignore_eos=True
        )
        prompt = PROMPT[:40]
        runs = await asyncio.gather(
            generate(nc, stack, "seeded-1", prompt, sp), generate(nc, stack, "seeded-2", prompt, sp)
        )
        for events in runs:
            check_matches(events, llm, prompt, sp, stack)
    finally:
        await nc.close()


async def test_heartbeats_report_real_load(stack: Stack) -> None:
    nc = await nats.connect(stack.nats_url)
    seen: dict[str, control_pb2.InstanceStatus] = {}
    got_both = asyncio.Event()

    async def on_hb(msg: object) -> None:
        st = control_pb2.InstanceStatus.FromString(msg.data)  # type: ignore[attr-defined]
        seen[st.instance_id] = st
        if {PREFILL_ID, DECODE_ID} <= seen.keys():
            got_both.set()

    try:
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_hb)
        await asyncio.wait_for(got_both.wait(), 5.0)  # every second, so both within ~1 s
    finally:
        await nc.close()
    p, d = seen[PREFILL_ID], seen[DECODE_ID]
    assert p.role == control_pb2.ROLE_PREFILL and d.role == control_pb2.ROLE_DECODE
    assert p.model == d.model == MODEL_NAME
    assert d.address == stack.decode_address
    for st in (p, d):
        assert st.total_kv_blocks == NUM_KV_BLOCKS and st.free_kv_blocks == NUM_KV_BLOCKS  # idle
        assert st.running == st.waiting == 0 and st.block_size == 128 and not st.draining
        assert abs(st.sent_unix_ms / 1000 - time.time()) < 10


def healthz_body(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return str(resp.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


def test_no_log_line_or_healthz_shows_the_nats_password(stack: Stack, tmp_path: Path) -> None:
    """Issue 13: the NATS password was in the logs and /healthz. prefill and decode logged
    in with it; a balancer given a wrong one reports the URL in its log and /healthz."""
    for p in (stack.prefill, stack.decode):
        assert NATS_PASSWORD not in p.log.read_text(errors="replace") + healthz_body(p.http_port)
    nats_port = stack.nats_url.rsplit(":", 1)[1]
    wrong = f"nats://{NATS_USER}:wrong-{NATS_PASSWORD}@127.0.0.1:{nats_port}"
    shown = f"nats://***@127.0.0.1:{nats_port}"  # an '@' in the password hides the user too
    port, log = procs.free_port(), tmp_path / "balancer.log"
    argv = [sys.executable, "-m", "services.balancer", "--nats-url", wrong]
    with open(log, "wb") as out:
        bal = subprocess.Popen(
            [*argv, "--http-port", str(port)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline, body = time.monotonic() + 30, ""
        while shown not in body and time.monotonic() < deadline:
            assert bal.poll() is None, log.read_text()
            time.sleep(0.2)
            body = healthz_body(port) if healthz(port) else ""
        assert shown in body and "unavailable" in body, f"{body}\n{log.read_text()}"
        time.sleep(1.5)  # a few refused logins logged
    finally:
        procs.stop(bal)
    text = log.read_text(errors="replace")
    assert shown in text and "uthorization" in text, text  # 'Authorization Violation'
    assert NATS_PASSWORD not in text + body


def push_garbage(
    stack: Stack, task: control_pb2.DecodeTask, chunks: int, chunk_bytes: int = 1 << 20
) -> tuple[kv_transfer_pb2.KVPushReply, int]:
    """Push ``task`` then ``chunks`` chunks of garbage; the reply and how many messages the
    gRPC client pulled from the stream (a bound on what decode read)."""
    pulled = 0
    garbage = os.urandom(chunk_bytes)

    def stream() -> Iterator[kv_transfer_pb2.KVPush]:
        nonlocal pulled
        pulled += 1
        yield kv_transfer_pb2.KVPush(task=task)
        for _ in range(chunks):
            pulled += 1
            yield kv_transfer_pb2.KVPush(chunk=garbage)

    with grpc.insecure_channel(stack.decode_address) as channel:
        stub = kv_transfer_pb2_grpc.KVTransferStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.Push(stream(), timeout=60)
    return reply, pulled


def test_decode_refuses_an_oversized_push_without_reading_it(stack: Stack) -> None:
    """Issue 13: decode buffered a 200 MiB garbage push before refusing it. A 10-token prompt
    has one block of KV; the refusal must come after about that much, not after 200 MiB."""
    sp = SamplingParams(max_tokens=8)
    task = control_pb2.DecodeTask(
        request_id="garbage-1",
        token_ids=PROMPT[:11],
        num_prompt_tokens=10,
        sampling=sp.to_proto(),
        events_subject=subjects.token_events("garbage-1"),
    )
    t0 = time.monotonic()
    reply, pulled = push_garbage(stack, task, chunks=200)
    assert not reply.accepted and "KV frame for request 'garbage-1' passed" in reply.error
    # the tiny model's one block plus the header allowance are a few MiB at most; the client
    # pulls a few messages ahead of what the server read (flow control windows)
    assert pulled < 40, (pulled, reply.error)
    assert time.monotonic() - t0 < 20

    for bad, why in [
        (
            control_pb2.DecodeTask(request_id="g-2", token_ids=[1, 2], num_prompt_tokens=0),
            "num_prompt_tokens must lie in [1, ",
        ),
        (
            control_pb2.DecodeTask(request_id="g-3", token_ids=[1, 2], num_prompt_tokens=2),
            "token_ids must hold the 2 prompt tokens and the first generated token, got 2",
        ),
    ]:
        reply, pulled = push_garbage(stack, bad, chunks=200)
        assert not reply.accepted and why in reply.error, reply.error
        assert pulled < 40, pulled


async def test_sigterm_drains_the_request_in_flight(stack: Stack, llm: LLM) -> None:
    """Last in the module: SIGTERM decode mid-request; it says draining, finishes, exits 0."""
    nc = await nats.connect(stack.nats_url)
    draining: set[str] = set()

    async def on_hb(msg: object) -> None:
        st = control_pb2.InstanceStatus.FromString(msg.data)  # type: ignore[attr-defined]
        if st.draining:
            draining.add(st.instance_id)

    signalled = False

    async def on_event(ev: control_pb2.TokenEvent) -> None:
        nonlocal signalled
        if ev.index >= 2 and not signalled:  # decode is generating: stop it now
            signalled = True
            stack.decode.popen.send_signal(signal.SIGTERM)

    try:
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_hb)
        sp = SamplingParams(max_tokens=48, ignore_eos=True)
        events = await generate(nc, stack, "drained", PROMPT, sp, on_event=on_event)
        assert signalled
        check_matches(events, llm, PROMPT, sp, stack)
        rc = await asyncio.to_thread(stack.decode.popen.wait, 30)
        assert rc == 0, stack.decode.tail()
        assert DECODE_ID in draining
        stack.prefill.popen.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(stack.prefill.popen.wait, 30) == 0, stack.prefill.tail()
    finally:
        await nc.close()
    assert PREFILL_ID in draining
