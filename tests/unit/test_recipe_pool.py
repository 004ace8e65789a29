"""recipe: the encode pool admits request bodies by their bytes -- a burst of large requests
is all accepted while the byte budget holds and refused with 429 only past it (the old bound,
64 waiting requests, refused bursts the CPUs would have cleared)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from libs.common.errors import Overloaded
from services.recipe.encoding import PromptEncoder
from services.recipe.pool import EncodePool, host_cores

from ..sdk_strict import strict_http
from .recipe_fakes import MODEL, FakeBackend
from .test_recipe_hostile import app_of

BODY_TEXT = "word " * 40_000  # ~200 KB of JSON per request
BURST = 100  # more than the old 4 threads + 64 waiting


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


class GatedEncoder:
    """The real encoder; every conversion waits on one gate, so a burst piles up in the pool."""

    def __init__(self, inner: PromptEncoder) -> None:
        self.inner, self.gate = inner, threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def options(self) -> Any:
        self.gate.wait(30)
        return self.inner.options


def test_threads_default_to_the_cores() -> None:
    pool = EncodePool(0)
    try:
        assert pool.threads == host_cores() >= 1
    finally:
        pool.close()


async def test_pool_admits_by_bytes() -> None:
    pool, gate = EncodePool(1, queue_bytes=10 << 20), threading.Event()
    jobs = [asyncio.ensure_future(pool.run(lambda: gate.wait(10), 1 << 20)) for _ in range(10)]
    await asyncio.sleep(0)
    assert pool.bytes == 10 << 20
    with pytest.raises(Overloaded, match="--encode-queue-bytes"):
        await pool.run(lambda: None, 1)
    gate.set()
    assert all(await asyncio.gather(*jobs))
    assert pool.bytes == 0 and await pool.run(lambda: 5, 1 << 20) == 5
    pool.close()


async def burst(encoder: PromptEncoder, **cfg: Any) -> list[int]:
    """BURST simultaneous ~200 KB requests while conversion is held; their status codes."""
    gated = GatedEncoder(encoder)
    app = app_of(gated, FakeBackend(encoder), encode_threads=2, **cfg)
    async with strict_http(
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60)
    ) as http:
        body = {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": BODY_TEXT}],
        }
        tasks = [
            asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
            for _ in range(BURST)
        ]
        await asyncio.sleep(0.5)  # every request is in, or refused
        gated.gate.set()
        return [r.status_code for r in await asyncio.gather(*tasks)]


async def test_a_burst_within_the_byte_budget_is_all_accepted(encoder: PromptEncoder) -> None:
    codes = await burst(encoder)  # the default budget: 256 MiB
    assert codes == [200] * BURST


async def test_a_burst_past_the_byte_budget_is_429_past_it(encoder: PromptEncoder) -> None:
    codes = await burst(encoder, encode_queue_bytes=5 << 20)  # room for ~25 of them
    assert 20 <= codes.count(200) <= 30 and codes.count(429) == BURST - codes.count(200), codes
