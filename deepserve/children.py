"""The stack's service processes: one :class:`Child` each, its health, its restarts, its stop.

No planning here (which argv and environment a service gets: :mod:`deepserve.service_plan`)
and no NATS or Redis (:mod:`deepserve.backends`): what a supervisor does to a process it
started -- wait for ``GET /healthz``, restart it after a backoff (:class:`RestartPolicy`),
signal its whole process group, drain it and kill what is left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

HOST = "127.0.0.1"


class StackError(RuntimeError):
    """The stack could not start: a service exited, or was not ready in time."""


@dataclass(frozen=True)
class RestartPolicy:
    """When :meth:`Stack.supervise` restarts a service that exited.

    The n-th restart in a row waits ``first_delay * 2**(n-1)`` seconds, at most ``max_delay``;
    a service that stays up ``reset_after`` seconds starts again from ``first_delay``. A
    service that exits ``max_start_failures`` times in a row before its /healthz answered
    (or is not healthy ``start_timeout`` seconds after a restart) stops the stack.
    """

    first_delay: float = 1.0
    max_delay: float = 30.0
    reset_after: float = 60.0
    max_start_failures: int = 5
    start_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.first_delay <= self.max_delay:
            raise ValueError(
                f"restart delays need 0 < first_delay <= max_delay, got "
                f"{self.first_delay:g} / {self.max_delay:g}"
            )
        if self.max_start_failures < 1:
            raise ValueError(f"max_start_failures must be >= 1, got {self.max_start_failures}")

    def delay(self, failures_in_a_row: int) -> float:
        """Seconds before the restart after the ``failures_in_a_row``-th exit (1, 2, ...)."""
        return min(self.max_delay, self.first_delay * 2.0 ** max(0, failures_in_a_row - 1))


@dataclass
class Child:
    """One service process: how it was started, where it logs, where its health is."""

    name: str  # log name: "kvstore", "prefill-0", ...
    service: str  # python -m services.<service>
    argv: list[str]
    health_port: int
    log_path: Path
    instance_id: str = ""
    grpc_port: int = 0
    ops_port: int = 0  # --http-port: /healthz and /metrics (the recipe's health is on its API)
    ep: int = 1  # expert-parallel ranks (processes started by this one); 1: none
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0  # times the supervisor started it again
    last_exit_code: int | None = None  # of its latest exit while the stack was up
    healthy: bool = False  # /healthz answered 200 since the latest (re)start
    started_at: float = 0.0  # time.monotonic() of the latest (re)start
    exits_in_a_row: int = 0  # exits without staying up reset_after seconds (sets the backoff)
    start_failures: int = 0  # exits in a row before /healthz ever answered
    restart_at: float | None = None  # a restart is due at this time.monotonic()
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def rank_ids(self) -> list[str]:
        """The routing identities it heartbeats under: its instance id, or one per EP rank
        (those of the group it started first; after a rank died, see its /healthz)."""
        if self.ep == 1:
            return [self.instance_id]
        return [f"{self.instance_id}-r{k}" for k in range(self.ep)]

    @property
    def ports(self) -> list[int]:
        """Every port it listens on (the supervisor chose them; a restart reuses them)."""
        return sorted({p for p in (self.health_port, self.ops_port, self.grpc_port) if p})

    def status(self) -> str:
        """``running`` (healthy), ``starting``, ``restarting`` (waiting out the backoff) or
        ``exited``."""
        if self.restart_at is not None:
            return "restarting"
        if not self.running():
            return "exited"
        return "running" if self.healthy else "starting"


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def healthz(port: int, timeout: float = 1.0) -> tuple[bool, str]:
    """(ready, detail) from ``GET /healthz`` on ``port``."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/healthz", timeout=timeout) as resp:
            return resp.status == 200, resp.read(200).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}: {exc.read(200).decode(errors='replace')}"
    except (OSError, ValueError) as exc:
        return False, str(exc)


