"""recipe fuzz: malformed bodies and headers on every route never give a 5xx, and the service
still answers a good request afterwards (hypothesis, in-process against the fake backend)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from libs.common.auth import KeyTable
from services.recipe.app import build_app
from services.recipe.encoding import PromptEncoder
from services.recipe.handlers import AppConfig, Metrics

from ..sdk_strict import strict_http
from .recipe_fakes import MODEL, FakeBackend

ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
]
GOOD = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    },
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
}
FIELDS = [
    "model",
    "messages",
    "input",
    "instructions",
    "system",
    "max_tokens",
    "max_output_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stop_sequences",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "response_format",
    "thinking",
    "reasoning",
    "reasoning_effort",
    "n",
    "logprobs",
    "top_logprobs",
    "prompt",
    "suffix",
    "echo",
    "best_of",
    "logit_bias",
    "role",
    "content",
    "type",
    "text",
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
    | st.sampled_from(
        [
            "user",
            "assistant",
            "system",
            "tool",
            "text",
            "function",
            MODEL,
            "<｜User｜>",
            "enabled",
            "disabled",
        ]
    ),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def bodies(draw: Any, route: str) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return json.dumps(draw(json_values)).encode()
    body = dict(GOOD[route])
    for _ in range(draw(st.integers(1, 4))):  # mutate a good body field by field
        body[draw(st.sampled_from(FIELDS))] = draw(json_values)
    if kind == 3:
        body["messages"] = [
            {
                "role": draw(st.sampled_from(["user", "assistant", "tool", "system", "x"])),
                "content": draw(json_values),
            }
        ]
    return json.dumps(body).encode()


header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
headers = st.fixed_dictionaries(
    {},
    optional={
        "content-type": st.sampled_from(
            ["application/json", "text/plain", "", "multipart/form-data"]
        ),
        "authorization": header_text,
        "x-api-key": header_text,
        "x-deepserve-traffic-class": header_text,
        "traceparent": header_text,
        "anthropic-version": header_text,
    },
)


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


@pytest.mark.parametrize("keys", [{}, {"k1": "t1"}])
def test_malformed_requests_never_5xx(encoder: PromptEncoder, keys: dict[str, str]) -> None:
    backend = FakeBackend(encoder)
    app = build_app(
        AppConfig(model_name=MODEL, default_max_tokens=8, max_body_bytes=4096, keys=KeyTable(keys)),
        encoder,
        backend,
        Metrics(CollectorRegistry()),
    )
    client = strict_http(TestClient(app, raise_server_exceptions=True))

    @settings(
        max_examples=120,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(route=st.sampled_from(ROUTES), data=st.data(), hdrs=headers)
    def one(route: str, data: Any, hdrs: dict[str, str]) -> None:
        body = data.draw(bodies(route))
        r = client.post(route, content=body, headers=hdrs)
        assert r.status_code < 500, (route, body[:300], hdrs, r.status_code, r.text[:300])
        assert r.status_code in (200, 400, 401, 404, 413, 422), r.status_code
        if r.status_code != 200:
            err = r.json()
            assert "error" in err and err["error"]["message"]

    one()
    auth = {"authorization": "Bearer k1"} if keys else {}
    for route, body in GOOD.items():
        r = client.post(route, json=body, headers=auth)
        assert r.status_code == 200, (route, r.text)
    assert client.get("/healthz").status_code == 200
