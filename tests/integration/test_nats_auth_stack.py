"""NATS on the real stack: no anonymous connection, each role only its subjects, KV pushed
only to heard decode instances, and nats-server / redis-server restarted with their data."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from deepserve.up import SERVICE_SECRETS, Stack
from libs.common import nats_auth, subjects
from libs.proto.deepserve.v1 import control_pb2

from .conftest import MODEL_NAME, dump_logs, start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("nats-auth"), restart=True)
    try:
        yield s
    finally:
        s.stop()


def chat(stack: Stack, timeout: float = 60.0) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }
    req = urllib.request.Request(
        f"{stack.api_url}/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


async def _connect(url: str, errors: list[str] | None = None) -> Any:
    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))

    return await nats.connect(
        url, connect_timeout=3, max_reconnect_attempts=0, allow_reconnect=False, error_cb=on_error
    )


def test_a_client_without_credentials_cannot_connect(stack: Stack) -> None:
    async def run() -> None:
        with pytest.raises(Exception):  # noqa: B017 - nats raises its own for 'Authorization Violation'
            nc = await _connect(stack.nats_address)
            await nc.close()
        port = stack.nats_address.rsplit(":", 1)[1]
        with pytest.raises(Exception):  # noqa: B017
            nc = await _connect(f"nats://recipe:wrong@127.0.0.1:{port}")
            await nc.close()

    asyncio.run(run())


def test_secrets_stay_off_command_lines_and_the_config_is_private(stack: Stack) -> None:
    conf = stack.run_dir / "nats.conf"
    assert conf.stat().st_mode & 0o777 == 0o600
    state = json.loads((stack.run_dir / "stack.json").read_text())
    assert state["nats_url"].startswith("nats://tools:")
    pids = [c.pid for c in stack.children] + [state["pids"]["nats"]]
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        for pw in stack.nats_passwords.values():
            assert pw not in cmdline
    for c in stack.children:
        log = c.log_path.read_text(errors="replace")
        assert not any(pw in log for pw in stack.nats_passwords.values()), c.name


def test_the_recipe_cannot_forge_tasks_aborts_or_read_prompts(stack: Stack) -> None:
    """The probes of issue 33 with the recipe's own credentials: each is refused by the
    server, and an admin listener sees nothing arrive."""

    async def run() -> None:
        admin = await nats.connect(stack.nats_url)
        errors: list[str] = []
        recipe = await _connect(stack.nats_url_of("recipe"), errors)
        try:
            seen: list[str] = []

            async def on_any(msg: Any) -> None:
                seen.append(msg.subject)

            await admin.subscribe("ds.prefill.>", cb=on_any)
            await admin.subscribe(subjects.ABORT, cb=on_any)
            await admin.subscribe("ds.usage.>", cb=on_any)
            await admin.flush()
            prefill_id = stack.instance_ids["prefill"][0]
            task = control_pb2.PrefillTask(request_id="forged", prompt_token_ids=[1, 2, 3])
            await recipe.publish(subjects.prefill_task(prefill_id), task.SerializeToString())
            await recipe.publish(
                subjects.ABORT, control_pb2.Abort(request_id="x").SerializeToString()
            )
            await recipe.publish("$JS.API.STREAM.PURGE.DEEPSERVE_USAGE", b"{}")
            stolen: list[bytes] = []

            async def on_stolen(msg: Any) -> None:
                stolen.append(msg.data)

            await recipe.subscribe("ds.prefill.>", cb=on_stolen)
            await recipe.subscribe("ds.tokens.>", cb=on_stolen)
            await recipe.flush()
            await asyncio.sleep(0.5)
            # what the entrypoint would send: a prompt and its token events
            await admin.publish(subjects.prefill_task("nobody"), b"prompt")
            await admin.publish(subjects.token_events("r1"), b"tokens")
            await admin.flush()
            await asyncio.sleep(0.5)
        finally:
            await recipe.close()
            await admin.close()
        assert seen == ["ds.prefill.nobody.task"], seen  # only the admin's own
        assert stolen == []
        text = "\n".join(errors).lower()
        assert text.count("permissions violation") >= 5, errors

    asyncio.run(run())


def test_other_roles_cannot_send_what_is_not_theirs(stack: Stack) -> None:
    async def run() -> None:
        for role, subject in (
            ("decode", subjects.ABORT),
            ("prefill", subjects.prefill_task("p")),
            ("tools", "ds.usage.forged"),
            ("balancer", subjects.heartbeat("decode", "fake")),
            ("kvstore", subjects.token_events("r")),
        ):
            errors: list[str] = []
            nc = await _connect(stack.nats_url_of(role), errors)
            try:
                await nc.publish(subject, b"x")
                await nc.flush()
                await asyncio.sleep(0.3)
            finally:
                await nc.close()
            assert any("permissions violation" in e.lower() for e in errors), (role, errors)

    asyncio.run(run())


def test_roles_that_need_no_prompt_cannot_read_tasks_or_tokens(stack: Stack) -> None:
    """Issue 33's probe read a tenant's prompt and cache salt off the bus: only prefill (tasks)
    and the entrypoint (token events) may subscribe there."""

    async def run() -> None:
        admin = await nats.connect(stack.nats_url)
        try:
            for role in ("balancer", "decode", "kvstore", "tools"):
                errors: list[str] = []
                nc = await _connect(stack.nats_url_of(role), errors)
                stolen: list[bytes] = []

                async def on_stolen(msg: Any, into: list[bytes] = stolen) -> None:
                    into.append(msg.data)

                try:
                    await nc.subscribe("ds.prefill.>", cb=on_stolen)
                    await nc.subscribe("ds.tokens.>", cb=on_stolen)
                    await nc.flush()
                    await asyncio.sleep(0.2)
                    await admin.publish(subjects.prefill_task("nobody"), b"prompt")
                    await admin.publish(subjects.token_events("r1"), b"tokens")
                    await admin.flush()
                    await asyncio.sleep(0.2)
                finally:
                    await nc.close()
                assert stolen == [], role
                text = "\n".join(errors).lower()
                assert text.count("permissions violation") >= 2, (role, errors)
        finally:
            await admin.close()

    asyncio.run(run())


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def test_each_service_is_handed_only_the_secrets_it_uses(stack: Stack) -> None:
    """Issue 33's probe: up handed every secret to every service. Read from each process's
    own environment: the stack's secrets only where SERVICE_SECRETS says, one NATS login."""
    for c in stack.children:
        env = _environ(c.pid)
        values = "\0".join(env.values())
        given = {name for name, secret in stack.secrets.items() if secret in values}
        assert given == set(SERVICE_SECRETS.get(c.service, ())), c.name
        logins = {role for role, pw in stack.nats_passwords.items() if pw in values}
        assert logins <= {c.service} and env.get(nats_auth.USER_ENV, c.service) == c.service, (
            c.name,
            logins,
        )


