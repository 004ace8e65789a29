"""Bounded grammar compilation: a constraint is first compiled in a probe process, under a time
and a memory budget, and killed there when it exceeds either; only a constraint that fits is
then compiled in the engine's process (``GrammarBackend.compile``).

Why a process: xgrammar's compile cannot be cancelled, and what it costs grows fast with some
schemas -- measured on the 129K-token DeepSeek vocabulary, one compiler thread (the probe's),
a 2-core box: an object of 100 optional string properties compiles in 0.08 s, 600 in 1.4 s,
1,000 in 6.2 s, 1,500 in 25 s (issue 33: 4,000 in 59 s, 8,000 in 390 s and +3.9 GB). A
thread that ran such a compile would hold a core and its memory long after the request was
refused. A compiled grammar cannot be handed back from the probe either (600 properties
serialize to 124 MB), so the engine compiles it again -- once the probe showed it fits; the
engine's compile then takes about as long as the probe's (it has at least as many threads).

The probe (``python -m libs.engine.grammar_probe``) gets the tokenizer once, builds the same
vocabulary views as the engine (1-4 s, ~450 MB: xgrammar imports torch), then answers compile
requests over its stdin/stdout, one at a time. The parent times each answer and watches the
probe's resident memory; past :attr:`GrammarBudget.compile_seconds`, or past
:attr:`GrammarBudget.memory_mib` of growth, it kills the probe (the next request starts a new
one) and the constraint is refused with :class:`GrammarLimitError` naming the limit. A compiled
grammar larger than ``memory_mib`` is refused the same way (the engine would hold it in its
cache). ``probes`` processes serve at once, so one tenant's slow schema delays another
tenant's new schema by at most the budget; a schema already compiled (cached) never waits.
"""

from __future__ import annotations

import json
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .grammar_compile import Compilers, GrammarError, build_views, reason_of

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">I")
_POLL_S = 0.02  # the parent's look at the probe's memory while it compiles
_START_TIMEOUT_S = 120.0  # a probe builds the vocabulary views (1-4 s; a loaded host: more)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class GrammarBudget:
    """What compiling one constraint may cost: ``compile_seconds`` of the probe's time (one
    compiler thread) and ``memory_mib`` of memory (the probe's growth while compiling, and the
    compiled grammar's size); ``probes`` compile at once."""

    compile_seconds: float = 5.0
    memory_mib: int = 256
    probes: int = 2

    def __post_init__(self) -> None:
        if not self.compile_seconds > 0:
            raise ValueError(f"--grammar-compile-seconds must be > 0, got {self.compile_seconds}")
        if self.memory_mib <= 0:
            raise ValueError(f"--grammar-memory-mib must be positive, got {self.memory_mib}")
        if self.probes < 1:
            raise ValueError(f"grammar probes must be >= 1, got {self.probes}")

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib << 20


class GrammarLimitError(GrammarError):
    """The constraint does not compile within this deployment's budget (the message names the
    limit and its flag)."""


def over_time(kind: str, budget: GrammarBudget) -> GrammarLimitError:
    return GrammarLimitError(
        f"the {kind} constraint did not compile within {budget.compile_seconds:g} s, this "
        "server's limit (--grammar-compile-seconds); simplify it (fewer optional properties, "
        "alternatives or bounded repetitions)"
    )


def over_memory(kind: str, budget: GrammarBudget, compiled_bytes: int = 0) -> GrammarLimitError:
    what = (
        f"compiles to {compiled_bytes / 2**20:.0f} MiB, more than"
        if compiled_bytes
        else "took more memory to compile than"
    )
    return GrammarLimitError(
        f"the {kind} constraint {what} this server's limit of {budget.memory_mib} MiB "
        "(--grammar-memory-mib); simplify it"
    )


