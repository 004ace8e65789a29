"""Structured outputs in the engine: constrained requests on the tiny random-weight model
always produce what the constraint accepts, also across a prefill -> decode hand-off and with
the overlap, while unconstrained requests in the same batch are untouched."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from libs.common.sampling import Constraint, SamplingParams
from libs.engine.engine import Engine, EngineConfig, InvalidRequest
from libs.engine.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "code": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "code", "n"],
    "additionalProperties": False,
}
TOK = load_tokenizer(None)


def _engine(overlap: bool = False) -> Engine:
    return Engine(EngineConfig(model="tiny", seed=0, overlap=overlap, num_kv_blocks=64))


def _run(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]], **kw: Any) -> dict:
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params, **kw)
    out: dict[str, Any] = {rid: ([], None) for rid in reqs}
    while engine.has_unfinished():
        for ev in engine.step():
            toks, _ = out[ev.request_id]
            if ev.token_id is not None:
                toks.append(ev.token_id)
            if ev.finished:
                out[ev.request_id] = (toks, ev.finish_reason)
    return out


def _text(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


def _valid(doc: Any) -> bool:
    return (
        set(doc) == {"ok", "color", "code", "n"}
        and isinstance(doc["ok"], bool)
        and doc["color"] in ("red", "green", "blue")
        and re.fullmatch(r"[a-z]{2}[0-9]", doc["code"]) is not None
        and isinstance(doc["n"], int)
        and 0 <= doc["n"] <= 99
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_json_schema_output_always_parses_and_validates(overlap: bool) -> None:
    engine = _engine(overlap)
    c = Constraint("json_schema", json.dumps(SCHEMA))
    reqs = {
        f"s{seed}": (
            [5, 6, 7 + seed],
            SamplingParams(max_tokens=80, temperature=1.2, seed=seed, constraint=c),
        )
        for seed in range(4)
    }
    reqs["free"] = ([5, 6, 9], SamplingParams(max_tokens=12, temperature=1.2, seed=9))
    out = _run(engine, reqs)
    for rid in [r for r in reqs if r != "free"]:
        toks, reason = out[rid]
        assert reason == "stop" and toks[-1] in engine.model_config.eos_token_ids
        assert _valid(json.loads(_text(toks))), _text(toks)
    # The unconstrained row of the same batches is what it is alone.
    alone = _run(_engine(overlap), {"free": reqs["free"]})
    assert out["free"] == alone["free"]


def test_regex_ebnf_json_and_tool_call_kinds() -> None:
    engine = _engine()
    tool = {
        "tools": [
            {
                "begin": "<call get_weather>",
                "schema": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
                "end": "</call>",
            },
            {
                "begin": "<call get_time>",
                "schema": {
                    "type": "object",
                    "properties": {"tz": {"enum": ["UTC"]}},
                    "required": ["tz"],
                    "additionalProperties": False,
                },
                "end": "</call>",
            },
        ]
    }
    kinds = {
        "regex": Constraint("regex", r"(yes|no), [0-9]{3}"),
        "ebnf": Constraint("ebnf", 'root ::= "A" ("b" | "c")+ "!"'),
        "json": Constraint("json"),
        "tool": Constraint("tool_call", json.dumps(tool)),
    }
    out = _run(
        engine,
        {
            k: ([5, 6, 7], SamplingParams(max_tokens=60, temperature=1.0, seed=1, constraint=c))
            for k, c in kinds.items()
        },
    )
    texts = {k: _text(v[0]) for k, v in out.items()}
    assert re.fullmatch(r"(yes|no), [0-9]{3}", texts["regex"]), texts
    assert re.fullmatch(r"A[bc]+!", texts["ebnf"]) or out["ebnf"][1] == "length", texts
    if out["json"][1] == "stop":
        assert isinstance(json.loads(texts["json"]), dict)
    else:  # a random model may nest until max_tokens: then a prefix of a JSON object
        assert texts["json"].startswith("{")
    m = re.fullmatch(r"<call (get_weather|get_time)>(.*)</call>", texts["tool"])
    assert m, texts["tool"]
    args = json.loads(m.group(2))
    assert (
        args in ({"city": "Oslo"}, {"city": "Rome"})
        if m.group(1) == "get_weather"
        else args == {"tz": "UTC"}
    )


def test_decode_continues_the_grammar_prefill_began() -> None:
    """As after the hand-off: decode gets prompt + the first token as prior output and goes on
    where one engine would (greedy: the same tokens)."""
    c = Constraint("json_schema", json.dumps(SCHEMA))
    p = SamplingParams(max_tokens=60, constraint=c)
    whole = _run(_engine(), {"r": ([5, 6, 7], p)})["r"][0]
    first = _run(_engine(), {"r": ([5, 6, 7], SamplingParams(max_tokens=1, constraint=c))})["r"][0]
    assert first == whole[:1]
    rest = _run(_engine(), {"r": ([5, 6, 7, *first], p)}, prior_outputs=1)["r"][0]
    assert first + rest == whole and _valid(json.loads(_text(whole)))


def test_bad_constraints_are_refused_with_the_reason() -> None:
    engine = _engine()
    with pytest.raises(InvalidRequest, match="does not compile"):
        engine.add_request("x", [1, 2], SamplingParams(constraint=Constraint("regex", "([a-")))
    with pytest.raises(InvalidRequest, match="does not compile"):
        engine.add_request("y", [1, 2], SamplingParams(constraint=Constraint("ebnf", "root ::= (")))
    # An output the request already has that the grammar cannot accept (a forged hand-off).
    with pytest.raises(InvalidRequest, match="does not follow"):
        engine.add_request(
            "z",
            [1, 2, *TOK.encode("x", add_special_tokens=False).ids],
            SamplingParams(constraint=Constraint("json")),
            prior_outputs=1,
        )
    assert not engine.has_unfinished()


async def test_the_engine_loop_compiles_off_the_engine_thread_and_refuses_bad_ones() -> None:
    """A constraint is compiled in a worker thread before the engine sees the request (the
    engine thread then finds it cached); one that does not compile is an InvalidRequest."""
    import threading

    from libs.serving.engine_loop import EngineLoop

    engine = _engine()
    threads: list[str] = []
    real = engine.grammar.compile

    def spy(c: Constraint) -> Any:
        threads.append(threading.current_thread().name)
        return real(c)

    engine.grammar.compile = spy  # type: ignore[method-assign]
    loop = EngineLoop(engine)
    loop.start()
    try:
        c = Constraint("regex", "[0-9]{4}")
        stream = await loop.add("g", [5, 6, 7], SamplingParams(max_tokens=8, constraint=c))
        toks = [ev.token_id async for ev in stream if ev.token_id is not None]
        assert re.fullmatch(r"[0-9]{4}", _text(toks))
        assert threads and all(t != "engine" and t != "MainThread" for t in threads[:1])
        with pytest.raises(InvalidRequest, match="does not compile"):
            await loop.add("b", [5, 6], SamplingParams(constraint=Constraint("regex", "([")))
    finally:
        await loop.close()


def test_masks_are_filled_while_the_next_forward_is_queued() -> None:
    """With the overlap, a constrained batch queues step N+1's forward first, then finishes
    step N and fills N+1's masks (the host works while the device computes), then samples."""
    engine = _engine(overlap=True)
    order: list[str] = []
    forward, finish = engine.runner._forward, engine._finish  # type: ignore[attr-defined]

    def spy_forward(*a: Any, **k: Any) -> Any:
        order.append("forward")
        return forward(*a, **k)

    def spy_finish(launched: Any) -> Any:
        order.append("finish")
        return finish(launched)

    engine.runner._forward = spy_forward  # type: ignore[attr-defined]
    engine._finish = spy_finish  # type: ignore[method-assign]
    c = Constraint("regex", "[a-z]{12}")
    out = _run(engine, {"r": ([5, 6, 7], SamplingParams(max_tokens=12, constraint=c))})
    assert re.fullmatch(r"[a-z]{12}", _text(out["r"][0]))
    # Steady state: each forward is queued before the previous step is finished.
    assert order[:4] == ["forward", "forward", "finish", "forward"], order[:8]
