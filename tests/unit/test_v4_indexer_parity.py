"""DeepSeek-V4 against transformers where CSA's indexer chooses (issue 35 item 2): rows that
hold more closed entries than ``index_topk``, with exact ties at the k-th pick, in prefill,
decode (one sequence and a batch) and after a block restore.

The difference the issue measured (v4-tiny, 320-token prompt: logits up to 0.25 apart in
prefill, 1.47 in decode, a greedy token flipping after 17 steps) is all tie-breaking: an indexer
score is ``sum_h w_h * relu(q_h . k)``, exactly 0 for every entry that all heads' queries point
away from, and transformers keeps the top ``k`` with ``torch.topk``, whose order among equal
values depends on the row's length -- so its own one-pass logits at a position change with the
number of tokens after it (tests/hf_reference.py, :func:`index_ties_to_lower_entry`). Ours
sends ties to the lower entry, the same for any chunking. With transformers' ties sent there
too, everything else agrees to float rounding (v4-tiny: prefill 0.0, 32 decode steps 6.3e-7).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from libs.engine.v4.blocks import BLOCK_TOKENS, prefill_blocks, restore
from libs.engine.v4.config import CSA
from libs.engine.v4.model import V4ForCausalLM, V4State
from tests.hf_reference import (
    build_hf_v4,
    index_ties_to_lower_entry,
    ours_of,
    require_reference,
)

require_reference("transformers")

ATOL = 5e-5  # fp32 on the CPU, as tests/unit/test_v4_parity.py


class IndexerRows:
    """Counts, over transformers' CSA indexer calls, the rows where it chooses (more closed
    entries than ``index_topk``) and those where an exact tie straddles its k-th pick (which
    entry it keeps decides the logits), by position: every call of several rows here starts at
    position 0 (a prompt); a call of one row is a decode step, all its entries closed."""

    def __init__(self, hf: torch.nn.Module) -> None:
        self.k = int(hf.config.index_topk)
        self.rate = int(hf.config.compress_rates[CSA])
        self.choosing: list[int] = []
        self.tied: list[int] = []
        self.decode_tied = 0
        self.handles = [
            m.register_forward_hook(self._hook)
            for m in hf.modules()
            if type(m).__name__ == "DeepseekV4IndexerScorer"
        ]

    def _hook(self, module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        scores = out[0]  # [S, T]: every entry, closed or not
        s, t = scores.shape
        for row in range(s):
            seen = t if s == 1 else min(t, (row + 1) // self.rate)
            if seen <= self.k:
                continue
            top = scores[row, :seen].sort(descending=True).values
            tie = bool(top[self.k - 1] == top[self.k])
            if s == 1:
                self.decode_tied += tie
                continue
            self.choosing.append(row)
            if tie:
                self.tied.append(row)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, V4ForCausalLM]:
    hf = build_hf_v4("v4-indexer-ties")
    return hf, ours_of(hf)


@pytest.fixture
def rows(pair: tuple[torch.nn.Module, V4ForCausalLM]) -> Iterator[IndexerRows]:
    counter = IndexerRows(pair[0])
    with index_ties_to_lower_entry():
        yield counter
    counter.close()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _generate(
    hf: torch.nn.Module, prompt: torch.Tensor, n: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens after ``prompt`` and its logits at each step."""
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf.generate(
            prompt[None],
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [lg[0] for lg in out.logits]


def test_prefill_where_the_indexer_chooses_among_ties(
    pair: tuple[torch.nn.Module, V4ForCausalLM], rows: IndexerRows
) -> None:
    """96 tokens: up to 48 closed entries per CSA layer for 4 picks; one pass and chunks."""
    hf, ours = pair
    ids = _ids(96, seed=1)
    with torch.no_grad():
        want = hf(ids[None], use_cache=False).logits[0]
    assert len(rows.choosing) > 100 and len(rows.tied) > 20  # the case is exercised
    torch.testing.assert_close(ours(ids, V4State.empty(ours.cfg)), want, rtol=0, atol=ATOL)
    st = V4State.empty(ours.cfg)
    parts = [ours(ids[a:b], st) for a, b in ((0, 37), (37, 38), (38, 71), (71, 96))]
    torch.testing.assert_close(torch.cat(parts), want, rtol=0, atol=ATOL)


def test_decode_where_the_indexer_chooses_alone_and_batched(
    pair: tuple[torch.nn.Module, V4ForCausalLM], rows: IndexerRows
) -> None:
    """Two prompts decoded 24 steps: one alone (per-sequence attention), then both as one
    batch (the engine's padded decode attention, the indexer's pick as a mask)."""
    hf, ours = pair
    prompts = [_ids(40, seed=2), _ids(57, seed=3)]
    n = 24
    runs = [_generate(hf, p, n) for p in prompts]
    assert rows.decode_tied > 5
    st = V4State.empty(ours.cfg)
    logits = ours(prompts[0], st)[-1]
    for step in range(n):
        torch.testing.assert_close(logits, runs[0][1][step], rtol=0, atol=ATOL)
        logits = ours(torch.tensor([int(logits.argmax())]), st)[-1]
    states = [V4State.empty(ours.cfg) for _ in prompts]
    last = ours.forward_batch(prompts, states)
    got: list[list[int]] = [[], []]
    for step in range(n):
        for i, (_, want) in enumerate(runs):
            torch.testing.assert_close(last[i], want[step], rtol=0, atol=ATOL)
            got[i].append(int(last[i].argmax()))
        last = ours.forward_batch([torch.tensor([g[-1]]) for g in got], states)
    assert got == [tokens for tokens, _ in runs]


def test_restored_request_continues_as_transformers(
    pair: tuple[torch.nn.Module, V4ForCausalLM], rows: IndexerRows
) -> None:
    """A request restored from its first block's state (no token replayed) finishes its
    prompt and decodes as transformers does over the whole sequence in one call."""
    hf, ours = pair
    ids = _ids(BLOCK_TOKENS + 30, seed=4)
    with torch.no_grad():
        want = hf(ids[None], use_cache=False).logits[0]
    assert sum(r >= BLOCK_TOKENS for r in rows.tied) > 5  # ties after the restore point
    tokens, steps = _generate(hf, ids, 12)
    _, blocks, _ = prefill_blocks(ours, ids[:BLOCK_TOKENS].tolist())
    state = restore(blocks, ours)
    rest = ours(ids[BLOCK_TOKENS:], state)
    torch.testing.assert_close(rest, want[BLOCK_TOKENS:], rtol=0, atol=ATOL)
    logits = rest[-1]
    for step, tok in enumerate(tokens):
        torch.testing.assert_close(logits, steps[step], rtol=0, atol=ATOL)
        assert int(logits.argmax()) == tok
        logits = ours(torch.tensor([tok]), state)[-1]
