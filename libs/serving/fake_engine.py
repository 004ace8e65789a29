"""A deterministic fake engine (``--model fake``): the real :class:`Engine` (scheduler, block
manager, KV frames) plugged into a fake runner and cache, with the model replaced by a hash.

The next token after position ``n - 1`` is ``sha256(seed, token[n - 1], n) mod vocab`` (never
an EOS id), so any process computes the same completion from the same prompt, and a request
resent as ``prompt + tokens so far`` continues exactly where the first one stopped -- what the
entrypoint's exact-continuation retry relies on. Each step costs a fixed time plus a time per
token (a sleep), so load tests see queueing without a model. KV import/export, prefix reuse and
block accounting are the real engine's code paths; the "cache" is 4 bytes per token kept in a
dict.

No torch work happens here; torch is still imported because the runner hands the engine its
sampled ids as a tensor, like the real one.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Sequence

import torch

from libs.common.sampling import SamplingParams
from libs.engine.config import ModelConfig
from libs.engine.cost_model import CostModel
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kv.host import HostBlockStore
from libs.engine.kv.layout import CacheSpec, PagedEntry
from libs.engine.parts import EngineParts
from libs.engine.runner import Launched, ModelRunner
from libs.engine.sampler import LogprobRows
from libs.engine.scheduler import StepPlan

FAKE_MODEL = "fake"
FAKE_VOCAB = 129280  # the tiny preset's (the real tokenizer's) vocabulary
FAKE_EOS = (1,)
STEP_SECONDS = 0.002  # fixed cost of one step
TOKEN_SECONDS = 2e-6  # and per token computed in it (a 32K-token prompt: ~65 ms)


def fake_next_token(seed: int, previous: int, position: int, vocab: int = FAKE_VOCAB) -> int:
    """The fake model's token at ``position`` given the token before it."""
    digest = hashlib.sha256(struct.pack("<qqq", seed, previous, position)).digest()
    token = int.from_bytes(digest[:8], "little") % vocab
    return token + 1 if token in FAKE_EOS else token


def fake_completion(prompt: Sequence[int], max_tokens: int, seed: int = 0) -> list[int]:
    """What the fake engine generates for ``prompt`` (no stop tokens): the in-process answer."""
    out: list[int] = []
    last = prompt[-1]
    for i in range(max_tokens):
        last = fake_next_token(seed, last, len(prompt) + i)
        out.append(last)
    return out


FAKE_CONFIG = ModelConfig(
    model_type="deepseek_v3",
    vocab_size=FAKE_VOCAB,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=1,
    first_k_dense_replace=1,
    num_attention_heads=1,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=1,
    n_shared_experts=1,
    num_experts_per_tok=1,
    n_group=1,
    topk_group=1,
    eos_token_ids=FAKE_EOS,
)


class FakeRunner:
    """The runner interface over :func:`fake_next_token` and a sleep (synchronous: a step is
    done when ``launch`` returns)."""

    collect = staticmethod(ModelRunner.collect)

    def __init__(self, step_seconds: float = STEP_SECONDS, token_seconds: float = TOKEN_SECONDS):
        self.step_seconds, self.token_seconds = step_seconds, token_seconds

    def launch(
        self,
        plan: StepPlan,
        params: Sequence[SamplingParams],
        prev: Launched | None,
        num_generated: Sequence[int] | None = None,
        histories: Sequence[tuple[int, list[int], int]] | None = None,
        *,
        masks_fn: Callable[[], tuple[list[int], torch.Tensor] | None] | None = None,
    ) -> Launched:
        """Penalties, min_tokens and constraints do not change a fake token (the scheduler
        still holds a stop back until min_tokens)."""
        t0 = time.perf_counter()
        time.sleep(self.step_seconds + self.token_seconds * plan.num_tokens)
        if masks_fn is not None:  # what the engine does then (finish the step before) must run
            masks_fn()
        sampling = [s for s in plan.seqs if s.sample]
        # s.token_ids are the tokens fed this step; the last one precedes the sampled token.
        sampled = [
            fake_next_token(p.seed if p.seed is not None else 0, s.token_ids[-1], s.sample_position)
            for s, p in zip(sampling, params, strict=True)
        ]
        host = torch.tensor(sampled, dtype=torch.int64)
        # The fake model is a point mass on its token: log probability 0, the only candidate.
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = None
        if rows:
            counts = [min(int(params[i].logprobs or 0), 1) for i in rows]
            vals = torch.zeros(len(rows), 2)
            ids = torch.tensor([[sampled[i]] for i in rows], dtype=torch.int64)
            lp = LogprobRows(rows, counts, vals, ids)
            logprobs = (lp, vals, ids)
        return Launched(
            plan, sampling, None, host, None, None, time.perf_counter() - t0, logprobs=logprobs
        )

    logprobs = staticmethod(ModelRunner.logprobs)

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def warm_kernels(self) -> None:
        """No kernels."""


def fake_parts(
    config: EngineConfig,
    *,
    step_seconds: float = STEP_SECONDS,
    token_seconds: float = TOKEN_SECONDS,
) -> EngineParts:
    """A :class:`FakeRunner` and a :class:`HostBlockStore` (4096 blocks unless configured)."""
    model_id = f"{FAKE_MODEL}-seed{config.seed}"
    spec = CacheSpec(model_id, config.block_size, (PagedEntry("tokens", 0, (1,), "float32"),))
    return EngineParts(
        model_id,
        FAKE_CONFIG,
        spec,
        HostBlockStore(spec.bytes_per_block),
        config.num_kv_blocks or 4096,
        CostModel.for_model(FAKE_CONFIG, 4, 4, 5e10, 1e10),
        FakeRunner(step_seconds, token_seconds),
    )


def build_fake_engine(
    config: EngineConfig | None = None,
    *,
    step_seconds: float = STEP_SECONDS,
    token_seconds: float = TOKEN_SECONDS,
) -> Engine:
    """The real :class:`Engine` on :func:`fake_parts`: no model, same engine code paths."""
    config = config or EngineConfig(model=FAKE_MODEL)
    parts = fake_parts(config, step_seconds=step_seconds, token_seconds=token_seconds)
    return Engine(config, parts=parts)
