"""What the stack's services stand on: NATS, Redis and, for engines sharing a GPU, CUDA MPS.

:class:`Backends` starts nats-server (JetStream, behind ``<run_dir>/nats.conf``: a user per
service role, libs/common/nats_auth.py) and redis-server (append-only file) on free ports, or
uses ``NATS_URL`` / ``REDIS_URL`` from the environment; restarts the ones it started on the
same port with their data; stops them. :class:`Mps` runs the stack's own CUDA MPS control
daemon. :func:`await_heartbeats` waits until instances have heartbeated on NATS.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from deepserve import procs
from deepserve.children import HOST, StackError, log_tail, port_is_free
from deepserve.placement import EnginePlacement, shared_gpus
from libs.common import nats_auth


class Backends:
    """nats-server and redis-server of one stack (or the URLs its environment gives).

    ``passwords``: this stack's NATS password per role (and admin), written only to the
    owner-only nats.conf. After :meth:`start`, :attr:`nats_url` logs in as admin (when the
    stack started NATS), :attr:`nats_address` has no credentials (what services dial).
    """

    def __init__(self, run_dir: Path, env: Mapping[str, str], passwords: dict[str, str]) -> None:
        self.run_dir, self.env, self.passwords = run_dir, env, passwords
        self.nats_proc: subprocess.Popen[bytes] | None = None
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.nats_url = ""  # with the admin user's credentials when the stack started NATS
        self.redis_url = ""
        self.nats_address = ""  # nats://host:port, no credentials (what services dial)
        self.restarts = {"nats": 0, "redis": 0}
        self.nats_port = self.redis_port = 0  # of the servers the stack started

    def start(self) -> None:
        self.nats_url = self.nats_address = self.env.get("NATS_URL", "")
        if not self.nats_url:
            self.nats_port = procs.free_port()
            self._write_nats_config()
            self._start_nats()
            self.nats_address = f"nats://{HOST}:{self.nats_port}"
            self.nats_url = self.nats_url_of(nats_auth.ADMIN)
        self.redis_url = self.env.get("REDIS_URL", "")
        if not self.redis_url:
            # A new stack starts with empty data (this run's KV MAC key would refuse an
            # earlier run's blocks anyway); a restart within the run keeps redis's
            # append-only file, and so the kvstore's block files.
            shutil.rmtree(self.run_dir / "kvstore", ignore_errors=True)
            shutil.rmtree(self.run_dir / "redis", ignore_errors=True)
            self.redis_port = procs.free_port()
            self._start_redis()
            self.redis_url = f"redis://{HOST}:{self.redis_port}/0"

    def nats_url_of(self, user: str) -> str:
        """The URL of this stack's nats-server logged in as ``user`` (a role or admin)."""
        return f"nats://{user}:{self.passwords[user]}@{HOST}:{self.nats_port}"

    def login_env(self, service: str) -> dict[str, str]:
        """NATS_URL for ``service``, and on the stack's own nats-server its role's login (only
        that role's): URLs that may carry credentials travel in the environment, not on the
        command line (which every user of the host can read)."""
        env = {"NATS_URL": self.nats_address}
        if self.nats_proc is not None:
            role = service if service in nats_auth.PERMISSIONS else "tools"
            env[nats_auth.USER_ENV] = role
            env[nats_auth.PASSWORD_ENV] = self.passwords[role]
        return env

    def tools_url(self) -> str:
        """What stack.json names: the tools user's URL (``deepserve usage``), not admin's."""
        return self.nats_url_of("tools") if self.nats_proc else self.nats_url

    def _write_nats_config(self) -> None:
        """``<run_dir>/nats.conf`` (0600): a user per role, each limited to its subjects."""
        text = nats_auth.server_config(
            {r: self.passwords[r] for r in nats_auth.ROLES},
            admin_password=self.passwords[nats_auth.ADMIN],
        )
        path = self.run_dir / "nats.conf"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        tmp.replace(path)

    def _start_nats(self) -> None:
        self.nats_proc = procs.start_nats(
            self.nats_port,
            self.run_dir / "nats",
            self.run_dir / "logs" / "nats.log",
            config=self.run_dir / "nats.conf",
        )

    def _start_redis(self) -> None:
        self.redis_proc = procs.start_redis(
            self.redis_port,
            self.run_dir / "redis",
            self.run_dir / "logs" / "redis.log",
            persist=True,
        )

    def supervise(self) -> list[str]:
        """Start nats-server / redis-server again (same port, config and data) if it exited;
        what happened, one line each. StackError when one does not start again."""
        events = []
        starts: tuple[tuple[str, Callable[[], None]], ...] = (
            ("nats", self._start_nats),
            ("redis", self._start_redis),
        )
        for name, start in starts:
            proc = self.nats_proc if name == "nats" else self.redis_proc
            if proc is None or proc.poll() is None:
                continue
            code, log = proc.returncode, self.run_dir / "logs" / f"{name}.log"
            port = self.nats_port if name == "nats" else self.redis_port
            deadline = time.monotonic() + 10.0
            while not port_is_free(port) and time.monotonic() < deadline:
                time.sleep(0.2)  # what it left behind lets the port go
            try:
                start()
            except (RuntimeError, OSError) as exc:
                raise StackError(
                    f"{name}-server exited with code {code} and did not start again ({exc}); "
                    f"last lines of {log}:\n{log_tail(log)}"
                ) from exc
            self.restarts[name] += 1
            new = self.nats_proc if name == "nats" else self.redis_proc
            assert new is not None
            events.append(
                f"{name}-server exited with code {code}; restarted with its data "
                f"(restart {self.restarts[name]}, pid {new.pid}; log {log})"
            )
        return events

    def pids(self) -> dict[str, int]:
        return {
            **({"nats": self.nats_proc.pid} if self.nats_proc else {}),
            **({"redis": self.redis_proc.pid} if self.redis_proc else {}),
        }

    def stop(self) -> list[str]:
        """Stop redis-server and nats-server (those started); the names of any still running."""
        for proc in (self.redis_proc, self.nats_proc):
            if proc is not None:
                procs.stop(proc)
        return [
            name
            for name, p in (("redis", self.redis_proc), ("nats", self.nats_proc))
            if p is not None and p.poll() is None
        ]


