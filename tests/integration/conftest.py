"""The real stack for integration tests: nats-server, redis-server and every service as its
own process on free ports (``deepserve.up.Stack``), plus helpers to talk to it.

One stack (tiny model, 1 prefill + 1 decode) serves a whole test module; it is always
stopped, and its logs stay under the test's tmp dir (pytest prints the path on failure).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from deepserve.up import REPO_ROOT, Stack, log_tail
from libs.proto.deepserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

from ..sdk_strict import strict_http

MODEL_NAME = "deepseek-tiny"
READY_TIMEOUT = 240.0  # two CPU cores load several tiny models at once


def start_stack(run_dir: Path, **kwargs: object) -> Stack:
    """A started stack; on failure the exception carries the failing service's log tail."""
    kwargs.setdefault("ready_timeout", READY_TIMEOUT)
    kwargs.setdefault("drain_seconds", 5.0)
    return Stack(run_dir, model="tiny", model_name=MODEL_NAME, **kwargs).start()  # type: ignore[arg-type]


@contextlib.contextmanager
def long_stream(api_url: str, key: str) -> Iterator[tuple[httpx.Response, Iterator[str]]]:
    """A streamed 4,000-token chat completion (sampled, EOS ignored) under API key ``key``:
    the response (status 200) and its SSE lines. Leaving the block closes the connection, as a
    client that goes away does."""
    body = {
        "model": MODEL_NAME,
        "max_tokens": 4000,
        "stream": True,
        "temperature": 1.0,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "ignore_eos": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    with strict_http(httpx.Client(timeout=60)) as http:
        with http.stream("POST", f"{api_url}/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            yield r, r.iter_lines()


def metrics_text(port: int) -> str:
    """The ops port ``port``'s /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def scrape_metric(port: int, name: str, label: str = "") -> float:
    """The sum of ``name``'s samples on the ops port ``port``'s /metrics, over those whose
    labels contain ``label`` (all by default); 0 when there is none."""
    text = metrics_text(port)
    pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
    return sum(
        float(m.group(2)) for m in re.finditer(pattern, text, re.M) if label in (m.group(1) or "")
    )


def service_metric(stack: Stack, service: str, name: str, label: str = "") -> float:
    """:func:`scrape_metric` on the first child of ``service`` (e.g. "decode")."""
    port = next(c.ops_port for c in stack.children if c.service == service)
    return scrape_metric(port, name, label)


def wait_for(what: str, ok: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``ok`` every 10 ms until it holds; an AssertionError naming ``what`` past
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def dump_logs(stack: Stack) -> str:
    return "\n".join(
        f"--- {c.name} ({c.log_path})\n{log_tail(c.log_path, 30)}" for c in stack.children
    )


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    """A nats-server of this test's own on a free port."""
    from deepserve import procs

    port = procs.free_port()
    proc = procs.start_nats(port, tmp_path / "nats", log=tmp_path / "nats.log")
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        procs.stop(proc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("stack")
    env = {**os.environ, "DEEPSERVE_TRACE_FILE": str(run_dir / "spans-{service}.jsonl")}
    s = Stack(
        run_dir,
        prefill=1,
        decode=1,
        model="tiny",
        model_name=MODEL_NAME,
        ready_timeout=READY_TIMEOUT,
        drain_seconds=5.0,
        env=env,
    )
    try:
        s.start()
        yield s
        dead = s.exited()
        assert not dead, f"services died during the tests: {[c.name for c in dead]}\n{dump_logs(s)}"
    finally:
        s.stop()


class AuthorizedStub:
    """A Generate stub that presents the stack's service credential on every call."""

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub = generate_pb2_grpc.GenerateStub(channel)
        self._md = metadata

    def Generate(self, request: generate_pb2.GenerateRequest, **kw: Any) -> Any:  # noqa: N802
        kw.setdefault("metadata", self._md)
        return self._stub.Generate(request, **kw)


@pytest.fixture(scope="module")
def grpc_stub(stack: Stack) -> Iterator[AuthorizedStub]:
    channel = grpc.insecure_channel(stack.grpc_address)
    try:
        yield AuthorizedStub(channel, stack.call_metadata)
    finally:
        channel.close()


@dataclass
class Generation:
    ready: generate_pb2.Ready | None
    token_ids: list[int]
    finish: generate_pb2.Finish | None


def sampling(
    max_tokens: int, temperature: float = 0.0, seed: int | None = None
) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0)
    if seed is not None:
        params.seed = seed
    return params


def grpc_generate(
    stub: generate_pb2_grpc.GenerateStub | AuthorizedStub,
    prompt_ids: Sequence[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    request_id: str = "",
    timeout: float = 120.0,
    model: str = MODEL_NAME,
) -> Generation:
    """One ``Generate`` call, its events collected (Ready, then Tokens..., then Finish)."""
    req = generate_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_ids),
        sampling=sampling(max_tokens, temperature, seed),
        model=model,
    )
    out = Generation(None, [], None)
    for event in stub.Generate(req, timeout=timeout):
        kind = event.WhichOneof("event")
        if kind == "ready":
            assert out.ready is None and not out.token_ids, "Ready must come once, first"
            out.ready = event.ready
        elif kind == "tokens":
            out.token_ids.extend(event.tokens.token_ids)
        elif kind == "finish":
            assert out.finish is None, "Finish must come once"
            out.finish = event.finish
    return out


class ReferenceRuns:
    """``deepserve generate --json`` in its own process (the single-process answer), several
    launched at once so their model loads overlap."""

    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen[str]] = {}
        self._results: dict[str, dict[str, object]] = {}

    def launch(
        self,
        name: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "deepserve.cli",
            "generate",
            "--model",
            "tiny",
            "--prompt-ids",
            ",".join(map(str, prompt_ids)),
            "--max-tokens",
            str(max_tokens),
            "--temperature",
            str(temperature),
            "--json",
        ]
        if seed is not None:
            cmd += ["--seed", str(seed)]
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self._procs[name] = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )

    def result(self, name: str) -> dict[str, object]:
        if name not in self._results:
            proc = self._procs[name]
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"deepserve generate ({name}) failed:\n{err[-2000:]}"
            self._results[name] = json.loads(out.strip().splitlines()[-1])
        return self._results[name]

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
