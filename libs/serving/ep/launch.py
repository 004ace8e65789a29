"""Start the N rank processes of one EP group on this host and collect what each returns.

``run_group(fn, n, arg)`` starts N processes, each joins the group (:meth:`EPGroup.init` on a
free 127.0.0.1 port; rank ``r`` on ``cuda:r`` with NCCL when ``device`` is CUDA, else the CPU
with gloo), calls ``fn(group, arg)`` and sends back its result. A rank that raises takes the
group down: the others fail their next collective within the timeout (or are stopped), and
``run_group`` raises with the first failing rank's traceback. ``fn`` and ``arg`` must pickle
(``fn`` a module-level function).

Processes come from a fork server (multiprocessing's ``forkserver``) that imported torch and
the engine once: a rank inherits no state of the caller (its threads, its CUDA context) and
does not pay the ~2 s torch import again, N times over, on every launch.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from libs.engine.ep.group import DEFAULT_TIMEOUT_S, EPGroup

T = TypeVar("T")
A = TypeVar("A")

_ADDR = "127.0.0.1"


class RankFailed(RuntimeError):
    """A rank of the group raised (fatal for the group: its peers cannot go on)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_ADDR, 0))
        port: int = s.getsockname()[1]
        return port


def rank_device(device: str, rank: int) -> str:
    """``cuda`` -> ``cuda:{rank}`` (one GPU per rank); anything else as given."""
    return f"cuda:{rank}" if device == "cuda" else device


def run_group(
    fn: Callable[[EPGroup, A], T],
    n: int,
    arg: A,
    *,
    device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline_s: float | None = None,
) -> list[T]:
    """Run ``fn(group, arg)`` on ranks ``0..n-1``; their results in rank order.

    ``timeout_s``: every collective's timeout; ``deadline_s``: the whole run's (None: none).
    """
    if n < 1:
        raise ValueError(f"an EP group needs at least one rank, got {n}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["libs.serving.ep.generate"])
    results: Any = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, n, port, device, timeout_s, arg, results),
            name=f"ep-rank-{r}",
            daemon=True,
        )
        for r in range(n)
    ]
    for p in procs:
        p.start()
    out: dict[int, T] = {}
    failure: str | None = None
    end = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        while len(out) < n and failure is None:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    failure = f"{dead[0].name} exited with {dead[0].exitcode} and no result"
                elif end is not None and time.monotonic() > end:
                    failure = f"the group did not finish within {deadline_s} s"
                continue
            if ok:
                out[rank] = value
            else:
                failure = f"rank {rank} failed:\n{value}"
    finally:
        for p in procs:
            p.join(timeout=timeout_s if failure is None else 2.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    if failure is not None:
        raise RankFailed(failure)
    return [out[r] for r in range(n)]


def _rank_main(
    fn: Callable[[EPGroup, Any], Any],
    rank: int,
    n: int,
    port: int,
    device: str,
    timeout_s: float,
    arg: Any,
    results: Any,
) -> None:
    dev = rank_device(device, rank)
    if not dev.startswith("cuda"):
        # N ranks share this host's cores: no rank oversubscribes them on its own.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    group = None
    try:
        group = EPGroup.init(rank, n, _ADDR, port, device=dev, timeout_s=timeout_s)
        results.put((rank, True, fn(group, arg)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if group is not None:
            group.close()
