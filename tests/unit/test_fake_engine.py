"""The fake engine (``--model fake``): deterministic, continuable, exact block accounting."""

from __future__ import annotations

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine
from libs.serving.fake_engine import build_fake_engine, fake_completion


def run(engine: Engine, rid: str, prompt: list[int], max_tokens: int, **kw: object) -> list[int]:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens), **kw)  # type: ignore[arg-type]
    out: list[int] = []
    while engine.has_unfinished():
        out += [ev.token_id for ev in engine.step() if ev.token_id is not None]
    return out


def test_output_is_the_hash_completion_and_resuming_from_prompt_plus_output_is_exact() -> None:
    e = build_fake_engine(step_seconds=0, token_seconds=0)
    prompt = list(range(100, 400))
    full = run(e, "a", prompt, 10)
    assert full == fake_completion(prompt, 10)
    assert run(e, "b", prompt + full[:4], 6) == full[4:]
    assert e.blocks.num_free == e.blocks.num_blocks  # nothing held after finishing


def test_kv_moves_between_two_fake_engines_like_prefill_to_decode() -> None:
    pre = build_fake_engine(step_seconds=0, token_seconds=0)
    dec = build_fake_engine(step_seconds=0, token_seconds=0)
    prompt = list(range(5, 305))
    first = run(pre, "r", prompt, 1, hold_kv=True)
    frame = pre.export_kv("r", include_partial=True)
    pre.release("r")
    rest = run(dec, "r", prompt + first, 7, kv=frame)
    assert first + rest == fake_completion(prompt, 8)
    assert (
        pre.blocks.num_free == pre.blocks.num_blocks
        and dec.blocks.num_free == dec.blocks.num_blocks
    )
