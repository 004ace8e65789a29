"""Which engine features run together: the one table of combinations the engine refuses.

Every refusal of a feature combination is a row of :data:`REFUSED` -- the features, the
reason a person can act on, and the test on a :class:`Setup` -- so the answer to "does X run
with Y" is read here, not searched for in the factories. :func:`check` raises one
``ValueError`` naming every row that applies; :class:`~.engine_config.EngineConfig` checks
what its own fields decide when it is made, the model family's factory checks the rest
(family, expert parallelism) before a weight is read, and ``deepserve generate`` checks its
flags through the same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Setup:
    """What an engine is asked to run, in the terms the table reads."""

    family: str = ""  # a registry family name ("deepseek-v3", "deepseek-v4"); "": not known yet
    weights: str = "auto"  # "auto" (the checkpoint's), "bf16" or "fp8"
    experts: str = "auto"  # "auto" (as the weights) or "fp4"
    batch_invariant: bool = False
    speculative: bool = False
    expert_parallel: bool = False
    kv_cache_dtype: bool = False  # a KV cache dtype other than the model's
    cuda: bool = False
    kernels: str = "auto"  # "auto", "triton" or "torch"


@dataclass(frozen=True)
class Refusal:
    features: tuple[str, ...]
    reason: str
    applies: Callable[[Setup], bool]


def _v4(what: Callable[[Setup], bool]) -> Callable[[Setup], bool]:
    return lambda s: s.family == "deepseek-v4" and what(s)


# The combinations the engine does not run, each with why and what to do instead. The V4 rows
# share one sentence (see :func:`check`), so a V4 request that asks for several hears all.
REFUSED: tuple[Refusal, ...] = (
    Refusal(
        ("FP8 weights", "FP4 experts"),
        "weight_dtype='fp8' and expert_dtype='fp4' exclude each other",
        lambda s: s.weights == "fp8" and s.experts == "fp4",
    ),
    Refusal(
        ("batch-invariant mode", "FP8 weights or FP4 experts"),
        "batch_invariant serves bf16 weights: drop weight_dtype='fp8' / expert_dtype='fp4'",
        lambda s: s.batch_invariant and (s.weights == "fp8" or s.experts == "fp4"),
    ),
    Refusal(
        ("batch-invariant mode", "PyTorch kernels on CUDA"),
        "batch_invariant on CUDA runs the Triton kernels: use kernels='auto' or 'triton'",
        lambda s: s.batch_invariant and s.cuda and s.kernels == "torch",
    ),
    Refusal(
        ("batch-invariant mode", "expert parallelism"),
        "batch-invariant mode does not run with expert parallelism yet",
        lambda s: s.batch_invariant and s.expert_parallel,
    ),
    Refusal(
        ("speculative decoding", "expert parallelism"),
        "speculative decoding does not run with expert parallelism yet",
        lambda s: s.speculative and s.expert_parallel,
    ),
    Refusal(("V4", "speculative decoding"), "V4", _v4(lambda s: s.speculative)),
    Refusal(("V4", "a KV cache dtype"), "V4", _v4(lambda s: s.kv_cache_dtype)),
    Refusal(("V4", "batch-invariant mode"), "V4", _v4(lambda s: s.batch_invariant)),
)


def refusals(setup: Setup, table: Iterable[Refusal] = REFUSED) -> list[str]:
    """The reasons ``setup`` is refused, one sentence per reason (empty: it runs)."""
    hits = [r for r in table if r.applies(setup)]
    out = [r.reason for r in hits if r.reason != "V4"]
    v4 = [r.features[1] for r in hits if r.reason == "V4"]
    if v4:
        out.append(f"DeepSeek-V4 models are served without {', '.join(v4)} for now")
    return out


def check(setup: Setup) -> None:
    """Raise ``ValueError`` naming every refused combination in ``setup``."""
    reasons = refusals(setup)
    if reasons:
        raise ValueError("; ".join(reasons))
