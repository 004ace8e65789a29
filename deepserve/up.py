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

Stack holds the order and the state; the parts live beside it: ``children.py`` (a service
process: health, restart backoff, stop), ``backends.py`` (nats-server, redis-server, MPS),
``service_plan.py`` (each service's argv and environment), ``up_report.py`` (stack.json and
the printed summary), ``up_command.py`` (``deepserve up`` itself: :func:`run_up`).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from subprocess import Popen
from typing import Self

from deepserve import procs
from deepserve.backends import Backends, Mps, await_heartbeats
from deepserve.children import (
    HOST,
    Child,
    RestartPolicy,
    StackError,
    await_healthy,
    healthz,
    log_tail,
    port_is_free,
    stop_children,
    supervise_child,
)
from deepserve.placement import (
    choose_mode,
    place_aggregated,
    place_engines,
    visible_gpus,
)
from deepserve.service_plan import (
    ENGINE_SERVICES,
    REPO_ROOT,
    SERVICE_SECRETS,
    ServicePlan,
    default_model_name,
    engine_args,
    launch,
    merge_args,
    service_env,
    vllm_args,
)
from deepserve.up_command import run_up
from deepserve.up_report import chosen, write_state
from libs.common import nats_auth
from libs.common.grpc_auth import call_metadata
from libs.engine.tokenizer import model_vocab_size

__all__ = [  # what tests and tools import from here (the names live in the modules above)
    "ENGINE_SERVICES",
    "HOST",
    "REPO_ROOT",
    "SERVICE_SECRETS",
    "Child",
    "RestartPolicy",
    "Stack",
    "StackError",
    "chosen",
    "default_model_name",
    "engine_args",
    "healthz",
    "log_tail",
    "merge_args",
    "port_is_free",
    "run_up",
    "vllm_args",
]


