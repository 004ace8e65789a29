"""End to end through the real stack (recipe -> entrypoint -> balancer -> prefill -> decode,
kvstore, NATS, Redis; each its own process): what a user of the API sees.

Disaggregation must change nothing: the tokens the stack returns equal the tokens
``deepserve generate`` computes in one process, greedy and seeded, with and without a
kvstore hit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from deepserve.up import Stack
from libs.proto.deepserve.v1 import generate_pb2, generate_pb2_grpc

from ..sdk_strict import openai_client
from .conftest import (
    MODEL_NAME,
    Generation,
    ReferenceRuns,
    dump_logs,
    grpc_generate,
    sampling,
)
from .conftest import AuthorizedStub as Stub

pytestmark = pytest.mark.timeout(900)

SHORT = [(i * 7919 + 1000) % 120000 + 100 for i in range(20)]
LONG = [(i * 104729 + 17) % 120000 + 100 for i in range(300)]  # 2 full blocks inside prompt[:-1]
SEED = 1234


@pytest.fixture(scope="module", autouse=True)
def references() -> Iterator[ReferenceRuns]:
    """Launched before the stack starts (autouse), so the model loads overlap."""
    refs = ReferenceRuns()
    try:
        refs.launch("greedy", SHORT, 12)
        refs.launch("seeded", SHORT, 12, temperature=0.8, seed=SEED)
        refs.launch("long", LONG, 12)
        yield refs
    finally:
        refs.close()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai_client(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=120)


def _ok(gen: Generation, prompt_len: int, max_tokens: int) -> None:
    assert gen.ready is not None and gen.finish is not None
    assert gen.ready.request_id
    assert gen.ready.prompt_tokens == prompt_len
    assert gen.finish.reason in ("stop", "length")
    assert 1 <= len(gen.token_ids) <= max_tokens
    assert gen.finish.usage.prompt_tokens == prompt_len
    assert gen.finish.usage.completion_tokens == len(gen.token_ids)


# -- OpenAI API (recipe) ---------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert MODEL_NAME in [m.id for m in client.models.list()]


def test_chat_completion_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Say hello to the integration test."}
    ]
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0
    )
    text = full.choices[0].message.content
    assert text, f"empty completion: {full}"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage is not None
    assert full.usage.prompt_tokens > 0 and 1 <= full.usage.completion_tokens <= 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    pieces, usage, finish = [], None, None
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == text
    assert finish == full.choices[0].finish_reason
    assert usage is not None, "no usage chunk although stream_options.include_usage was set"
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )


# -- token API (entrypoint): same tokens as one process -------------------------------------


def test_greedy_equals_single_process(grpc_stub: Stub, references: ReferenceRuns) -> None:
    gen = grpc_generate(grpc_stub, SHORT, 12)
    _ok(gen, len(SHORT), 12)
    assert gen.token_ids == references.result("greedy")["token_ids"]


def test_seeded_sampling_equals_single_process(grpc_stub: Stub, references: ReferenceRuns) -> None:
    gen = grpc_generate(grpc_stub, SHORT, 12, temperature=0.8, seed=SEED)
    _ok(gen, len(SHORT), 12)
    assert gen.token_ids == references.result("seeded")["token_ids"]
    again = grpc_generate(grpc_stub, SHORT, 12, temperature=0.8, seed=SEED)
    assert again.token_ids == gen.token_ids


def test_repeated_long_prompt_hits_the_kvstore(
    grpc_stub: Stub, references: ReferenceRuns, stack: Stack
) -> None:
    first = grpc_generate(grpc_stub, LONG, 12)
    _ok(first, len(LONG), 12)
    assert first.token_ids == references.result("long")["token_ids"]
    # The prefill puts new blocks to the kvstore after it hands the request to decode
    # (fire-and-forget), so the very next request may still miss: retry for a while.
    deadline = time.monotonic() + 20
    while True:
        again = grpc_generate(grpc_stub, LONG, 12)
        assert again.ready is not None and again.finish is not None
        assert again.token_ids == first.token_ids, "a kvstore hit changed the output"
        if again.ready.cached_tokens > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert again.ready.cached_tokens == 256, (
        f"no kvstore hit for a repeated 300-token prompt (cached_tokens="
        f"{again.ready.cached_tokens})\n{dump_logs(stack)}"
    )
    assert again.finish.usage.cached_tokens == 256


def test_invalid_token_id_is_rejected_and_the_stack_keeps_serving(grpc_stub: Stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(grpc_stub, [1, 2, 999999999], 4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    details = err.value.details() or ""
    assert "999999999" in details or "token" in details.lower(), details
    gen = grpc_generate(grpc_stub, SHORT[:5], 4)
    _ok(gen, 5, 4)


def test_one_request_is_one_trace_across_every_hop(client: openai.OpenAI, stack: Stack) -> None:
    import json

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "trace me"}],
        max_tokens=3,
        temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    seen: dict[str, set[str]] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # decode's span ends just after the last token is sent
        seen = {}
        for path in stack.run_dir.glob("spans-*.jsonl"):
            for line in path.read_text().splitlines():
                span = json.loads(line)
                if span["context"]["trace_id"] == "0x" + trace_id:
                    seen.setdefault(span["resource"]["attributes"]["service.name"], set()).add(
                        span["name"]
                    )
        if {"recipe", "entrypoint", "prefill", "decode"} <= seen.keys():
            break
        time.sleep(0.2)
    assert {"recipe", "entrypoint", "prefill", "decode"} <= seen.keys(), seen


def test_internal_apis_refuse_callers_without_the_service_credential(stack: Stack) -> None:
    """The kvstore, decode's KV transfer and Generate answer UNAUTHENTICATED to a caller
    without the stack's service token, and serve it with; health checks need none."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from libs.proto.deepserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, kvstore_pb2
    from libs.proto.deepserve.v1 import kvstore_pb2_grpc as kv_grpc

    port = {c.service: c.grpc_port for c in stack.children if c.grpc_port}
    calls = {
        "kvstore": (
            f"127.0.0.1:{port['kvstore']}",
            lambda ch, **kw: kv_grpc.KVStoreStub(ch).Lookup(
                kvstore_pb2.LookupRequest(hashes=[b"x" * 32]), timeout=10, **kw
            ),
        ),
        "decode": (
            f"127.0.0.1:{port['decode']}",
            lambda ch, **kw: kv_transfer_pb2_grpc.KVTransferStub(ch).Match(
                kv_transfer_pb2.MatchRequest(block_hashes=[b"x" * 32]), timeout=10, **kw
            ),
        ),
        "entrypoint": (
            stack.grpc_address,
            lambda ch, **kw: list(
                generate_pb2_grpc.GenerateStub(ch).Generate(
                    generate_pb2.GenerateRequest(
                        prompt_token_ids=[5, 6, 7], sampling=sampling(2), model=MODEL_NAME
                    ),
                    timeout=60,
                    **kw,
                )
            ),
        ),
    }
    for name, (address, call) in calls.items():
        with grpc.insecure_channel(address) as ch:
            for md in ((), (("authorization", "Bearer not-the-token"),)):
                with pytest.raises(grpc.RpcError) as err:
                    call(ch, metadata=md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                assert "credential" in (err.value.details() or ""), name
            call(ch, metadata=stack.call_metadata)  # served
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING, name
