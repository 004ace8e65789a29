"""Expert-parallel engine instances in the real stack (CPU ranks, gloo, the tiny model).

prefill-0 and decode-0 each run as an EP group of 2 rank processes (``--ep 2``), started and
supervised by the instance's own process; each rank is a routing target of its own
(``<instance>-r<k>``). decode-1 (no EP) is the decode instance that keeps serving while
decode-0's group restarts after one of its ranks is killed.

What a user sees: the greedy tokens equal those of one process without EP, requests are
served by every rank, and a rank killed mid-stream costs no stream its exact completion; the
instance comes back with one rank and serves again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from deepserve.up import Child, Stack, healthz

from ..sdk_strict import openai_client
from .conftest import (
    MODEL_NAME,
    READY_TIMEOUT,
    AuthorizedStub,
    dump_logs,
    grpc_generate,
    metrics_text,
    scrape_metric,
)

pytestmark = [pytest.mark.timeout(300)]

PROMPTS = [[(i * 7919 + 31 * k) % 120000 + 100 for i in range(20 + 3 * k)] for k in range(8)]
MAX_TOKENS = 8
STREAM_TOKENS = 64


def _greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The tokens of one process without EP (the reference)."""
    from libs.common.sampling import SamplingParams
    from libs.engine.llm import LLM

    llm = LLM("tiny", num_kv_blocks=256)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), decode_text=False)
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    return {
        "short": _greedy(PROMPTS, MAX_TOKENS),
        "stream": _greedy(PROMPTS[:4], STREAM_TOKENS),
    }


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, references: dict[str, list[list[int]]]
) -> Iterator[Stack]:
    s = Stack(
        tmp_path_factory.mktemp("ep-stack"),
        prefill=1,
        decode=2,
        model="tiny",
        model_name=MODEL_NAME,
        ready_timeout=READY_TIMEOUT,
        drain_seconds=3.0,
        ep={"prefill": 2, "decode-0": 2},
        ep_timeout=5.0,
        extra_args={
            "prefill": ["--num-kv-blocks", "256"],
            "decode": ["--num-kv-blocks", "256"],
            # attempts: the killed group fails its requests at once, the dead rank's only
            # after --instance-dead-after, and a retry may still pick the dead rank once
            "entrypoint": ["--instance-dead-after", "2", "--max-attempts", "5"],
        },
    )
    try:
        t0 = time.monotonic()
        s.start()
        print(f"EP stack up in {time.monotonic() - t0:.1f}s")
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[AuthorizedStub]:
    channel = grpc.insecure_channel(stack.grpc_address)
    try:
        yield AuthorizedStub(channel, stack.call_metadata)
    finally:
        channel.close()


def _child(stack: Stack, name: str) -> Child:
    (c,) = [c for c in stack.children if c.name == name]
    return c


def ranks(stack: Stack, name: str) -> dict[str, int]:
    """The current group of an EP instance, from its supervisor's /healthz: id -> ops port."""
    ok, detail = healthz(_child(stack, name).health_port)
    return {m[0]: int(m[1]) for m in re.findall(r"([\w-]+)@(\d+)", detail)}


def _generate_all(stub: AuthorizedStub, prompts: list[list[int]], n: int) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        gens = list(pool.map(lambda p: grpc_generate(stub, p, n), prompts))
    return [g.token_ids for g in gens]


def test_ep_ranks_serve_chat_and_greedy_tokens_equal_no_ep(
    stack: Stack, stub: AuthorizedStub, references: dict[str, list[list[int]]]
) -> None:
    state = json.loads((Path(stack.run_dir) / "stack.json").read_text())
    assert state["services"]["decode-0"]["ep"] == 2
    decode0 = state["services"]["decode-0"]
    assert decode0["rank_ids"] == [f"{decode0['instance_id']}-r{k}" for k in (0, 1)]
    assert state["services"]["decode-1"]["rank_ids"] == [
        state["services"]["decode-1"]["instance_id"]
    ]
    log = Path(decode0["log"]).read_text()
    assert " decode r0 INFO " in log and " decode r1 INFO " in log  # which rank said it
    client = openai_client(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello from the EP test."}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens >= 1

    got = _generate_all(stub, PROMPTS, MAX_TOKENS)
    assert got == references["short"], dump_logs(stack)

    prefill, decode = ranks(stack, "prefill-0"), ranks(stack, "decode-0")
    assert len(prefill) == 2 and len(decode) == 2, (prefill, decode)
    served = {i: scrape_metric(p, "deepserve_prefill_requests_total") for i, p in prefill.items()}
    assert all(v > 0 for v in served.values()), f"a prefill rank got no task: {served}"
    tokens = _tokens_by_target(stack)
    assert all(v > 0 for v in tokens.values()), f"a decode target got no request: {tokens}"
    # EPLB runs on every rank by default (--eplb decode / prefill) and exports its balance.
    for port in [*prefill.values(), *decode.values()]:
        assert metrics_text(port).count("\ndeepserve_ep_balance_max_mean ") == 1
    assert "deepserve_ep_balance" not in metrics_text(_child(stack, "decode-1").ops_port)


def _rank_pid(stack: Stack, supervisor: Child, rank: int) -> int:
    assert supervisor.proc is not None
    ppid = str(supervisor.proc.pid)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            stat[1] == ppid
            and b"--ep-rank" in cmd
            and cmd[cmd.index(b"--ep-rank") + 1] == b"%d" % rank
        ):
            return int(entry)
    raise AssertionError(f"no rank {rank} under {supervisor.name}")


