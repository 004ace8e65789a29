"""What the engine's own prefill ceiling allows for the first tokens of the requests a run sent.

``bench serve --url --engine-json`` measures time to first token through the whole stack. Part
of it is the stack (admission, hand-offs, steps shared with decoding); part is the trace
itself: when many sessions send long prompts at once, the last of them waits for the others'
prompts however fast the stack is. :func:`ttfts_at_ceiling` separates the two. It takes each
request's send time and the prompt tokens it had computed for it (prompt less cached, as the
server reported them) and runs them through an engine that does nothing but compute prompts,
at the ceiling's prefill rate (``bench engine``'s, at the step nearest 16K tokens), one after
another in the order they were sent -- the order the scheduler admits waiting requests in.
No decode step, no hand-off and no host work delays them there, so a percentile of these times
is what the stack could at best reach with that engine and that arrival order: a target below it
cannot be met by the stack's serving code, only by a faster engine, another order or more GPUs.

The send times are the run's own. In a closed loop they depend on how fast the stack answered
earlier turns (a faster stack sends the next turns sooner, and as bunched), so the figure is
exact for each session's first turn and an estimate after it.
"""

from __future__ import annotations

from collections.abc import Iterable


def ttfts_at_ceiling(sent: Iterable[tuple[float, int]], tokens_per_s: float) -> list[float]:
    """Per request ``(send time in s, prompt tokens to compute)``: its time to first token on
    an engine computing prompts at ``tokens_per_s``, one at a time in send order (ties in
    the order given), in the order given."""
    if not tokens_per_s > 0:
        raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
    items = list(sent)
    out = [0.0] * len(items)
    free_at = float("-inf")  # when the engine finishes the prompts before this one
    for i in sorted(range(len(items)), key=lambda i: items[i][0]):
        at, tokens = items[i]
        if tokens < 0:
            raise ValueError(f"a request cannot have {tokens} prompt tokens to compute")
        free_at = max(at, free_at) + tokens / tokens_per_s
        out[i] = free_at - at
    return out
