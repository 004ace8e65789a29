"""Per-key limits (libs/gateway/keylimits.py): concurrency caps and the token bucket, on a
fake clock."""

from __future__ import annotations

import hashlib

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from libs.common.auth import KeyTable
from libs.gateway.keylimits import (
    CONCURRENCY_RETRY_S,
    KeyLimit,
    KeyLimiter,
    KeyLimitPolicy,
    Refusal,
    Slot,
    key_id,
    parse_key_limits,
)
from services.recipe.app import build_app
from services.recipe.config import build_parser, config_from
from services.recipe.encoding import PromptEncoder
from services.recipe.handlers import AppConfig, Metrics

from ..sdk_strict import strict_http
from .recipe_fakes import MODEL, FakeBackend


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def slot(got: Slot | Refusal) -> Slot:
    assert isinstance(got, Slot), got
    return got


def test_key_id_is_the_start_of_the_sha256_not_the_key() -> None:
    assert key_id("sk-secret") == hashlib.sha256(b"sk-secret").hexdigest()[:8]
    assert "secret" not in key_id("sk-secret")


def test_parse_overrides() -> None:
    got = parse_key_limits(" ABCDEF01=2500:600000, 0badf00d=500 ,")
    assert got == {"abcdef01": KeyLimit(2500, 600000), "0badf00d": KeyLimit(500, 0)}
    for bad in ("abcdef01", "abcdef01=x", "abcdef01=-1", "abcdef01=5:-3"):
        with pytest.raises(ValueError, match="--key-limits entry"):
            parse_key_limits(bad)
    with pytest.raises(ValueError, match="not a key id"):
        KeyLimitPolicy(overrides={"sk-live-key": KeyLimit(1)})


def test_concurrency_cap_per_key_with_override() -> None:
    lim = KeyLimiter(KeyLimitPolicy(KeyLimit(2), {"bbbbbbbb": KeyLimit(3)}), Clock())
    a = [slot(lim.enter("aaaaaaaa")) for _ in range(2)]
    refused = lim.enter("aaaaaaaa")
    assert isinstance(refused, Refusal) and refused.reason == "concurrency"
    assert refused.retry_after_s == CONCURRENCY_RETRY_S and "limit is 2" in refused.message
    for _ in range(3):  # another key, its own (overridden) cap
        slot(lim.enter("bbbbbbbb"))
    assert isinstance(lim.enter("bbbbbbbb"), Refusal)
    lim.leave(a[0])
    lim.leave(a[0])  # idempotent: frees one slot, not two
    slot(lim.enter("aaaaaaaa"))
    assert isinstance(lim.enter("aaaaaaaa"), Refusal)


def test_zero_means_no_cap_and_no_rate() -> None:
    lim = KeyLimiter(KeyLimitPolicy(KeyLimit(0, 0)), Clock())
    slots = [slot(lim.enter("aaaaaaaa")) for _ in range(10_000)]
    assert lim.reserve(slots[0], 10**9) is None


def test_token_bucket_reserves_refunds_and_refills() -> None:
    clock = Clock()
    lim = KeyLimiter(KeyLimitPolicy(KeyLimit(0, 6000)), clock)  # 100 tokens per second
    s1 = slot(lim.enter("aaaaaaaa"))
    assert lim.reserve(s1, 5000) is None  # 1,000 left
    s2 = slot(lim.enter("aaaaaaaa"))
    refused = lim.reserve(s2, 3000)
    assert isinstance(refused, Refusal) and refused.reason == "tokens"
    assert refused.retry_after_s == 20  # 2,000 short at 100/s
    lim.leave(s2)  # refused: nothing was reserved, nothing given back
    lim.leave(s1, used=1200)  # 3,800 of the reservation come back: 4,800
    s3 = slot(lim.enter("aaaaaaaa"))
    assert lim.reserve(s3, 4800) is None
    s4 = slot(lim.enter("aaaaaaaa"))
    refused = lim.reserve(s4, 100)
    assert isinstance(refused, Refusal) and refused.retry_after_s == 1
    clock.t += 1.0  # refilled 100
    assert lim.reserve(s4, 100) is None


def test_unknown_cost_keeps_the_reservation_and_more_than_reserved_is_charged() -> None:
    clock = Clock()
    lim = KeyLimiter(KeyLimitPolicy(KeyLimit(0, 600)), clock)  # 10 tokens per second
    s = slot(lim.enter("aaaaaaaa"))
    assert lim.reserve(s, 300) is None
    lim.leave(s, used=None)
    s = slot(lim.enter("aaaaaaaa"))
    assert lim.reserve(s, 300) is None  # exactly the 300 left
    lim.leave(s, used=400)  # cost 100 more than reserved: -100
    s = slot(lim.enter("aaaaaaaa"))
    refused = lim.reserve(s, 1)
    assert isinstance(refused, Refusal) and refused.retry_after_s == 11  # 101 short at 10/s


