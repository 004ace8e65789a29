"""Who may publish and subscribe what on NATS: one user per service role (docs/security.md).

The table below is docs/architecture.md's subject table turned into nats-server permissions:
a role may publish only what it sends and subscribe only what it reads, so a prompt
(``ds.prefill.<id>.task``, ``ds.tokens.<request>``) reaches only the roles that need it and a
task, abort, heartbeat or usage record can come only from the role that sends it. A role that
answers requests (balancer, prefill, aggregated) gets ``allow_responses``: it may publish once
to the reply subject of a request it received, nowhere else. A role that makes requests
subscribes only its own inbox prefix ``_INBOX.<role>.>`` (:func:`inbox_prefix`; the client
sets it from its user name), so no role reads another's replies.

:func:`server_config` writes the ``authorization`` block of a nats-server config with these
users; ``deepserve up`` writes one with fresh passwords, compose and the Kubernetes manifests
use ``docker/k8s/nats.conf`` whose passwords are environment references (``$NAME``) filled
from the secret.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from . import subjects

USAGE_STREAM = "DEEPSERVE_USAGE"
USAGE_SUBJECTS = f"{subjects.PREFIX}.usage.>"
ADMIN = "admin"  # deepserve up's own user (waits for heartbeats; tests): every subject

# Environment of a service process: its NATS user and password (never on a command line).
USER_ENV = "DEEPSERVE_NATS_USER"
PASSWORD_ENV = "DEEPSERVE_NATS_PASSWORD"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    responses: bool = False  # may reply (once) to the requests it received


def inbox_prefix(user: str) -> str:
    """The inbox prefix of ``user``'s requests (its replies come there)."""
    return f"_INBOX.{user}"


def _inbox(role: str) -> str:
    return f"{inbox_prefix(role)}.>"


_P = subjects.PREFIX


def _load(role: str) -> str:
    """``role``'s load progress (``ds.load.<role>.<id>``): only its own."""
    return subjects.load_status(role, "*")


_HEARTBEAT_DECODE = f"{_P}.heartbeat.decode.*"
_HEARTBEAT_PREFILL = f"{_P}.heartbeat.prefill.*"
_TASKS = f"{_P}.prefill.*.task"
_TOKENS = f"{_P}.tokens.>"
_JS = "$JS.API"

PERMISSIONS: dict[str, Permissions] = {
    # /status page reads heartbeats and load progress; usage records go to the JetStream
    # stream (creates it if missing, then publishes with an ack)
    "recipe": Permissions(
        publish=(
            USAGE_SUBJECTS,
            f"{_JS}.STREAM.INFO.{USAGE_STREAM}",
            f"{_JS}.STREAM.CREATE.{USAGE_STREAM}",
        ),
        subscribe=(subjects.HEARTBEAT_ALL, subjects.LOAD_ALL, _inbox("recipe")),
    ),
    # routes (request), sends tasks (request) and aborts; reads token events and heartbeats
    "entrypoint": Permissions(
        publish=(subjects.ROUTE, _TASKS, subjects.ABORT),
        subscribe=(_TOKENS, subjects.HEARTBEAT_ALL, _inbox("entrypoint")),
    ),
    "balancer": Permissions(
        subscribe=(subjects.HEARTBEAT_ALL, subjects.ROUTE),
        responses=True,
    ),
    # takes tasks (receipt as reply), publishes the first token; hears decode heartbeats for
    # the addresses it may push KV to (libs/serving/known_decoders.py)
    "prefill": Permissions(
        publish=(_HEARTBEAT_PREFILL, _TOKENS, _load("prefill")),
        subscribe=(_TASKS, subjects.ABORT, _HEARTBEAT_DECODE),
        responses=True,
    ),
    "decode": Permissions(
        publish=(_HEARTBEAT_DECODE, _TOKENS, _load("decode")),
        subscribe=(subjects.ABORT,),
    ),
    # both roles in one engine: beats as prefill and as decode
    "aggregated": Permissions(
        publish=(_HEARTBEAT_PREFILL, _HEARTBEAT_DECODE, _TOKENS, _load("aggregated")),
        subscribe=(_TASKS, subjects.ABORT, _HEARTBEAT_DECODE),
        responses=True,
    ),
    "kvstore": Permissions(),  # no NATS traffic at all
    # `deepserve usage`: reads the usage stream through an ephemeral pull consumer; cannot
    # publish records, purge or delete the stream
    "tools": Permissions(
        publish=(
            f"{_JS}.STREAM.INFO.{USAGE_STREAM}",
            f"{_JS}.CONSUMER.CREATE.{USAGE_STREAM}",
            f"{_JS}.CONSUMER.CREATE.{USAGE_STREAM}.>",
            f"{_JS}.CONSUMER.INFO.{USAGE_STREAM}.>",
            f"{_JS}.CONSUMER.MSG.NEXT.{USAGE_STREAM}.>",
            f"{_JS}.CONSUMER.DELETE.{USAGE_STREAM}.>",
            f"$JS.ACK.{USAGE_STREAM}.>",
        ),
        subscribe=(_inbox("tools"),),
    ),
}
ROLES = tuple(PERMISSIONS)


def password_env(role: str) -> str:
    """The variable the NATS server's config reads ``role``'s password from (compose, k8s)."""
    return f"DEEPSERVE_NATS_PASSWORD_{role.upper()}"


def _allow(subjects_: tuple[str, ...]) -> dict[str, list[str]]:
    return {"allow": list(subjects_)} if subjects_ else {"deny": [">"]}


def server_config(passwords: Mapping[str, str], *, admin_password: str = "") -> str:
    """The ``authorization`` block of a nats-server config: a user per role in
    ``passwords`` (role -> password, or ``$NAME`` to read it from the server's environment)
    with its :data:`PERMISSIONS`, and with ``admin_password`` an ``admin`` user allowed
    everything. Values are JSON strings (valid nats-server config syntax)."""
    users = []
    for role, password in passwords.items():
        p = PERMISSIONS[role]
        perms: dict[str, object] = {"publish": _allow(p.publish), "subscribe": _allow(p.subscribe)}
        if p.responses:
            perms["allow_responses"] = True
        shown = password if password.startswith("$") else json.dumps(password)
        users.append(
            f"    {{user: {json.dumps(role)}, password: {shown}, permissions: {json.dumps(perms)}}}"
        )
    if admin_password:
        users.append(f"    {{user: {json.dumps(ADMIN)}, password: {json.dumps(admin_password)}}}")
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def deployment_config() -> str:
    """docker/k8s/nats.conf: every role, passwords from the server's environment."""
    head = (
        "# Generated from libs/common/nats_auth.py (tests/unit/test_nats_auth.py checks it):\n"
        "# one user per service role, each password from the nats-server's environment\n"
        "# (DEEPSERVE_NATS_PASSWORD_<ROLE>, from the secret). See docs/security.md.\n"
    )
    return head + server_config({r: "$" + password_env(r) for r in ROLES})
