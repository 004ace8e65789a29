"""DeepSeek-V4's MoE: sqrt-softplus or hash routing, clamped SwiGLU experts, a shared expert.
The routed experts are bf16 (or the model's dtype) or FP4 e2m1 with a scale per 32 (as the
release stores them, or quantized at load: :meth:`Experts.set_fp4`), decoded inside the fused
MoE's GEMMs on a GPU and one expert at a time in PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..model.moe import slot_rows
from .config import V4Config
from .layers import _linear, _param

if TYPE_CHECKING:  # the kernels' module imports Triton: only when FP4 is asked for
    from ..kernels.fused_moe import Fp4Weight


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedMLP(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        inter = cfg.moe_intermediate_size
        self.gate_proj = _linear(inter, cfg.hidden_size)
        self.up_proj = _linear(inter, cfg.hidden_size)
        self.down_proj = _linear(cfg.hidden_size, inter)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(
            _clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit)
        )
        return out


class Router(nn.Module):
    """Scores (sqrt-softplus or sigmoid) of every expert; the top-k by score plus the
    correction bias, or (hash layers) the token's fixed ``tid2eid`` row; weights normalized
    and scaled by ``routed_scaling_factor``."""

    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size)
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            )
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        f = self.cfg.scoring_func
        scores = torch.sqrt(F.softplus(logits)) if f == "sqrtsoftplus" else torch.sigmoid(logits)
        if self.hashed:
            table = self.get_buffer("tid2eid")
            idx = table[ids].long()
        else:
            k = self.cfg.num_experts_per_tok
            bias = self.get_buffer("e_score_correction_bias")
            idx = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.cfg.routed_scaling_factor, idx


class Experts(nn.Module):
    """Routed experts stored fused: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I].

    ``slots``: the expert each row holds when this module keeps only some of them (one rank of
    an expert-parallel group, :mod:`libs.engine.ep`, which asks for the slot methods below);
    None: all ``n_routed_experts`` in order. Row ``s`` then answers ``idx == s``."""

    def __init__(self, cfg: V4Config, slots: tuple[int, ...] | None = None) -> None:
        super().__init__()
        e = cfg.n_routed_experts if slots is None else len(slots)
        i, h = cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = _param(e, 2 * i, h)
        self.down_proj = _param(e, h, i)
        self.limit = cfg.swiglu_limit
        self.use_kernels = False  # the fused Triton MoE (no host synchronization)
        self.slots = slots
        self._fp4: tuple[Fp4Weight, Fp4Weight] | None = None

    @property
    def fp4(self) -> tuple[Fp4Weight, Fp4Weight] | None:
        """The FP4 experts (gate/up, down) when held so; None: the parameters hold them."""
        return self._fp4

    def set_fp4(self, gate_up: Fp4Weight, down: Fp4Weight) -> None:
        """Hold the experts as these FP4 weights (the parameters' copies are freed)."""
        self._fp4 = (gate_up, down)
        p = self.gate_up_proj
        self.gate_up_proj = nn.Parameter(p.new_empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(p.new_empty(0), requires_grad=False)

    def quantize_fp4(self) -> None:
        """Quantize the experts to FP4 (e2m1, a scale per 32 along K); once."""
        if self._fp4 is None:
            from ..kernels.fused_moe import quantize_fp4

            self.set_fp4(quantize_fp4(self.gate_up_proj.data), quantize_fp4(self.down_proj.data))

    def keep_slots(self, slots: tuple[int, ...]) -> None:
        """Keep copies of these experts' weights (``-1``: an empty slot, zeros), drop the rest."""
        if self.slots is not None:
            raise ValueError(f"experts already hold slots {self.slots}")
        self.set_slot_state(slot_rows(self.slot_state(), slots), slots)

    def slot_state(self) -> list[torch.Tensor]:
        """The tensors that hold the experts, one row per slot (bf16: gate/up and down; FP4:
        codes and scales of each): what moves when a slot changes hands."""
        if self._fp4 is not None:
            return [t for w in self._fp4 for t in (w.packed, w.scales)]
        return [self.gate_up_proj.data, self.down_proj.data]

    def set_slot_state(self, state: list[torch.Tensor], slots: tuple[int, ...]) -> None:
        """Take ``state`` (laid out as :meth:`slot_state`) as the weights of ``slots``."""
        if self._fp4 is not None:
            from ..kernels.fused_moe import Fp4Weight

            self._fp4 = (Fp4Weight(state[0], state[1]), Fp4Weight(state[2], state[3]))
        else:
            self.gate_up_proj = nn.Parameter(state[0], requires_grad=False)
            self.down_proj = nn.Parameter(state[1], requires_grad=False)
        self.slots = slots

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._fp4 or (self.gate_up_proj, self.down_proj)
        if self.use_kernels:
            from ..kernels.fused_moe import fused_moe

            return fused_moe(x, gate_up, down, w.float(), idx, swiglu_limit=self.limit)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            g, u = F.linear(x[tok], _expert(gate_up, e, x.dtype)).chunk(2, dim=-1)
            y = F.linear(_clamped_swiglu(g, u, self.limit), _expert(down, e, x.dtype))
            out.index_add_(0, tok, (y * w[tok, slot, None]).to(out.dtype))
        return out


def _expert(w: torch.Tensor | Fp4Weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s matrix in ``dtype`` (FP4: decoded, code times scale in fp32, then cast)."""
    if isinstance(w, torch.Tensor):
        return w[e]
    from ..kernels.fused_moe import expert_weight

    return expert_weight(w, e).to(dtype)


class MoE(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, slots: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.gate = Router(cfg, cfg.mlp_layer_types[layer] == "hash_moe")
        self.experts = Experts(cfg, slots)
        self.shared_experts = SharedMLP(cfg)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w, idx = self.gate(x, ids)
        out: torch.Tensor = self.experts(x, w, idx) + self.shared_experts(x)
        return out
