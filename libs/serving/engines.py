"""Which engine a service runs, from its model flags: the real model or the fake one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model_flags import ModelFlags

if TYPE_CHECKING:
    from libs.engine.engine import Engine


def build_engine(flags: ModelFlags) -> Engine:
    """Load the model ``flags`` name, or build the deterministic fake for ``--model fake``.

    Slow (loads weights, allocates the KV cache, captures CUDA graphs): call it off the
    event loop. Raises ValueError / OSError for a model that cannot be served.
    """
    from libs.engine.engine import Engine  # torch: only once an engine is built

    from .fake_engine import FAKE_MODEL, build_fake_engine

    if flags.model == FAKE_MODEL:
        return build_fake_engine(
            flags.engine_config(),
            step_seconds=flags.fake_step_ms / 1e3,
            token_seconds=flags.fake_token_us / 1e6,
        )
    engine = Engine(flags.engine_config())
    if engine.device.type == "cuda":  # compile the kernels' shapes before the first request
        import logging

        seconds = engine.warm_up()
        logging.getLogger(__name__).info("engine warmed up in %.1f s", seconds)
    return engine