def test_a_request_larger_than_a_minute_runs_when_the_bucket_is_full() -> None:
    clock = Clock()
    lim = KeyLimiter(KeyLimitPolicy(KeyLimit(0, 600)), clock)
    big = slot(lim.enter("aaaaaaaa"))
    assert lim.reserve(big, 5000) is None  # bucket full: admitted, 4,400 in debt
    lim.leave(big, used=5000)
    s = slot(lim.enter("aaaaaaaa"))
    refused = lim.reserve(s, 5000)  # needs a full bucket again: 5,000 tokens at 10/s
    assert isinstance(refused, Refusal) and refused.retry_after_s == 500
    clock.t += 500
    assert lim.reserve(s, 5000) is None
    assert lim.inflight == {"aaaaaaaa": 1}


def test_recipe_flags_build_the_policy() -> None:
    kid = key_id("sk-flash")
    args = build_parser().parse_args(
        [
            "--api-keys",
            "sk-pro=acme,sk-flash=acme",
            "--key-max-concurrency",
            "500",
            "--key-limits",
            f"{kid}=2500:1000000",
        ]
    )
    policy = config_from(args).app.key_limits
    assert policy.of(key_id("sk-pro")) == KeyLimit(500, 0)
    assert policy.of(kid) == KeyLimit(2500, 1000000)
    args = build_parser().parse_args(["--api-keys", "sk-pro=acme", "--key-limits", "abcdef01=1"])
    with pytest.raises(ValueError, match="no configured API key: abcdef01"):
        config_from(args)
    args = build_parser().parse_args(["--key-max-concurrency", "-1"])
    with pytest.raises(ValueError, match="--key-max-concurrency"):
        config_from(args)


def test_concurrency_counts_generations_not_requests() -> None:
    """Measured before: a key capped at 4 ran 64 generations as 4 requests with n=16."""
    lim = KeyLimiter(KeyLimitPolicy(KeyLimit(4)), Clock())
    many = slot(lim.enter("aaaaaaaa"))
    too_many = lim.widen(many, 16)  # more than the cap could ever hold: names the cap
    assert isinstance(too_many, Refusal) and too_many.reason == "concurrency"
    assert "limit is 4 generations" in too_many.message and "n=16" in too_many.message
    assert lim.inflight["aaaaaaaa"] == 1 and many.generations == 1  # it keeps what it held
    lim.leave(many)
    assert "aaaaaaaa" not in lim.inflight
    three = slot(lim.enter("aaaaaaaa"))
    assert lim.widen(three, 3) is None and lim.inflight["aaaaaaaa"] == 3
    assert isinstance(lim.enter("aaaaaaaa"), Slot)  # the 4th generation
    assert isinstance(lim.enter("aaaaaaaa"), Refusal)  # a 5th: past the cap
    other = slot(lim.enter("bbbbbbbb"))
    assert lim.widen(other, 4) is None  # another key: its own 4
    lim.leave(three)  # frees all 3 of its generations
    assert lim.inflight["aaaaaaaa"] == 1
    two = slot(lim.enter("aaaaaaaa"))
    assert lim.widen(two, 3) is None  # 1 + 3 = 4
    assert lim.widen(two, 2) is None and two.generations == 3  # never shrinks
    lim.leave(two)
    lim.leave(two)  # idempotent
    assert lim.inflight["aaaaaaaa"] == 1


def test_generations_that_fit_the_cap_but_not_now_are_refused_like_a_request_past_it() -> None:
    lim = KeyLimiter(KeyLimitPolicy(KeyLimit(4)), Clock())
    held = [slot(lim.enter("aaaaaaaa")) for _ in range(2)]
    wide = slot(lim.enter("aaaaaaaa"))
    busy = lim.widen(wide, 3)  # 3 + 2 held = 5 > 4
    assert isinstance(busy, Refusal) and busy.retry_after_s == CONCURRENCY_RETRY_S
    assert "3 are and this request adds 2 more (n=3)" in busy.message  # 3: its own first
    lim.leave(wide)
    lim.leave(held[0])
    again = slot(lim.enter("aaaaaaaa"))
    assert lim.widen(again, 3) is None and lim.inflight["aaaaaaaa"] == 4
    unlimited = KeyLimiter(KeyLimitPolicy(KeyLimit(0)), Clock())
    assert unlimited.widen(slot(unlimited.enter("aaaaaaaa")), 10_000) is None


def test_recipe_counts_n_against_the_keys_concurrency_cap() -> None:
    encoder = PromptEncoder([MODEL], default_thinking=True)
    backend = FakeBackend(encoder)
    cfg = AppConfig(
        model_name=MODEL,
        default_max_tokens=8,
        keys=KeyTable({"k-alpha": "acme"}),
        key_limits=KeyLimitPolicy(KeyLimit(concurrency=4)),
    )
    http = strict_http(TestClient(build_app(cfg, encoder, backend, Metrics(CollectorRegistry()))))
    alpha = {"authorization": "Bearer k-alpha"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = http.post("/v1/chat/completions", json={**body, "n": 16}, headers=alpha)
    assert r.status_code == 429, r.text
    assert "limit is 4 generations" in r.json()["error"]["message"]
    assert not backend.requests  # refused before the backend
    r = http.post("/v1/chat/completions", json={**body, "n": 4}, headers=alpha)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    r = http.post("/v1/chat/completions", json={**body, "n": 4}, headers=alpha)
    assert r.status_code == 200, r.text  # the 4 generations were given back