def signal_group(c: Child, sig: signal.Signals) -> None:
    """Signal the child's process group (it leads its own session)."""
    assert c.proc is not None
    try:
        os.killpg(c.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def await_healthy(stage: Sequence[Child], ready_timeout: float) -> float:
    """Wait until every child of ``stage`` answers /healthz with 200; returns the stage's
    deadline (what is left of it bounds the wait for heartbeats). StackError, with the log
    tail, when one exits or is not ready within ``ready_timeout`` seconds."""
    deadline = time.monotonic() + ready_timeout
    pending = {c.name: c for c in stage}
    detail: dict[str, str] = {}
    while pending:
        for name, c in list(pending.items()):
            assert c.proc is not None
            if c.proc.poll() is not None:
                raise StackError(
                    f"{name} exited with code {c.proc.returncode} while starting; "
                    f"last lines of {c.log_path}:\n{log_tail(c.log_path)}"
                )
            ok, detail[name] = healthz(c.health_port)
            if ok:
                c.healthy = True
                del pending[name]
        if not pending:
            break
        if time.monotonic() > deadline:
            c = next(iter(pending.values()))
            raise StackError(
                f"{', '.join(pending)} not ready after {ready_timeout:.0f}s "
                f"(/healthz: {detail[c.name]}); last lines of {c.log_path}:\n"
                f"{log_tail(c.log_path)}"
            )
        time.sleep(0.2)
    return deadline


def supervise_child(c: Child, policy: RestartPolicy, launch: Callable[[Child], None]) -> str:
    """One supervision round for ``c``: what changed ("" if nothing). Restarts it through
    ``launch`` once its backoff passed and its ports are free; raises StackError when it
    failed ``policy.max_start_failures`` times in a row at start."""
    assert c.proc is not None
    now = time.monotonic()
    if c.restart_at is not None:
        if now < c.restart_at:
            return ""
        # Its ports are its identity (a decode's gRPC address is what prefill pushes KV
        # to); wait until the old process (and anything in its group) let them go.
        if not all(port_is_free(port) for port in c.ports):
            c.restart_at = now + 0.5
            return ""
        c.restart_at = None
        c.restarts += 1
        launch(c)
        return f"{c.name} restarted (restart {c.restarts}, pid {c.pid})"
    code = c.proc.poll()
    if code is None:
        if not c.healthy:
            if healthz(c.health_port, timeout=0.5)[0]:
                c.healthy, c.start_failures = True, 0
                return f"{c.name} is up again (pid {c.pid})" if c.restarts else ""
            if now - c.started_at > policy.start_timeout:
                signal_group(c, signal.SIGKILL)  # its exit counts as a failed start
                return f"{c.name} not healthy {policy.start_timeout:.0f}s after its start; killed"
        elif c.exits_in_a_row and now - c.started_at >= policy.reset_after:
            c.exits_in_a_row = 0  # it stayed up: the next restart waits first_delay again
        return ""
    signal_group(c, signal.SIGKILL)  # whatever it started in its group, so ports free up
    c.last_exit_code = code
    c.exits_in_a_row += 1
    if not c.healthy:
        c.start_failures += 1
    if c.start_failures >= policy.max_start_failures:
        raise StackError(
            f"{c.name} failed {c.start_failures} times in a row at start (last exit code "
            f"{code}); last lines of {c.log_path}:\n{log_tail(c.log_path)}"
        )
    delay = policy.delay(c.exits_in_a_row)
    c.restart_at, c.healthy = now + delay, False
    return (
        f"{c.name} exited with code {code}; restarting in {delay:g}s "
        f"(restart {c.restarts + 1}; log {c.log_path})"
    )


def stop_children(children: Sequence[Child], drain_seconds: float) -> list[str]:
    """SIGTERM every running child (reverse start order), wait up to the drain time, then
    SIGKILL each one's whole process group; closes their logs. Returns the names of those
    that had not exited by themselves (killed)."""
    live = [c for c in children if c.running()]
    for c in reversed(live):
        signal_group(c, signal.SIGTERM)
    deadline = time.monotonic() + drain_seconds + 5.0  # drain, then exit bookkeeping
    for c in reversed(live):
        assert c.proc is not None
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for c in children:
        if c.proc is not None:
            # Also ends anything the service itself started in its group.
            signal_group(c, signal.SIGKILL)
            if c.proc.poll() is None:
                c.proc.wait(10)
        if c._log is not None:
            c._log.close()
    return [c.name for c in children if c.proc is not None and c.proc.returncode == -signal.SIGKILL]
