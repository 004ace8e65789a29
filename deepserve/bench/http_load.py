"""``deepserve bench serve --url URL``: any OpenAI-compatible deployment, driven over HTTP.

The official ``openai`` client streams Chat Completions from synthetic traces:

* ``agent`` -- sessions that each grow a long context (a shared system prompt, a ~4K-token
  working context of their own, then every earlier turn resent), many turns, short answers
  (96 tokens);
* ``chat`` -- short prompts (~130 tokens) and longer answers (256 tokens); a session asks a few
  questions, and sessions reuse one of a few system prompts (long-tail reuse).

Load is either a fixed number of concurrent sessions (``--concurrency``: each session sends its
next turn when the previous answer is complete, as a user or an agent would) or open loop
(``--rate``: sessions start as a Poisson process of that many per second, each then plays its
turns). Each request records time to first token (TTFT), inter-token gaps (ITL), time per
output token (TPOT) and end to end; usage comes from the stream's final chunk (cached input
tokens from ``prompt_tokens_details.cached_tokens`` or DeepSeek's ``prompt_cache_hit_tokens``).
429s are counted apart from errors.

Revenue-equivalent per GPU-hour prices the measured token rates (``--price`` in $ per million
uncached input, cached input and output tokens; DeepSeek's off-peak list by default) over
``--gpus``. With ``--engine-json`` (a ``deepserve bench engine`` result) the same token mix is
priced at the engine's own rates -- prefill tok/s at 16K tokens per step, decode tok/s at its
largest batch, cached input free -- and the ratio stack/engine is printed: what the serving
path leaves on the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deepserve.bench import admission_view, engine_view, http_procs
from deepserve.bench.traces import TRACES, Session, TraceShape, make_sessions
from deepserve.bench.ttft_floor import ttfts_at_ceiling

OFF_PEAK_PRICE = (0.15, 0.003, 0.60)  # $/M tokens: uncached input, cached input, output
RETRIES_429 = 5  # a turn refused with 429 is sent again this many times at most
BLOCK = 128  # tokens per prefix block: what a prefix cache can reuse is counted in blocks


@dataclass
class Result:
    session: int
    turn: int
    ok: bool = False
    status: str = ""  # "" ok, "429", or the error's class / HTTP status
    retry_after_s: float = 0.0  # a 429's Retry-After
    ttft_s: float = 0.0
    first_chunk_s: float = 0.0  # any streamed chunk (the role chunk comes before any token)
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    allowed_cached_tokens: int = 0  # what the trace lets a prefix cache reuse (see below)
    sent_at: float = 0.0  # time.time() when it was sent (client processes share the clock)


def _cached(usage: Any) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    if cached is None:
        extra = getattr(usage, "model_extra", None) or {}
        cached = extra.get("prompt_cache_hit_tokens", 0)
    return int(cached or 0)


async def one_request(
    client: Any, model: str, session: Session, turn: int, max_tokens: int, timeout: float
) -> tuple[Result, str]:
    """Stream one turn; returns its record and the answer text (empty on failure)."""
    import openai

    res = Result(session.index, turn)
    messages = [{"role": "system", "content": session.system}]
    first_user = (session.context + "\n\n" if session.context else "") + session.users[0]
    messages.append({"role": "user", "content": first_user})
    messages += session.messages
    if turn:
        messages.append({"role": "user", "content": session.users[turn]})
    text: list[str] = []
    res.sent_at = time.time()
    t0 = time.perf_counter()
    last = t0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            timeout=timeout,
        )
        async for chunk in stream:
            now = time.perf_counter()
            if not res.first_chunk_s:
                res.first_chunk_s = now - t0
            delta = chunk.choices[0].delta if chunk.choices else None
            piece = (getattr(delta, "content", None) or "") if delta is not None else ""
            piece += (getattr(delta, "reasoning_content", None) or "") if delta is not None else ""
            if piece:
                if not text:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
                text.append(piece)
            if chunk.usage is not None:
                res.prompt_tokens = chunk.usage.prompt_tokens
                res.completion_tokens = chunk.usage.completion_tokens
                res.cached_tokens = _cached(chunk.usage)
        res.e2e_s = time.perf_counter() - t0
        res.ok = True
    except openai.RateLimitError as exc:
        res.status = "429"
        try:
            res.retry_after_s = float(exc.response.headers.get("retry-after", "1"))
        except ValueError:
            res.retry_after_s = 1.0
    except openai.APIStatusError as exc:
        res.status = str(exc.status_code)
    except (openai.APIError, TimeoutError) as exc:
        res.status = type(exc).__name__
    return res, "".join(text)


async def play(
    client: Any,
    model: str,
    session: Session,
    shape: TraceShape,
    timeout: float,
    results: list[Result],
    progress: Any,
    deadline: float = math.inf,
) -> None:
    """A session's turns in order: a 429 is sent again after its Retry-After; any other failed
    turn ends the session (its context is lost); no turn starts after ``deadline``
    (perf_counter)."""
    previous_prompt = 0
    for turn in range(shape.turns):
        if time.perf_counter() >= deadline:
            return
        for attempt in range(RETRIES_429 + 1):
            res, answer = await one_request(client, model, session, turn, shape.max_tokens, timeout)
            # Every earlier turn's prompt is a prefix of this one: its full blocks may be reused.
            res.allowed_cached_tokens = (previous_prompt // BLOCK) * BLOCK
            results.append(res)
            if res.status != "429" or attempt == RETRIES_429:
                break
            await asyncio.sleep(min(res.retry_after_s, 60.0))
        progress.update(1)
        if not res.ok:
            return
        previous_prompt = res.prompt_tokens
        if turn:
            session.messages.append({"role": "user", "content": session.users[turn]})
        session.messages.append({"role": "assistant", "content": answer})


async def drive(
    url: str,
    model: str,
    sessions: list[Session],
    shape: TraceShape,
    *,
    concurrency: int,
    rate: float,
    timeout: float,
    api_key: str,
    seed: int,
    duration: float = 0.0,
    quiet: bool = False,
) -> tuple[list[Result], float]:
    """Play the sessions; with ``duration`` > 0 no turn starts after that many seconds (those
    in flight finish and count; the elapsed time includes them). ``quiet``: no progress bar
    (a client process of several)."""
    import openai
    from tqdm import tqdm

    client = openai.AsyncOpenAI(base_url=url, api_key=api_key or "none", max_retries=0)
    results: list[Result] = []
    progress = tqdm(
        total=len(sessions) * shape.turns, unit="req", desc="bench serve", disable=quiet
    )
    t0 = time.perf_counter()
    end = t0 + duration if duration > 0 else math.inf
    try:
        if rate > 0:
            rng = random.Random(seed)
            tasks = []
            for s in sessions:
                if time.perf_counter() >= end:
                    break
                tasks.append(
                    asyncio.create_task(
                        play(client, model, s, shape, timeout, results, progress, end)
                    )
                )
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        else:
            queue = list(reversed(sessions))

            async def worker() -> None:
                while queue and time.perf_counter() < end:
                    await play(client, model, queue.pop(), shape, timeout, results, progress, end)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        progress.close()
        await client.close()
    return results, time.perf_counter() - t0


def _pcts(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, round(p * (len(s) - 1)))] * 1e3

    return {
        "p50_ms": q(0.5),
        "p90_ms": q(0.9),
        "p99_ms": q(0.99),
        "mean_ms": statistics.fmean(s) * 1e3,
    }


def engine_ceiling(engine: dict[str, Any]) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of a ``bench engine`` result: prefill at the step size
    nearest 16K tokens, decode at the largest batch measured."""
    prefill = min(engine["prefill"], key=lambda r: abs(r["tokens"] - 16384))["tokens_per_s"]
    decode = max(engine["decode"], key=lambda r: r["batch"])["tokens_per_s"]
    return float(prefill), float(decode)


