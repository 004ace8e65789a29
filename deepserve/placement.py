"""Where ``deepserve up`` runs each engine: which GPU, how much of it, and in which mode.

Pure functions over GPU indices (only :func:`visible_gpus` asks torch how many there are);
unit-tested without a GPU (``tests/unit/test_up_placement.py``).

Modes. ``disaggregated``: prefill and decode are separate engines (processes), dealt over the
GPUs by :func:`place_engines`; where both roles land on one GPU they time-slice it (MPS, when
the supervisor can start it, lets their kernels run side by side) and each holds its own copy
of the weights. ``aggregated``: one engine per GPU (``services/aggregated``) is both a prefill
and a decode target -- one copy of the weights, one KV pool, prompt chunks inside the decode
batch, no KV hand-over. ``auto`` (the default) picks aggregated exactly when the two roles
would otherwise share a GPU (fewer GPUs than engines), disaggregated when each has GPUs of
its own, and on the CPU (tests and ``make up`` show the disaggregated path).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from libs.common.config import parse_gpu_indices

MODES = ("auto", "aggregated", "disaggregated")

# Of each GPU, the share split among the engines placed on it. The rest is for what the
# fraction does not count: each process's CUDA context and library workspaces (~0.5-1 GiB).
GPU_MEMORY_SHARE = 0.90


@dataclass(frozen=True)
class EnginePlacement:
    """Where one prefill/decode instance runs, as the flags its process gets."""

    name: str  # "prefill-0", "decode-1", ...
    device: str  # "cpu", "cuda:<i>", or "cuda" for an EP group (its ranks on ep_gpus)
    gpu_memory_fraction: float | None = None  # None: not on a GPU (else: of each GPU)
    ep_gpus: tuple[int, ...] = ()  # an EP group on CUDA: rank k on cuda:<ep_gpus[k]>

    def flags(self) -> list[str]:
        out = ["--device", self.device]
        if self.ep_gpus:
            out += ["--ep-gpus", ",".join(map(str, self.ep_gpus))]
        if self.gpu_memory_fraction is not None:
            out += ["--gpu-memory-fraction", repr(self.gpu_memory_fraction)]
        return out


def place_engines(
    prefill: int,
    decode: int,
    gpus: Sequence[int] = (),
    *,
    fraction: float | None = None,
    share: float = GPU_MEMORY_SHARE,
    ep: Mapping[str, int] | None = None,
) -> list[EnginePlacement]:
    """Deal the engines over ``gpus`` round robin, roles interleaved.

    The order is prefill-0, decode-0, prefill-1, decode-1, ... (the extra instances of the
    larger role last); the k-th engine goes to ``gpus[k % len(gpus)]``. So with one GPU every
    engine shares it; with two GPUs and as many prefill as decode instances, prefill runs on
    the first and decode on the second; with as many GPUs as engines, each has its own.
    Each engine gets ``fraction`` of its GPU if given, else ``share`` / (engines on that
    GPU), rounded down to 1e-4. No ``gpus``: every engine on the CPU, no fraction.
    Raises ValueError for counts below one, a fraction outside (0, 1], or engines on one
    GPU whose fractions add up to more than 1.

    ``ep``: ranks per engine name (absent: 1). When an engine has more than one, GPUs are
    dealt in units of its rank count and nobody shares one: in the same order each engine
    takes the next ``ep`` GPUs (device ``cuda``, ``ep_gpus`` its ranks' GPUs; an engine of
    one rank ``cuda:<i>``), each with ``fraction`` or ``share`` of them. NCCL refuses two
    ranks of a group on one GPU, and ranks of co-located groups would wait on each other's
    steps, so ValueError when the GPUs are fewer than the ranks that need them.
    """
    if prefill < 1 or decode < 1:
        raise ValueError(
            f"need at least one prefill and one decode instance, got {prefill}/{decode}"
        )
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must lie in (0, 1], got {fraction}")
    names = [f"prefill-{i}" for i in range(prefill)], [f"decode-{i}" for i in range(decode)]
    order = [n for i in range(max(prefill, decode)) for role in names for n in role[i : i + 1]]
    if not gpus:
        return [EnginePlacement(name, "cpu") for name in order]
    widths = {name: (ep or {}).get(name, 1) for name in order}
    if max(widths.values()) > 1:
        return _place_ep(order, widths, gpus, fraction if fraction is not None else share)
    gpu_of = {name: gpus[k % len(gpus)] for k, name in enumerate(order)}
    per_gpu = {g: list(gpu_of.values()).count(g) for g in gpus}
    if fraction is not None:
        crowded = {g: n for g, n in per_gpu.items() if n * fraction > 1}
        if crowded:
            g, n = next(iter(crowded.items()))
            raise ValueError(
                f"--gpu-memory-fraction {fraction:g} x {n} engines on cuda:{g} is more than "
                f"the whole GPU; use at most {_round_down(1 / n):g}"
            )
    return [
        EnginePlacement(
            name,
            f"cuda:{gpu_of[name]}",
            fraction if fraction is not None else _round_down(share / per_gpu[gpu_of[name]]),
        )
        for name in order
    ]


def _place_ep(
    order: Sequence[str], widths: Mapping[str, int], gpus: Sequence[int], fraction: float
) -> list[EnginePlacement]:
    """GPUs of their own for every engine, ``widths[name]`` each (see :func:`place_engines`)."""
    need = sum(widths.values())
    if need > len(gpus):
        ranks = " + ".join(f"{widths[n]} ({n})" for n in order)
        raise ValueError(
            f"--ep on --device cuda: each rank needs a GPU of its own (NCCL refuses two ranks "
            f"on one), and these engines have {need} ranks = {ranks}, but the GPUs are "
            f"{len(gpus)} ({','.join(map(str, gpus))}); pass more --gpus or fewer "
            "--ep / --prefill / --decode"
        )
    out, at = [], 0
    for name in order:
        mine = tuple(gpus[at : at + widths[name]])
        at += widths[name]
        if len(mine) == 1:
            out.append(EnginePlacement(name, f"cuda:{mine[0]}", fraction))
        else:
            out.append(EnginePlacement(name, "cuda", fraction, ep_gpus=mine))
    return out


def _round_down(x: float) -> float:
    """To 1e-4, down (0.9 / 7 -> 0.1285), so the shares never add up to more than intended;
    the 1e-9 keeps 0.45 from becoming 0.4499 through float error."""
    return math.floor(x * 1e4 + 1e-9) / 1e4


def parse_gpus(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``; ValueError with the flag's name for anything else."""
    gpus = list(parse_gpu_indices(text, "--gpus"))
    if not gpus:
        raise ValueError(f"--gpus must list GPU indices such as 0 or 0,1; got {text!r}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus names a GPU twice: {text!r}")
    return gpus