class Mps:
    """Disaggregated engines sharing a GPU: a CUDA MPS control daemon of this stack's own
    (pipe and log directories under the run dir, so it neither meets nor stops anyone
    else's), so their kernels run side by side instead of time-slicing. :attr:`status` says
    what happened ("" : not asked; shown by ``up`` and in stack.json); :attr:`env` is what
    an engine needs to reach it."""

    def __init__(self, run_dir: Path, env: Mapping[str, str]) -> None:
        self.run_dir, self.base_env = run_dir, env
        self.status = ""
        self.env: dict[str, str] = {}

    def start(self, placements: Sequence[EnginePlacement]) -> None:
        shared = shared_gpus(list(placements))
        if not shared:
            return
        gpus = ",".join(map(str, shared))
        control = shutil.which("nvidia-cuda-mps-control")
        if control is None:
            self.status = (
                f"not available (no nvidia-cuda-mps-control): engines time-slice GPU {gpus}"
            )
            return
        env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.run_dir / "mps" / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self.run_dir / "mps" / "log"),
        }
        for d in env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(
                [control, "-d"],
                env={**self.base_env, **env},
                check=True,
                timeout=30,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self.status = f"could not start ({exc}): engines time-slice GPU {gpus}"
            return
        self.env = env
        self.status = f"started for GPU {gpus} (pipe {env['CUDA_MPS_PIPE_DIRECTORY']})"

    def stop(self) -> None:
        control = shutil.which("nvidia-cuda-mps-control")
        if not self.env or control is None:
            return
        try:
            subprocess.run(
                [control],
                input=b"quit\n",
                env={**self.base_env, **self.env},
                timeout=30,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError):
            pass  # its daemon exits with the machine; nothing else depends on it
        self.env = {}


async def await_heartbeats(
    nats_url: str,
    instance_ids: set[str],
    timeout: float,
    kv_blocks: dict[str, tuple[int, int]] | None = None,
) -> set[str]:
    """Instance ids not heard on ``ds.heartbeat.>`` within ``timeout`` (empty: all heard);
    ``kv_blocks`` gets each one's (KV blocks, block size) as its heartbeat says."""
    import nats

    from libs.common import subjects
    from libs.proto.deepserve.v1 import control_pb2

    missing = set(instance_ids)
    done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        status = control_pb2.InstanceStatus.FromString(msg.data)
        missing.discard(status.instance_id)
        if kv_blocks is not None and status.instance_id in instance_ids:
            kv_blocks[status.instance_id] = (status.total_kv_blocks, status.block_size)
        if not missing:
            done.set()

    nc = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_msg)
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except TimeoutError:
            pass
    finally:
        await nc.close()
    return missing
