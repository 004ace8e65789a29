"""DeepSeek-V4 through every service: ``deepserve up --model v4-tiny`` (its Stack) serves chat
completions with the V4 chat encoding; prefill hands decode the request's V4 state (the
last block part-way through) and the tokens equal one process generating alone; a long
prompt repeated after the prefill instance was killed -- its own cache gone -- is restored
from the kvstore's blocks and continues the same."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from deepserve.up import Stack
from libs.engine.v4.load import generate_v4, load_v4

from ..sdk_strict import openai_client
from .conftest import READY_TIMEOUT, AuthorizedStub, dump_logs, grpc_generate, service_metric

pytestmark = pytest.mark.timeout(600)
MODEL_NAME = "deepseek-v4-tiny"
LONG_TEXT = " ".join(f"w{i}" for i in range(400))  # > 2 full 128-token blocks


@pytest.fixture(scope="module")
def v4_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        tmp_path_factory.mktemp("v4-stack"),
        model="v4-tiny",
        model_name=MODEL_NAME,
        ready_timeout=READY_TIMEOUT,
        drain_seconds=5.0,
        env=dict(os.environ),
        restart=True,
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def test_prompt_ids_through_prefill_and_decode_equal_one_process(v4_stack: Stack) -> None:
    prompt = [(i * 7919) % 128000 + 3 for i in range(150)]  # one full block and a part
    channel = grpc.insecure_channel(v4_stack.grpc_address)
    try:
        stub = AuthorizedStub(channel, v4_stack.call_metadata)
        out = grpc_generate(stub, prompt, 10, model=MODEL_NAME)
    finally:
        channel.close()
    want = generate_v4(load_v4("v4-tiny"), prompt, 10).token_ids
    n = len(out.token_ids)
    assert out.token_ids == list(want[:n]) and (n == 10 or want[n - 1] == 1), dump_logs(v4_stack)


def test_a_repeated_long_prompt_is_restored_from_the_kvstore(v4_stack: Stack) -> None:
    client = openai_client(base_url=v4_stack.api_url, api_key="local", max_retries=0, timeout=120)

    def chat() -> tuple[str, int]:
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": LONG_TEXT}],
            max_tokens=6,
            temperature=0,
        )
        assert out.usage is not None and out.usage.prompt_tokens > 256
        details = out.usage.prompt_tokens_details
        return out.choices[0].message.content or "", (details.cached_tokens or 0) if details else 0

    first, cached = chat()
    assert cached == 0
    deadline = time.monotonic() + 30  # the prefill writes its blocks behind the hand-over
    while service_metric(v4_stack, "prefill", "deepserve_prefill_kvstore_blocks_put_total") < 2:
        assert time.monotonic() < deadline, dump_logs(v4_stack)
        time.sleep(0.3)
    prefill = next(c for c in v4_stack.children if c.service == "prefill")
    os.kill(prefill.pid, signal.SIGKILL)  # its own prefix cache goes with it
    deadline = time.monotonic() + READY_TIMEOUT
    while not (prefill.restarts and prefill.healthy):
        assert time.monotonic() < deadline, dump_logs(v4_stack)
        v4_stack.supervise()
        time.sleep(0.3)
    again, cached = chat()
    assert cached >= 256, dump_logs(v4_stack)
    assert service_metric(v4_stack, "prefill", "deepserve_prefill_kvstore_blocks_loaded_total") >= 2
    assert again == first