def test_prefill_pushes_kv_only_to_decode_instances_it_heard(stack: Stack) -> None:
    """A task naming the prober's own server as decode_address: prefill refuses it (retryable)
    and never connects there, so the service token does not travel."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    async def run() -> control_pb2.TokenEvent:
        admin = await nats.connect(stack.nats_url)  # the entrypoint's rights, and more
        try:
            sub = await admin.subscribe(subjects.token_events("probe-1"))
            task = control_pb2.PrefillTask(
                request_id="probe-1",
                prompt_token_ids=[5, 6, 7, 8, 9],
                decode_address=address,
            )
            task.sampling.max_tokens = 4
            prefill_id = stack.instance_ids["prefill"][0]
            await admin.request(subjects.prefill_task(prefill_id), task.SerializeToString(), 10)
            while True:
                ev = control_pb2.TokenEvent.FromString((await sub.next_msg(30)).data)
                if ev.error or ev.finished:
                    return ev
        finally:
            await admin.close()

    try:
        ev = asyncio.run(run())
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody called
    finally:
        listener.close()
    assert "not a decode instance" in ev.error, ev
    assert ev.retryable, ev


def test_decode_refuses_a_forged_pool_handle_without_opening_it(stack: Stack) -> None:
    """Issue 33's probe: a well-formed pool handle naming a file of the caller's made decode
    map it, grow it and stream its bytes as tokens. Sent with the service token itself, it is
    refused (not signed by a prefill for this request) and the file stays untouched."""
    import grpc

    from libs.engine.kv import peer as kv_peer
    from libs.proto.deepserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

    def forged_handle(fd: int) -> bytes:  # a file of this process, as a prefill's pool
        return pickle.dumps(
            kv_peer._Handle(
                pool_id="made-up",
                host=kv_peer.host_id(),
                device_type="cpu",
                num_blocks=256,
                nbytes=1 << 20,
                pid=os.getpid(),
                fd=fd,
            )
        )

    prompt = [(i * 7919) % 1000 + 10 for i in range(300)]
    task = control_pb2.DecodeTask(
        request_id="forged-pool",
        token_ids=[*prompt, 11],
        num_prompt_tokens=len(prompt),
        events_subject=subjects.token_events("forged-pool"),
    )
    task.sampling.max_tokens = 4
    (decode,) = [c for c in stack.children if c.service == "decode"]
    with (
        tempfile.TemporaryFile() as victim,
        grpc.insecure_channel(f"127.0.0.1:{decode.grpc_port}") as ch,
    ):
        peer = kv_transfer_pb2.PeerBlocks(
            pool=forged_handle(victim.fileno()),
            block_ids=[0, 1],
            num_tokens=256,
            block_hashes=["ab" * 32, "cd" * 32],
        )
        stub = kv_transfer_pb2_grpc.KVTransferStub(ch)  # type: ignore[no-untyped-call]
        reply = stub.Push(
            iter([kv_transfer_pb2.KVPush(task=task), kv_transfer_pb2.KVPush(peer=peer)]),
            timeout=30,
            metadata=stack.call_metadata,
        )
        victim.seek(0, os.SEEK_END)
        size = victim.tell()
    assert not reply.accepted and "nothing imported" in reply.error, reply
    assert size == 0, "decode mapped and grew the caller's file"


def test_a_chat_completion_is_served_end_to_end(stack: Stack) -> None:
    got = chat(stack)
    assert got["choices"][0]["message"]["content"] is not None, dump_logs(stack)
    assert got["usage"]["completion_tokens"] >= 1


def _kill_and_recover(stack: Stack, which: str) -> None:
    state = json.loads((stack.run_dir / "stack.json").read_text())
    os.kill(state["pids"][which], signal.SIGKILL)
    deadline = time.monotonic() + 45
    events: list[str] = []
    while not any(f"{which}-server exited" in e for e in events):
        assert time.monotonic() < deadline, events
        events += stack.supervise()
        time.sleep(0.2)
    assert stack.backend_restarts[which] >= 1
    last: Exception | None = None
    while time.monotonic() < deadline:  # services reconnect by themselves
        stack.supervise()
        try:
            chat(stack, timeout=15)
            return
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last = exc
            time.sleep(0.5)
    raise AssertionError(f"no answer after {which} restarted: {last}\n{dump_logs(stack)}")


def test_nats_server_is_restarted_and_the_next_request_succeeds(stack: Stack) -> None:
    _kill_and_recover(stack, "nats")
    assert not stack.exited()


def test_redis_server_is_restarted_with_its_data(stack: Stack) -> None:
    import redis

    r = redis.Redis.from_url(stack.redis_url)
    r.set("deepserve-test-survives", b"1")
    r.execute_command("BGREWRITEAOF")
    time.sleep(1.5)  # appendfsync everysec
    r.close()
    _kill_and_recover(stack, "redis")
    r = redis.Redis.from_url(stack.redis_url)
    try:
        assert r.get("deepserve-test-survives") == b"1"
    finally:
        r.close()
    assert not stack.exited()
