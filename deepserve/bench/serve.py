"""``deepserve bench serve``: the serving path under load, as real processes.

Two stacks (``deepserve.up.Stack``: NATS, Redis, kvstore, balancer, prefill, decode,
entrypoint, recipe -- each its own process):

1. fake engine (``--model fake``): time to first token through every hop against the same
   fake engine called in this process (the difference is what the hops cost: gRPC, NATS, the
   balancer, the kvstore lookup, the KV push), then sustained requests per second with
   ``--concurrency`` clients, checking every completion against the fake model's answer
   (``lost`` counts errors and wrong completions; it must be 0);
2. tiny model: a ``--long-tokens`` prompt twice; the second finds the first's blocks in the
   kvstore, reports them as cached tokens, and its time to first token drops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from deepserve.up import Stack
from libs.proto.deepserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _summary_ms(xs: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(_pct(xs, 0.5) * 1e3, 2),
        "p99_ms": round(_pct(xs, 0.99) * 1e3, 2),
        "mean_ms": round(statistics.fmean(xs) * 1e3, 2),
    }


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 1_000_003 + j * 7919) % 120_000 + 100 for j in range(n)]


def inprocess_ttft(n: int, prompt_tokens: int) -> list[float]:
    """The fake engine in this process: add a request, step until its first token."""
    from libs.common.sampling import SamplingParams
    from libs.serving.fake_engine import build_fake_engine

    engine = build_fake_engine()
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", _prompt(i, prompt_tokens), SamplingParams(max_tokens=1))
        while not any(ev.token_id is not None for ev in engine.step()):
            pass
        out.append(time.perf_counter() - t0)
    return out


async def _generate(
    stub: Any, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[int], int, str]:
    """(time to first token, tokens, cached tokens, error) of one Generate call."""
    req = generate_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        model=model,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )
    t0 = time.perf_counter()
    ttft, cached = 0.0, 0
    tokens: list[int] = []
    try:
        async for ev in stub.Generate(req, timeout=600):
            kind = ev.WhichOneof("event")
            if kind == "ready":
                cached = ev.ready.cached_tokens
            elif kind == "tokens":
                if not tokens:
                    ttft = time.perf_counter() - t0
                tokens.extend(ev.tokens.token_ids)
    except grpc.aio.AioRpcError as exc:
        return ttft, tokens, cached, f"{exc.code().name}: {exc.details()}"
    return ttft, tokens, cached, ""


async def fake_phase(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    from libs.serving.fake_engine import fake_completion

    async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerateStub(ch)  # type: ignore[no-untyped-call]
        for i in range(5):  # warm-up: channels, NATS subscriptions, JIT-free but cold caches
            await _generate(stub, stack.model_name, _prompt(10_000 + i, args.prompt_tokens), 1)
        ttfts = []
        for i in range(args.ttft_requests):
            ttft, _, _, err = await _generate(
                stub, stack.model_name, _prompt(i, args.prompt_tokens), 1
            )
            if err:
                raise RuntimeError(f"TTFT request failed: {err}")
            ttfts.append(ttft)

        total, lost, errors = args.load_requests, 0, []
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(total):
            queue.put_nowait(i)

        async def client() -> None:
            nonlocal lost
            while not queue.empty():
                i = queue.get_nowait()
                prompt = _prompt(20_000 + i, args.prompt_tokens)
                _, tokens, _, err = await _generate(stub, stack.model_name, prompt, args.max_tokens)
                if err or tokens != fake_completion(prompt, args.max_tokens):
                    lost += 1
                    errors.append(err or "wrong completion")

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    base = inprocess_ttft(args.ttft_requests, args.prompt_tokens)
    stack_ms, base_ms = _summary_ms(ttfts), _summary_ms(base)
    return {
        "prompt_tokens": args.prompt_tokens,
        "ttft_stack": stack_ms,
        "ttft_inprocess": base_ms,
        "ttft_overhead_ms": {
            "p50": round(stack_ms["p50_ms"] - base_ms["p50_ms"], 2),
            "p99": round(stack_ms["p99_ms"] - base_ms["p99_ms"], 2),
        },
        "load": {
            "requests": total,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "seconds": round(wall, 2),
            "requests_per_s": round(total / wall, 1),
            "tokens_per_s": round(total * args.max_tokens / wall, 1),
            "lost": lost,
            "errors": errors[:5],
        },
    }


async def cache_phase(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    prompt = _prompt(7, args.long_tokens)
    async with grpc.aio.insecure_channel(stack.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerateStub(ch)  # type: ignore[no-untyped-call]
        miss = await _generate(stub, stack.model_name, prompt, 2)
        if miss[3]:
            raise RuntimeError(f"miss request failed: {miss[3]}")
        hit = miss
        deadline = time.monotonic() + 120  # the blocks reach the kvstore after the handover
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            hit = await _generate(stub, stack.model_name, prompt, 2)
            if hit[3]:
                raise RuntimeError(f"hit request failed: {hit[3]}")
            if hit[2] > 0:
                break
    return {
        "prompt_tokens": len(prompt),
        "miss_ttft_s": round(miss[0], 3),
        "hit_ttft_s": round(hit[0], 3),
        "hit_cached_tokens": hit[2],
        "speedup": round(miss[0] / hit[0], 2) if hit[0] else None,
        "same_tokens": hit[1] == miss[1],
    }


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="bench-serve-"))
    result: dict[str, Any] = {"cpu_count": os.cpu_count()}
    t0 = time.perf_counter()
    with Stack(
        run_dir / "fake",
        prefill=1,
        decode=1,
        model="fake",
        model_name="deepseek-fake",
        drain_seconds=3.0,
        extra_args={"entrypoint": ["--max-inflight", "0"]},
    ) as stack:
        result["fake"] = asyncio.run(fake_phase(stack, args))
    print(json.dumps(result["fake"], indent=2), flush=True)
    _write(args.json_out, result)
    if args.long_tokens:
        # A 32K-token prompt takes the tiny model minutes on 2 CPU cores: no token for that long.
        with Stack(
            run_dir / "tiny",
            prefill=1,
            decode=1,
            model="tiny",
            drain_seconds=3.0,
            ready_timeout=300,
            extra_args={"entrypoint": ["--request-timeout", "900"]},
        ) as stack:
            result["tiny_cache"] = asyncio.run(cache_phase(stack, args))
        print(json.dumps(result["tiny_cache"], indent=2), flush=True)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    _write(args.json_out, result)
    return 0 if result["fake"]["load"]["lost"] == 0 else 1
