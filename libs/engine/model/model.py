"""The DeepSeek-V3 family as one PyTorch module tree.

Parameter names mirror the Hugging Face checkpoints (``model.layers.3.self_attn.kv_b_proj.weight``)
except the routed experts, which are stored fused (``mlp.experts.w13``/``w2``), and the MTP
layers, which live under ``mtp.{j}`` (``model.layers.{num_hidden_layers + j}`` on disk).

The model is single-device and runs over a flattened batch of tokens from many requests:
the caller gives token ids, positions, the step's :class:`AttentionMetadata` and one cache
tensor per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..kv.cache import LayerCache
from .attention import AttentionMetadata, MLAttention
from .layers import MLP, Fp8Linear, Linear, RMSNorm, _linear
from .moe import Experts, MoE, Router
from .quant import BF16_EXPERTS, Bf16Experts, ExpertsMethod, arithmetic
from .rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        moe: bool,
        rotary: Rotary,
        dtype: torch.dtype,
        device: torch.device,
        expert_slots: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = MLAttention(cfg, rotary, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp: nn.Module = (
            MoE(cfg, dtype, device, expert_slots)
            if moe
            else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
    ) -> torch.Tensor:
        h, x = self.post_attention_layernorm.add_forward(
            self.self_attn(self.input_layernorm(x), cos, sin, meta, cache), x
        )
        out: torch.Tensor = x + self.mlp(h)
        return out


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.head = _linear(cfg.vocab_size, cfg.hidden_size, False, dtype, device)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 multi-token prediction module (one per predicted depth).

    Given the previous depth's hidden state ``h`` at position ``i`` and the embedding of
    token ``i + 1``: ``x = eh_proj([enorm(emb); hnorm(h)])``, then one MoE decoder layer, then
    ``shared_head`` (norm + vocabulary projection) predicts token ``i + 2``.
    """

    def __init__(
        self, cfg: ModelConfig, rotary: Rotary, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(cfg, True, rotary, dtype, device)
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h, dtype=dtype, device=device)
        self.embed_tokens.requires_grad_(False)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.eh_proj = _linear(h, 2 * h, False, dtype, device)
        self.shared_head = SharedHead(cfg, dtype, device)

    def predict(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this depth's hidden states, fp32 logits for the token after ``next_ids``)."""
        x = self.block(hidden, next_ids, positions, meta, cache)
        return x, self.head(x)

    def block(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
    ) -> torch.Tensor:
        """This depth's hidden states (its KV written to ``cache``), without the head: a
        caller that needs logits for a few rows only projects those (:meth:`head`)."""
        emb = self.embed_tokens(next_ids)
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(hidden)), dim=-1))
        cos, sin = self.self_attn.rotary.cos_sin(positions)
        out: torch.Tensor = super().forward(x, cos, sin, meta, cache)
        return out

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the shared head for hidden states ``x``."""
        out: torch.Tensor = self.shared_head.head(self.shared_head.norm(x)).float()
        return out


class Backbone(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: Rotary,
        dtype: torch.dtype,
        device: torch.device,
        expert_slots: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device
        )
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.is_moe_layer(i), rotary, dtype, device, expert_slots)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class DeepseekForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        with_mtp: bool = False,
        expert_slots: tuple[int, ...] | None = None,
    ) -> None:
        """``expert_slots``: keep only these routed experts in the decoder layers (one rank's
        slots of an expert-parallel group; the MTP layers keep all); None: all of them."""
        super().__init__()
        device = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.weight_dtype = "model"  # "fp8" once quantize_weights_fp8 ran
        self.rotary = Rotary(cfg, device)
        self.model = Backbone(cfg, self.rotary, dtype, device, expert_slots)
        self.lm_head = _linear(cfg.vocab_size, cfg.hidden_size, False, dtype, device)
        n_mtp = cfg.num_nextn_predict_layers if with_mtp else 0
        self.mtp = nn.ModuleList(MTPLayer(cfg, self.rotary, dtype, device) for _ in range(n_mtp))

    @property
    def num_cache_layers(self) -> int:
        """Attention layers that own cache pages: the decoder layers, then the MTP layers."""
        return self.cfg.num_hidden_layers + len(self.mtp)

    @property
    def experts_method(self) -> ExpertsMethod:
        """How the routed experts are stored and run (every MoE layer alike; :mod:`.quant`)."""
        return next((m.method for m in self.modules() if isinstance(m, Experts)), BF16_EXPERTS)

    def set_absorb_decode(self, on: bool) -> None:
        for module in self.modules():
            if isinstance(module, MLAttention):
                module.absorb_decode = on

    def set_kernels(self, on: bool) -> None:
        """Fused attention and Triton decode/MoE kernels (on) or the plain PyTorch reference."""
        for module in self.modules():
            if isinstance(module, (MLAttention, Experts, RMSNorm, MLP, Fp8Linear, Linear, Router)):
                module.use_kernels = on
        self.rotary.use_kernels = on

    def set_batch_invariant(self, on: bool) -> None:
        """Batch-invariant mode (``--batch-invariant``): every product and reduction a token's
        logits go through is summed in an order fixed by the token's own row and context --
        linears, the router, the experts, and attention (prompt rows as decode rows) -- so a
        request's logits do not depend on the requests beside it, on how its prompt was
        chunked, or on whether its tokens were prefilled or decoded. bf16/fp32 weights only."""
        if on and self.weight_dtype == "fp8":
            raise ValueError("batch-invariant mode serves bf16 weights, not FP8 ones")
        if on and not isinstance(self.experts_method, Bf16Experts):
            raise ValueError("batch-invariant mode serves bf16 experts, not FP4/FP8 ones")
        arith = arithmetic(on)
        for module in self.modules():
            if isinstance(module, (MLAttention, Experts, MLP, Linear, Router, RMSNorm)):
                module.arith = arith
        self.rotary.arith = arith

    def keep_experts(self, slots: tuple[int, ...]) -> None:
        """Decoder MoE layers keep only these routed experts (see ``expert_slots``)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE) and isinstance(layer.mlp.experts, Experts):
                layer.mlp.experts.keep_slots(slots)

    def quantize_experts_fp4(self) -> None:
        for module in self.modules():
            if isinstance(module, Experts):
                module.quantize_fp4()

    def quantize_weights_fp8(self, empty: bool = False, experts: bool = True) -> None:
        """Attention projections, dense/shared MLPs and routed experts of every decoder (and
        MTP) layer become e4m3 with 128x128 block scales, as DeepSeek's FP8 release stores
        them; embeddings, router, norms, ``eh_proj`` and the heads stay in the model dtype.
        ``empty``: allocate the FP8 linears only (the loader fills them); ``experts=False``:
        leave the routed experts for a later call. Layers already FP8 are left as they are."""
        for layer in [*self.model.layers, *self.mtp]:
            for parent in [*layer.self_attn.modules(), *layer.mlp.modules()]:
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        fp8 = (
                            Fp8Linear(
                                child.out_features,
                                child.in_features,
                                child.bias is not None,
                                child.weight.dtype,
                                child.weight.device,
                            )
                            if empty
                            else Fp8Linear.from_linear(child)
                        )
                        setattr(parent, name, fp8)
                if experts and isinstance(parent, Experts):
                    parent.quantize_fp8()
        self.weight_dtype = "fp8"

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[LayerCache],
    ) -> torch.Tensor:
        """Final-norm hidden states [tokens, hidden] of every input token."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, cos, sin, meta, cache)
        out: torch.Tensor = self.model.norm(x)
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(hidden).float()
        return out
