"""Start and stop the real servers the stack needs: nats-server and redis-server.

Used by ``deepserve up`` and by integration tests: each server gets a free port (or the one
asked for) and its data under a given directory, and is stopped with everything it started.
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from libs.common.redact import redact_text

_GIVEN: collections.deque[int] = collections.deque(maxlen=4096)


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out recently (the
    kernel may offer a just-closed port again, and a stack picks a dozen before any binds)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.append(port)
            return port
    raise RuntimeError("no free port that was not handed out recently")


def wait_port(
    host: str, port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"{shown_args(proc.args)} exited with {proc.returncode} before listening on {port}"
            )
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


def shown_args(args: Any) -> str:
    """A command line for an error message: the value after ``--pass`` masked, URLs redacted."""
    words = [str(a) for a in args] if isinstance(args, list | tuple) else [str(args)]
    words = ["***" if prev == "--pass" else w for prev, w in zip(["", *words], words)]
    return redact_text(" ".join(words))


def start_nats(
    port: int,
    data_dir: Path,
    log: Path | None = None,
    *,
    user: str = "",
    password: str = "",
    config: Path | None = None,
) -> subprocess.Popen[bytes]:
    """nats-server with JetStream on ``port``; with ``user`` and ``password`` a client must
    log in (``nats://user:password@127.0.0.1:port``); ``config`` is a config file to load
    (``deepserve up``'s users and permissions: libs/common/nats_auth.py)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = find_binary("nats-server", ["/usr/sbin/nats-server"])
    out = open(log, "ab") if log else subprocess.DEVNULL
    args = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(data_dir)]
    if config is not None:
        args += ["-c", str(config)]
    if user or password:
        args += ["--user", user, "--pass", password]
    proc = subprocess.Popen(
        args,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_port("127.0.0.1", port, 15, proc)
    return proc


def start_redis(
    port: int, data_dir: Path, log: Path | None = None, *, persist: bool = False
) -> subprocess.Popen[bytes]:
    """redis-server on ``port``; with ``persist`` it keeps its data in an append-only file
    under ``data_dir`` (fsync every second), so a restart on the same dir has it back."""
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = find_binary("redis-server", ["/usr/bin/redis-server"])
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "yes" if persist else "no",
            "--dir",
            str(data_dir),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
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


def start_seaweedfs(
    data_dir: Path, log: Path | None = None, timeout: float = 90.0
) -> tuple[subprocess.Popen[bytes], str]:
    """A single-node SeaweedFS (master, volume, filer, S3 gateway) on free ports; returns the
    process and its S3 endpoint URL once a bucket listing answers. Needs no network."""
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = find_binary("weed")
    # Every listener on a free port: weed's defaults (8333, 8888, 9333, 8181...) may be taken.
    names = [
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port",
        "s3.port.grpc",
        "s3.port.iceberg",
        "s3.port.lance",
    ]
    ports = [free_port() for _ in names]
    out = open(log, "ab") if log else subprocess.DEVNULL
    args = [
        binary,
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data_dir}",
        "-filer",
        "-s3",
        "-volume.max=0",
        "-master.volumeSizeLimitMB=256",
        "-master.telemetry=false",
    ]
    args += [f"-{n}={p}" for n, p in zip(names, ports)]
    # weed turns AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in its environment into its only
    # identity; without them a fresh single node accepts any credentials (a local test store).
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen(
        args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=data_dir, env=env
    )
    endpoint = f"http://127.0.0.1:{ports[6]}"
    try:
        wait_port("127.0.0.1", ports[6], timeout, proc)
        _wait_s3(endpoint, timeout, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, endpoint


def _wait_s3(endpoint: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    """Until a bucket can be created and written (the volume server registers a few s late)."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="any",
        aws_secret_access_key="any",
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.create_bucket(Bucket="ds-probe")
            client.put_object(Bucket="ds-probe", Key="probe", Body=b"x")
            return
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {proc.returncode} before S3 answered"
                ) from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