class Stack:
    """The deepserve stack as child processes; a context manager that always cleans up.

    ``extra_args`` adds flags per service (key: service name such as ``"prefill"``).
    ``recipe_port`` 0 picks a free port; ``recipes`` replicas of the recipe share the per-key
    caps through Redis (the first on ``recipe_port``; every one's URL in :attr:`api_bases`).
    ``device`` is ``"cpu"`` or ``"cuda"``; with CUDA the engines are placed over ``gpus``
    (default: every visible GPU) by :func:`place_engines`,
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
        recipes: int = 1,
    ) -> None:
        if recipes < 1:
            raise ValueError(f"recipes must be >= 1, got {recipes}")
        self.recipes = recipes
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
        self.plan = ServicePlan(self.run_dir, self.stack_id, drain_seconds, self.extra_args)
        self.children: list[Child] = []
        # this stack's NATS passwords, a fresh one per role (and admin); never written but
        # to the owner-only nats.conf
        self.nats_passwords = {
            role: secrets.token_hex(24) for role in (*nats_auth.ROLES, nats_auth.ADMIN)
        }
        self.backends = Backends(self.run_dir, self.env, self.nats_passwords)
        self._mps = Mps(self.run_dir, self.env)  # for engines sharing a GPU
        self.grpc_address = ""
        self.kvstore_address = ""
        self.api_base = ""  # http://host:port
        self.api_bases: list[str] = []  # every recipe replica's, api_base first
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
    def nats_url(self) -> str:
        """With the admin user's credentials when the stack started NATS."""
        return self.backends.nats_url

    @property
    def nats_address(self) -> str:
        """nats://host:port, no credentials (what services dial)."""
        return self.backends.nats_address

    @property
    def redis_url(self) -> str:
        return self.backends.redis_url

    @property
    def nats_proc(self) -> Popen[bytes] | None:
        return self.backends.nats_proc

    @nats_proc.setter
    def nats_proc(self, proc: Popen[bytes] | None) -> None:  # tests restart it by hand
        self.backends.nats_proc = proc

    @property
    def redis_proc(self) -> Popen[bytes] | None:
        return self.backends.redis_proc

    @property
    def backend_restarts(self) -> dict[str, int]:
        """Times nats-server / redis-server were started again by :meth:`supervise`."""
        return self.backends.restarts

    @property
    def mps(self) -> str:
        """What became of MPS for engines sharing a GPU ("": not asked)."""
        return self._mps.status

    def nats_url_of(self, user: str) -> str:
        """The URL of this stack's nats-server logged in as ``user`` (a role or admin)."""
        return self.backends.nats_url_of(user)

    @property
    def instance_ids(self) -> dict[str, list[str]]:
        ids: dict[str, list[str]] = {}
        for c in self.children:
            ids.setdefault(c.service, []).append(c.instance_id)
        return ids

    def ep_of(self, name: str, service: str) -> int:
        if isinstance(self.ep, int):
            return self.ep
        return self.ep.get(name, self.ep.get(service, 1))

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
        self.backends.start()
        kv_port = procs.free_port()
        write_state(self)
        # kvstore and balancer need only NATS/Redis; the balancer must listen to heartbeats
        # before any engine starts, and the engines must be routable before the entrypoint.
        kvstore = self.plan.child(
            "kvstore",
            "kvstore",
            grpc_port=kv_port,
            args=["--data-dir", str(self.run_dir / "kvstore")],
        )
        balancer = self.plan.child("balancer", "balancer")
        self.kvstore_address = f"{HOST}:{kv_port}"
        stages = [[kvstore, balancer], self._plan_engines()]
        ep_port = procs.free_port()
        self.grpc_address = f"{HOST}:{ep_port}"
        entrypoint = self.plan.child(
            "entrypoint",
            "entrypoint",
            grpc_port=ep_port,
            args=[
                "--kvstore-address",
                self.kvstore_address,
                "--model-name",
                self.model_name,
                "--vocab-size",
                str(self.vocab_size),
            ],
        )
        stages.append([entrypoint])
        replicas = []
        for i in range(self.recipes):  # replicas share the per-key caps through Redis
            port = (self.recipe_port if i == 0 else 0) or procs.free_port()
            self.api_bases.append(f"http://{HOST}:{port}")
            replicas.append(
                self.plan.recipe(
                    port,
                    entrypoint_address=self.grpc_address,
                    model=self.model,
                    model_name=self.model_name,
                    ops_of={"kvstore": kvstore, "balancer": balancer, "entrypoint": entrypoint},
                    name="recipe" if i == 0 else f"recipe-{i}",
                )
            )
        self.api_base = self.api_bases[0]
        stages.append(replicas)
        for stage in stages:
            for c in stage:
                self.children.append(c)
                self._launch(c)
            write_state(self)
            self._await_ready(stage)
        write_state(self)

    def _plan_engines(self) -> list[Child]:
        """One aggregated engine per placement, or the prefill then the decode instances
        (disaggregated: with the MPS daemon started where they share a GPU)."""
        model_args = ["--model", self.model, "--model-name", self.model_name]
        placed = {p.name: p.flags() for p in self.placements}  # --device [--gpu-memory-...]

        def engine(name: str, service: str, grpc_port: int) -> Child:
            return self.plan.engine(
                name,
                service,
                grpc_port,
                [*model_args, *placed[name]],
                kvstore_address=self.kvstore_address,
                ep=self.ep_of(name, service),
                ep_timeout=self.ep_timeout,
            )

        if self.mode == "aggregated":
            return [engine(p.name, "aggregated", procs.free_port()) for p in self.placements]
        engines = [engine(f"prefill-{i}", "prefill", 0) for i in range(self.prefill)]
        engines += [engine(f"decode-{i}", "decode", procs.free_port()) for i in range(self.decode)]
        self._mps.start(self.placements)
        return engines

    def _launch(self, c: Child) -> None:
        """Start (or restart) ``c``'s process with its argv and this stack's environment."""
        env = service_env(
            c.service,
            self.env,
            self.secrets,
            nats=self.backends.login_env(c.service),
            redis_url=self.redis_url,
            mps=self._mps.env,
        )
        launch(c, env)

    def _await_ready(self, stage: list[Child]) -> None:
        deadline = await_healthy(stage, self.ready_timeout)
        engines = {i for c in stage if c.service in ENGINE_SERVICES for i in c.rank_ids}
        if engines:
            missing = asyncio.run(
                await_heartbeats(
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
        events = self.backends.supervise()
        if events:
            write_state(self)
        events += [e for c in self.children if (e := supervise_child(c, policy, self._launch))]
        if events:
            write_state(self)
        return events

    # -- stop --------------------------------------------------------------------------
    def stop(self) -> None:
        """Drain and stop everything started; afterwards no process of the stack runs."""
        if self._stopped:
            return
        self._stopped = True
        self.killed = stop_children(self.children, self.drain_seconds)
        leftover = self.backends.stop()
        self._mps.stop()
        leftover = [
            c.name for c in self.children if c.proc is not None and c.proc.poll() is None
        ] + leftover
        if leftover:  # cannot happen after SIGKILL + wait, but say so loudly if it does
            raise StackError(f"still running after stop: {', '.join(leftover)}")