def visible_gpus(asked: Sequence[int] | None = None) -> list[int]:
    """``asked`` (default: every visible CUDA device), checked against what torch sees.

    Imports torch (only called for ``device="cuda"``); ``torch.cuda.device_count()`` creates
    no CUDA context, so the supervisor takes no GPU memory.
    """
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(
            "--device cuda: no CUDA device is visible to torch "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    if asked is None:
        return list(range(count))
    missing = [g for g in asked if g >= count]
    if missing:
        raise ValueError(
            f"--gpus {','.join(map(str, asked))}: no GPU {','.join(map(str, missing))}; "
            f"{count} visible (0..{count - 1})"
        )
    return list(asked)


def choose_mode(
    mode: str, device: str, gpus: Sequence[int], prefill: int, decode: int, ep: int = 1
) -> str:
    """``aggregated`` or ``disaggregated`` for ``--mode`` (see the module docstring);
    ValueError for a mode this deployment cannot run."""
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        shared = device == "cuda" and len(gpus) < prefill + decode
        return "aggregated" if shared and ep == 1 else "disaggregated"
    if mode == "aggregated" and ep > 1:
        raise ValueError(
            "--mode aggregated runs one engine per GPU without expert parallelism; "
            "use --mode disaggregated with --ep"
        )
    return mode


def place_aggregated(
    count: int, gpus: Sequence[int] = (), *, fraction: float | None = None
) -> list[EnginePlacement]:
    """``aggregated-<i>``: one per GPU of ``gpus`` (``count`` ignored), each with ``fraction``
    or :data:`GPU_MEMORY_SHARE` of it; no GPUs: ``count`` engines on the CPU."""
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must lie in (0, 1], got {fraction}")
    if not gpus:
        if count < 1:
            raise ValueError(f"need at least one aggregated instance, got {count}")
        return [EnginePlacement(f"aggregated-{i}", "cpu") for i in range(count)]
    share = fraction if fraction is not None else GPU_MEMORY_SHARE
    return [EnginePlacement(f"aggregated-{i}", f"cuda:{g}", share) for i, g in enumerate(gpus)]


def shared_gpus(placements: Sequence[EnginePlacement]) -> list[int]:
    """GPUs that more than one engine runs on (where MPS helps)."""
    on = [p.device for p in placements if p.device.startswith("cuda:")]
    return sorted({int(d.split(":")[1]) for d in on if on.count(d) > 1})
