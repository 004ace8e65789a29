"""A deterministic fake engine (``--model fake``): the real scheduler, block manager and KV
frames, with the model replaced by a hash.

The next token after position ``n - 1`` is ``sha256(seed, token[n - 1], n) mod vocab`` (never
an EOS id), so any process computes the same completion from the same prompt, and a request
resent as ``prompt + tokens so far`` continues exactly where the first one stopped -- what the
entrypoint's exact-continuation retry relies on. Each step costs a fixed time plus a time per
token (a sleep), so load tests see queueing without a model. KV import/export, prefix reuse and
block accounting are the real :class:`Engine` code paths (inherited); the "cache" is 4 bytes
per token kept in a dict.

No torch work happens here; torch is still imported because the exceptions live with the
engine.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence

import torch

from libs.engine.config import ModelConfig
from libs.engine.cost_model import CostModel
from libs.engine.engine import Engine, EngineConfig
from libs.engine.kv.block_manager import BlockManager
from libs.engine.kv.layout import CacheSpec, PagedEntry
from libs.engine.runner import Launched, ModelRunner
from libs.engine.scheduler import Scheduler, SchedulerConfig, StepPlan

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


class _DictCache:
    """Stands in for PagedKVCache: block id -> payload bytes (zeros until written)."""

    def __init__(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block
        self._blocks: dict[int, bytes] = {}
        self.tensors: list[object] = []

    def read_blocks(self, blocks: Sequence[int]) -> bytes:
        zero = bytes(self.bytes_per_block)
        return b"".join(self._blocks.get(b, zero) for b in blocks)

    def write_blocks(self, blocks: Sequence[int], payload: bytes | memoryview) -> None:
        bpb = self.bytes_per_block
        if len(payload) != len(blocks) * bpb:
            raise ValueError(f"payload is {len(payload)} bytes, expected {len(blocks)} x {bpb}")
        for i, b in enumerate(blocks):
            self._blocks[b] = bytes(payload[i * bpb : (i + 1) * bpb])


class FakeEngine(Engine):
    """:class:`Engine` with the model replaced by :func:`fake_next_token` and a sleep."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        step_seconds: float = STEP_SECONDS,
        token_seconds: float = TOKEN_SECONDS,
    ) -> None:  # no super().__init__: no model
        self.config = config = config or EngineConfig(model=FAKE_MODEL)
        self.step_seconds, self.token_seconds = step_seconds, token_seconds
        self.model_config = cfg = ModelConfig(
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
        self.model_id = f"{FAKE_MODEL}-seed{config.seed}"
        self.spec = CacheSpec(
            self.model_id, config.block_size, (PagedEntry("tokens", 0, (1,), "float32"),)
        )
        num_blocks = config.num_kv_blocks or 4096
        self.cache = _DictCache(self.spec.bytes_per_block)  # type: ignore[assignment]
        self.blocks = BlockManager(num_blocks, config.block_size)
        max_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.scheduler_config = SchedulerConfig(
            config.max_tokens_per_step, config.time_budget_s, config.max_running, max_len
        )
        self.cost = CostModel.for_model(cfg, 4, 4, 5e10, 1e10)
        self.scheduler = Scheduler(self.scheduler_config, self.blocks, self.cost, cfg.eos_token_ids)
        self.last_step_seconds = 0.0
        self.last_step_tokens = 0
        self.runner = _FakeRunner(self)  # type: ignore[assignment]
        self._inflight = None

    def _run(self, plan: StepPlan) -> dict[str, int]:
        time.sleep(self.step_seconds + self.token_seconds * plan.num_tokens)
        out: dict[str, int] = {}
        for s in plan.seqs:
            if not s.sample:
                continue
            params = self.scheduler.requests[s.request_id].params
            seed = params.seed if params.seed is not None else 0
            # s.token_ids are the tokens fed this step; the last one precedes the sampled token.
            out[s.request_id] = fake_next_token(seed, s.token_ids[-1], s.sample_position)
        return out


class _FakeRunner:
    """The engine's runner interface over :meth:`FakeEngine._run` (synchronous, no overlap)."""

    collect = staticmethod(ModelRunner.collect)

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def launch(self, plan: StepPlan, params: object, prev: Launched | None) -> Launched:
        t0 = time.perf_counter()
        sampled = self.engine._run(plan)
        sampling = [s for s in plan.seqs if s.sample]
        host = torch.tensor([sampled[s.request_id] for s in sampling], dtype=torch.int64)
        return Launched(plan, sampling, None, host, None, None, time.perf_counter() - t0)
