"""``deepserve up``: the whole stack on one machine, each service its own process.

:class:`Stack` starts nats-server (JetStream) and redis-server on free ports -- or uses
``NATS_URL`` / ``REDIS_URL`` from the environment -- then the services in dependency order:

    kvstore, balancer  ->  prefill x N, decode x M  ->  entrypoint  ->  recipe

Each stage waits until every process in it answers ``GET /healthz`` with 200, and the model
stage also until every prefill/decode instance has heartbeated once (the balancer is already
subscribed by then, so the first request can be routed). Ports are picked free and passed as
explicit flags; each child logs to ``<run_dir>/logs/<name>.log`` and runs in its own process
group, so a terminal's Ctrl-C reaches only the supervisor, which then drains the children.

``stop()`` sends SIGTERM to every service (reverse order), waits up to the drain time, kills
what is left (the whole process group), then stops redis and nats. ``<run_dir>/stack.json``
names every process started, for tools and tests that check nothing outlives the stack, and
where each service listens (API, gRPC, ops ports, kvstore, NATS, Redis).

With ``restart`` (``deepserve up`` turns it on; tests that kill instances on purpose leave it
off) :meth:`Stack.supervise`, called in a loop, restarts a service that exits: same argv, env
and ports, after an exponential backoff (:class:`RestartPolicy`); its restart count and last
exit code go into stack.json. A service that fails ``max_start_failures`` times in a row
before answering /healthz stops the stack. nats-server and redis-server, when the stack
started them, are restarted at once on the same port with their data: redis keeps an
append-only file under ``<run_dir>/redis`` (the kvstore's block metadata survives), nats-server
the same JetStream store (``<run_dir>/nats``: the usage stream survives); the services
reconnect by themselves. Either failing to come back stops the stack.

NATS is internal like every other port: the nats-server the stack starts loads
``<run_dir>/nats.conf`` (owner-only), a user per service role with fresh passwords and the
permissions of ``libs/common/nats_auth.py``. Each service gets only its own role's user and
password, through its environment (DEEPSERVE_NATS_USER / DEEPSERVE_NATS_PASSWORD). The
supervisor logs in as ``admin`` (:attr:`Stack.nats_url`, for tests); stack.json names the
``tools`` user's URL (what ``deepserve usage`` needs).

With ``device="cuda"`` the engines are spread over GPUs by :func:`place_engines`: each gets
``--device cuda:<i>`` and ``--gpu-memory-fraction`` (its share of that GPU).

With ``ep`` (``deepserve up --ep N``) a prefill/decode instance is an expert-parallel group of
N rank processes that its own process starts and supervises (``libs/serving/ep_supervisor.py``);
each rank heartbeats as ``<instance>-r<k>`` (the stack waits for every rank's heartbeat), and
the supervisor restarts the group with the ranks left when one dies. On CUDA every rank gets
a GPU of its own (``--ep-gpus``, dealt by :func:`place_engines` in units of N GPUs).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

from deepserve import procs
from deepserve.placement import (
    choose_mode,
    parse_gpus,
    place_aggregated,
    place_engines,
    shared_gpus,
    visible_gpus,
)
from libs.common import nats_auth
from libs.common.grpc_auth import call_metadata
from libs.common.redact import redact, redact_text
from libs.engine.tokenizer import model_vocab_size

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


class StackError(RuntimeError):
    """The stack could not start: a service exited, or was not ready in time."""


# Which service needs which secret (docs/security.md): the entrypoint keys the tenants' cache
# salts; prefill and decode sign and check KV frames; the internal APIs need the service token.
ENGINE_SERVICES = ("prefill", "decode", "aggregated")  # the services that run an engine
SERVICE_SECRETS = {
    "entrypoint": ("DEEPSERVE_CACHE_SALT_SECRET", "DEEPSERVE_SERVICE_TOKEN"),
    "prefill": ("DEEPSERVE_KV_MAC_KEY", "DEEPSERVE_SERVICE_TOKEN"),
    "decode": ("DEEPSERVE_KV_MAC_KEY", "DEEPSERVE_SERVICE_TOKEN"),
    "aggregated": ("DEEPSERVE_KV_MAC_KEY", "DEEPSERVE_SERVICE_TOKEN"),
    "kvstore": ("DEEPSERVE_SERVICE_TOKEN",),
    "recipe": ("DEEPSERVE_SERVICE_TOKEN",),
}


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
    import socket

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


async def _await_heartbeats(
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


def default_model_name(model: str) -> str:
    """The served name for ``--model``: ``deepseek-<preset>`` (or ``deepseek-fake``), else the
    checkpoint directory's name."""
    stripped = model.rstrip("/")
    return Path(stripped).name if "/" in stripped else f"deepseek-{stripped}"


