"""The ``deepserve up`` command around a :class:`~deepserve.up.Stack`: start it, print where
it listens, supervise it until SIGINT/SIGTERM (or until it must stop), stop it."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from deepserve.children import HOST, StackError, log_tail, port_is_free
from deepserve.placement import parse_gpus
from deepserve.service_plan import engine_args, merge_args
from deepserve.up_report import starting_line, up_lines

if TYPE_CHECKING:
    from deepserve.up import Stack


def _serve(stack: Stack, stop_requested: Sequence[int]) -> str:
    """Supervise ``stack`` until a signal arrives (returns "") or it must stop (returns why)."""
    while not stop_requested:
        if stack.restart_policy is None:
            dead = stack.exited()
            if dead:
                c = dead[0]
                code_of = c.proc.returncode if c.proc else "?"
                return (
                    f"{c.name} exited with code {code_of}; stopping. "
                    f"Last lines of {c.log_path}:\n{log_tail(c.log_path)}"
                )
        else:
            try:
                events = stack.supervise()
            except StackError as exc:
                return f"{exc}\nstopping the stack"
            for line in events:
                print(f"deepserve up: {line}", flush=True)
        time.sleep(0.5)
    return ""


class _Interrupted(BaseException):
    """SIGINT/SIGTERM while the stack was still starting."""


def run_up(
    port: int,
    prefill: int,
    decode: int,
    model: str,
    model_name: str,
    run_dir: str,
    ready_timeout: float = 300.0,
    *,
    device: str = "cpu",
    gpus: str | None = None,
    gpu_memory_fraction: float | None = None,
    restart: bool = True,
    ep: int = 1,
    ep_timeout: float | None = None,
    speculative_tokens: int = 0,
    batch_invariant: bool = False,
    mode: str = "auto",
    more_args: Mapping[str, Sequence[str]] | None = None,
    api_key: str = "",
) -> int:
    """``deepserve up``: start the stack, print its URL, serve until SIGINT/SIGTERM, stop it.

    ``more_args``: further flags per service (:func:`vllm_args` makes them from vLLM's names);
    ``api_key``: the one key the API then requires (tenant ``default``), handed to the recipe
    and the entrypoint through their environment like the other secrets.

    With ``restart`` a service that exits is restarted (:meth:`Stack.supervise`); the stack
    stops, with exit code 1, only when one fails repeatedly at start or nats/redis exit.
    Without it the first service that exits stops the stack. A bad flag (``gpus``:
    ``"0,1"``; None: every visible GPU) or a taken port: one line on stderr and 2, before
    anything starts."""
    from deepserve.up import Stack  # here: deepserve.up re-exports run_up from this module

    try:
        stack = Stack(
            run_dir,
            prefill=prefill,
            decode=decode,
            model=model,
            model_name=model_name,
            recipe_port=port,
            device=device,
            gpus=parse_gpus(gpus) if gpus is not None else None,
            gpu_memory_fraction=gpu_memory_fraction,
            ready_timeout=ready_timeout,
            restart=restart,
            ep=ep,
            ep_timeout=ep_timeout,
            # Prefill fills the MTP layer's KV that decode drafts from, and a continuation is
            # exact only if both engines are batch-invariant: both get these flags.
            extra_args=merge_args(engine_args(speculative_tokens, batch_invariant), more_args),
            mode=mode,
            env={**os.environ, "DEEPSERVE_API_KEYS": f"{api_key}=default"} if api_key else None,
        )
    except ValueError as exc:
        print(f"deepserve up: {exc}", file=sys.stderr)
        return 2
    if not port_is_free(port):
        print(
            f"deepserve up: port {port} on {HOST} is already in use; pick another with --port",
            file=sys.stderr,
        )
        return 2
    stop_requested: list[int] = []
    starting = True

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.append(signum)
        if starting and len(stop_requested) == 1:  # abandon the start; start() cleans up
            raise _Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        print(starting_line(stack, ep), flush=True)
        try:
            stack.start()
        except _Interrupted:
            print("deepserve: interrupted while starting; stopped", flush=True)
            return 0  # start() already stopped what it had started
        except (StackError, OSError) as exc:
            print(f"deepserve up: {exc}", file=sys.stderr)
            return 1
        finally:
            starting = False
        for line in up_lines(stack):
            print(line, flush=True)
        problem = _serve(stack, stop_requested)
        if problem:
            print(f"deepserve up: {problem}", file=sys.stderr, flush=True)
            code = 1
        print("deepserve: stopping ...", flush=True)
    finally:
        stack.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("deepserve: stopped", flush=True)
    return code
