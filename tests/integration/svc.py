"""Run one service as its own process for a test (``python -m services.<name>``), always stopped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from deepserve import procs

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def service(
    name: str, args: list[str], log_dir: Path, timeout: float = 20.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``services.<name>`` with ``args`` and a free ``--http-port``; wait for /healthz."""
    http_port = procs.free_port()
    log_path = log_dir / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPSERVE_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}", *args, "--http-port", str(http_port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode}:\n{log_path.read_text()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.get(f"http://127.0.0.1:{http_port}/healthz", timeout=1)
                    if r.status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{name} not healthy after {timeout:.0f}s:\n{log_path.read_text()}"
                    )
                time.sleep(0.1)
            yield proc
        finally:
            procs.stop(proc)