def _tokens_by_target(stack: Stack) -> dict[str, float]:
    """Decode tokens so far, per routing target (decode-0's ranks and decode-1)."""
    tokens = {
        i: scrape_metric(p, "deepserve_decode_tokens_total")
        for i, p in ranks(stack, "decode-0").items()
    }
    tokens["decode-1"] = scrape_metric(
        _child(stack, "decode-1").ops_port, "deepserve_decode_tokens_total"
    )
    return tokens


def _streams_with_a_kill(
    stack: Stack, stub: AuthorizedStub, victim: int, references: dict[str, list[list[int]]]
) -> tuple[list[list[int]], float]:
    """Four streams, and kill -9 of ``victim`` once decode-0's group runs one of them: (the
    streams' tokens, when the kill came). The streams go where the balancer sends them; a
    round in which all four ended on decode-1, or ended before a poll saw decode-0 run one,
    is checked for exact tokens and tried again (at most 3 rounds)."""
    group = ranks(stack, "decode-0")
    for attempt in range(3):
        before = _tokens_by_target(stack)
        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(grpc_generate, stub, p, STREAM_TOKENS, 0.0, None, "", 120.0)
                for p in PROMPTS[:4]
            ]
            deadline = time.monotonic() + 30
            while not any(
                scrape_metric(port, "deepserve:num_requests_running") for port in group.values()
            ):
                assert time.monotonic() < deadline, "no stream reached decode-0's group"
                if all(f.done() for f in futures):
                    break
                time.sleep(0.02)
            else:
                t_kill = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                return [f.result().token_ids for f in futures], t_kill
            missed = [f.result().token_ids for f in futures]
        assert missed == references["stream"], dump_logs(stack)
        after = _tokens_by_target(stack)
        print(
            f"round {attempt}: the streams ended before a poll saw decode-0 run one; decode "
            f"tokens by target: { {k: after[k] - before.get(k, 0) for k in after} }"
        )
    raise AssertionError("3 rounds of 4 streams, and decode-0's group was never seen running one")


@pytest.mark.slow
def test_rank_killed_mid_stream_streams_finish_and_the_group_comes_back_smaller(
    stack: Stack, stub: AuthorizedStub, references: dict[str, list[list[int]]]
) -> None:
    supervisor = _child(stack, "decode-0")
    victim = _rank_pid(stack, supervisor, 1)
    entrypoint = _child(stack, "entrypoint").ops_port
    retries = scrape_metric(entrypoint, "deepserve_entrypoint_retries_total")
    got, t_kill = _streams_with_a_kill(stack, stub, victim, references)
    took = time.monotonic() - t_kill
    assert got == references["stream"], dump_logs(stack)
    continued = scrape_metric(entrypoint, "deepserve_entrypoint_retries_total") - retries
    assert continued >= 1, "no stream was on the killed group: the kill came too late"
    print(f"4 streams exact; the last ended {took:.1f}s after kill -9 of a decode rank")

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        now = ranks(stack, "decode-0")
        if list(now) and all(i.endswith("-g1") for i in now) and healthz(supervisor.health_port)[0]:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"decode-0 not back: {healthz(supervisor.health_port)}")
    print(f"decode-0 back as {now} {time.monotonic() - t_kill:.1f}s after the kill")
    assert len(now) == 1, now
    assert supervisor.proc is not None and supervisor.proc.poll() is None  # same instance

    (port,) = now.values()
    for k in range(12):  # the new rank is routed to again (ties broken by request id)
        got = grpc_generate(stub, PROMPTS[k % len(PROMPTS)], MAX_TOKENS)
        assert got.token_ids == references["short"][k % len(PROMPTS)]
        if scrape_metric(port, "deepserve_decode_tokens_total") > 0:
            break
    else:
        raise AssertionError("the restarted rank never served a request")
