"""The container tier (``make test-container``; not part of ``make test``): builds the image
with ``scripts/docker/build.sh``, runs ``compose.yaml`` under its own project name and ports,
and drives it as a user would, with the official openai SDK and an API key: a plain request,
requests spread over ``--scale decode=2 --scale prefill=2``, and one decode replica killed
(``docker kill``: SIGKILL) under streams that the retry rules can continue exactly (greedy),
after which every stream still ends with the undisturbed text and the stack keeps serving.

Needs a Docker engine and docker-compose: ``make test-container`` installs and starts them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from deepserve import procs
from libs.common import nats_auth

from ..sdk_strict import openai_client

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "deepseek-tiny"
KEY = "sk-container-" + secrets.token_hex(8)
DOCKER = os.environ.get("DOCKER") or (
    "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
)


def _compose_cmd() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return [DOCKER, "compose"]


@dataclass
class Compose:
    project: str
    env: dict[str, str]
    api_port: int
    cmd: list[str] = field(default_factory=_compose_cmd)

    def run(self, *args: str, timeout: float = 600) -> str:
        out = subprocess.run(
            [*self.cmd, "-p", self.project, "-f", str(ROOT / "compose.yaml"), *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert out.returncode == 0, f"compose {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def containers(self, service: str) -> list[str]:
        ids = self.run("ps", "-q", service).split()
        assert ids, f"no {service} container"
        return ids

    def metric(self, container: str, name: str) -> float:
        """The sum of ``name``'s samples on a container's ops port (not published)."""
        code = (
            "import urllib.request as u;"
            "print(u.urlopen('http://127.0.0.1:9090/metrics', timeout=5).read().decode())"
        )
        text = subprocess.run(
            [DOCKER, "exec", container, "python", "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    def client(self) -> openai.OpenAI:
        return openai_client(
            base_url=f"http://127.0.0.1:{self.api_port}/v1", api_key=KEY, max_retries=0
        )


def _wait_healthy(c: Compose, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ids = c.run("ps", "-q").split()
        fmt = "{{.Name}} {{.State.Status}} {{.State.Health.Status}}"
        out = subprocess.run(
            [DOCKER, "inspect", "--format", fmt, *ids], capture_output=True, text=True
        ).stdout.split("\n")
        # A replica the test killed stays exited (a kill is a manual stop for the restart
        # policy); one that crashes is "restarting", and counts as not healthy.
        rows = [line.split(" ", 2) for line in out if line.count(" ") == 2]
        states = {name: health for name, status, health in rows if status != "exited"}
        if states and all(s == "healthy" for s in states.values()):
            return
        if time.monotonic() > deadline:
            logs = c.run("logs", "--tail", "30")
            raise AssertionError(f"not healthy after {timeout}s: {states}\n{logs}")
        time.sleep(2)


@pytest.fixture(scope="module")
def stack() -> Iterator[Compose]:
    if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers: run `make test-container` (it starts one)")
    build = subprocess.run(
        ["bash", str(ROOT / "scripts/docker/build.sh"), "cpu"],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    api_port = procs.free_port()
    env = {
        **os.environ,
        "DEEPSERVE_API_PORT": str(api_port),
        "DEEPSERVE_GRPC_PORT": str(procs.free_port()),
        "DEEPSERVE_API_KEYS": f"{KEY}=acme",
        "DEEPSERVE_SERVICE_TOKEN": secrets.token_hex(32),
        "DEEPSERVE_CACHE_SALT_SECRET": secrets.token_hex(32),
        "DEEPSERVE_KV_MAC_KEY": secrets.token_hex(32),
        # compose refuses to start NATS without a password per role (scripts/docker/env.sh)
        **{nats_auth.password_env(r): secrets.token_hex(24) for r in nats_auth.ROLES},
        "DOCKER_BUILDKIT": "1",
    }
    c = Compose(f"dstest{secrets.token_hex(3)}", env, api_port)
    try:
        c.run("up", "-d")
        _wait_healthy(c, 300)
        yield c
    finally:
        subprocess.run(
            [*c.cmd, "-p", c.project, "-f", str(ROOT / "compose.yaml"), "down", "-v", "-t", "5"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            timeout=300,
        )


def _chat(client: openai.OpenAI, prompt: str, max_tokens: int) -> str:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "length"
    return out.choices[0].message.content or ""


def test_serves_the_api_with_a_key(stack: Compose) -> None:
    client = stack.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _chat(client, "hello from a container", 8)
    anonymous = openai_client(
        base_url=f"http://127.0.0.1:{stack.api_port}/v1", api_key="sk-wrong", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    # Only the API leaves the compose network: the ops port (metrics) is not published.
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{stack.api_port}/metrics", timeout=5)


def _stream(client: openai.OpenAI, prompt: str, max_tokens: int, got: list[str]) -> str:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    finish = None
    for chunk in stream:
        if chunk.choices:
            got.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    return "".join(got)


def test_scale_spreads_and_a_killed_decode_loses_no_stream(stack: Compose) -> None:
    stack.run("up", "-d", "--scale", "decode=2", "--scale", "prefill=2")
    _wait_healthy(stack, 300)
    time.sleep(3)  # a heartbeat or two: the entrypoint and balancer see the new replicas
    client = stack.client()
    decodes, prefills = stack.containers("decode"), stack.containers("prefill")
    assert len(decodes) == 2 and len(prefills) == 2
    accepted = 'deepserve_decode_requests_total{outcome="accepted"}'

    # Spread: concurrent requests reach both replicas of each engine service.
    before = {d: stack.metric(d, accepted) for d in decodes}
    before_p = {p: stack.metric(p, "deepserve_prefill_requests_total") for p in prefills}
    prompts = [f"request {i}: tell me about containers number {i * 7}" for i in range(8)]
    threads = [threading.Thread(target=_chat, args=(client, p, 16)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    served = {d: stack.metric(d, accepted) - before[d] for d in decodes}
    served_p = {
        p: stack.metric(p, "deepserve_prefill_requests_total") - before_p[p] for p in prefills
    }
    assert all(n > 0 for n in served.values()), f"decode replicas served {served}"
    assert all(n > 0 for n in served_p.values()), f"prefill replicas served {served_p}"

    # Kill: the undisturbed greedy texts first, then the same streams with a replica killed.
    max_tokens = 96
    prompts = [f"stream {i}: a long answer about ships, please, {i}" for i in range(6)]
    expected = [_chat(client, p, max_tokens) for p in prompts]
    before = {d: stack.metric(d, accepted) for d in decodes}
    got: list[list[str]] = [[] for _ in prompts]
    results: list[str | BaseException] = ["" for _ in prompts]

    def run(i: int) -> None:
        try:
            results[i] = _stream(client, prompts[i], max_tokens, got[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(g) >= 3 for g in got) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(len(g) >= 3 for g in got), "streams did not start"
    load = {d: stack.metric(d, accepted) - before[d] for d in decodes}
    victim = max(load, key=lambda d: load[d])
    assert load[victim] > 0
    subprocess.run([DOCKER, "kill", victim], check=True, capture_output=True, timeout=60)
    for t in threads:
        t.join(300)
    for i, r in enumerate(results):
        assert not isinstance(r, BaseException), f"stream {i} failed: {r!r}"
        assert r == expected[i], f"stream {i} differs after the kill"
    # The stack keeps serving on what is left.
    assert _chat(client, "after the kill", 8)
    info = json.loads(
        subprocess.run(
            [DOCKER, "inspect", victim], capture_output=True, text=True, check=True
        ).stdout
    )[0]
    assert info["State"]["ExitCode"] == 137  # it really died by SIGKILL


def test_s3_profile_puts_blocks_in_seaweedfs(stack: Compose) -> None:
    """``--profile s3`` with 12 ``s3://`` targets: the kvstore, recreated with them, writes
    each block's 12 shards as objects, one per bucket, in the stack's SeaweedFS."""
    buckets = [f"ds-c{i}" for i in range(12)]
    stack.env["DEEPSERVE_TARGETS"] = ",".join(f"s3://{b}" for b in buckets)
    # Only what changes: the others stay up and find the new kvstore at the same address.
    stack.run("--profile", "s3", "up", "-d", "seaweedfs", "kvstore")
    _wait_healthy(stack, 300)
    time.sleep(3)
    client = stack.client()
    _chat(client, "a prompt of several blocks " * 60, 4)  # ~300 tokens: 2 full blocks
    (kvstore,) = stack.containers("kvstore")
    code = (
        "import boto3, json;"
        "c = boto3.client('s3', endpoint_url='http://seaweedfs:8333', region_name='us-east-1');"
        "n = lambda b: c.list_objects_v2(Bucket=b).get('KeyCount', 0);"
        f"print(json.dumps({{b: n(b) for b in {buckets}}}))"
    )
    deadline = time.monotonic() + 60
    while True:  # prefill writes behind the request
        out = subprocess.run(
            [DOCKER, "exec", kvstore, "python", "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        counts = json.loads(out.stdout)
        if all(n >= 2 for n in counts.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert all(n >= 2 for n in counts.values()), f"objects per bucket: {counts}"
