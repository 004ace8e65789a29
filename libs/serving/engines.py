"""Which engine a service runs, from its model flags: the real model or the fake one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model_flags import ModelFlags

if TYPE_CHECKING:
    from libs.engine.engine import Engine
    from libs.engine.grammar_probe import GrammarBudget
    from libs.engine.load_progress import ProgressSink


def build_engine(flags: ModelFlags, progress: ProgressSink | None = None) -> Engine:
    """Load the model ``flags`` name, or build the deterministic fake for ``--model fake``;
    ``progress`` hears how far a checkpoint's read has got (``libs/engine/load_progress.py``).

    Slow (loads weights, allocates the KV cache, captures CUDA graphs): call it off the
    event loop. Raises ValueError / OSError for a model that cannot be served.
    """
    import dataclasses

    from libs.engine.engine import Engine  # torch: only once an engine is built

    from .fake_engine import FAKE_MODEL, build_fake_engine

    if flags.model == FAKE_MODEL:
        return build_fake_engine(
            flags.engine_config(),
            step_seconds=flags.fake_step_ms / 1e3,
            token_seconds=flags.fake_token_us / 1e6,
        )
    engine = Engine(dataclasses.replace(flags.engine_config(), load_progress=progress))
    if engine.device.type == "cuda":  # compile the kernels' shapes before the first request
        import logging

        seconds = engine.warm_up()
        logging.getLogger(__name__).info("engine warmed up in %.1f s", seconds)
    return engine


def warm_grammar(engine: Engine, budget: GrammarBudget | None = None) -> float:
    """Build what structured outputs need over the whole vocabulary before the first request:
    the engine's grammar backend (xgrammar's views of the 129K-token vocabulary: 1-6 s on a
    busy CPU; built by the first constrained request, it ran on the service's event loop and
    stopped its heartbeats that long), a first compile, and the mask kernel on the engine's
    device (a Triton JIT on CUDA, per row-count specialization). Seconds it took.

    Called in the thread that loads the model, before the service reports ready. What a
    constraint of its own costs (compiling its schema) stays per request, bounded by
    ``budget``."""
    import time

    import torch

    from libs.common.sampling import Constraint
    from libs.engine.grammar import apply_masks

    t0 = time.perf_counter()
    g = engine.grammar
    g.compile(Constraint("json"))  # the JSON object grammar (json_object outputs), cached
    g.limit(budget)  # its probe process starts with the first new constraint (1-6 s, once)
    vocab = g.vocab_size
    bitmask = g._xgr.allocate_token_bitmask(16, vocab)  # all allowed
    logits = torch.zeros(16, vocab, dtype=torch.float32, device=engine.device)
    # Triton specializes an integer argument (the rows) on ==1, on %16 == 0, and otherwise.
    for rows in (1, 2, 16) if engine.device.type == "cuda" else (1,):
        apply_masks(logits[:rows], (list(range(rows)), bitmask[:rows]))
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - t0
