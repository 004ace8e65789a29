"""How long each step of turning one large chat request into prompt ids keeps other Python
threads (the event loop's among them) from running, and the memory it takes.

A ticker thread sleeps 1 ms at a time and records the longest gap between its wakes while
each step runs in the main thread, as the recipe's encode pool runs them: a C call that holds
the GIL shows as a gap as long as the call. Prints one line a step and the process's resident
memory before, at its peak, and after the request (``docs/security.md`` quotes the figures)::

    .venv/bin/python scripts/recipe_gil_probe.py --mb 20 --text words
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.recipe.api import CHAT, APIError  # noqa: E402
from services.recipe.encoding import PromptEncoder  # noqa: E402
from services.recipe.plan import Planner  # noqa: E402

T = TypeVar("T")
MODEL = "deepseek-tiny"


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def step(name: str, fn: Callable[[], T]) -> T:
    stop, gaps = threading.Event(), [0.0]

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        took = time.perf_counter() - t0
        stop.set()
        ticker.join()
        print(f"{name:34s} {took * 1000:9.1f} ms   longest tick gap {max(gaps) * 1000:7.1f} ms")


def text_of(kind: str, chars: int) -> str:
    rng = random.Random(0)
    if kind == "words":
        words = ["hello", "world", "naïve", "über", "12345", "数据", "the", "quick,", "fox."]
        unit = " ".join(rng.choice(words) for _ in range(100_000)) + " "
        return (unit * (chars // len(unit) + 1))[:chars]
    if kind == "cjk":
        unit = "".join(chr(0x4E00 + rng.randrange(2000)) for _ in range(50_000)) + "。"
        return (unit * (chars // len(unit) + 1))[:chars]
    return " " * chars  # "spaces": 128 to a token, one pre-token


def one_request(encoder: PromptEncoder, planner: Planner, body: bytes, limit: int) -> None:
    """What ``Planner.chat`` does up to the prompt ids, a step at a time."""
    _, conv, _, _ = step("json + conversion (library)", lambda: planner.convert(CHAT, body, "r"))
    rendered = step("render (library)", lambda: encoder.render(conv.conversation))
    spans = step("spans", lambda: encoder.spans(rendered))
    print(f"  plain-text pieces: {[p[1] - p[0] for p in spans if isinstance(p, tuple)]} characters")
    try:
        ids = step("tokenize", lambda: encoder.encode_rendered(rendered, limit=limit))
        print(f"  {len(ids):,} prompt tokens")
    except APIError as err:
        print(f"  400: {err}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=20.0, help="request body size, MB")
    ap.add_argument("--text", choices=["words", "cjk", "spaces"], default="words")
    ap.add_argument("--max-context", type=int, default=163_840)
    args = ap.parse_args()
    encoder = PromptEncoder([MODEL])
    planner = Planner(encoder, MODEL, 16, args.max_context)
    per_char = 3 if args.text == "cjk" else 1  # UTF-8 bytes, sent unescaped
    text = text_of(args.text, int(args.mb * 1e6) // per_char)
    msg = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    body = json.dumps(msg, ensure_ascii=False).encode()
    del text, msg
    gc.collect()
    print(f"{args.text}: body {len(body) / 1e6:.1f} MB; resident {rss_mb():.0f} MB before")
    one_request(encoder, planner, body, args.max_context)
    gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"resident: peak {peak:.0f} MB, after {rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
