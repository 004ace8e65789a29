"""Token sampling over a batch of logits with per-request settings.

Sampling uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. draws the
token with probability ``p``. For a seeded request the ``E`` vector for the token at sequence
position ``n`` comes from a generator seeded with ``mix(seed, n)``, so its draw depends on
nothing else in the batch and can be replayed anywhere (after preemption or KV import).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from libs.common.sampling import SamplingParams


def position_seed(seed: int, position: int) -> int:
    """63-bit seed for (request seed, token position), stable across processes."""
    digest = hashlib.sha256(struct.pack("<QQ", seed, position)).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (-inf) tokens outside top-k and outside the top-p nucleus; [V] fp32."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token if the mass strictly before it is below top_p (the first always stays).
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self._rng = torch.Generator(device=device)
        if seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(seed)
        self._seeded = torch.Generator(device=device)

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
    ) -> list[int]:
        """One token per row. ``positions[i]``: sequence position of the token being sampled."""
        out: list[int] = self.sample_device(logits, params, positions).tolist()
        return out

    def sample_device(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
    ) -> torch.Tensor:
        """As :meth:`sample`, as an int64 tensor on the logits' device, without waiting for it."""
        out = logits.float().argmax(dim=-1)
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = _filter(logits[i].float() / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            if p.seed is None:
                gen = self._rng
            else:
                gen = self._seeded
                gen.manual_seed(position_seed(p.seed, positions[i]))
            e = torch.empty_like(probs).exponential_(generator=gen).clamp_min_(1e-30)
            out[i] = (probs / e).argmax()
        return out
