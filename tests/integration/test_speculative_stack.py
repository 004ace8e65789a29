"""Speculative decoding through the real prefill -> decode hand-off: both processes run with
``--speculative-tokens`` (prefill fills the MTP layer's KV it hands over, decode drafts and
verifies every draft); a client gets the tokens of one engine decoding one token a step, and
decode's ``/metrics`` count the drafts it verified."""

from __future__ import annotations

from collections.abc import Iterator

import nats
import pytest

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.llm import LLM
from tests.integration.conftest import scrape_metric
from tests.integration.test_prefill_decode import (
    NUM_KV_BLOCKS,
    PROMPT,
    Stack,
    check_matches,
    generate,
    running_pair,
)

SPEC = ["--speculative-tokens", "3", "--speculative-schedule", "all"]


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_pair(tmp_path_factory.mktemp("speculative"), SPEC) as s:
        yield s


@pytest.fixture(scope="module")
def llm(tiny_loaded) -> LLM:
    """One engine in this process, one token a step: what the client must get."""
    engine = Engine(
        EngineConfig(model="tiny", block_size=128, num_kv_blocks=NUM_KV_BLOCKS), loaded=tiny_loaded
    )
    return LLM("tiny", engine=engine)


async def test_speculative_prefill_and_decode_give_the_plain_tokens(
    spec_stack: Stack, llm: LLM
) -> None:
    nc = await nats.connect(spec_stack.nats_url)
    try:
        for i, sp in enumerate(
            [
                SamplingParams(max_tokens=24),
                SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=(1,)),
            ]
        ):
            events = await generate(nc, spec_stack, f"spec-{i}", PROMPT, sp)
            check_matches(events, llm, PROMPT, sp, spec_stack)
            # decode's per-request counts ride on the finishing event (the entrypoint logs them)
            assert events[-1].HasField("speculative")
            counts = events[-1].speculative
            assert counts.drafted >= counts.verified >= counts.accepted >= 0
    finally:
        await nc.close()
    port = spec_stack.decode.http_port
    verified = scrape_metric(port, "deepserve:spec_decode_num_draft_tokens_total")
    assert verified > 0, spec_stack.logs()
    assert scrape_metric(port, "deepserve:spec_decode_num_accepted_tokens_total") <= verified
