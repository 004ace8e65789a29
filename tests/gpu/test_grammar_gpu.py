"""Structured outputs on a CUDA device: the kernels' path with CUDA graphs and the overlap on,
constrained rows beside free ones."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.common.sampling import Constraint, SamplingParams  # noqa: E402
from libs.engine.engine import Engine, EngineConfig  # noqa: E402
from libs.engine.tokenizer import load_tokenizer  # noqa: E402
from tests.unit.test_grammar import SCHEMA, _valid  # noqa: E402


def test_constrained_rows_parse_beside_free_ones_on_device() -> None:
    engine = Engine(EngineConfig(model="tiny", device="cuda", seed=0, num_kv_blocks=256))
    assert engine.config.use_overlap
    c = Constraint("json_schema", json.dumps(SCHEMA))
    for i in range(8):
        engine.add_request(
            f"c{i}",
            [5, 6, 7 + i],
            SamplingParams(max_tokens=80, temperature=1.1, seed=i, constraint=c),
        )
        engine.add_request(
            f"f{i}", [5, 6, 7 + i], SamplingParams(max_tokens=20, temperature=1.1, seed=i)
        )
    out: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                out.setdefault(ev.request_id, []).append(ev.token_id)
            if ev.finished:
                reasons[ev.request_id] = ev.finish_reason
    tok = load_tokenizer(None)
    for i in range(8):
        assert reasons[f"c{i}"] == "stop"
        assert _valid(json.loads(tok.decode(out[f"c{i}"], skip_special_tokens=True)))
        assert len(out[f"f{i}"]) == 20
