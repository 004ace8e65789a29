"""DeepSeek-V4 in plain PyTorch, its per-request state as data.

This is the family's reference: parameter names are the Hugging Face checkpoint's (a
``DeepseekV4ForCausalLM`` state dict loads as it is), and :class:`V4State` holds everything a
request carries between forward calls, per layer:

* ``window``: the last ``sliding_window - 1`` key/value rows (K = V: one shared head, RoPE'd);
* per compressor (``"compressor"``, and for CSA layers the indexer's ``"indexer"``): the tokens
  of the window not yet closed (``buf_kv``/``buf_gate``), the entries emitted so far
  (``entries``; one per ``rate`` tokens), and for CSA the previous window's first-half series
  (``overlap_kv``/``overlap_gate``: an entry pools ``2 * rate`` tokens at stride ``rate``).

A chunk of ``S`` tokens at positions ``p0 .. p0+S-1`` (:meth:`V4ForCausalLM.forward`) attends,
per query at ``t``, to the window rows at positions ``t-W < k <= t``, plus compressed entries
whose windows closed by ``t`` (HCA: all of them; CSA: the indexer's top ``index_topk`` of
them), plus a per-head sink that takes probability mass and gives no value. Chunking a prompt
differently, or decoding token by token, gives what one pass gives: exactly tied indexer scores
go to the lower entry (transformers' ``torch.topk`` breaks such ties by the row's length, so
there, and only there, the two can pick differently).

Several sequences go through one pass (:meth:`V4ForCausalLM.forward_batch`, what the engine's
V4 runner calls): every matrix over all their rows, attention per sequence over its own state
-- for decode rows (one token each) as one batch: padded in PyTorch, or gathered by the Triton
kernels (:meth:`V4ForCausalLM.set_kernels`, on by default on CUDA), the compressor windows that
close at that step pooled together.

The parts: :mod:`.layers` (norms, linears, RoPE, hyper-connections), :mod:`.state`,
:mod:`.compressor`, :mod:`.attention`, :mod:`.moe`; here the decoder layer and the model.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..model.layers import Fp8Linear
from .attention import Attention, _rotary_of
from .compressor import Indexer
from .config import CSA, V4Config
from .layers import HyperConnection, HyperHead, RMSNorm, V4Rotary, _linear
from .moe import Experts, MoE, SharedMLP
from .state import CompressorState, LayerState, V4State

if TYPE_CHECKING:
    from ..kernels.fused_moe import Fp4Weight

__all__ = ["CompressorState", "DecoderLayer", "LayerState", "V4ForCausalLM", "V4State"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, slots: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg, layer, slots)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(
        self,
        streams: torch.Tensor,
        ids: torch.Tensor,
        spans: Sequence[tuple[int, int, torch.Tensor]],
        states: Sequence[LayerState],
        rotary: dict[str, V4Rotary],
        trig: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """``spans``: (first row, rows, positions) of each sequence in the batch, whose
        layer state is the same index of ``states``; everything but attention is per token
        (``trig``: :meth:`Attention.forward`'s)."""
        post, comb, x = self.attn_hc(streams)
        y = self.self_attn(self.input_layernorm(x), spans, states, rotary, trig)
        streams = HyperConnection.expand(post, comb, y, streams)
        post, comb, x = self.ffn_hc(streams)
        y = self.mlp(self.post_attention_layernorm(x), ids)
        return HyperConnection.expand(post, comb, y, streams)


class Backbone(nn.Module):
    def __init__(self, cfg: V4Config, slots: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, slots) for i in range(n))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class V4ForCausalLM(nn.Module):
    """The model (module doc). ``forward(ids, state)`` runs the next chunk of one sequence.
    ``expert_slots``: the routed experts every layer holds, in slot order (one rank of an EP
    group: :func:`libs.engine.ep.runtime.apply_ep`); None: all of them."""

    def __init__(self, cfg: V4Config, expert_slots: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.hf_config: dict[str, Any] | None = None  # the config.json it was read from, if known
        self.model = Backbone(cfg, expert_slots)
        self.lm_head = _linear(cfg.vocab_size, cfg.hidden_size)
        r = cfg.qk_rope_head_dim
        self.rotary = {
            "main": V4Rotary(cfg.rope_main, r),
            "compress": V4Rotary(cfg.rope_compress, r),
        }

    def set_kernels(self, on: bool) -> None:
        """Decode attention, the indexer, the routed experts, the hyper-connections' mixing
        weights and the FP8 projections through the Triton kernels (on) or plain PyTorch (the
        reference)."""
        for module in self.modules():
            if isinstance(module, (Attention, Experts, HyperConnection, Fp8Linear)):
                module.use_kernels = on

    def fp8_projections(self) -> list[str]:
        """The projections DeepSeek's release stores in FP8 (e4m3, a scale per 128x128 tile)
        that run as FP8 GEMMs here, by module name: attention's query, key/value and output
        projections (not the grouped ``o_a_proj``, which stays in the model dtype), the
        indexer's query projection and the shared experts. The compressors' and the
        indexer's own key/value, gate and weight projections are bf16 in the release too."""
        names: list[str] = []
        for name, module in self.named_modules():
            children: tuple[str, ...]
            if isinstance(module, Attention):
                children = ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")
            elif isinstance(module, Indexer):
                children = ("q_b_proj",)
            elif isinstance(module, SharedMLP):
                children = ("gate_proj", "up_proj", "down_proj")
            else:
                continue
            names += [f"{name}.{child}" for child in children]
        return names

    def quantize_weights_fp8(
        self, only: Collection[str] | None = None, empty: bool = False
    ) -> None:
        """:meth:`fp8_projections` (``only``: those of them) become :class:`Fp8Linear` layers,
        their weights quantized (``empty``: left for the loader to fill); once."""
        modules = dict(self.named_modules())
        for name in self.fp8_projections():
            layer = modules[name]
            if (only is not None and name not in only) or not isinstance(layer, nn.Linear):
                continue
            w = layer.weight
            fp8 = (
                Fp8Linear(layer.out_features, layer.in_features, False, w.dtype, w.device)
                if empty
                else Fp8Linear.from_linear(layer)
            )
            parent, child = name.rsplit(".", 1)
            setattr(modules[parent], child, fp8)

    def quantize_experts_fp4(self) -> None:
        """Every layer's routed experts to FP4 (e2m1, a scale per 32): ``--experts fp4``."""
        for module in self.modules():
            if isinstance(module, Experts):
                module.quantize_fp4()

    @torch.inference_mode()
    def warm_kernels(self) -> None:
        """Compile, now, every variant of the Triton kernels a step can reach, rather than in
        the middle of someone's stream (the CSA indexer first runs once a request holds more
        entries than it picks: 2,052 tokens into V4-Flash; a compile there stalls the step
        ~0.6 s on an H200). Each kernel once, the attention combine per power-of-two split
        count, the fused MoE per launch config (one, a few and many rows per expert)."""
        from ..kernels.v4_attention import indexer_scores, sparse_decode_attention

        cfg = self.cfg
        p = next(self.parameters())
        dev, dt = p.device, p.dtype
        h, d = cfg.num_attention_heads, cfg.head_dim
        q, rows = (
            torch.zeros(1, h, d, device=dev, dtype=dt),
            torch.zeros(2, d, device=dev, dtype=dt),
        )
        index = torch.tensor([[0, 1]], device=dev, dtype=torch.int32)
        sinks = torch.zeros(h, device=dev)
        for splits in (1, 2, 4, 8, 16):
            sparse_decode_attention(q, rows, index, sinks, 1.0, num_splits=splits)
        if CSA in cfg.layer_types:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            one = torch.ones(1, device=dev, dtype=torch.int32)
            indexer_scores(
                torch.zeros(1, hi, di, device=dev, dtype=dt), torch.zeros(1, hi, device=dev),
                torch.zeros(2, di, device=dev, dtype=dt), one - 1, one, 2, 1.0,
            )  # fmt: skip
        layer = self.model.layers[0]
        assert isinstance(layer, DecoderLayer)
        layer.attn_hc(torch.zeros(1, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=dt))
        slots = layer.mlp.experts.slots  # an EP rank's experts: its slots are the rows
        e, k = (cfg.n_routed_experts if slots is None else len(slots)), cfg.num_experts_per_tok
        for rows_per_expert in (1, 13, 97):
            t = -(-rows_per_expert * e // k)
            idx = torch.arange(t * k, device=dev).remainder(e).view(t, k)
            x = torch.zeros(t, cfg.hidden_size, device=dev, dtype=dt)
            layer.mlp.experts(x, torch.ones(t, k, device=dev), idx)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, state: V4State) -> torch.Tensor:
        """Logits ``[S, vocab]`` (fp32) of the chunk ``ids [S]`` that follows ``state.seen``
        tokens; ``state`` is advanced past it."""
        return self.forward_batch([ids], [state], last_only=False)

    @torch.inference_mode()
    def forward_batch(
        self, chunks: Sequence[torch.Tensor], states: Sequence[V4State], last_only: bool = True
    ) -> torch.Tensor:
        """Several sequences in one pass: ``chunks[i]`` follows ``states[i].seen`` tokens and
        advances that state. Logits (fp32) of each chunk's last token ``[len(chunks), vocab]``,
        or of every token (``last_only=False``: ``[sum of lengths, vocab]``)."""
        ids = chunks[0] if len(chunks) == 1 else torch.cat(list(chunks))
        lengths = [int(c.shape[0]) for c in chunks]
        # Every row's position in one host-to-device copy; each span's a view of it.
        where = [
            p for n, st in zip(lengths, states, strict=True) for p in range(st.seen, st.seen + n)
        ]
        positions = torch.tensor(where, device=ids.device)
        spans: list[tuple[int, int, torch.Tensor]] = []
        o = 0
        for n in lengths:
            spans.append((o, n, positions[o : o + n]))
            o += n
        x = self.model.embed_tokens(ids)
        # cos/sin at every row's position, once per rotary table the layers use.
        tables = {_rotary_of(kind) for kind in self.cfg.layer_types}
        trig = {n: self.rotary[n].cos_sin(positions, x.dtype) for n in sorted(tables)}
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.model.layers):
            states_i = [st.layers[i] for st in states]
            streams = layer(streams, ids, spans, states_i, self.rotary, trig)
        for (_, n, _), st in zip(spans, states, strict=True):
            st.seen += n
        if last_only:
            streams = streams[[o + n - 1 for o, n, _ in spans]]
        hidden = self.model.norm(self.model.hc_head(streams))
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def load_hf_state(
        self,
        state: dict[str, torch.Tensor],
        fp4: Mapping[str, tuple[Fp4Weight, Fp4Weight]] | None = None,
    ) -> None:
        """A transformers ``DeepseekV4ForCausalLM`` state dict (rotary tables, which are
        computed here, and the MTP layers, not run here yet, are skipped). ``fp4``: routed
        experts held in FP4, by module name (``model.layers.N.mlp.experts``), in place of
        their ``gate_up_proj`` and ``down_proj``."""
        keep = {
            k: v
            for k, v in state.items()
            if "rotary_emb" not in k and not k.startswith(("mtp.", "model.mtp."))
        }
        modules = dict(self.named_modules())
        for name, (gate_up, down) in (fp4 or {}).items():
            experts = modules.get(name)
            if not isinstance(experts, Experts):
                raise ValueError(f"V4 checkpoint does not match the config: no experts {name}")
            want = tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape)
            if (gate_up.shape, down.shape) != want:
                raise ValueError(
                    f"V4 checkpoint does not match the config: {name} holds "
                    f"{gate_up.shape} / {down.shape}, the config {want[0]} / {want[1]}"
                )
            experts.set_fp4(gate_up, down)
            for part in ("gate_up_proj", "down_proj"):  # the emptied parameters, loaded as such
                keep[f"{name}.{part}"] = getattr(experts, part).data
        try:
            missing, unexpected = self.load_state_dict(keep, strict=False)
        except RuntimeError as exc:  # shapes: the checkpoint is another config's
            raise ValueError(f"V4 checkpoint does not match the config: {exc}") from None
        if missing or unexpected:
            raise ValueError(
                f"V4 checkpoint does not match the config: missing {sorted(missing)[:8]}, "
                f"unexpected {sorted(unexpected)[:8]}"
            )
