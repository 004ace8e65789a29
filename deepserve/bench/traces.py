"""The traces ``deepserve bench serve --url`` plays: their shapes and the sessions drawn from
them (words from a small vocabulary, seeded, so every run sends the same prompts)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORDS = (
    "alpha beta gamma delta epsilon model token cache block route decode prefill expert layer "
    "matrix vector kernel stream batch queue session answer question context window memory "
    "latency throughput budget schedule commit launch graph tensor shard target replica"
).split()


@dataclass(frozen=True)
class TraceShape:
    turns: int
    system_words: int  # shared by sessions (agent: one prompt; chat: one of ``systems``)
    context_words: int  # each session's own context, sent with every turn
    user_words: int
    max_tokens: int
    systems: int = 1


TRACES = {
    "agent": TraceShape(
        turns=8, system_words=600, context_words=3000, user_words=120, max_tokens=96
    ),
    "chat": TraceShape(
        turns=3, system_words=60, context_words=0, user_words=90, max_tokens=256, systems=4
    ),
}


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Session:
    """One conversation of a trace: its fixed prefix and the turns' user messages."""

    index: int
    system: str
    context: str
    users: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)


def make_sessions(shape: TraceShape, n: int, seed: int) -> list[Session]:
    rng = random.Random(seed)
    systems = [f"[system {i}] " + _text(rng, shape.system_words) for i in range(shape.systems)]
    out = []
    for i in range(n):
        context = _text(rng, shape.context_words) if shape.context_words else ""
        users = [_text(rng, shape.user_words) for _ in range(shape.turns)]
        out.append(Session(i, systems[rng.randrange(len(systems))], context, users))
    return out
