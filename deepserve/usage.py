"""``deepserve usage``: total the recipe's usage records (``services/recipe/usage.py``) per
tenant, and price them.

    deepserve usage --nats-url nats://127.0.0.1:4222 [--tenant T] [--since 2026-11-01T00:00Z]
                    [--price off-peak|peak|schedule|IN,CACHED,OUT] [--json]

Prices are US dollars per million tokens: (uncached input, cached input, output). The named
tables are DeepSeek's list for DeepSeek-V4.1-Flash (``deepseek-flash``) as published at
api-docs.deepseek.com/quick_start/pricing and quoted in the DeepInfer release write-ups:
off-peak $0.15 / $0.003 / $0.60, peak $0.30 / $0.006 / $1.20 (the same numbers
``deepserve bench serve`` uses as its off-peak price). Peak hours are weekdays 01:00-04:00 and
06:00-10:00 UTC (Beijing 09:00-12:00 and 14:00-18:00); ``schedule`` prices each request by the
hour it started (Chinese public holidays, off-peak at DeepSeek, are not known here and are
priced as weekdays).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from services.recipe.usage import STREAM, SUBJECT_PREFIX, UsageRecord


@dataclass(frozen=True)
class Price:
    """US dollars per million tokens."""

    uncached: float
    cached: float
    output: float

    def of(self, r: UsageRecord) -> float:
        return (
            r.uncached_tokens * self.uncached
            + r.cached_tokens * self.cached
            + r.completion_tokens * self.output
        ) / 1e6


OFF_PEAK = Price(0.15, 0.003, 0.60)
PEAK = Price(0.30, 0.006, 1.20)
PEAK_HOURS_UTC = ((1, 4), (6, 10))  # [start, end) on weekdays


def is_peak(at: float) -> bool:
    t = datetime.fromtimestamp(at, UTC)
    return t.weekday() < 5 and any(a <= t.hour < b for a, b in PEAK_HOURS_UTC)


def parse_price(text: str) -> Price | None:
    """``off-peak``, ``peak``, ``IN,CACHED,OUT`` -> a fixed table; ``schedule`` -> None (by the
    hour); ValueError otherwise."""
    named = {"off-peak": OFF_PEAK, "offpeak": OFF_PEAK, "peak": PEAK}
    if text in named:
        return named[text]
    if text == "schedule":
        return None
    try:
        uncached, cached, output = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(
            f"--price must be off-peak, peak, schedule or IN,CACHED,OUT ($/M tokens), got {text!r}"
        ) from None
    if min(uncached, cached, output) < 0:
        raise ValueError(f"--price: prices must be >= 0, got {text!r}")
    return Price(uncached, cached, output)


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    uncached_tokens: int = 0
    completion_tokens: int = 0
    price_usd: float = 0.0


def totals(records: Iterable[UsageRecord], price: Price | None) -> dict[str, Totals]:
    """Per tenant ("" on an open API); ``price`` None prices each request by its start hour."""
    out: dict[str, Totals] = {}
    for r in records:
        t = out.setdefault(r.tenant, Totals())
        t.requests += 1
        t.prompt_tokens += r.prompt_tokens
        t.cached_tokens += r.cached_tokens
        t.uncached_tokens += r.uncached_tokens
        t.completion_tokens += r.completion_tokens
        table = price or (PEAK if is_peak(r.started_at) else OFF_PEAK)
        t.price_usd += table.of(r)
    return out


def parse_since(text: str) -> datetime:
    """An ISO 8601 time (``Z`` or an offset; naive means UTC)."""
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since must be an ISO 8601 time, got {text!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


async def read_records(
    nats_url: str,
    tenant: str | None = None,
    since: datetime | None = None,
    stream: str = STREAM,
    timeout: float = 5.0,
) -> list[UsageRecord]:
    """Every record of ``stream`` (of ``tenant``, from ``since``), read with an ephemeral
    consumer that acknowledges nothing (reading changes nothing)."""
    import nats
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from libs.common.natsutil import credentials  # the tools user's inbox (its permissions)

    nc = await nats.connect(
        servers=[nats_url],
        connect_timeout=timeout,
        max_reconnect_attempts=0,
        **credentials(nats_url),
    )
    try:
        js = nc.jetstream(timeout=timeout)
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=60.0)
        if since is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = since.astimezone(UTC)
        # every subject: a tenant's is its salted label, which only the services can compute
        subject = f"{SUBJECT_PREFIX}.>"
        sub = await js.pull_subscribe(subject, stream=stream, config=config)
        out: list[UsageRecord] = []
        while (await sub.consumer_info()).num_pending or 0:
            try:
                msgs = await sub.fetch(512, timeout=timeout)
            except NatsTimeout:
                break
            for m in msgs:
                try:
                    r = UsageRecord.from_json(m.data)
                except (ValueError, KeyError, TypeError):
                    print(
                        f"deepserve usage: skipped a bad record: {m.data[:80]!r}", file=sys.stderr
                    )
                    continue
                if tenant is None or r.tenant == tenant:
                    out.append(r)
        await sub.unsubscribe()
        return out
    finally:
        await nc.close()


def render(per_tenant: dict[str, Totals], price_name: str) -> str:
    head = (
        f"{'tenant':<24} {'requests':>9} {'uncached in':>12} {'cached in':>12} "
        f"{'output':>12} {'USD':>12}"
    )
    lines = [f"price: {price_name} ($/M tokens: uncached input, cached input, output)", head]
    for name, t in sorted(per_tenant.items()):
        lines.append(
            f"{name or '(open API)':<24} {t.requests:>9} {t.uncached_tokens:>12} "
            f"{t.cached_tokens:>12} {t.completion_tokens:>12} {t.price_usd:>12.6f}"
        )
    return "\n".join(lines)


def run(
    nats_url: str,
    tenant: str | None,
    since: str | None,
    price: str,
    as_json: bool,
    stream: str = STREAM,
) -> int:
    try:
        table = parse_price(price)
        start = parse_since(since) if since else None
    except ValueError as exc:
        print(f"deepserve usage: {exc}", file=sys.stderr)
        return 2
    try:
        records = asyncio.run(read_records(nats_url, tenant, start, stream))
    except Exception as exc:  # noqa: BLE001 - one line for the operator, not a traceback
        print(
            f"deepserve usage: cannot read stream {stream} at {nats_url}: {exc!r}", file=sys.stderr
        )
        return 1
    per_tenant = totals(records, table)
    price_name = price if table is None or price in ("off-peak", "peak") else f"custom {table}"
    if as_json:
        print(
            json.dumps(
                {
                    "price": price_name,
                    "tenants": {name: asdict(t) for name, t in sorted(per_tenant.items())},
                }
            )
        )
    else:
        print(render(per_tenant, price_name))
    return 0
