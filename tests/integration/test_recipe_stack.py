"""The recipe's three protocols through the real stack, driven by the official openai and
anthropic SDKs, with API keys configured (one from the flag, one from a key file).

The tiny model emits random tokens, so these tests check shapes, usage, errors and that the
key's tenant travels (it salts the kvstore's prefix hashes); parsing of thinking, tool calls
and JSON is tested against scripted tokens in tests/unit/test_recipe.py.
"""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from deepserve.up import Stack
from libs.common.tenant_label import SECRET_ENV as TENANT_SECRET
from libs.common.tenant_label import label_of
from libs.gateway.keylimits import key_id
from services.recipe.handlers import tenant_label

from ..sdk_strict import anthropic_client, openai_client
from .conftest import (
    MODEL_NAME,
    READY_TIMEOUT,
    dump_logs,
    long_stream,
    service_metric,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)
LONG_TEXT = " ".join(f"w{i}" for i in range(400))  # > 2 full 128-token blocks
GAMMA_CAP = ["--key-limits", f"{key_id('sk-gamma')}=1"]  # one generation at a time


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("recipe-stack")
    keys_file = run_dir / "keys"
    keys_file.write_text("# tenant globex\nsk-beta=globex\n")
    s = Stack(
        run_dir,
        prefill=1,
        decode=1,
        model="tiny",
        model_name=MODEL_NAME,
        ready_timeout=READY_TIMEOUT,
        drain_seconds=5.0,
        env=dict(os.environ),
        extra_args={
            "recipe": [
                "--api-keys",
                "sk-alpha=acme,sk-gamma=initech",
                "--api-keys-file",
                str(keys_file),
                "--max-body-bytes",
                str(1 << 20),
                *GAMMA_CAP,
            ],
            # Generate takes API keys too: sk-gamma's one generation is one cap on both doors
            "entrypoint": ["--api-keys", "sk-alpha=acme,sk-gamma=initech", *GAMMA_CAP],
        },
    )
    try:
        s.start()
        yield s
        assert not s.exited(), dump_logs(s)
    finally:
        s.stop()


def oai(stack: Stack, key: str = "sk-alpha", sdk_validation: bool = True) -> openai.OpenAI:
    return openai_client(
        sdk_validation, base_url=stack.api_url, api_key=key, max_retries=0, timeout=120
    )


def claude(stack: Stack, key: str = "sk-beta") -> anthropic.Anthropic:
    return anthropic_client(base_url=stack.api_base, api_key=key, max_retries=0, timeout=120)


def test_chat_completions_shapes_and_usage(keyed_stack: Stack) -> None:
    c = oai(keyed_stack)
    out = c.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=6,
        temperature=0,
    )
    u = out.usage
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert 1 <= u.completion_tokens <= 6 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert (u.model_extra or {})[
        "prompt_cache_miss_tokens"
    ] == u.prompt_tokens - u.prompt_tokens_details.cached_tokens
    parts = list(
        c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert parts[0].choices[0].delta.role == "assistant"
    assert [p.usage for p in parts if p.usage][-1].prompt_tokens == u.prompt_tokens
    thinking = c.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        extra_body={"thinking": {"type": "enabled"}},
    )
    assert thinking.usage.completion_tokens >= 1


def test_responses_and_messages(keyed_stack: Stack) -> None:
    r = oai(keyed_stack).responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=5)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1
    events = list(
        oai(keyed_stack).responses.create(
            model=MODEL_NAME, input="Hello", max_output_tokens=5, stream=True
        )
    )
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    m = claude(keyed_stack).messages.create(
        model=MODEL_NAME, max_tokens=5, messages=[{"role": "user", "content": "Hello"}]
    )
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert m.usage.input_tokens > 0 and m.usage.output_tokens >= 1
    with claude(keyed_stack).messages.stream(
        model=MODEL_NAME,
        max_tokens=5,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Hi"}],
    ) as s:
        types = [e.type for e in s]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    n = claude(keyed_stack).messages.count_tokens(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}]
    )
    assert n.input_tokens > 0