def summarize(
    results: list[Result],
    seconds: float,
    *,
    price: tuple[float, float, float],
    gpus: int,
    engine: dict[str, Any] | None,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    uncached = sum(r.prompt_tokens - r.cached_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt = uncached + cached
    allowed = sum(r.allowed_cached_tokens for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    dollars = (uncached * price[0] + cached * price[1] + out_tokens * price[2]) / 1e6
    per_gpu_hour = dollars / seconds * 3600 / gpus if seconds > 0 else 0.0
    summary: dict[str, Any] = {
        "requests": len(results),
        "ok": len(ok),
        "rate_limited_429": sum(r.status == "429" for r in results),
        "errors": sum(not r.ok and r.status != "429" for r in results),
        "error_kinds": sorted({r.status for r in results if r.status}),
        "seconds": seconds,
        "ttft": _pcts([r.ttft_s for r in ok]),
        "first_chunk": _pcts([r.first_chunk_s for r in ok]),
        "tpot": _pcts(tpot),
        "itl": _pcts([g for r in ok for g in r.itl_s]),
        "e2e": _pcts([r.e2e_s for r in ok]),
        "input_tokens_per_s": prompt / seconds,
        "cached_input_tokens_per_s": cached / seconds,
        "output_tokens_per_s": out_tokens / seconds,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "trace_allowed_hit_rate": allowed / prompt if prompt else 0.0,
        "hit_rate_vs_allowed": cached / allowed if allowed else None,
        "price_per_million": dict(
            zip(("uncached_input", "cached_input", "output"), price, strict=True)
        ),
        "gpus": gpus,
        "revenue_per_gpu_hour": per_gpu_hour,
    }
    if engine is not None and prompt + out_tokens:
        prefill_rate, decode_rate = engine_ceiling(engine)
        gpu_seconds = uncached / prefill_rate + out_tokens / decode_rate
        ceiling = dollars / gpu_seconds * 3600 if gpu_seconds else 0.0
        summary["engine_ceiling"] = {
            "source": f"{engine.get('preset')} on {engine.get('device_name')}",
            "prefill_tokens_per_s": prefill_rate,
            "decode_tokens_per_s": decode_rate,
            "revenue_per_gpu_hour": ceiling,
            "stack_over_ceiling": per_gpu_hour / ceiling if ceiling else None,
        }
        if ok and all(r.sent_at > 0 for r in ok):
            floor = ttfts_at_ceiling(
                [(r.sent_at, r.prompt_tokens - r.cached_tokens) for r in ok], prefill_rate
            )
            summary["engine_ceiling"]["ttft_at_ceiling"] = _pcts(floor)
    return summary


def _price(text: str) -> tuple[float, float, float]:
    parts = [float(x) for x in text.split(",")]
    if len(parts) != 3 or any(p < 0 for p in parts):
        raise ValueError(
            f"--price takes three non-negative $/M figures (uncached input, cached "
            f"input, output), got {text!r}"
        )
    return parts[0], parts[1], parts[2]


def run(args: argparse.Namespace) -> int:
    """Entry of ``deepserve bench serve --url``; prints the summary, writes JSON/PNG."""
    try:
        price = _price(args.price)
        if args.gpus <= 0 or args.sessions <= 0:
            raise ValueError("--gpus and --sessions must be positive")
        if args.client_processes < 0:
            raise ValueError("--client-processes must be >= 0 (0: one per 32 sessions)")
        if args.rate < 0 or (args.rate == 0 and args.concurrency <= 0):
            raise ValueError("give --concurrency N (> 0) or --rate R (sessions per second)")
        engine = json.loads(Path(args.engine_json).read_text()) if args.engine_json else None
        targets = engine_view.targets_from(args.metrics, args.stack_json)
    except (ValueError, OSError) as exc:
        print(f"deepserve bench serve: {exc}")
        return 2
    shape = TRACES[args.trace]
    sessions = make_sessions(shape, args.sessions, args.seed)

    async def measured() -> tuple[list[Result], float, dict[str, Any] | None]:
        view = engine_view.EngineView(targets) if targets else None
        if view is not None:
            await view.start()
        common = dict(
            url=args.url,
            model=args.model,
            timeout=args.request_timeout,
            api_key=args.api_key,
            seed=args.seed,
            duration=args.duration,
        )
        if processes == 1:
            cpu0 = time.process_time()
            results, seconds = await drive(
                sessions=sessions,
                shape=shape,
                concurrency=args.concurrency,
                rate=args.rate,
                **common,
            )
            cpu.append(time.process_time() - cpu0)
        else:
            results, seconds, used = await asyncio.to_thread(
                http_procs.drive_processes,
                drive,
                processes,
                sessions,
                shape,
                concurrency=args.concurrency,
                rate=args.rate,
                **common,
            )
            cpu.extend(used)
        return results, seconds, (await view.stop() if view is not None else None)

    processes = args.client_processes or http_procs.auto_processes(args.concurrency, args.rate)
    cpu: list[float] = []
    services0 = http_procs.service_cpu(args.stack_json)
    entry = admission_view.url_from(args.stack_json)
    admitted0 = admission_view.scrape(entry)
    results, seconds, engines = asyncio.run(measured())
    admitted1 = admission_view.scrape(entry)
    summary = summarize(results, seconds, price=price, gpus=args.gpus, engine=engine)
    summary["client"] = http_procs.client_report(processes, cpu, seconds)
    shares = http_procs.service_shares(services0, http_procs.service_cpu(args.stack_json), seconds)
    if shares:
        summary["services_cores"] = shares
    if engines is not None:
        summary["engines"] = engines
    if admitted0 is not None and admitted1 is not None:
        summary["admission"] = admission_view.report(admitted0, admitted1)
    report = {
        "bench": "serve-http",
        "url": args.url,
        "model": args.model,
        "trace": args.trace,
        "trace_shape": asdict(shape),
        "sessions": args.sessions,
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "rate": args.rate,
        **summary,
    }
    print(
        json.dumps(
            {k: v for k, v in report.items() if k not in ("trace_shape", "engines")}, indent=1
        )
    )
    if summary["client"]["throttled"]:
        print(
            f"warning: a client process was {summary['client']['busiest']:.0%} busy: the "
            "figures may be the client's limit; raise --client-processes"
        )
    if engines is not None:
        print("\n".join(engine_view.summary_lines(engines)))
    if "admission" in summary:
        print(admission_view.summary_line(summary["admission"]))
    ceiling = summary.get("engine_ceiling")
    if ceiling:
        print(
            f"revenue ${summary['revenue_per_gpu_hour']:.2f}/GPU-h vs engine-only "
            f"${ceiling['revenue_per_gpu_hour']:.2f}: ratio {ceiling['stack_over_ceiling']:.3f}"
        )
        floor = ceiling.get("ttft_at_ceiling")
        if floor:
            print(
                f"TTFT p50 / p99 {summary['ttft']['p50_ms']:.0f} / {summary['ttft']['p99_ms']:.0f} "
                f"ms; the engine's prefill ceiling alone, in send order: {floor['p50_ms']:.0f} / "
                f"{floor['p99_ms']:.0f} ms"
            )
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        from deepserve.bench.http_plot import plot

        plot(results, summary, Path(args.plot))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--url`` mode's flags (``deepserve bench serve``; ``--concurrency`` and ``--json``
    are the command's own: sessions in flight, and where the report goes)."""
    p.add_argument(
        "--url",
        default="",
        help="an OpenAI-compatible base URL (.../v1): drive it "
        "over HTTP with a trace instead of starting stacks",
    )
    p.add_argument("--model", default="deepseek-tiny", help="--url: the served model name")
    p.add_argument("--trace", choices=sorted(TRACES), default="agent", help="--url: trace")
    p.add_argument("--sessions", type=int, default=32, help="--url: sessions in the trace")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="--url: open loop, sessions started per second (Poisson)",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="--url: seconds")
    p.add_argument(
        "--duration",
        type=float,
        default=0.0,
        help="--url: start no turn after this many seconds (0: play every session out); "
        "the turns in flight then finish and count",
    )
    p.add_argument("--api-key", default="", help="--url: bearer key, if the API needs one")
    p.add_argument(
        "--price",
        default=",".join(map(str, OFF_PEAK_PRICE)),
        help="--url: $ per million uncached input, cached input, output tokens",
    )
    p.add_argument("--gpus", type=int, default=1, help="--url: GPUs the deployment uses")
    p.add_argument(
        "--engine-json",
        default="",
        help="--url: a `deepserve bench engine` result: print the engine-only ceiling",
    )
    p.add_argument("--seed", type=int, default=0, help="--url: trace seed")
    p.add_argument(
        "--client-processes",
        type=int,
        default=0,
        help="--url: client processes the sessions are dealt over (0: one per 32 concurrent "
        "sessions, at most half the cores); the report gives each one's CPU use",
    )
    p.add_argument(
        "--metrics",
        default="",
        help="--url: the engines' /metrics, NAME=URL,... (or bare URLs): their own view of "
        "the run (steps, batch, step time, TTFT/ITL, prefix hits, KV use) beside the client's",
    )
    p.add_argument(
        "--stack-json",
        default="",
        help="--url: a `deepserve up` run's stack.json: read every prefill/decode /metrics",
    )
    p.add_argument("--plot", default="", help="--url: also draw TTFT and ITL as this PNG")
