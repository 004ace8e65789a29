"""Offline generation over an EP group: prompts spread over the ranks, outputs in prompt order.

``generate(model, prompts, params, ep=N)`` starts N rank processes (:func:`run_group`); prompt
``i`` is served by rank ``i mod N`` (attention is data-parallel: each rank its own requests,
scheduler and KV cache); a rank with fewer prompts runs empty steps while others work. This
is what ``deepserve generate --ep N`` runs, and the greedy tokens equal ``--ep 1``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from libs.common.sampling import SamplingParams
from libs.engine.ep.group import DEFAULT_TIMEOUT_S, EPGroup
from libs.engine.ep.placement import Placement
from libs.engine.llm import LLM, GenerationOutput

from .launch import run_group


@dataclass(frozen=True)
class EPJob:
    """What every rank runs. ``replace``: (step, placement): after that many lockstep steps
    every rank re-places its experts live (:meth:`EPRuntime.apply_placement`)."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    placement: Placement | None = None
    replace: tuple[int, Placement] | None = None
    decode_text: bool = True
    device: str = "cpu"


@dataclass(frozen=True)
class RankResult:
    outputs: tuple[tuple[int, GenerationOutput], ...]  # (prompt index, output)
    # [MoE layers][experts]: tokens this rank routed (plain lists: a tensor sent between
    # processes would be shared memory that dies with the rank)
    load_counts: list[list[int]]
    steps: int
    seconds: float


def generate(
    model: str,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    ep: int,
    device: str = "cpu",
    placement: Placement | None = None,
    replace: tuple[int, Placement] | None = None,
    decode_text: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **engine_kwargs: Any,
) -> list[GenerationOutput]:
    """Greedy/sampled outputs of ``prompts``, in order, from an ``ep``-rank group."""
    results = generate_ranks(
        model,
        prompts,
        params,
        ep=ep,
        device=device,
        placement=placement,
        replace=replace,
        decode_text=decode_text,
        timeout_s=timeout_s,
        **engine_kwargs,
    )
    return collect_outputs(results, len(prompts))


def generate_ranks(
    model: str,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    ep: int,
    device: str = "cpu",
    placement: Placement | None = None,
    replace: tuple[int, Placement] | None = None,
    decode_text: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    master: str = "",
    ranks: Sequence[int] | None = None,
    **engine_kwargs: Any,
) -> list[RankResult]:
    """:func:`generate`, returning each rank's :class:`RankResult` (load counts, steps).
    Across hosts: ``master`` (rank 0's rendezvous) and this host's ``ranks``, whose results
    alone come back (every host passes the same prompts)."""
    plist = (
        tuple(params)
        if isinstance(params, Sequence)
        else (params or SamplingParams(),) * len(prompts)
    )
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
    job = EPJob(
        model,
        tuple(p if isinstance(p, str) else tuple(int(t) for t in p) for p in prompts),
        plist,
        dict(engine_kwargs),
        placement,
        replace,
        decode_text,
        device,
    )
    return run_group(
        run_rank, ep, job, device=device, timeout_s=timeout_s, master=master, ranks=ranks
    )


def collect_outputs(results: Sequence[RankResult], n: int) -> list[GenerationOutput]:
    by_index = {i: out for r in results for i, out in r.outputs}
    return [by_index[i] for i in range(n)]


def run_rank(group: EPGroup, job: EPJob) -> RankResult:
    """One rank: its own Engine over prompts ``rank, rank + N, ...``, stepping in lockstep."""
    import time

    from libs.engine.engine import Engine, EngineConfig

    # The group's device: its GPU on this host (run_group picked it), or the CPU.
    config = EngineConfig(model=job.model, device=str(group.device), **job.engine_kwargs)
    engine = Engine(config, ep=group, placement=job.placement)
    runtime = engine.ep
    assert runtime is not None  # built with a group
    mine = [i for i in range(len(job.prompts)) if i % group.size == group.rank]
    steps = 0

    def on_step(step: int) -> None:
        nonlocal steps
        steps = step
        if job.replace is not None and step == job.replace[0]:
            runtime.apply_placement(job.replace[1])

    t0 = time.perf_counter()
    outs = LLM(engine=engine).generate(
        [job.prompts[i] for i in mine],
        [job.params[i] for i in mine],
        decode_text=job.decode_text,
        on_step=on_step,
    )
    seconds = time.perf_counter() - t0
    counts: torch.Tensor = runtime.load_counts()
    return RankResult(tuple(zip(mine, outs)), counts.tolist(), steps, seconds)
