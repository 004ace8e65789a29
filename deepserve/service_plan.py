"""What each service of ``deepserve up`` is started with: its argv, its environment, its log.

:class:`ServicePlan` turns a service name into a :class:`~deepserve.children.Child` (ports
picked free and passed as explicit flags, ``--instance-id <name>-<stack id>``, the flags the
operator added for that service); :func:`service_env` gives it only the secrets and NATS login
its role needs (docs/security.md); :func:`launch` starts it in its own session, logging to
``<run_dir>/logs/<name>.log``. The flag builders below (:func:`engine_args`, :func:`vllm_args`,
:func:`merge_args`) make per-service flags from ``deepserve up``'s own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deepserve import procs
from deepserve.children import HOST, Child
from libs.common.redact import redact_text

REPO_ROOT = Path(__file__).resolve().parents[1]

# Which service needs which secret (docs/security.md): the entrypoint keys the tenants' cache
# salts; prefill and decode sign and check KV frames; the internal APIs need the service token;
# the recipe and the entrypoint salt the tenant labels of their logs and metrics.
ENGINE_SERVICES = ("prefill", "decode", "aggregated")  # the services that run an engine
SERVICE_SECRETS = {
    "entrypoint": (
        "DEEPSERVE_CACHE_SALT_SECRET",
        "DEEPSERVE_SERVICE_TOKEN",
        "DEEPSERVE_TENANT_LABEL_SECRET",
    ),
    "prefill": ("DEEPSERVE_KV_MAC_KEY", "DEEPSERVE_SERVICE_TOKEN"),
    "decode": ("DEEPSERVE_KV_MAC_KEY", "DEEPSERVE_SERVICE_TOKEN"),
    "aggregated": ("DEEPSERVE_KV_MAC_KEY", "DEEPSERVE_SERVICE_TOKEN"),
    "kvstore": ("DEEPSERVE_SERVICE_TOKEN",),
    "recipe": ("DEEPSERVE_SERVICE_TOKEN", "DEEPSERVE_TENANT_LABEL_SECRET"),
}
# kvstore: its metadata; recipe and entrypoint: per-key caps shared by every replica and the
# entrypoint's usage ledger.
REDIS_SERVICES = ("kvstore", "recipe", "entrypoint")


@dataclass(frozen=True)
class ServicePlan:
    """Plans the children of one stack: where they log, what flags every one gets."""

    run_dir: Path
    stack_id: str
    drain_seconds: float
    extra_args: Mapping[str, Sequence[str]]  # more flags per service name

    def child(
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

    def engine(
        self,
        name: str,
        service: str,
        grpc_port: int,
        args: Sequence[str],
        *,
        kvstore_address: str,
        ep: int = 1,
        ep_timeout: float | None = None,
    ) -> Child:
        """A prefill/decode instance; with EP its process supervises the rank processes (each
        rank picks its own gRPC port: what the stack passes is then unused)."""
        ep_args = ["--ep", str(ep)] if ep > 1 else []
        if ep > 1 and ep_timeout is not None:
            ep_args += ["--ep-timeout", repr(ep_timeout)]
        c = self.child(
            name,
            service,
            grpc_port=grpc_port,
            args=["--kvstore-address", kvstore_address, *args, *ep_args],
        )
        c.ep = ep
        return c

    def recipe(
        self,
        port: int,
        *,
        entrypoint_address: str,
        model: str,
        model_name: str,
        ops_of: Mapping[str, Child],
        name: str = "recipe",
    ) -> Child:
        """A recipe (replica ``name``) on ``port``. Its health is on that main HTTP port; its
        ops port's /status page reads the other services' ops ports (``ops_of``: kvstore,
        balancer, entrypoint)."""
        c = self.child(
            name,
            "recipe",
            args=[
                "--port",
                str(port),
                "--entrypoint-address",
                entrypoint_address,
                "--model-name",
                model_name,
                "--model",
                model,
                *[
                    arg
                    for service in ("kvstore", "balancer", "entrypoint")
                    for arg in (f"--{service}-ops-address", f"{HOST}:{ops_of[service].ops_port}")
                ],
            ],
        )
        c.health_port = port
        return c


def service_env(
    service: str,
    base: Mapping[str, str],
    secrets: Mapping[str, str],
    *,
    nats: Mapping[str, str],
    redis_url: str,
    mps: Mapping[str, str],
) -> dict[str, str]:
    """``service``'s environment: ``base`` plus each secret only where it is used (unless
    ``base`` has it), ``nats`` (NATS_URL and its role's login), the MPS daemon's for engines
    and REDIS_URL for those that keep state there."""
    env = dict(base)
    for name in SERVICE_SECRETS.get(service, ()):
        env.setdefault(name, secrets[name])
    env.update(nats)
    if service in ENGINE_SERVICES:
        env.update(mps)  # the engines reach this stack's MPS daemon, if any
    if service in REDIS_SERVICES:
        env["REDIS_URL"] = redis_url
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def launch(c: Child, env: Mapping[str, str]) -> None:
    """Start (or restart) ``c``'s process: ``python -m services.<service> <argv>`` in a session
    of its own, stdout and stderr appended to its log."""
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


# -- flags per service, from deepserve up's own --------------------------------------------
def default_model_name(model: str) -> str:
    """The served name for ``--model``: ``deepseek-<preset>`` (or ``deepseek-fake``), else the
    checkpoint directory's name."""
    stripped = model.rstrip("/")
    return Path(stripped).name if "/" in stripped else f"deepseek-{stripped}"


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