def test_errors(keyed_stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError):
        oai(keyed_stack, "sk-wrong").chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    with pytest.raises(anthropic.AuthenticationError):
        claude(keyed_stack, "sk-wrong").messages.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.NotFoundError):
        oai(keyed_stack).chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(anthropic.NotFoundError):
        claude(keyed_stack).messages.create(
            model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError):
        oai(keyed_stack).chat.completions.create(model=MODEL_NAME, messages=[])
    with pytest.raises(anthropic.BadRequestError):
        claude(keyed_stack).messages.create(model=MODEL_NAME, max_tokens=2, messages=[])
    with pytest.raises(openai.APIStatusError) as e:
        oai(keyed_stack).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x" * (2 << 20)}]
        )
    assert e.value.status_code == 413


def test_tenant_salts_the_kvstore(keyed_stack: Stack) -> None:
    """The same long prompt hits the cache for its own tenant only."""

    def cached(c: openai.OpenAI) -> int:
        out = c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": LONG_TEXT}],
            max_tokens=2,
            temperature=0,
        )
        return out.usage.prompt_tokens_details.cached_tokens

    alpha, beta = oai(keyed_stack, "sk-alpha"), oai(keyed_stack, "sk-beta")
    assert cached(alpha) == 0
    deadline = time.monotonic() + 20  # the prefill writes blocks to the kvstore after handing off
    hit = 0
    while not hit and time.monotonic() < deadline:
        hit = cached(alpha)
        time.sleep(0.3)
    assert hit >= 256, dump_logs(keyed_stack)
    assert cached(beta) == 0, "another tenant must not hit acme's cached prefix"
    # The metrics are on the ops port (--http-port), labelled by a hash of the tenant; the
    # public port has none.
    recipe = next(c for c in keyed_stack.children if c.service == "recipe")
    ops = recipe.argv[recipe.argv.index("--http-port") + 1]
    with urllib.request.urlopen(f"http://127.0.0.1:{ops}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    # Salted with the deployment's secret (deepserve up generates one): not computable without it.
    salted = label_of(keyed_stack.secrets[TENANT_SECRET].encode(), "acme")
    assert f'tenant="{salted}"' in metrics and "acme" not in metrics
    assert f'tenant="{tenant_label("acme")}"' not in metrics
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{keyed_stack.api_base}/metrics", timeout=10)
    assert e.value.code == 404


def test_disconnect_aborts_downstream_within_a_second(keyed_stack: Stack) -> None:
    with long_stream(keyed_stack.api_url, "sk-alpha") as (r, lines):
        rid = r.headers["x-request-id"]
        while not next(lines).startswith("data: "):
            pass
    gone = time.monotonic()  # leaving the block closed the connection
    log = next(c.log_path for c in keyed_stack.children if c.name == "entrypoint")
    aborted = re.compile(
        rf"request {rid}(-\w+)?: aborting upstream"
    )  # the entrypoint may suffix ids
    while time.monotonic() - gone < 1.0 and not aborted.search(log.read_text()):
        time.sleep(0.05)
    assert aborted.search(log.read_text()), f"the entrypoint did not abort {rid} within 1 s"


@pytest.mark.parametrize(
    "keys, expected", [("", "the API is OPEN"), ("k1=t1,k2=t2", "API keys required: 2 keys")]
)
def test_startup_log_and_no_backend_is_503(keys: str, expected: str) -> None:
    import signal
    import subprocess
    import sys

    from deepserve.procs import free_port
    from deepserve.up import REPO_ROOT

    port = free_port()
    env = {**os.environ, "DEEPSERVE_API_KEYS": keys, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.recipe",
            "--port",
            str(port),
            "--entrypoint-address",
            "127.0.0.1:9",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if expected in line or len(seen) > 50:
                break
        if not keys:  # no entrypoint behind it: 503 + Retry-After, in each protocol's shape
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while True:
                try:
                    c = openai_client(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
                    c.chat.completions.create(
                        model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "x"}]
                    )
                except openai.APIConnectionError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
                    continue
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503 and int(exc.response.headers["retry-after"]) >= 1
                    break
                raise AssertionError("a request with no entrypoint succeeded")
            with pytest.raises(anthropic.APIStatusError) as err:
                anthropic_client(base_url=base, api_key="x", max_retries=0).messages.create(
                    model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "x"}]
                )
            assert (
                err.value.status_code == 503
                and err.value.body["error"]["type"] == "overloaded_error"
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert any(expected in line for line in seen), "".join(seen)


def test_bench_serve_url_drives_the_stack_over_http(keyed_stack: Stack) -> None:
    """``deepserve bench serve --url``'s driver against the real stack: every turn answered,
    usage read from the stream, and later turns of a session served from the prefix cache."""
    import asyncio

    from deepserve.bench import http_load, http_procs

    shape = http_load.TraceShape(
        turns=3, system_words=200, context_words=200, user_words=20, max_tokens=4
    )
    sessions = http_load.make_sessions(shape, 2, seed=7)
    from deepserve.bench.engine_view import EngineView

    # The counts below must be this run's alone: an earlier test's aborted stream may step on.
    running = "deepserve:num_requests_running"
    wait_for("an idle decode", lambda: service_metric(keyed_stack, "decode", running) == 0)

    view = EngineView(
        {
            c.name: f"http://127.0.0.1:{c.ops_port}/metrics"
            for c in keyed_stack.children
            if c.service in ("prefill", "decode")
        },
        interval=0.2,
    )

    async def run() -> tuple[list[http_load.Result], float, dict[str, Any]]:
        await view.start()
        results, seconds, cpu = await asyncio.to_thread(  # one client process per session
            http_procs.drive_processes,
            http_load.drive,
            2,
            sessions,
            shape,
            concurrency=2,
            rate=0.0,
            url=keyed_stack.api_url,
            model=MODEL_NAME,
            timeout=120.0,
            api_key="sk-alpha",
            seed=7,
        )
        assert len(cpu) == 2 and all(0 < c < seconds for c in cpu), (cpu, seconds)
        return results, seconds, await view.stop()

    results, seconds, engines = asyncio.run(run())
    # The engines' own view of the same run (bench serve --metrics): what they did for it.
    prefill, decode = engines["prefill-0"], engines["decode-0"]
    assert "scrape_errors" not in engines, engines
    assert prefill["prompt_tokens"] >= sum(r.prompt_tokens - r.cached_tokens for r in results)
    assert prefill["ttft_ms"] > 0 and prefill["prefix_hit_rate"] > 0  # later turns hit
    assert decode["steps"] > 0 and decode["batch"] >= 1 and decode["step_ms"] > 0
    assert prefill["generation_tokens"] + decode["generation_tokens"] == 6 * 4
    summary = http_load.summarize(
        results, seconds, price=http_load.OFF_PEAK_PRICE, gpus=1, engine=None
    )
    assert summary["requests"] == 6 and summary["ok"] == 6, [r.status for r in results]
    assert all(r.prompt_tokens > 0 and r.completion_tokens == 4 for r in results)
    later = [r for r in results if r.turn > 0]
    assert all(r.allowed_cached_tokens >= 128 for r in later)
    # The previous turn's prompt is a prefix of this one: its full blocks come from the cache.
    assert all(r.cached_tokens >= r.allowed_cached_tokens for r in later), [
        (r.cached_tokens, r.allowed_cached_tokens) for r in later
    ]
    assert summary["ttft"]["p50_ms"] > 0 and summary["output_tokens_per_s"] > 0


def test_usage_records_reach_jetstream_and_the_reader(keyed_stack: Stack) -> None:
    """Recipe → JetStream → ``deepserve usage``: each tenant's totals grow by the sums of what
    its responses said (prompt, cached, completion tokens), keyed by the tenant the API key
    names. Earlier tests' records (published in the background) are waited out first."""
    from .test_usage import usage_cli

    def totals() -> dict[str, dict[str, int]]:
        got = usage_cli(keyed_stack.nats_url)["tenants"]
        assert isinstance(got, dict)
        return {
            name: {
                "requests": t["requests"],
                "uncached": t["uncached_tokens"],
                "cached": t["cached_tokens"],
                "out": t["completion_tokens"],
            }
            for name, t in got.items()
        }

    def settled() -> dict[str, dict[str, int]]:
        last, deadline = totals(), time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now = totals()
            if now == last:
                return now
            last = now
        return last

    zero = dict.fromkeys(("requests", "uncached", "cached", "out"), 0)
    before = settled()
    want: dict[str, dict[str, int]] = {}
    for key, tenant, prompt in [
        ("sk-alpha", "acme", "usage one"),
        ("sk-alpha", "acme", "usage two, a little longer"),
        ("sk-beta", "globex", "usage three"),
    ]:
        u = (
            oai(keyed_stack, key)
            .chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=5,
                temperature=0,
            )
            .usage
        )
        assert u is not None
        t = want.setdefault(tenant, dict(zero))
        cached = (u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0) or 0
        t["requests"] += 1
        t["uncached"] += u.prompt_tokens - cached
        t["cached"] += cached
        t["out"] += u.completion_tokens
    deadline = time.monotonic() + 20
    while True:  # records are published in the background
        after = totals()
        grew = {
            name: {k: after[name][k] - before.get(name, zero)[k] for k in zero}
            for name in after
            if after[name] != before.get(name)
        }
        if grew == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert grew == want


