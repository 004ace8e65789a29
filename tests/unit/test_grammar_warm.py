"""Structured outputs' vocabulary-wide setup happens when a service loads its engine, not on the
first constrained request: built there (xgrammar's views of the 129K-token vocabulary, seconds
holding the GIL) it stalled the service's event loop and its heartbeats, and the balancer and
entrypoint counted the instance dead. The views are built once per process and tokenizer."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace
from typing import Any

from libs.common.sampling import Constraint, SamplingParams
from libs.engine.grammar import GrammarBackend, vocabulary_views
from libs.engine.tokenizer import load_tokenizer
from libs.serving.engine_loop import EngineLoop
from libs.serving.engines import build_engine
from libs.serving.instance import InstanceRuntime
from libs.serving.model_flags import ModelFlags

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
)


def _runtime() -> InstanceRuntime:
    ctx: Any = SimpleNamespace(
        name="decode",
        config=SimpleNamespace(instance_id="decode-warm", drain_seconds=1.0),
        log=logging.getLogger("test-grammar-warm"),
        stop=asyncio.Event(),
    )
    return InstanceRuntime(ctx, ModelFlags(model="fake"), 1.0)


async def test_a_service_engine_has_its_grammar_backend_before_the_first_request() -> None:
    """The engine a service loads comes with its grammar backend built and the JSON grammar
    compiled; then the first constrained request leaves the event loop ticking (a heartbeat
    every 0.1 s here, none late by 1 s). (The fake model's tokens ignore the mask: what the
    output holds is test_grammar.py's business.)"""
    engine = await _runtime()._load(build_engine)
    assert engine is not None
    assert engine._grammar is not None, "the grammar backend is built at start-up"
    assert engine._grammar._compiled, "and a first grammar compiled"

    loop = EngineLoop(engine, name="decode")
    loop.start()
    ticks: list[float] = []
    done = asyncio.Event()

    async def heartbeat() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.1)

    beat = asyncio.create_task(heartbeat())
    try:
        await asyncio.sleep(0.3)
        params = SamplingParams(max_tokens=64, constraint=Constraint("json_schema", SCHEMA))
        stream = await loop.add("first", [5, 6, 7, 8], params)
        tokens = [ev.token_id async for ev in stream if ev.token_id is not None]
        await asyncio.sleep(0.3)
    finally:
        done.set()
        await beat
        await loop.close()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < 1.0, f"the event loop stalled {max(gaps):.2f} s"
    assert tokens


def test_backends_over_one_tokenizer_share_its_vocabulary_views() -> None:
    tok = load_tokenizer(None)
    views = vocabulary_views(tok, 129280, [1])
    t0 = time.perf_counter()
    a = GrammarBackend(tok, 129280, [1])
    b = GrammarBackend(tok, 129280, [1])
    assert time.perf_counter() - t0 < 0.5, "a backend over a tokenizer already seen is cheap"
    assert vocabulary_views(tok, 129280, [1]) is views
    assert vocabulary_views(tok, 129280, [1, 2]) is not views  # other stop ids: other views
    a.start("r", Constraint("json_schema", SCHEMA), [])
    b.start("r", Constraint("json_schema", SCHEMA), [])  # per backend: its own matchers
    assert a.has("r") and b.has("r")
    a.drop("r")
    assert not a.has("r") and b.has("r")
