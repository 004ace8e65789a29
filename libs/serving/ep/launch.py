"""Start the rank processes of one EP group on this host and collect what each returns.

``run_group(fn, n, arg)`` starts N processes, each joins the group (:meth:`EPGroup.init` on a
free 127.0.0.1 port; rank ``r`` on ``cuda:r`` with NCCL when ``device`` is CUDA, else the CPU
with gloo), calls ``fn(group, arg)`` and sends back its result. A group across hosts runs
``run_group`` on each host with the same ``master`` (``host:port`` where rank 0 serves the
rendezvous) and that host's ``ranks`` (its k-th on ``cuda:k``); each host gets its own
ranks' results. A rank that raises takes the
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
from collections.abc import Callable, Sequence
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


def rank_device(device: str, local: int) -> str:
    """``cuda`` -> ``cuda:{local}`` (one GPU per rank, ``local``: its index on this host);
    anything else as given."""
    return f"cuda:{local}" if device == "cuda" else device


def run_group(
    fn: Callable[[EPGroup, A], T],
    n: int,
    arg: A,
    *,
    device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline_s: float | None = None,
    master: str = "",
    ranks: Sequence[int] | None = None,
) -> list[T]:
    """Run ``fn(group, arg)`` on ``ranks`` (None: ``0..n-1``) of an ``n``-rank group; their
    results in rank order.

    ``timeout_s``: every collective's timeout; ``deadline_s``: the whole run's (None: none);
    ``master``: the rendezvous ``host:port`` ("": a free port here, every rank here).
    """
    if n < 1:
        raise ValueError(f"an EP group needs at least one rank, got {n}")
    mine = list(range(n)) if ranks is None else list(ranks)
    if not mine or len(set(mine)) != len(mine) or not all(0 <= r < n for r in mine):
        raise ValueError(f"ranks {mine} are not distinct ranks of a group of {n}")
    if len(mine) < n and not master:
        raise ValueError("a group whose ranks are on several hosts needs master host:port")
    addr, _, port_text = master.rpartition(":") if master else (_ADDR, "", str(free_port()))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["libs.serving.ep.generate"])
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, n, (k, len(mine)), (addr, int(port_text)), device, timeout_s, arg),
            kwargs={"results": results},
            name=f"ep-rank-{r}",
            daemon=True,
        )
        for k, r in enumerate(mine)
    ]
    for p in procs:
        p.start()
    out: dict[int, T] = {}
    failure: str | None = None
    end = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        while len(out) < len(mine) and failure is None:
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
    return [out[r] for r in mine]


def _rank_main(
    fn: Callable[[EPGroup, Any], Any],
    rank: int,
    n: int,
    local: tuple[int, int],
    master: tuple[str, int],
    device: str,
    timeout_s: float,
    arg: Any,
    *,
    results: Any,
) -> None:
    """Rank ``rank`` of ``n``, the ``local[0]``-th of the ``local[1]`` ranks on this host."""
    dev = rank_device(device, local[0])
    if not dev.startswith("cuda"):
        # The ranks on this host share its cores: none oversubscribes them on its own.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local[1]))
    group = None
    try:
        group = EPGroup.init(rank, n, master[0], master[1], device=dev, timeout_s=timeout_s)
        results.put((rank, True, fn(group, arg)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if group is not None:
            group.close()
