"""Start and stop the real servers the stack needs: nats-server and redis-server.

Used by ``deepserve up`` and by integration tests: each server gets a free port (or the one
asked for) and its data under a given directory, and is stopped with everything it started.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def find_binary(name: str, extra: list[str] = ()) -> str:  # type: ignore[assignment]
    """The binary next to this Python first (pip-installed servers), then PATH, then ``extra``."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    for path in extra:
        if Path(path).is_file():
            return path
    raise FileNotFoundError(f"{name} not found; run `make setup`")


def start_nats(port: int, data_dir: Path, log: Path | None = None) -> subprocess.Popen[bytes]:
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = find_binary("nats-server", ["/usr/sbin/nats-server"])
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(data_dir)],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    wait_port("127.0.0.1", port, 15, proc)
    return proc


def start_redis(port: int, data_dir: Path, log: Path | None = None) -> subprocess.Popen[bytes]:
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = find_binary("redis-server", ["/usr/bin/redis-server"])
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(data_dir)],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    wait_port("127.0.0.1", port, 15, proc)
    return proc


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL; never leaves the process behind."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
