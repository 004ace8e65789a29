"""Which drafts a step verifies (policy: numpy, no torch, no I/O).

Each draft's confidence is the MTP head's probability for it; :class:`AcceptanceModel` maps
confidence to the probability of acceptance given its predecessors were accepted, learnt online
from what verification observed. :func:`choose_drafts` picks the number of drafts verified per
request that maximises the step's expected emitted tokens per second under the engine's measured
step-time model; ``"all"`` verifies every draft, for comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

SCHEDULES = ("confidence", "all")


class AcceptanceModel:
    """P(a draft is accepted | the drafts before it were), by the draft's confidence.

    Ten confidence bins, each a Beta posterior over its acceptance rate, whose prior (two
    pseudo-observations) is centred on the bin's own confidence: trust the head until
    verification says otherwise. :meth:`rate` adds an exploration bonus that shrinks as a bin
    is observed (``EXPLORE / sqrt(observations)``): without it a bin whose prior is low (a head
    that is right while unsure of itself, as the test model's nearly flat one) would never be
    verified, so never learnt."""

    BINS = 10
    PRIOR = 2.0
    EXPLORE = 0.5

    def __init__(self) -> None:
        self.accepted = [self.PRIOR * (b + 0.5) / self.BINS for b in range(self.BINS)]
        self.seen = [self.PRIOR] * self.BINS

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.BINS), 0), self.BINS - 1)

    def rate(self, confidence: float) -> float:
        b = self._bin(confidence)
        return min(1.0, self.accepted[b] / self.seen[b] + self.EXPLORE / math.sqrt(self.seen[b]))

    def observe(self, confidences: Sequence[float], num_accepted: int) -> None:
        """A verification of these drafts (in order) accepted the first ``num_accepted``."""
        for i, c in enumerate(confidences):
            b = self._bin(c)
            self.seen[b] += 1
            if i < num_accepted:
                self.accepted[b] += 1
            else:
                break  # the drafts after a rejection say nothing: they were not reached


def choose_drafts(
    confidences: Sequence[Sequence[float]],
    limits: Sequence[int],
    model: AcceptanceModel,
    step_seconds: Callable[[np.ndarray], np.ndarray | float],
    schedule: str = "confidence",
) -> list[int]:
    """How many leading drafts of each request to verify this step.

    ``confidences[r]``: request r's drafts' confidences; ``limits[r]``: at most that many;
    ``step_seconds(m)``: the step's estimated time with ``m`` draft tokens added to it, for
    an array of counts at once.
    ``"confidence"``: the ``m`` most valuable drafts over the whole batch (a draft's value is
    the probability that it and its predecessors are accepted), for the ``m`` that maximises
    (requests + expected accepted drafts) / step time. ``"all"``: every draft up to the
    limit."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    caps = [min(len(c), max(lim, 0)) for c, lim in zip(confidences, limits, strict=True)]
    if schedule == "all":
        return caps
    gains: list[tuple[float, int, int]] = []  # (value, draft index, request)
    for r, confs in enumerate(confidences):
        value = 1.0
        for i, c in enumerate(confs[: caps[r]]):
            value *= model.rate(c)
            gains.append((value, i, r))
    gains.sort(key=lambda g: (-g[0], g[1]))  # a request's values never grow: prefixes stay
    # Every m at once: step_seconds takes the array 0..len(gains) (a constant broadcasts).
    counts = np.arange(len(gains) + 1)
    secs = np.broadcast_to(np.asarray(step_seconds(counts), dtype=np.float64), counts.shape)
    expected = np.concatenate(([0.0], np.cumsum([g[0] for g in gains])))
    rates = (len(confidences) + expected) / np.maximum(secs, 1e-9)
    best_m = int(np.argmax(rates))  # the first of equal rates: the fewest drafts
    out = [0] * len(confidences)
    for _, _, r in gains[:best_m]:
        out[r] += 1
    return out
