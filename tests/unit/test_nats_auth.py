"""The NATS permission table (libs/common/nats_auth.py) is docs/architecture.md's subject
table: each role publishes exactly what it sends and subscribes exactly what it reads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from libs.common import nats_auth, subjects
from libs.common.errors import InstanceFailed
from libs.common.natsutil import credentials
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.known_decoders import CheckedPusher, KnownDecoders

ROOT = Path(__file__).resolve().parents[2]
JS = "$JS.API"
S = "DEEPSERVE_USAGE"

# role -> (publish, subscribe, answers requests), from the subject table
EXPECTED = {
    "recipe": (
        {"ds.usage.>", f"{JS}.STREAM.INFO.{S}", f"{JS}.STREAM.CREATE.{S}"},
        {"ds.heartbeat.>", "ds.load.>", "_INBOX.recipe.>"},
        False,
    ),
    "entrypoint": (
        {"ds.balancer.route", "ds.prefill.*.task", "ds.abort"},
        {"ds.tokens.>", "ds.heartbeat.>", "_INBOX.entrypoint.>"},
        False,
    ),
    "balancer": (set(), {"ds.heartbeat.>", "ds.balancer.route"}, True),
    "prefill": (
        {"ds.heartbeat.prefill.*", "ds.tokens.>", "ds.load.prefill.*"},
        {"ds.prefill.*.task", "ds.abort", "ds.heartbeat.decode.*"},
        True,
    ),
    "decode": (
        {"ds.heartbeat.decode.*", "ds.tokens.>", "ds.load.decode.*"},
        {"ds.abort"},
        False,
    ),
    "aggregated": (
        {"ds.heartbeat.prefill.*", "ds.heartbeat.decode.*", "ds.tokens.>", "ds.load.aggregated.*"},
        {"ds.prefill.*.task", "ds.abort", "ds.heartbeat.decode.*"},
        True,
    ),
    "kvstore": (set(), set(), False),
    "tools": (
        {
            f"{JS}.STREAM.INFO.{S}",
            f"{JS}.CONSUMER.CREATE.{S}",
            f"{JS}.CONSUMER.CREATE.{S}.>",
            f"{JS}.CONSUMER.INFO.{S}.>",
            f"{JS}.CONSUMER.MSG.NEXT.{S}.>",
            f"{JS}.CONSUMER.DELETE.{S}.>",
            f"$JS.ACK.{S}.>",
        },
        {"_INBOX.tools.>"},
        False,
    ),
}


@pytest.mark.parametrize("role", sorted(EXPECTED))
def test_each_role_is_allowed_exactly_its_subjects(role: str) -> None:
    p = nats_auth.PERMISSIONS[role]
    publish, subscribe, responses = EXPECTED[role]
    assert set(p.publish) == publish
    assert set(p.subscribe) == subscribe
    assert p.responses is responses
    assert len(p.publish) == len(publish) and len(p.subscribe) == len(subscribe)


def test_every_role_has_a_user_and_the_subjects_are_the_code_s() -> None:
    assert set(nats_auth.ROLES) == set(EXPECTED)
    assert subjects.prefill_task("x") == "ds.prefill.x.task"
    assert subjects.token_events("r") == "ds.tokens.r"
    assert subjects.ROUTE == "ds.balancer.route" and subjects.ABORT == "ds.abort"


def test_prompts_reach_only_the_roles_that_need_them() -> None:
    readers = {
        "ds.prefill.*.task": {"prefill", "aggregated"},
        "ds.tokens.>": {"entrypoint"},
    }
    for subject, who in readers.items():
        got = {r for r, p in nats_auth.PERMISSIONS.items() if subject in p.subscribe}
        assert got == who, subject
    senders = {
        "ds.prefill.*.task": {"entrypoint"},
        "ds.abort": {"entrypoint"},
        "ds.usage.>": {"recipe"},
        "ds.heartbeat.decode.*": {"decode", "aggregated"},
    }
    for subject, who in senders.items():
        got = {r for r, p in nats_auth.PERMISSIONS.items() if subject in p.publish}
        assert got == who, subject
    # nobody may purge or delete the usage stream, nor subscribe everything
    for p in nats_auth.PERMISSIONS.values():
        assert not any("PURGE" in s or "STREAM.DELETE" in s or s == ">" for s in p.publish)
        assert ">" not in p.subscribe and "_INBOX.>" not in p.subscribe


def test_the_architecture_doc_lists_every_subject_and_the_readers() -> None:
    doc = (ROOT / "docs/architecture.md").read_text()
    table = doc.split("## NATS subjects", 1)[1].split("\n## ", 1)[0]
    for subject in (
        "ds.heartbeat.<role>.<instance>",
        "ds.balancer.route",
        "ds.prefill.<instance>.task",
        "ds.tokens.<request_id>",
        "ds.abort",
        "ds.usage.<tenant hash>",
    ):
        assert f"`{subject}`" in table, subject
    assert "known_decoders" in table  # prefill hears decode heartbeats for push addresses


def test_server_config_and_the_deployment_file() -> None:
    text = nats_auth.server_config({"decode": 'pw"x'}, admin_password="a")
    assert '"decode"' in text and '"pw\\"x"' in text and '"admin"' in text
    assert '"allow": ["ds.heartbeat.decode.*", "ds.tokens.>", "ds.load.decode.*"]' in text
    kv = nats_auth.server_config({"kvstore": "$P"})
    assert "password: $P" in kv and '"deny": [">"]' in kv
    committed = (ROOT / "docker/k8s/nats.conf").read_text()
    assert committed == nats_auth.deployment_config(), "regenerate docker/k8s/nats.conf"


def test_credentials_come_from_the_url_or_the_environment() -> None:
    env = {nats_auth.USER_ENV: "prefill", nats_auth.PASSWORD_ENV: "s3cret"}
    assert credentials("nats://h:4222", env) == {
        "user": "prefill",
        "password": "s3cret",
        "inbox_prefix": "_INBOX.prefill",
    }
    assert credentials("nats://tools:pw@h:4222", env) == {"inbox_prefix": "_INBOX.tools"}
    assert credentials("nats://h:4222", {}) == {}


class _Inner:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def match(self, address: str, block_hashes: list[bytes]) -> object:
        self.sent.append(address)
        return None

    async def push(self, address: str, task: object, kv: object) -> None:
        self.sent.append(address)

    async def close(self) -> None:
        pass


def test_kv_goes_only_to_decode_instances_heard_on_nats() -> None:
    async def run() -> None:
        now = [0.0]
        known = KnownDecoders(ttl=10.0, wait=0.2, clock=lambda: now[0])
        inner = _Inner()
        pusher = CheckedPusher(inner, known)  # type: ignore[arg-type]
        with pytest.raises(InstanceFailed, match="not a decode instance") as exc:
            await pusher.push("evil:1", control_pb2.DecodeTask(), b"")
        assert exc.value.retryable and inner.sent == []
        known.heard(control_pb2.InstanceStatus(instance_id="d", address="10.0.0.1:5"))
        await pusher.match("10.0.0.1:5", [])
        await pusher.push("10.0.0.1:5", control_pb2.DecodeTask(), b"")
        assert inner.sent == ["10.0.0.1:5", "10.0.0.1:5"]
        await pusher.close()  # the inner pusher's
        now[0] = 11.0  # not heard for longer than ttl: forgotten
        with pytest.raises(InstanceFailed):
            await pusher.push("10.0.0.1:5", control_pb2.DecodeTask(), b"")

    asyncio.run(run())


def test_a_heartbeat_while_waiting_lets_the_push_through() -> None:
    async def run() -> None:
        known = KnownDecoders(wait=5.0)
        inner = _Inner()
        pusher = CheckedPusher(inner, known)  # type: ignore[arg-type]
        beat = control_pb2.InstanceStatus(address="h:1").SerializeToString()

        class Msg:
            data = beat

        async def later() -> None:
            await asyncio.sleep(0.1)
            await known.on_message(Msg())

        asyncio.get_running_loop().create_task(later())
        await asyncio.wait_for(pusher.push("h:1", control_pb2.DecodeTask(), b""), 2.0)
        assert inner.sent == ["h:1"]

    asyncio.run(run())