class ProbePool:
    """Probe processes over one tokenizer. :meth:`check` blocks (call it off the event loop and
    off the engine thread); thread-safe."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        budget: GrammarBudget,
    ) -> None:
        self.budget = budget
        self._setup = {
            "tokenizer": tokenizer_json,
            "vocab_size": vocab_size,
            "stop_token_ids": [int(t) for t in stop_token_ids],
        }
        self._slots = threading.BoundedSemaphore(budget.probes)
        self._lock = threading.Condition()
        self._idle: list[_Probe] = []
        self._starting = 0  # replacements starting in the background
        self._closed = False
        self.started = 0  # probe processes started (a killed one is replaced)

    def warm(self) -> None:
        """Start one probe now (a service does it before it reports ready)."""
        with self._slots:
            probe = self._take()
            self._give_back(probe)

    def check(self, kind: str, spec: str) -> None:
        """Whether ``kind``/``spec`` compiles within the budget: returns if so; raises
        :class:`GrammarLimitError` past a limit, :class:`GrammarError` if it does not compile
        at all, RuntimeError if no probe can run."""
        with self._slots:
            probe = self._take()
            try:
                refusal, healthy = probe.judge(kind, spec, self.budget)
            except BaseException:
                probe.kill()
                raise
            if healthy:
                self._give_back(probe)
            else:
                probe.kill()  # stopped mid-compile (or dead): its CPU and memory come back now
                self._replace()
        if refusal is not None:
            raise refusal

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._lock.notify_all()
        for probe in idle:
            probe.kill()

    def _take(self) -> _Probe:
        with self._lock:
            # a replacement on its way is sooner than a probe started now (both build views)
            self._lock.wait_for(lambda: self._idle or not self._starting or self._closed)
            if self._closed:
                raise RuntimeError("the grammar probes are closed")
            if self._idle:
                return self._idle.pop()
            self.started += 1
        return _Probe.start(self._setup)

    def _give_back(self, probe: _Probe) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.budget.probes:
                self._idle.append(probe)
                self._lock.notify()
                return
        probe.kill()

    def _replace(self) -> None:
        """Start a probe for the one just killed, in the background: the next new constraint
        should not wait seconds for the vocabulary views."""

        def start() -> None:
            try:
                probe = _Probe.start(self._setup)
            except RuntimeError as exc:  # the next check() starts one and reports it
                log.warning("%s", exc)
                probe = None
            with self._lock:
                self._starting -= 1
                self._lock.notify_all()
            if probe is not None:
                self._give_back(probe)

        with self._lock:
            if self._closed:
                return
            self.started += 1
            self._starting += 1
        threading.Thread(target=start, name="grammar-probe-start", daemon=True).start()


class _Probe:
    """One probe process and its pipes."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self.stdin, self.stdout = proc.stdin, proc.stdout

    @classmethod
    def start(cls, setup: dict[str, Any]) -> _Probe:
        root = str(Path(__file__).resolve().parents[2])  # the package root, importable there
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "libs.engine.grammar_probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        probe = cls(proc)
        try:
            _write(probe.stdin, setup)
            reply = probe._reply(time.monotonic() + _START_TIMEOUT_S, None)
        except (OSError, ValueError) as exc:
            reply = f"failed: {exc}"
        if not isinstance(reply, dict) or not reply.get("ready"):
            probe.kill()
            raise RuntimeError(f"the grammar probe did not start ({reply})")
        return probe

    def judge(
        self, kind: str, spec: str, budget: GrammarBudget
    ) -> tuple[GrammarError | None, bool]:
        """Why the constraint does not fit (None: it does), and whether this probe may compile
        again (not when it was stopped mid-compile); RuntimeError if it cannot be asked."""
        baseline = _rss(self.proc.pid)
        started = time.monotonic()
        try:
            _write(self.stdin, {"kind": kind, "spec": spec})
        except OSError as exc:
            raise RuntimeError(f"the grammar probe is gone ({exc})") from None
        limit = None if baseline is None else baseline + budget.memory_bytes
        reply = self._reply(started + budget.compile_seconds, limit)
        if reply == "time":
            return over_time(kind, budget), False
        if reply == "memory":
            return over_memory(kind, budget), False
        if not isinstance(reply, dict):  # the probe died while compiling
            crashed = f"the {kind} constraint crashed the grammar compiler ({reply}); simplify it"
            return GrammarError(crashed), False
        if not reply["ok"]:
            bad = f"constraint of kind {kind!r} does not compile: {reply['error']}"
            return GrammarError(bad), True
        if reply["bytes"] > budget.memory_bytes:
            return over_memory(kind, budget, reply["bytes"]), True
        return None, True

    def _reply(self, deadline: float, rss_limit: int | None) -> dict[str, Any] | str:
        """The next message, or why none came: "time", "memory", or how the probe ended."""
        fd, buf = self.stdout.fileno(), b""
        while True:
            now = time.monotonic()
            if now >= deadline:
                return "time"
            ready, _, _ = select.select([fd], [], [], min(_POLL_S, deadline - now))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return f"exit {self.proc.wait()}"
                buf += chunk
                if len(buf) >= _HEADER.size:
                    (size,) = _HEADER.unpack_from(buf)
                    if len(buf) >= _HEADER.size + size:
                        reply: dict[str, Any] = json.loads(buf[_HEADER.size : _HEADER.size + size])
                        return reply
            if rss_limit is not None and (_rss(self.proc.pid) or 0) > rss_limit:
                return "memory"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.stdin, self.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _rss(pid: int) -> int | None:
    """A process's resident memory in bytes (Linux's /proc; None where there is none)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _write(pipe: IO[bytes], message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    pipe.write(_HEADER.pack(len(data)) + data)
    pipe.flush()


def _read(pipe: IO[bytes]) -> dict[str, Any] | None:
    head = pipe.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    message: dict[str, Any] = json.loads(pipe.read(size))
    return message


def main() -> None:
    """The probe: setup, then one compile per request until its stdin closes (the parent
    died or closed it)."""
    out = os.fdopen(os.dup(1), "wb")  # the replies; stray prints go to stderr instead
    os.dup2(2, 1)
    parent = os.getppid()

    def orphaned() -> None:  # the parent died mid-compile: stop now, not when xgrammar is done
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=orphaned, name="parent-watch", daemon=True).start()
    inp = sys.stdin.buffer
    setup = _read(inp)
    if setup is None:
        return
    views = build_views(setup["tokenizer"], setup["vocab_size"], setup["stop_token_ids"])
    compilers = Compilers(views, threads=1)
    compilers.compile("json", "")  # first compile: xgrammar's own start-up, not a request's
    _write(out, {"ready": True})
    while (request := _read(inp)) is not None:
        started = time.perf_counter()
        try:
            compiled = compilers.compile(request["kind"], request["spec"])
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            _write(out, {"ok": False, "error": reason_of(exc)})
            continue
        _write(
            out,
            {
                "ok": True,
                "seconds": time.perf_counter() - started,
                "bytes": int(compiled.memory_size_bytes),
            },
        )
        del compiled


if __name__ == "__main__":
    main()