class Stack:
    """The deepserve stack as child processes; a context manager that always cleans up.

    ``extra_args`` adds flags per service (key: service name such as ``"prefill"``).
    ``recipe_port`` 0 picks a free port. ``device`` is ``"cpu"`` or ``"cuda"``; with CUDA the
    engines are placed over ``gpus`` (default: every visible GPU) by :func:`place_engines`,
    each with ``gpu_memory_fraction`` if given. After :meth:`start`, :attr:`api_url`,
    :attr:`grpc_address`, :attr:`nats_url`, :attr:`redis_url` and :attr:`instance_ids` are set.
    ``restart`` (True: the default :class:`RestartPolicy`) lets :meth:`supervise` restart
    services that exit; without it a service that exits stays down (:meth:`exited`).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        prefill: int = 1,
        decode: int = 1,
        model: str = "tiny",
        model_name: str = "deepseek-tiny",
        recipe_port: int = 0,
        device: str = "cpu",
        gpus: Sequence[int] | None = None,
        gpu_memory_fraction: float | None = None,
        ready_timeout: float = 120.0,
        drain_seconds: float = 10.0,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        env: Mapping[str, str] | None = None,
        restart: RestartPolicy | bool = False,
        ep: int | Mapping[str, int] = 1,
        ep_timeout: float | None = None,
        mode: str = "disaggregated",
    ) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(
                f"--device must be cpu or cuda (pick GPUs with --gpus), got {device!r}"
            )
        if device == "cpu" and (gpus or gpu_memory_fraction is not None):
            raise ValueError("--gpus and --gpu-memory-fraction apply to --device cuda")
        # ep: ranks of every prefill/decode instance, or per instance/service name
        # ({"decode-0": 2} or {"decode": 2}; others 1)
        self.ep = ep
        for n in [ep] if isinstance(ep, int) else list(ep.values()):
            if n < 1:
                raise ValueError(f"--ep must be >= 1, got {n}")
        names = [("prefill", f"prefill-{i}") for i in range(prefill)]
        names += [("decode", f"decode-{i}") for i in range(decode)]
        on = visible_gpus(gpus or None) if device == "cuda" else []
        widest = max(self.ep_of(name, service) for service, name in names)
        self.mode = choose_mode(mode, device, on, prefill, decode, widest)
        if self.mode == "aggregated":  # one engine per GPU (CPU: as many as the larger role)
            self.placements = place_aggregated(
                max(prefill, decode), on, fraction=gpu_memory_fraction
            )
        else:
            self.placements = place_engines(
                prefill,
                decode,
                on,
                fraction=gpu_memory_fraction,
                ep={name: self.ep_of(name, service) for service, name in names},
            )
        self.mps = ""  # what became of MPS for engines sharing a GPU ("": not asked)
        self._mps_env: dict[str, str] = {}
        self.kv_blocks: dict[str, tuple[int, int]] = {}  # instance -> (KV blocks, block size)
        self.vocab_size = model_vocab_size(model)  # ValueError for a model nobody can load
        self.run_dir = Path(run_dir).resolve()
        self.prefill, self.decode = prefill, decode
        self.model, self.model_name, self.device = model, model_name, device
        self.recipe_port = recipe_port
        self.ready_timeout, self.drain_seconds = ready_timeout, drain_seconds
        self.restart_policy: RestartPolicy | None = (
            (RestartPolicy(start_timeout=ready_timeout) if restart else None)
            if isinstance(restart, bool)
            else restart
        )
        self.extra_args = {k: list(v) for k, v in (extra_args or {}).items()}
        if ep_timeout is not None and ep_timeout <= 0:
            raise ValueError(f"--ep-timeout must be positive, got {ep_timeout}")
        self.ep_timeout = ep_timeout
        self.env = dict(os.environ if env is None else env)
        self.stack_id = secrets.token_hex(3)
        # This stack's secrets (unless the environment gives them): they reach the services
        # through their environment, never their command lines.
        self.secrets = {
            name: self.env.get(name) or secrets.token_hex(32)
            for name in {n for names in SERVICE_SECRETS.values() for n in names}
        }
        self.children: list[Child] = []
        self.nats_proc: subprocess.Popen[bytes] | None = None
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.nats_url = ""  # with the admin user's credentials when the stack started NATS
        self.redis_url = ""
        self.nats_address = ""  # nats://host:port, no credentials (what services dial)
        # this stack's NATS passwords, a fresh one per role (and admin); never written but
        # to the owner-only nats.conf
        self.nats_passwords = {
            role: secrets.token_hex(24) for role in (*nats_auth.ROLES, nats_auth.ADMIN)
        }
        self.backend_restarts = {"nats": 0, "redis": 0}
        self._nats_port = self._redis_port = 0  # of the servers the stack started
        self.grpc_address = ""
        self.kvstore_address = ""
        self.api_base = ""  # http://host:port
        self._stopped = False
        self.killed: list[str] = []  # services that did not exit within the drain time

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata with this stack's service credential, for tools and tests that call
        its internal APIs (or Generate) directly."""
        return call_metadata(self.secrets["DEEPSERVE_SERVICE_TOKEN"])

    # -- public surface ----------------------------------------------------------------
    @property
    def api_url(self) -> str:
        """OpenAI base URL, e.g. ``http://127.0.0.1:8000/v1``."""
        return f"{self.api_base}/v1"

    @property
    def instance_ids(self) -> dict[str, list[str]]:
        ids: dict[str, list[str]] = {}
        for c in self.children:
            ids.setdefault(c.service, []).append(c.instance_id)
        return ids

    def exited(self) -> list[Child]:
        """Services that have exited (while the stack should be up, that is a failure)."""
        return [c for c in self.children if c.proc is not None and c.proc.poll() is not None]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start -------------------------------------------------------------------------
    def start(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._start_backends()
        kv_port = procs.free_port()
        self._write_state()
        # kvstore and balancer need only NATS/Redis; the balancer must listen to heartbeats
        # before any engine starts, and the engines must be routable before the entrypoint.
        kvstore = self._plan(
            "kvstore",
            "kvstore",
            grpc_port=kv_port,
            args=["--data-dir", str(self.run_dir / "kvstore")],
        )
        balancer = self._plan("balancer", "balancer")
        stages = [[kvstore, balancer]]
        kv_addr = self.kvstore_address = f"{HOST}:{kv_port}"
        model_args = ["--model", self.model, "--model-name", self.model_name]
        placed = {p.name: p.flags() for p in self.placements}  # --device [--gpu-memory-...]
        if self.mode == "aggregated":
            engines = [
                self._plan_engine(p.name, "aggregated", procs.free_port(), [*model_args, *f])
                for p, f in ((p, placed[p.name]) for p in self.placements)
            ]
        else:
            engines = [
                self._plan_engine(
                    f"prefill-{i}", "prefill", 0, [*model_args, *placed[f"prefill-{i}"]]
                )
                for i in range(self.prefill)
            ]
            engines += [
                self._plan_engine(
                    f"decode-{i}",
                    "decode",
                    procs.free_port(),
                    [*model_args, *placed[f"decode-{i}"]],
                )
                for i in range(self.decode)
            ]
            self._start_mps()
        stages.append(engines)
        ep_port = procs.free_port()
        self.grpc_address = f"{HOST}:{ep_port}"
        entrypoint = self._plan(
            "entrypoint",
            "entrypoint",
            grpc_port=ep_port,
            args=[
                "--kvstore-address",
                kv_addr,
                "--model-name",
                self.model_name,
                "--vocab-size",
                str(self.vocab_size),
            ],
        )
        stages.append([entrypoint])
        recipe_port = self.recipe_port or procs.free_port()
        self.api_base = f"http://{HOST}:{recipe_port}"
        stages.append([self._plan_recipe(recipe_port, kvstore, balancer, entrypoint)])
        for stage in stages:
            for c in stage:
                self._spawn(c)
            self._write_state()
            self._await_ready(stage)
        self._write_state()

    def _start_backends(self) -> None:
        self.nats_url = self.nats_address = self.env.get("NATS_URL", "")
        if not self.nats_url:
            self._nats_port = procs.free_port()
            self._write_nats_config()
            self._start_nats()
            self.nats_address = f"nats://{HOST}:{self._nats_port}"
            self.nats_url = self.nats_url_of(nats_auth.ADMIN)
        self.redis_url = self.env.get("REDIS_URL", "")
        if not self.redis_url:
            # A new stack starts with empty data (this run's KV MAC key would refuse an
            # earlier run's blocks anyway); a restart within the run keeps redis's
            # append-only file, and so the kvstore's block files.
            shutil.rmtree(self.run_dir / "kvstore", ignore_errors=True)
            shutil.rmtree(self.run_dir / "redis", ignore_errors=True)
            self._redis_port = procs.free_port()
            self._start_redis()
            self.redis_url = f"redis://{HOST}:{self._redis_port}/0"

    def nats_url_of(self, user: str) -> str:
        """The URL of this stack's nats-server logged in as ``user`` (a role or admin)."""
        return f"nats://{user}:{self.nats_passwords[user]}@{HOST}:{self._nats_port}"

    def _write_nats_config(self) -> None:
        """``<run_dir>/nats.conf`` (0600): a user per role, each limited to its subjects."""
        text = nats_auth.server_config(
            {r: self.nats_passwords[r] for r in nats_auth.ROLES},
            admin_password=self.nats_passwords[nats_auth.ADMIN],
        )
        path = self.run_dir / "nats.conf"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        tmp.replace(path)

    def _start_nats(self) -> None:
        self.nats_proc = procs.start_nats(
            self._nats_port,
            self.run_dir / "nats",
            self.run_dir / "logs" / "nats.log",
            config=self.run_dir / "nats.conf",
        )

    def _start_redis(self) -> None:
        self.redis_proc = procs.start_redis(
            self._redis_port,
            self.run_dir / "redis",
            self.run_dir / "logs" / "redis.log",
            persist=True,
        )

    def _plan(
        self, name: str, service: str, *, grpc_port: int = 0, args: Sequence[str] = ()
    ) -> Child:
        ops_port = procs.free_port()
        instance_id = f"{name}-{self.stack_id}"
        argv = [
            "--http-port",
            str(ops_port),
            "--instance-id",
            instance_id,
            "--drain-seconds",
            str(self.drain_seconds),
        ]
        if grpc_port:
            argv += ["--grpc-port", str(grpc_port)]
        argv += [*args, *self.extra_args.get(service, [])]
        return Child(
            name,
            service,
            argv,
            ops_port,
            self.run_dir / "logs" / f"{name}.log",
            instance_id=instance_id,
            grpc_port=grpc_port,
            ops_port=ops_port,
        )

    def ep_of(self, name: str, service: str) -> int:
        if isinstance(self.ep, int):
            return self.ep
        return self.ep.get(name, self.ep.get(service, 1))

    def _plan_engine(self, name: str, service: str, grpc_port: int, args: list[str]) -> Child:
        """A prefill/decode instance; with EP its process supervises the rank processes (each
        rank picks its own gRPC port: what the stack passes is then unused)."""
        ep = self.ep_of(name, service)
        ep_args = ["--ep", str(ep)] if ep > 1 else []
        if ep > 1 and self.ep_timeout is not None:
            ep_args += ["--ep-timeout", repr(self.ep_timeout)]
        c = self._plan(
            name,
            service,
            grpc_port=grpc_port,
            args=["--kvstore-address", self.kvstore_address, *args, *ep_args],
        )
        c.ep = ep
        return c

    def _plan_recipe(self, port: int, kvstore: Child, balancer: Child, entrypoint: Child) -> Child:
        # The recipe's health is on its main HTTP port; its ops port's /status page reads the
        # other services' ops ports.
        c = self._plan(
            "recipe",
            "recipe",
            args=[
                "--port",
                str(port),
                "--entrypoint-address",
                self.grpc_address,
                "--model-name",
                self.model_name,
                "--model",
                self.model,
                "--kvstore-ops-address",
                f"{HOST}:{kvstore.ops_port}",
                "--balancer-ops-address",
                f"{HOST}:{balancer.ops_port}",
                "--entrypoint-ops-address",
                f"{HOST}:{entrypoint.ops_port}",
            ],
        )
        c.health_port = port
        return c

    def _spawn(self, c: Child) -> None:
        self.children.append(c)
        self._launch(c)

    def _launch(self, c: Child) -> None:
        """Start (or restart) ``c``'s process with its argv and this stack's environment."""
        env = dict(self.env)
        for name in SERVICE_SECRETS.get(c.service, ()):  # each secret only where it is used
            env.setdefault(name, self.secrets[name])
        # URLs that may carry credentials travel in the environment, not on the command line
        # (which every user of the host can read).
        env["NATS_URL"] = self.nats_address
        if self.nats_proc is not None:  # ours: the service logs in as its role, only that
            role = c.service if c.service in nats_auth.PERMISSIONS else "tools"
            env[nats_auth.USER_ENV] = role
            env[nats_auth.PASSWORD_ENV] = self.nats_passwords[role]
        if c.service in ENGINE_SERVICES:
            env.update(self._mps_env)  # the engines reach this stack's MPS daemon, if any
        if c.service in ("kvstore", "recipe", "entrypoint"):
            # kvstore: its metadata; recipe and entrypoint: per-key caps shared by every
            # replica and the entrypoint's usage ledger.
            env["REDIS_URL"] = self.redis_url
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        # Open for the child's whole life; stop() (or the next restart) closes it.
        if c._log is not None:
            c._log.close()
        c._log = open(c.log_path, "ab")  # noqa: SIM115
        cmd = [sys.executable, "-m", f"services.{c.service}", *c.argv]
        shown = redact_text(" ".join(cmd))  # --nats-url/--redis-url may carry a password
        c._log.write(f"# {time.strftime('%F %T')} {shown}\n".encode())
        c._log.flush()
        c.healthy, c.started_at = False, time.monotonic()
        c.proc = subprocess.Popen(
            cmd,
            stdout=c._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,
        )

    def _await_ready(self, stage: list[Child]) -> None:
        deadline = time.monotonic() + self.ready_timeout
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
                    f"{', '.join(pending)} not ready after {self.ready_timeout:.0f}s "
                    f"(/healthz: {detail[c.name]}); last lines of {c.log_path}:\n"
                    f"{log_tail(c.log_path)}"
                )
            time.sleep(0.2)
        engines = {i for c in stage if c.service in ENGINE_SERVICES for i in c.rank_ids}
        if engines:
            missing = asyncio.run(
                _await_heartbeats(
                    self.nats_url, engines, max(5.0, deadline - time.monotonic()), self.kv_blocks
                )
            )
            if missing:
                raise StackError(f"no heartbeat on NATS from {', '.join(sorted(missing))}")

    # -- supervise -------------------------------------------------------------------
    def supervise(self) -> list[str]:
        """One round of supervision (call it every ~0.5 s while the stack is up): restart
        what exited once its backoff passed, note what became healthy. Returns what happened,
        one line each, for the operator's log; stack.json is rewritten on every change.

        Does nothing without a restart policy or after :meth:`stop`. Restarts nats-server or
        redis-server (those the stack started) at once when one exited, with its data; raises
        StackError when one cannot start again, or a service failed ``max_start_failures``
        times in a row at start (the message names it and has its log tail).
        """
        policy = self.restart_policy
        if policy is None or self._stopped:
            return []
        events = self._supervise_backends()
        events += [e for c in self.children if (e := self._supervise_child(c, policy))]
        if events:
            self._write_state()
        return events

    def _supervise_backends(self) -> list[str]:
        """Start nats-server / redis-server again (same port, config and data) if it exited."""
        events = []
        for name, proc, start in (
            ("nats", self.nats_proc, self._start_nats),
            ("redis", self.redis_proc, self._start_redis),
        ):
            if proc is None or proc.poll() is None:
                continue
            code, log = proc.returncode, self.run_dir / "logs" / f"{name}.log"
            port = self._nats_port if name == "nats" else self._redis_port
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
            self.backend_restarts[name] += 1
            new = self.nats_proc if name == "nats" else self.redis_proc
            assert new is not None
            events.append(
                f"{name}-server exited with code {code}; restarted with its data "
                f"(restart {self.backend_restarts[name]}, pid {new.pid}; log {log})"
            )
        if events:
            self._write_state()
        return events

    def _supervise_child(self, c: Child, policy: RestartPolicy) -> str:
        """What changed for ``c`` ("" if nothing); see :meth:`supervise`."""
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
            self._launch(c)
            return f"{c.name} restarted (restart {c.restarts}, pid {c.pid})"
        code = c.proc.poll()
        if code is None:
            if not c.healthy:
                if healthz(c.health_port, timeout=0.5)[0]:
                    c.healthy, c.start_failures = True, 0
                    return f"{c.name} is up again (pid {c.pid})" if c.restarts else ""
                if now - c.started_at > policy.start_timeout:
                    _signal_group(c, signal.SIGKILL)  # its exit counts as a failed start
                    return (
                        f"{c.name} not healthy {policy.start_timeout:.0f}s after its start; killed"
                    )
            elif c.exits_in_a_row and now - c.started_at >= policy.reset_after:
                c.exits_in_a_row = 0  # it stayed up: the next restart waits first_delay again
            return ""
        _signal_group(c, signal.SIGKILL)  # whatever it started in its group, so ports free up
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

    def _write_state(self) -> None:
        """``<run_dir>/stack.json``: what runs and where it listens, for local tools.

        The NATS and Redis URLs are written as given (a tool needs them usable), so the file
        is created owner-only (0600), like the run dir's other state; the stack's secrets are
        never written.
        """
        state = {
            "api_url": self.api_url if self.api_base else "",
            "grpc_address": self.grpc_address,  # the entrypoint's Generate
            "kvstore_address": self.kvstore_address,
            "decode_addresses": {
                c.name: f"{HOST}:{c.grpc_port}"
                for c in self.children
                if c.service in ("decode", "aggregated")
            },
            "mode": self.mode,
            "mps": self.mps,
            # tools' credentials (deepserve usage), not admin's
            "nats_url": self.nats_url_of("tools") if self.nats_proc else self.nats_url,
            "backend_restarts": self.backend_restarts,
            "redis_url": self.redis_url,
            "supervisor_pid": os.getpid(),
            "pids": {
                **({"nats": self.nats_proc.pid} if self.nats_proc else {}),
                **({"redis": self.redis_proc.pid} if self.redis_proc else {}),
                **{c.name: c.pid for c in self.children if c.proc is not None},
            },
            "instance_ids": self.instance_ids,
            # where each service serves /healthz and /metrics
            "ops_ports": {c.name: c.ops_port for c in self.children},
            "services": {
                c.name: {
                    "service": c.service,
                    "instance_id": c.instance_id,
                    "ep": c.ep,
                    # the ids its ranks heartbeat under (its first group's; a later group's:
                    # <id>-r<k>-g<gen>, listed by its /healthz)
                    "rank_ids": c.rank_ids,
                    "pid": c.pid if c.proc is not None else None,
                    "status": c.status(),
                    "ops_port": c.ops_port,
                    "grpc_address": f"{HOST}:{c.grpc_port}" if c.grpc_port else "",
                    "restarts": c.restarts,
                    "last_exit_code": c.last_exit_code,
                    "log": str(c.log_path),
                }
                for c in self.children
            },
        }
        tmp = self.run_dir / "stack.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(state, indent=2))
        tmp.replace(self.run_dir / "stack.json")

    # -- MPS -----------------------------------------------------------------------------
    def _start_mps(self) -> None:
        """Disaggregated engines sharing a GPU: start a CUDA MPS control daemon of this stack's
        own (pipe and log directories under the run dir, so it neither meets nor stops
        anyone else's), so their kernels run side by side instead of time-slicing. Says what
        happened in :attr:`mps` (shown by ``up`` and in stack.json)."""
        shared = shared_gpus(self.placements)
        if not shared:
            return
        gpus = ",".join(map(str, shared))
        control = shutil.which("nvidia-cuda-mps-control")
        if control is None:
            self.mps = f"not available (no nvidia-cuda-mps-control): engines time-slice GPU {gpus}"
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
                env={**self.env, **env},
                check=True,
                timeout=30,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self.mps = f"could not start ({exc}): engines time-slice GPU {gpus}"
            return
        self._mps_env = env
        self.mps = f"started for GPU {gpus} (pipe {env['CUDA_MPS_PIPE_DIRECTORY']})"

    def _stop_mps(self) -> None:
        control = shutil.which("nvidia-cuda-mps-control")
        if not self._mps_env or control is None:
            return
        try:
            subprocess.run(
                [control],
                input=b"quit\n",
                env={**self.env, **self._mps_env},
                timeout=30,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError):
            pass  # its daemon exits with the machine; nothing else depends on it
        self._mps_env = {}

    # -- stop --------------------------------------------------------------------------
    def stop(self) -> None:
        """Drain and stop everything started; afterwards no process of the stack runs."""
        if self._stopped:
            return
        self._stopped = True
        live = [c for c in self.children if c.running()]
        for c in reversed(live):
            _signal_group(c, signal.SIGTERM)
        deadline = time.monotonic() + self.drain_seconds + 5.0  # drain, then exit bookkeeping
        for c in reversed(live):
            assert c.proc is not None
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            if c.proc is not None:
                # Also ends anything the service itself started in its group.
                _signal_group(c, signal.SIGKILL)
                if c.proc.poll() is None:
                    c.proc.wait(10)
            if c._log is not None:
                c._log.close()
        self.killed = [
            c.name
            for c in self.children
            if c.proc is not None and c.proc.returncode == -signal.SIGKILL
        ]
        for proc in (self.redis_proc, self.nats_proc):
            if proc is not None:
                procs.stop(proc)
        self._stop_mps()
        leftover = [c.name for c in self.children if c.proc is not None and c.proc.poll() is None]
        leftover += [
            name
            for name, p in (("redis", self.redis_proc), ("nats", self.nats_proc))
            if p is not None and p.poll() is None
        ]
        if leftover:  # cannot happen after SIGKILL + wait, but say so loudly if it does
            raise StackError(f"still running after stop: {', '.join(leftover)}")


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


