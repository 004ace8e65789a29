"""``deepserve up --mode aggregated`` on the real stack: one engine process that is both the
prefill and the decode target. A user sees the same tokens as one process computes; the
request's KV never leaves the engine (no hand-over counted anywhere), the balancer says it
kept decode on the same engine, and a repeated prompt still finds its blocks in the kvstore
(written by the aggregated engine when the request ends)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepserve.up import Stack

from ..sdk_strict import openai_client
from .conftest import (
    MODEL_NAME,
    AuthorizedStub,
    ReferenceRuns,
    dump_logs,
    grpc_generate,
    scrape_metric,
    start_stack,
)

pytestmark = pytest.mark.timeout(600)

SHORT = [(i * 7919 + 3000) % 120000 + 100 for i in range(24)]
LONG = [(i * 104729 + 91) % 120000 + 100 for i in range(300)]  # 2 full blocks inside prompt[:-1]


@pytest.fixture(scope="module")
def references() -> Iterator[ReferenceRuns]:
    refs = ReferenceRuns()
    try:
        refs.launch("short", SHORT, 10)
        refs.launch("long", LONG, 10)
        yield refs
    finally:
        refs.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, references: ReferenceRuns) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("agg"), mode="aggregated")
    try:
        yield s
        assert not s.exited(), dump_logs(s)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[AuthorizedStub]:
    import grpc

    channel = grpc.insecure_channel(stack.grpc_address)
    try:
        yield AuthorizedStub(channel, stack.call_metadata)
    finally:
        channel.close()


def _ops(stack: Stack, name: str) -> int:
    return next(c.ops_port for c in stack.children if c.name == name)


def test_one_engine_serves_both_roles(stack: Stack) -> None:
    state = json.loads((Path(stack.run_dir) / "stack.json").read_text())
    assert state["mode"] == "aggregated"
    engines = [n for n, c in state["services"].items() if c["service"] in ("prefill", "decode")]
    assert engines == []
    assert [n for n, c in state["services"].items() if c["service"] == "aggregated"] == [
        "aggregated-0"
    ]


def test_tokens_equal_one_process_and_no_kv_moves(
    stack: Stack, stub: AuthorizedStub, references: ReferenceRuns
) -> None:
    gen = grpc_generate(stub, SHORT, 10)
    assert gen.finish is not None and gen.finish.reason == "length"
    assert gen.token_ids == references.result("short")["token_ids"]
    client = openai_client(base_url=stack.api_url, api_key="x", max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello there"}],
        max_completion_tokens=6,
        temperature=0,
    )
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
    agg = _ops(stack, "aggregated-0")
    assert scrape_metric(agg, "deepserve_prefill_requests_total", 'outcome="decoding_here"') >= 2
    assert scrape_metric(agg, "deepserve_prefill_requests_total", 'outcome="handed_over"') == 0
    assert scrape_metric(agg, "deepserve_prefill_handoff_blocks_total") == 0
    routed = scrape_metric(
        _ops(stack, "balancer"),
        "deepserve:balancer_routing_decisions_total",
        'reason="same_engine"',
    )
    assert routed >= 2, dump_logs(stack)


def test_a_repeated_prompt_hits_the_kvstore(
    stack: Stack, stub: AuthorizedStub, references: ReferenceRuns
) -> None:
    first = grpc_generate(stub, LONG, 10)
    assert first.token_ids == references.result("long")["token_ids"]
    deadline = time.monotonic() + 20
    while True:  # the blocks are written when the request ends, in the background
        stored = scrape_metric(
            _ops(stack, "aggregated-0"), "deepserve_decode_kvstore_blocks_put_total"
        )
        if stored >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert stored >= 2, dump_logs(stack)
    again = grpc_generate(stub, LONG, 10)
    assert again.token_ids == first.token_ids
    assert again.ready is not None and again.ready.cached_tokens == 256
