"""Where a serving engine's steps spend their time, from inside the running service.

``DEEPSERVE_TORCH_PROFILE=DIR`` (with ``DEEPSERVE_TORCH_PROFILE_STEPS=START:COUNT[,START:COUNT
...]``, default ``200:100``) makes every engine of a process run steps ``START .. START + COUNT``
under ``torch.profiler`` and write ``DIR/torch-profile-<pid>-<START>.txt`` for each window:
each step's wall time, tokens and running requests, then the top operators and kernels by
device time and by host time. It is how a served engine's step is taken apart on a GPU (the
services inherit the variable from ``deepserve up``'s environment); without it nothing here
runs.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")
ENV = "DEEPSERVE_TORCH_PROFILE"
ENV_STEPS = "DEEPSERVE_TORCH_PROFILE_STEPS"


class StepProfile:
    def __init__(self, out_dir: Path, windows: list[tuple[int, int]]) -> None:
        self.out_dir, self.windows = out_dir, sorted(windows)
        self.start, self.count = self.windows.pop(0)
        self.seen = 0
        self.rows: list[tuple[float, int, int]] = []  # (seconds, tokens, running)
        self._prof: Any = None
        self._t0 = 0.0

    @classmethod
    def from_env(cls) -> StepProfile | None:
        out = os.environ.get(ENV)
        if not out:
            return None
        windows = []
        for w in os.environ.get(ENV_STEPS, "200:100").split(","):
            start, _, count = w.partition(":")
            windows.append((int(start), int(count or 100)))
        return cls(Path(out), windows)

    def step(self, run: Callable[[], T], tokens: Callable[[], int], running: int) -> T:
        """Run one step (``run``), profiled when it falls in the window."""
        self.seen += 1
        if not self.start <= self.seen < self.start + self.count:
            return run()
        from torch.profiler import ProfilerActivity, profile

        if self._prof is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        t0 = time.perf_counter()
        out = run()
        self.rows.append((time.perf_counter() - t0, tokens(), running))
        if self.seen == self.start + self.count - 1:
            self._write()
        return out

    def _write(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        events = self._prof.key_averages()
        self._prof = None
        secs = [r[0] for r in self.rows]
        device_us = sum(e.self_device_time_total for e in events)
        lines = [
            f"steps {self.start}..{self.start + len(self.rows) - 1}: wall {wall:.3f} s, "
            f"summed kernel time {device_us / 1e6:.3f} s, step host time p50 "
            f"{statistics.median(secs) * 1e3:.1f} ms, mean tokens "
            f"{statistics.fmean(r[1] for r in self.rows):.0f}",
            "step ms, tokens, running:",
            *(f"{s * 1e3:.1f} {t} {n}" for s, t, n in self.rows),
            events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70),
            events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
        ]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        name = f"torch-profile-{os.getpid()}-{self.start}.txt"
        (self.out_dir / name).write_text("\n".join(lines) + "\n")
        self.rows = []
        if self.windows:
            self.start, self.count = self.windows.pop(0)