def chosen(stack: Stack) -> list[str]:
    """What ``up`` chose, for the operator: mode, engines per GPU, each engine's KV room."""
    per_device: dict[str, list[str]] = {}
    for p in stack.placements:
        per_device.setdefault(p.device, []).append(p.name)
    out = [
        f"mode {stack.mode}: "
        + "; ".join(f"{d}: {len(n)} engine(s) ({', '.join(n)})" for d, n in per_device.items())
    ]
    if stack.mps:
        out.append(f"MPS {stack.mps}")
    for iid, (n, bs) in sorted(stack.kv_blocks.items()):
        out.append(f"{iid}: {n} KV blocks of {bs} tokens ({n * bs:,} tokens)")
    return out


def _signal_group(c: Child, sig: signal.Signals) -> None:
    """Signal the child's process group (it leads its own session)."""
    assert c.proc is not None
    try:
        os.killpg(c.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Interrupted(BaseException):
    """SIGINT/SIGTERM while the stack was still starting."""


def engine_args(speculative_tokens: int, batch_invariant: bool) -> dict[str, list[str]] | None:
    """The engine flags ``deepserve up`` gives every engine alike (None: none)."""
    args = ["--speculative-tokens", str(speculative_tokens)] if speculative_tokens else []
    if batch_invariant:
        args.append("--batch-invariant")
    return {s: list(args) for s in ENGINE_SERVICES} if args else None


def merge_args(
    *parts: Mapping[str, Sequence[str]] | None,
) -> dict[str, list[str]] | None:
    """Flags per service from several sources, in order (None: none at all)."""
    out: dict[str, list[str]] = {}
    for part in parts:
        for service, args in (part or {}).items():
            out.setdefault(service, []).extend(args)
    return out or None


def vllm_args(
    max_model_len: int = 0, max_num_batched_tokens: int = 0, max_num_seqs: int = 0, host: str = ""
) -> dict[str, list[str]]:
    """What vLLM's ``serve`` flags of the same names mean here, as flags per service: the
    context limit for every engine and for the entrypoint's and recipe's checks, the token
    budget of a step and the batch size for every engine, the recipe's bind address (0: not
    given)."""
    engine: list[str] = []
    if max_model_len:
        engine += ["--max-model-len", str(max_model_len)]
    if max_num_batched_tokens:
        engine += ["--max-tokens-per-step", str(max_num_batched_tokens)]
    if max_num_seqs:
        engine += ["--max-running", str(max_num_seqs)]
    out = {s: list(engine) for s in ENGINE_SERVICES} if engine else {}
    if max_model_len:
        for s in ("entrypoint", "recipe"):
            out[s] = ["--max-context", str(max_model_len)]
    if host:
        out.setdefault("recipe", []).extend(["--host", host])
    return out


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
        where = ", ".join(
            f"{p.name} {p.device}"
            + (f" {','.join(map(str, p.ep_gpus))}" if p.ep_gpus else "")
            + (f" ({p.gpu_memory_fraction:g})" if p.gpu_memory_fraction is not None else "")
            for p in stack.placements
        )
        if ep > 1:
            where += f"; {ep} expert-parallel ranks each"
        engines = (
            f"{len(stack.placements)} aggregated (prefill + decode in one engine)"
            if stack.mode == "aggregated"
            else f"{prefill} prefill + {decode} decode"
        )
        print(
            f"deepserve: starting {engines} ({model}: {where}); mode {stack.mode}; "
            f"logs in {stack.run_dir / 'logs'}",
            flush=True,
        )
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
        print(f"deepserve is up: {stack.api_url}  (model {model_name})", flush=True)
        for line in chosen(stack):
            print(f"  {line}", flush=True)
        print(
            f"  gRPC Generate: {stack.grpc_address}   NATS: {redact(stack.nats_url)}   "
            f"Redis: {redact(stack.redis_url)}",
            flush=True,
        )
        recipe = next(c for c in stack.children if c.service == "recipe")
        print(f"  status page: http://{HOST}:{recipe.ops_port}/status", flush=True)
        print(f"  where each service listens: {stack.run_dir / 'stack.json'}", flush=True)
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
