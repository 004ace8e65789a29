"""``bench serve --url --client-processes N``: the trace's sessions dealt over N client
processes, so the load generator is not the bottleneck it measures.

One Python process streaming through the ``openai`` client parses every SSE chunk into
pydantic objects: a few thousand chunks a second fill its core (128 chat sessions on a GPU
stream ~8K). Each process here drives every N-th session (its share of ``--concurrency`` or
``--rate``); all start at one signal, and the run's seconds are from the first start to the
last finish (``perf_counter`` is the machine's monotonic clock, the same in every process).
Each process reports the CPU it used, so a report says how busy its clients were; with a
stack file, so does each service of the stack (read from ``/proc``, on the same host).
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepserve.bench.traces import Session, TraceShape

BUSY_CLIENT = 0.8  # a client process busier than this may have throttled what it measured
START_TIMEOUT_S = 120.0  # a client process that is not ready by then (imports) fails the run


@dataclass
class ClientRun:
    """What one client process measured."""

    results: list[Any]  # http_load.Result
    started: float  # perf_counter at the start signal
    finished: float
    cpu_s: float  # this process's CPU time over the run


def auto_processes(concurrency: int, rate: float) -> int:
    """One process per 32 concurrent sessions (open loop: per 2 sessions/s), at most half
    the machine's cores, at least 1."""
    want = math.ceil(concurrency / 32) if rate <= 0 else math.ceil(rate / 2)
    return max(1, min(want, (os.cpu_count() or 2) // 2))


def _child(
    drive: Callable[..., Coroutine[Any, Any, tuple[list[Any], float]]],
    kwargs: dict[str, Any],
    sessions: list[Session],
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    ready.put(os.getpid())
    go.wait()
    cpu0, t0 = time.process_time(), time.perf_counter()
    try:
        results, _ = asyncio.run(drive(sessions=sessions, quiet=True, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        out.put(("error", f"{type(exc).__name__}: {exc}"))
        return
    out.put(("ok", ClientRun(results, t0, time.perf_counter(), time.process_time() - cpu0)))


def drive_processes(
    drive: Callable[..., Coroutine[Any, Any, tuple[list[Any], float]]],
    processes: int,
    sessions: list[Session],
    shape: TraceShape,
    *,
    concurrency: int,
    rate: float,
    **kwargs: Any,
) -> tuple[list[Any], float, list[float]]:
    """``drive`` (``http_load.drive``: a module-level function, which a spawned process
    imports by name) over ``processes`` processes; returns every result, the run's seconds,
    and each process's CPU seconds. Blocks: call it off the event loop."""
    ctx = mp.get_context("spawn")  # nothing of this process's event loop or threads carries
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [sessions[i::processes] for i in range(processes)]
    shares = [s for s in shares if s]
    procs = []
    for i, share in enumerate(shares):
        conc = concurrency // len(shares) + (i < concurrency % len(shares))
        child_kwargs = dict(
            kwargs, shape=shape, concurrency=max(1, conc), rate=rate / len(shares) if rate else 0.0
        )
        p = ctx.Process(
            target=_child, args=(drive, child_kwargs, share, ready, go, out), daemon=True
        )
        p.start()
        procs.append(p)
    try:
        for _ in procs:
            ready.get(timeout=START_TIMEOUT_S)
        go.set()
        runs: list[ClientRun] = []
        for _ in procs:
            kind, value = out.get()
            if kind != "ok":
                raise RuntimeError(f"a client process failed: {value}")
            runs.append(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    results = [r for run in runs for r in run.results]
    seconds = max(r.finished for r in runs) - min(r.started for r in runs)
    return results, seconds, [r.cpu_s for r in runs]


def client_report(processes: int, cpu_s: list[float], seconds: float) -> dict[str, Any]:
    """The clients' CPU use: each process's busy fraction of the run."""
    busy = [c / seconds if seconds > 0 else 0.0 for c in cpu_s]
    return {
        "processes": processes,
        "cpu_s": sum(cpu_s),
        "busiest": max(busy, default=0.0),
        "busy": busy,
        "throttled": max(busy, default=0.0) > BUSY_CLIENT,
    }


def service_cpu(stack_json: str) -> dict[str, float]:
    """CPU seconds each process of a ``deepserve up`` run (its stack.json's ``pids``) has used
    so far, every thread counted; {} without a stack file or off its host."""
    if not stack_json:
        return {}
    try:
        pids = json.loads(Path(stack_json).read_text()).get("pids", {})
    except (OSError, ValueError):
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def service_shares(
    before: dict[str, float], after: dict[str, float], seconds: float
) -> dict[str, float]:
    """Each service's cores over the run (a Python service near 1.0 is a bottleneck)."""
    if seconds <= 0:
        return {}
    return {n: (after[n] - before[n]) / seconds for n in after if n in before}
