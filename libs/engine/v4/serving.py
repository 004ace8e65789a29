"""DeepSeek-V4 in the batched :class:`~libs.engine.engine.Engine`: its state as the engine's blocks.

The engine's policy is model-blind -- scheduler, block manager, prefix cache, KV frames -- and
runs on :class:`~libs.engine.parts.EngineParts`. :func:`v4_parts` gives it V4's (through
:func:`build_v4_parts`, the family's entry in :mod:`libs.engine.registry`):

* **Blocks.** An engine block of ``block_size`` tokens holds the V4 state block of
  :mod:`.blocks` for those tokens (the entries its compressors emitted there and the carry at
  its end, a self-describing byte string), in a fixed-size slot: a 4-byte length, the block,
  zeros. :func:`v4_cache_spec` sizes the slot from the config's bound, so the engine's frames,
  the kvstore and the block accounting treat V4 blocks like MLA pages; its layout hash names
  the V4 config and dtype, so another model's frames are refused.
* **Runner.** :class:`V4Runner` keeps each running request's live :class:`~.model.V4State`
  and feeds it the step's tokens cut at block ends; each block is written to its slot the
  moment it fills. The block a request is in the middle of is written only when someone
  reads it (an export, a restore): until then the store marks it live. A request whose state
  this runner does not hold -- a prefix hit, a KV import, a preempted or evicted one -- is
  restored from its blocks exactly (the last one may be partial: it ends where its header
  says), so no token is replayed; the state then continues as if computed here. A step is
  one forward per round over the requests, a round reaching each request's next block end:
  every matrix over all its rows; attention for decode rows as one padded batch, for prompt
  chunks per request. Sampling is the engine's own sampler (every SamplingParams feature,
  logprobs, constraints).

What the engine knows of the model (vocabulary, stop ids, context limit) is a
:class:`~libs.engine.config.ModelConfig` view of the V4 config (:func:`engine_view`); its step
cost is V4's own (:mod:`.cost`). Not here yet: CUDA graphs, Triton kernels, expert parallelism,
speculative decoding, FP8 weights and KV.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import ModelConfig
from ..features import check
from ..kv.host import HostBlockStore
from ..kv.layout import CacheSpec, PagedEntry
from ..parts import EngineParts, kernels_on, nominal_rates
from ..runner import Launched, ModelRunner
from ..sampler import Sampler
from ..scheduler import PLACEHOLDER, ScheduledSeq, StepPlan
from .blocks import MAGIC, V4BlockError, _counts, encode_block, layout_hash, restore_open
from .config import CSA, HCA, V4Config
from .cost import v4_cost_model
from .load import V4_PRESETS, load_v4, v4_config
from .model import V4ForCausalLM, V4State

if TYPE_CHECKING:
    from ..engine_config import EngineConfig
    from ..ep.group import EPGroup
    from ..ep.placement import Placement
    from ..ep.runtime import EPRuntime
    from ..loader import LoadedModel

_LEN = struct.Struct("<I")
# Header bound per tensor of a block: its name, dtype, shape and byte range as JSON.
_HEADER_PER_TENSOR = 192
_HEADER_FIXED = 64


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def slot_bytes_per_layer(cfg: V4Config, layer: int, block_size: int, itemsize: int) -> int:
    """The most bytes a state block of ``block_size`` tokens holds for ``layer``: the window's
    rows, per compressor the entries it can emit in a block, its open window and (CSA) the
    overlap series, and their header entries."""
    kind = cfg.layer_types[layer]
    values = tensors = 0
    if cfg.sliding_window > 1:
        values += (cfg.sliding_window - 1) * cfg.head_dim
        tensors += 1
    comps: list[tuple[int, int, bool]] = []  # (dim, rate, overlap)
    if kind == CSA:
        comps = [(cfg.head_dim, cfg.csa_rate, True), (cfg.index_head_dim, cfg.csa_rate, True)]
    elif kind == HCA:
        comps = [(cfg.head_dim, cfg.hca_rate, False)]
    for dim, rate, overlap in comps:
        width = 2 * dim if overlap else dim
        values += -(-block_size // rate) * dim  # entries
        values += 2 * (rate - 1) * width  # the open window's kv and gate rows
        tensors += 3
        if overlap:
            values += 2 * rate * dim
            tensors += 2
    return values * itemsize + tensors * _HEADER_PER_TENSOR


def v4_cache_spec(cfg: V4Config, model_id: str, block_size: int, dtype: torch.dtype) -> CacheSpec:
    """One paged byte entry per layer, wide enough for that layer's share of any state block
    (:func:`slot_bytes_per_layer`); layer 0 also carries the slot's length and the block's
    magic and fixed header."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    fixed = _LEN.size + len(MAGIC) + 4 + _HEADER_FIXED
    paged = []
    for i in range(cfg.num_hidden_layers):
        n = slot_bytes_per_layer(cfg, i, block_size, itemsize) + (fixed if i == 0 else 0)
        width = -(-n // block_size)  # bytes per token
        paged.append(PagedEntry(f"v4_state:{_dtype_name(dtype)}", i, (width,), "uint8"))
    return CacheSpec(model_id, block_size, tuple(paged))


class V4BlockStore(HostBlockStore):
    """V4 state blocks in fixed slots (module doc). ``live`` blocks are the ones a running
    request is part-way through: written from its state when read."""

    def __init__(self, bytes_per_block: int) -> None:
        super().__init__(bytes_per_block)
        self._live: dict[int, Callable[[], bytes]] = {}

    def put(self, block: int, data: bytes) -> None:
        """Write one state block into ``block``'s slot."""
        if _LEN.size + len(data) > self.bytes_per_block:
            raise V4BlockError(
                f"a V4 state block of {len(data)} bytes exceeds its {self.bytes_per_block}-byte "
                "slot (the slot bound is wrong for this config)"
            )
        self._live.pop(block, None)
        pad = self.bytes_per_block - _LEN.size - len(data)
        self._blocks[block] = _LEN.pack(len(data)) + data + bytes(pad)

    def get(self, block: int) -> bytes:
        """The state block in ``block``'s slot (written now if live)."""
        self._settle([block])
        slot = self._blocks.get(block)
        n = _LEN.unpack_from(slot)[0] if slot is not None else 0
        if n == 0 or _LEN.size + n > self.bytes_per_block:
            raise V4BlockError(f"KV block {block} holds no V4 state")
        assert slot is not None
        return slot[_LEN.size : _LEN.size + n]

    def set_live(self, block: int, encode: Callable[[], bytes]) -> None:
        self._live[block] = encode

    def settle(self, block: int, keep: bool) -> None:
        """``block`` stops being live: written from its state first if ``keep``."""
        if keep:
            self._settle([block])
        self._live.pop(block, None)

    def _settle(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            encode = self._live.get(b)
            if encode is not None:
                self.put(b, encode())

    def read_blocks(self, blocks: Sequence[int]) -> bytes:
        """As stored, live blocks written first (``gather_async`` reads through here, on the
        engine thread)."""
        self._settle(blocks)
        return super().read_blocks(blocks)

    def write_blocks(self, blocks: Sequence[int], payload: bytes | memoryview) -> None:
        for b in blocks:
            self._live.pop(b, None)
        super().write_blocks(blocks, payload)


@dataclass
class _Running:
    state: V4State
    before: list[dict[str, int]]  # entry counts at the start of the block the state is in
    open_block: int | None = None  # the live block (the state ends inside it)


@dataclass
class _Work:
    run: _Running
    seq: ScheduledSeq
    ids: list[int]  # this step's tokens
    done: int = 0  # of them fed so far
    logits: torch.Tensor | None = None  # of the last one, once fed


class V4Runner(ModelRunner):
    """The engine's step runner over a :class:`V4ForCausalLM` (module doc). ``max_states``
    live states are kept (least recently stepped first out); a request beyond them is
    restored from its blocks when it steps again."""

    def __init__(
        self,
        net: V4ForCausalLM,
        store: V4BlockStore,
        sampler: Sampler,
        block_size: int,
        max_states: int,
        ep: EPRuntime | None = None,
    ) -> None:
        # Not ModelRunner.__init__: no paged cache or CUDA graphs; launch, collect and the
        # sampling (history, placeholders) are ModelRunner's, on this _forward.
        self.ep = ep  # one rank of an EP group: every round a step of the group's (_run)
        self.net = net
        self.store = store
        self.sampler = sampler
        self.device = next(net.parameters()).device
        self.block_size = block_size
        self.max_states = max(1, max_states)
        self.states: OrderedDict[str, _Running] = OrderedDict()

    def capture_all(self) -> None:
        """Nothing to capture: every step runs eagerly."""

    def warm_kernels(self) -> None:
        """Nothing beyond what the warm-up's prompts compile (no paged MLA decode kernel)."""

    def forget(self, request_id: str) -> None:
        """Drop the request's state; the block it was part-way through is written first (an
        export of a held request reads it)."""
        self._drop(request_id, keep=True)

    def _drop(self, request_id: str, keep: bool) -> None:
        """Drop the request's state; its open block written from it first if ``keep``."""
        run = self.states.pop(request_id, None)
        if run is not None and run.open_block is not None:
            self.store.settle(run.open_block, keep)

    def _forward(self, plan: StepPlan, prev: Launched | None) -> torch.Tensor:
        for rid in plan.preempted:  # its blocks are freed: nothing of it is written
            self._drop(rid, keep=False)
        work = [_Work(self._running(s), s, self._token_ids(s, prev)) for s in plan.seqs]
        self._run(work)
        rows = []
        for w in work:
            if w.seq.sample:
                assert w.logits is not None, "a sampling seq with no tokens this step"
                rows.append(w.logits)
        if not rows:
            return torch.empty(0, self.net.cfg.vocab_size, device=self.device)
        return torch.stack(rows)

    @staticmethod
    def _token_ids(seq: ScheduledSeq, prev: Launched | None) -> list[int]:
        """The step's tokens, a placeholder (overlap: sampled by the step in flight) read
        from that step."""
        ids = list(seq.token_ids)
        if ids and ids[-1] == PLACEHOLDER:
            assert prev is not None and prev.tokens is not None, "a placeholder without its step"
            ids[-1] = int(prev.tokens[prev.index[seq.request_id]])
        return ids

    def _running(self, seq: ScheduledSeq) -> _Running:
        """The request's state at ``seq.start``: held, or restored from its blocks."""
        run = self.states.get(seq.request_id)
        if run is not None and run.state.seen == seq.start:
            self.states.move_to_end(seq.request_id)
            return run
        if run is not None:  # rewound (a retry of the id): start over from its blocks
            self._drop(seq.request_id, keep=False)
        bs = self.block_size
        if seq.start == 0:
            state = V4State.empty(self.net.cfg)
            before = _counts(state)
        else:
            table = seq.block_table[: -(-seq.start // bs)]
            state, before = restore_open([self.store.get(b) for b in table], self.net)
            if state.seen != seq.start:
                raise V4BlockError(
                    f"request {seq.request_id}: its V4 state blocks end at token {state.seen}, "
                    f"but the step starts at {seq.start}"
                )
        run = _Running(state, before)
        self.states[seq.request_id] = run
        while len(self.states) > self.max_states:
            self.forget(next(iter(self.states)))
        return run

    def _run(self, work: list[_Work]) -> None:
        """Feed every request its tokens, cut at block ends, in rounds: each round one forward
        over the requests with tokens left, each up to its block's end (a filled block is
        written then). Decode rows all go in the first round; a long prompt chunk takes one
        round per block it reaches into. Each request's last-token logits land in its work.
        With EP every round is agreed with the group, and the step ends with a round that no
        rank has tokens for (:attr:`EPRuntime.rounds`): a rank done sooner steps empty rounds
        while the others still compute, so the MoE exchanges pair up."""
        bs = self.block_size
        while True:
            pending = [w for w in work if w.done < len(w.ids)]
            chunks = [w.ids[w.done : w.done + bs - w.run.state.seen % bs] for w in pending]
            if self.ep is None:
                if not pending:
                    break
                self._round(pending, chunks)
                continue
            rows = self.ep.begin_step(sum(map(len, chunks)), ())
            try:
                if pending:
                    self._round(pending, chunks)
                elif rows:
                    self.ep.empty_forward(rows)
            finally:
                self.ep.end_step()
            if rows == 0:
                break
        for w in work:
            self._mark_open(w.run, w.seq)

    def _round(self, pending: list[_Work], chunks: list[list[int]]) -> None:
        """One forward over ``pending``, each fed its chunk (up to its block's end)."""
        bs = self.block_size
        for w, chunk in zip(pending, chunks, strict=True):
            if w.run.state.seen % bs == 0:
                w.run.before = _counts(w.run.state)
            w.done += len(chunk)
        # One host-to-device copy for the round's tokens; each request's chunk a view.
        flat = [t for chunk in chunks for t in chunk]
        ids = torch.split(torch.tensor(flat, device=self.device), list(map(len, chunks)))
        logits = self.net.forward_batch(ids, [w.run.state for w in pending])
        for w, row in zip(pending, logits, strict=True):
            st = w.run.state
            if st.seen % bs == 0:
                self.store.put(w.seq.block_table[st.seen // bs - 1], encode_block(st, w.run.before))
            if w.done == len(w.ids):
                w.logits = row

    def _mark_open(self, run: _Running, seq: ScheduledSeq) -> None:
        """The block the request's state now ends inside (if any) becomes live; one it left
        filled on the way and was written (``put``), which ended its being live."""
        st, bs = run.state, self.block_size
        if st.seen % bs == 0:
            run.open_block = None
            return
        run.open_block = seq.block_table[(st.seen - 1) // bs]
        self.store.set_live(run.open_block, lambda: encode_block(run.state, run.before))


def engine_view(cfg: V4Config) -> ModelConfig:
    """What the engine reads of a model, for a V4 config: vocabulary, stop ids, context limit
    (the widths are V4's nearest V3 reading, one shared key/value row of ``head_dim`` per
    token as MLA's latent is one; the step cost is :mod:`.cost`'s, not derived from them)."""
    return ModelConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        first_k_dense_replace=0,
        num_attention_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.head_dim - cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.head_dim,
        n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=1,
        topk_group=1,
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_ids=cfg.eos_token_ids,
        bos_token_id=0,
    )


def build_v4_parts(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    ep: EPGroup | None = None,
    placement: Placement | None = None,
) -> EngineParts:
    """The V4 family's entry in :mod:`libs.engine.registry`: :func:`v4_parts` for the model
    ``config`` names (``ep``: as one rank of that group, its experts placed by ``placement``,
    default contiguous), refusing a V2/V3 model and what V4 does not take."""
    check(config.setup("deepseek-v4", ep is not None))
    if loaded is not None:
        raise ValueError("a loaded V2/V3 model cannot serve a DeepSeek-V4 name")
    return v4_parts(config, ep=ep, placement=placement)


def v4_parts(
    config: EngineConfig,
    net: V4ForCausalLM | None = None,
    model_id: str = "",
    ep: EPGroup | None = None,
    placement: Placement | None = None,
) -> EngineParts:
    """Load the V4 model ``config`` names and build the engine's parts for it (module doc).
    Or take ``net``, a model built elsewhere, whose weights ``model_id`` names (KV frames of
    another model id are refused). ``ep``: this process is one rank of that expert-parallel
    group; the routed experts are sharded by ``placement`` (default contiguous): a checkpoint's
    other experts are never held (:func:`libs.engine.ep.runtime.apply_ep` wraps the layers)."""
    from ..kernels.v4_attention import unsupported
    from ..loader import _checkpoint_digest

    check(config.setup("deepseek-v4", ep is not None))  # libs/engine/features.py
    device = torch.device(config.device)
    dtype = config.torch_dtype
    slots = None  # an EP rank loads only the experts its placement gives it
    if ep is not None:
        from ..ep.placement import Placement

        n = (net.cfg if net is not None else v4_config(config.model)).n_routed_experts
        placement = placement or Placement.contiguous(n, ep.size)
        slots = placement.experts_of(ep.rank)
    if net is not None:
        if not model_id:
            raise ValueError("a V4 model passed in needs the model_id that names its weights")
        device, dtype = next(net.parameters()).device, next(net.parameters()).dtype
        if config.weight_dtype == "fp8":  # load_v4 does this for the models it loads
            net.quantize_weights_fp8()
    elif config.model in V4_PRESETS:
        net = load_v4(
            config.model,
            device,
            dtype,
            config.seed,
            weights=config.weight_dtype,
            expert_slots=slots,
        )
        model_id = f"{config.model}-seed{config.seed}@{layout_hash(net)}"
    else:
        net = load_v4(
            config.model,
            device,
            dtype,
            config.seed,
            config.read_workers,
            config.load_progress,
            config.weight_dtype,
            slots,
        )
        path = Path(config.model)
        model_id = f"{path.name}@{_checkpoint_digest(path)}"
    cfg = net.cfg
    if config.expert_dtype == "fp4":  # --experts fp4 (a release checkpoint's are FP4 already)
        net.quantize_experts_fp4()
    kernels = kernels_on(config, lambda: unsupported(cfg.head_dim, cfg.index_head_dim))
    net.set_kernels(kernels)
    if kernels and device.type == "cuda":
        net.warm_kernels()
    runtime = None
    if ep is not None:
        from ..ep.runtime import apply_ep

        assert placement is not None
        runtime = apply_ep(net, ep, placement)  # a model passed in keeps its slots here
        runtime.rounds = True
    spec = v4_cache_spec(cfg, model_id, config.block_size, dtype)
    budget = config.kv_cache_bytes or 1 << 30  # host bytes, taken only by blocks written
    num_blocks = config.num_kv_blocks or max(1, budget // spec.bytes_per_block)
    store = V4BlockStore(spec.bytes_per_block)
    cost = v4_cost_model(net, *nominal_rates(device))
    sampler = Sampler(device, config.sampler_seed, cfg.eos_token_ids)
    runner = V4Runner(net, store, sampler, config.block_size, config.max_running, runtime)
    return EngineParts(
        model_id, engine_view(cfg), spec, store, num_blocks, cost, runner, device, ep=runtime
    )
