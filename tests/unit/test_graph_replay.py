"""The graph paths of the model runner, on the CPU.

CUDA graphs need a GPU (``tests/gpu`` captures real ones). Here ``ModelRunner.emulate_graphs``
records each graph as a closure that a replay runs again over the same static buffers, so what
surrounds the capture runs as on the GPU: the ladder of padded sizes, the rows staged into the
static inputs (ids, positions, slots, lengths, tables; a token still in flight gathered on the
device), padding rows, outputs read back from the captured tensors, and speculative decoding's
MTP passes through their own graph sets. Kernels run under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from libs.common.sampling import SamplingParams
from libs.engine.runner import GRAPH_LADDER, graph_ladder
from tests.unit.test_engine import prompt, run
from tests.unit.test_speculative import make, variant

KERNELS: dict[str, object] = dict(kernels="triton", max_running=4, max_tokens_per_step=64)
REQS = {
    "a": (prompt(6, 1), SamplingParams(max_tokens=7, ignore_eos=True)),
    "b": (prompt(21, 2), SamplingParams(max_tokens=5, ignore_eos=True)),
    "c": (prompt(3, 3), SamplingParams(temperature=0.9, seed=5, max_tokens=5, ignore_eos=True)),
}


def test_the_ladder_holds_every_row_count_up_to_its_maximum() -> None:
    assert graph_ladder(256) == [b for b in GRAPH_LADDER if b <= 256]
    assert graph_ladder(12) == [1, 2, 4, 8, 16]  # 12 rows replay the 16-row graph
    # Speculative verification at batch 256 with K = 3: 1,024 rows, past the fixed ladder.
    big = graph_ladder(1024)
    assert big[-5:] == [512, 640, 768, 896, 1024]
    assert graph_ladder(513)[-2:] == [512, 640]


def served(
    loaded, k: int, graphs: bool, reqs=REQS, mixed_rows: int = 0, **kw: object
) -> tuple[dict[str, list[int]], dict]:
    eng = make(loaded, k, **{**KERNELS, **kw})
    if graphs:
        eng.runner.emulate_graphs(mixed_rows)
    out = run(eng, reqs)
    replays = {
        name: sum(g.steps for g in gs.graphs.values()) for name, gs in eng.runner.graph_sets.items()
    }
    return out, {"replays": replays, "spec": eng.speculative, "runner": eng.runner}


def test_decode_graphs_give_the_eager_steps_tokens_with_overlap(tiny_mtp) -> None:
    """Three requests replay the 4-row graph (one padding row), and with overlap every step's
    input token is still in flight when the next step is staged."""
    want, _ = served(tiny_mtp, 0, graphs=False, overlap=True)
    got, info = served(tiny_mtp, 0, graphs=True, overlap=True)
    assert got == want
    assert info["replays"]["decode"] >= 5
    # A graph set that cannot be captured: an optional one (the MTP passes) stays eager and
    # the engine runs on; any other fails loudly.
    runner = info["runner"]

    def broken(x: torch.Tensor) -> tuple[torch.Tensor]:
        raise RuntimeError("capture failed")

    runner.add_graphs("extra", broken, 4, rows=False, x_in=(8, torch.float32), optional=True)
    assert runner.replay("extra", 2, x=torch.zeros(2, 8)) is None
    with pytest.raises(RuntimeError, match="capture failed"):
        runner.add_graphs("required", broken, 4, rows=False, x_in=(8, torch.float32))


def test_steps_with_prompt_chunks_replay_the_decode_graphs_row_by_row(tiny_mtp) -> None:
    """Two prompts (9 rows), then a third request's prompt beside the running one's decode
    (10 rows), run through the decode graphs with each prompt token a row at its own
    position; every token is the eager engine's, so each row read exactly its own context."""
    reqs = {
        "x": (prompt(5, 1), SamplingParams(max_tokens=2, ignore_eos=True)),
        "y": (prompt(4, 2), SamplingParams(temperature=0.9, seed=5, max_tokens=4, ignore_eos=True)),
        "z": (prompt(9, 3), SamplingParams(max_tokens=2, ignore_eos=True)),
    }
    want, _ = served(tiny_mtp, 0, graphs=False, reqs=reqs, overlap=True, max_running=2)
    got, info = served(
        tiny_mtp, 0, graphs=True, reqs=reqs, overlap=True, max_running=2, mixed_rows=16
    )
    assert got == want
    assert info["runner"].graph_sets["decode"].graphs[16].steps >= 2  # both mixed steps


def test_mtp_passes_through_graphs_draft_what_the_eager_passes_draft(tiny_mtp) -> None:
    """With the exact MTP head every draft is right only if each catch-up and drafting row got
    its own hidden state, token and position through the graphs' static inputs; the tokens are
    the one-token engine's (greedy: a sampled request draws differently when speculating)."""
    loaded = variant(tiny_mtp, 0.0)
    greedy = {r: REQS[r] for r in ("a", "b")}
    want, _ = served(loaded, 0, graphs=False, reqs=greedy, overlap=False)
    got, info = served(
        loaded, 3, graphs=True, reqs=greedy, speculative_schedule="all", max_running=2
    )
    assert got == want
    replays, stats = info["replays"], info["spec"].stats
    assert replays["decode"] > 0 and replays["mtp"] > 0 and replays["mtp_head"] > 0
    assert stats.verified > 0 and stats.accepted == stats.verified


def test_every_tensor_a_graph_touches_outlives_its_capture(tiny_mtp, monkeypatch) -> None:
    """A CUDA graph holds no tensor: what it reads and writes at replay must be kept alive by
    the runner, or its memory goes back to the allocator and each replay writes into whatever
    tensor gets it next. Recorded here as on CUDA (the closure dropped after the capture);
    every tensor the closures reached must still be alive afterwards, in every graph set."""
    import gc
    import weakref
    from collections import Counter

    from libs.engine.runner import ModelRunner

    reached: list[tuple[str, weakref.ref[torch.Tensor]]] = []

    def tensors(obj: object) -> list[torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            return [obj]
        if isinstance(obj, (list, tuple)):
            return [t for o in obj for t in tensors(o)]
        attrs = getattr(obj, "__dict__", {})
        return [v for v in attrs.values() if isinstance(v, torch.Tensor)]

    def record_as_cuda(self: ModelRunner, run):  # keeps only what a CUDA graph keeps
        with torch.inference_mode():
            outputs = run()
        for cell in run.__closure__ or ():
            for t in tensors(cell.cell_contents):
                reached.append((run.__qualname__, weakref.ref(t)))
        return object(), outputs

    monkeypatch.setattr(ModelRunner, "_record", record_as_cuda)
    eng = make(tiny_mtp, 2, **{**KERNELS, "max_running": 2})
    eng.runner.emulate_graphs()  # decode, mtp and mtp_head sets, ladder 1, 2 (4, 6 for decode)
    gc.collect()
    sets = eng.runner.graph_sets
    assert set(sets) == {"decode", "mtp", "mtp_head"} and all(gs.graphs for gs in sets.values())
    assert len(reached) > 10
    dead = Counter(name for name, ref in reached if ref() is None)
    assert not dead, f"tensors freed while their graphs still use them, by closure: {dead}"
