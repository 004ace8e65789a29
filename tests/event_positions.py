"""Where each token event of a request must start: a relay sends the tokens it finds waiting
as one event (one or more tokens), and an event's ``index`` is its first token's position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_positions(events: Sequence[Any]) -> list[int]:
    """The index each event must carry: every position once, in order, none skipped."""
    out: list[int] = []
    at = 0
    for e in events:
        out.append(at)
        at += len(e.token_ids)
    return out