def test_n_choices_count_against_a_keys_cap(keyed_stack: Stack) -> None:
    """Issue 33's probe: a tenant capped at 4 ran 64 generations with n. sk-gamma may run one."""
    with pytest.raises(openai.RateLimitError) as e:
        oai(keyed_stack, "sk-gamma").chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2, n=2
        )
    assert "n" in str(e.value.message), e.value.message


def test_a_key_on_generate_is_capped_with_http_and_billed(keyed_stack: Stack) -> None:
    """Issue 33's probe: a tenant's key on gRPC Generate bypassed its caps and wrote no usage
    record. While one Generate of sk-gamma runs, another (gRPC) and a chat (HTTP) are refused;
    the call's record names the key's tenant, its key id and route grpc, with what it got."""
    import grpc
    import redis

    from libs.proto.deepserve.v1 import common_pb2, generate_pb2
    from libs.proto.deepserve.v1 import generate_pb2_grpc as gen

    md = (("authorization", "Bearer sk-gamma"),)
    rid = f"probe-grpc-{time.monotonic_ns()}"

    def request(request_id: str) -> generate_pb2.GenerateRequest:
        return generate_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=[5, 6, 7, 8],
            model=MODEL_NAME,
            tenant="acme",  # not the key's: ignored
            sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True),
        )

    got = 0
    with grpc.insecure_channel(keyed_stack.grpc_address) as ch:
        stub = gen.GenerateStub(ch)  # type: ignore[no-untyped-call]
        held = stub.Generate(request(rid), timeout=120, metadata=md)
        for ev in held:  # the slot is taken once tokens flow
            got += len(ev.tokens.token_ids)
            if got >= 2:
                break
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(rid + "-2"), timeout=30, metadata=md))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        with pytest.raises(openai.RateLimitError):
            oai(keyed_stack, "sk-gamma").chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        held.cancel()
    r = redis.Redis.from_url(keyed_stack.redis_url, decode_responses=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            names = list(r.scan_iter(match=f"*:rec:*:{rid}"))
            rec = r.hgetall(names[0]) if len(names) == 1 else {}
            if rec.get("status", "open") != "open" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        r.close()
    want = {"tenant": "initech", "key_id": key_id("sk-gamma"), "route": "grpc"}
    assert {k: rec.get(k) for k in want} == want, rec
    assert int(rec["completion_tokens"]) >= got and rec["status"] != "open", rec
