"""Bounded grammar compilation (issue 33 item 2), with real xgrammar on the DeepSeek vocabulary:
a constraint is compiled first in a probe process under a time and a memory budget; past either
it is refused naming the limit and the probe is killed (its CPU and memory come back at once);
one that fits is then compiled in the engine's process and cached, so the engine thread's
``start`` never compiles; the same schema again is judged at once. Through the engine loop a
refused constraint is an InvalidRequest while other requests keep stepping."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from libs.common.sampling import Constraint, SamplingParams
from libs.engine.grammar import GrammarBackend, GrammarBudget, GrammarError, GrammarLimitError
from libs.engine.tokenizer import load_tokenizer
from libs.serving.model_flags import ModelFlags

pytestmark = pytest.mark.timeout(300)

# One compiler thread (the probe's) on a 2-core box: 10 optional properties take ~0.07 s,
# 600 ~1.4 s, 1,000 ~6 s, 1,500 ~25 s. A budget of 1 s admits 10 and refuses 1,500 with a
# wide margin either way.
BUDGET = GrammarBudget(compile_seconds=1.0, memory_mib=8, probes=1)


def properties(n: int) -> Constraint:
    props = {f"p{i}": {"type": "string"} for i in range(n)}
    return Constraint("json_schema", json.dumps({"type": "object", "properties": props}))


def strings(n: int) -> Constraint:
    """An enum of ``n`` 40-character strings: quick to compile, big compiled (2,000: ~17 MB)."""
    rnd = random.Random(0)
    values = ["".join(rnd.choice("abcdefghij") for _ in range(40)) for _ in range(n)]
    return Constraint("json_schema", json.dumps({"enum": values}))


@pytest.fixture(scope="module")
def g() -> Iterator[GrammarBackend]:
    """The backend the tiny engine builds (the bundled tokenizer), under BUDGET."""
    backend = GrammarBackend(load_tokenizer(None), 129280, [1])
    backend.limit(BUDGET, warm=True)
    yield backend
    backend.close()


class Spy:
    """Counts the compiles this process runs (not the probe's)."""

    def __init__(self, g: GrammarBackend) -> None:
        self.g, self.real, self.kinds = g, g._compilers.compile, []  # type: ignore[var-annotated]

    def __enter__(self) -> Spy:
        def compile(kind: str, spec: str) -> Any:
            self.kinds.append(kind)
            return self.real(kind, spec)

        self.g._compilers.compile = compile  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.g._compilers.compile = self.real  # type: ignore[method-assign]


def _idle_pids(g: GrammarBackend) -> list[int]:
    assert g._probes is not None
    with g._probes._lock:
        return [p.proc.pid for p in g._probes._idle]


def _wait_idle_probe(g: GrammarBackend, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while not _idle_pids(g) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _idle_pids(g)


def test_a_schema_within_budget_is_compiled_once_and_start_finds_it(g: GrammarBackend) -> None:
    small = properties(10)
    with Spy(g) as spy:
        g.compile(small)  # the engine loop does this in a worker thread
        assert spy.kinds == ["json_schema"] and small in g._compiled
        g.start("r-small", small, [])  # the engine thread: a cache hit, no compile
        g.compile(small)
        assert spy.kinds == ["json_schema"]
    g.drop("r-small")
    with pytest.raises(GrammarError, match="does not compile") as bad:
        g.compile(Constraint("regex", "([a-"))
    assert not isinstance(bad.value, GrammarLimitError)


def test_a_grammar_past_the_memory_budget_is_refused_naming_it(g: GrammarBackend) -> None:
    big = strings(2000)
    with Spy(g) as spy, pytest.raises(GrammarLimitError, match="--grammar-memory-mib") as refused:
        g.compile(big)
    assert "8 MiB" in str(refused.value) and spy.kinds == []
    assert _idle_pids(g), "a probe that answered is kept"


def test_a_schema_past_the_time_budget_is_refused_and_its_compile_killed(g: GrammarBackend) -> None:
    (pid,) = _wait_idle_probe(g)
    slow = properties(1500)
    with Spy(g) as spy:
        t0 = time.monotonic()
        with pytest.raises(GrammarLimitError, match="--grammar-compile-seconds") as refused:
            g.compile(slow)
        took = time.monotonic() - t0
        assert "within 1 s" in str(refused.value) and "json_schema" in str(refused.value)
        assert took < BUDGET.compile_seconds + 1.0  # refused at the budget, not at the end
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the probe that ran it is gone (killed and reaped)
        t0 = time.monotonic()
        with pytest.raises(GrammarLimitError, match="--grammar-compile-seconds"):
            g.compile(slow)  # the same schema again: judged at once, nothing compiled
        assert time.monotonic() - t0 < 0.1
        assert spy.kinds == []  # this process never compiled it
    assert slow not in g._compiled


async def test_the_engine_loop_refuses_a_slow_schema_while_other_requests_step(
    g: GrammarBackend,
) -> None:
    from libs.engine.engine import Engine, EngineConfig, InvalidRequest
    from libs.serving.engine_loop import EngineLoop

    engine = Engine(EngineConfig(model="tiny", seed=0, num_kv_blocks=64))
    engine._grammar = g  # the budgeted backend above (its probe is warm)
    loop = EngineLoop(engine, name="budget")
    loop.start()
    try:
        await asyncio.to_thread(_wait_idle_probe, g)
        plain = await loop.add("plain", [5, 6, 7], SamplingParams(max_tokens=4000))
        # 1,501 properties: not the schema the test above got judged (a verdict is remembered)
        slow = SamplingParams(max_tokens=8, constraint=properties(1501))
        refusal = asyncio.ensure_future(loop.add("slow", [5, 6, 7], slow))
        refused_at: list[float] = []
        refusal.add_done_callback(lambda _: refused_at.append(time.monotonic()))
        started, stamps = time.monotonic(), []
        async for ev in plain:
            stamps.append(time.monotonic())
            if refused_at:
                break
        with pytest.raises(InvalidRequest, match="--grammar-compile-seconds"):
            await refusal
        assert refused_at[0] - started >= BUDGET.compile_seconds  # the probe ran its budget
        # ... while the engine thread kept stepping the other request (a token every step)
        meanwhile = [t for t in stamps if started < t < refused_at[0]]
        assert len(meanwhile) >= 10 and max(np.diff([started, *meanwhile])) < 0.5
        await loop.abort("plain")
    finally:
        await loop.close()


def test_the_budget_comes_from_the_engine_flags() -> None:
    assert ModelFlags().grammar_budget() == GrammarBudget(5.0, 256)
    assert ModelFlags(grammar_compile_seconds=0).grammar_budget() is None  # unbounded
    with pytest.raises(ValueError, match="--grammar-memory-mib"):
        ModelFlags(grammar_memory_mib=0)
