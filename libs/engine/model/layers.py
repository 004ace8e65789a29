"""RMSNorm, linears (the model's dtype or FP8 block-scaled) and the dense SwiGLU MLP.

Each sums its products by the :class:`~.quant.Arithmetic` it holds (``arith``: plain or
batch-invariant, set once by ``set_batch_invariant``). DeepSeekMoE (router, routed and shared
experts) is :mod:`.moe`; the methods themselves are :mod:`.quant`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .quant import SummedBy

if TYPE_CHECKING:
    from ..kernels.fp8_gemm import Fp8Weight


class RMSNorm(SummedBy, nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.use_kernels = False

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x + residual), x + residual)``, in one kernel on the kernel path."""
        if self.use_kernels and x.stride(-1) == 1 and residual.stride(-1) == 1:
            from ..kernels.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        summed = residual + x
        return self(summed), summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels and x.dim() == 2 and x.stride(-1) == 1:
            from ..kernels.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps)[0]
        if x.dim() == 2:
            return self.arith.rows(self._norm, x)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * xf.to(x.dtype)
        return out


class Linear(SummedBy, nn.Linear):
    """``nn.Linear`` summed by its ``arith`` (:mod:`.quant`): batch-invariant, a row's output
    does not depend on the other rows of the call."""

    use_kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.arith.linear(x, self.weight, self.bias, self.use_kernels)


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: bool
) -> torch.Tensor:
    """``F.linear`` summed in one fixed order per row: Triton with ``kernels``, else PyTorch
    in fixed-shape chunks."""
    from ..kernels.invariant import linear

    return linear(x, weight, bias, kernel=kernels)


def invariant_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A row-wise PyTorch function in fixed-shape calls (``kernels.invariant.rows_fixed``)."""
    from ..kernels.invariant import rows_fixed

    return rows_fixed(fn, x)


def stack_weights(first: nn.Linear, second: nn.Linear) -> torch.Tensor:
    """``[first.weight; second.weight]`` as one tensor, both layers' weights becoming views of
    it (no second copy). Made outside inference mode (forward runs in it), so the weights stay
    ordinary tensors that later in-place updates may change."""
    with torch.inference_mode(False):
        w = torch.cat((first.weight, second.weight))
    n = first.weight.shape[0]
    first.weight.data, second.weight.data = w[:n], w[n:]
    return w


def _linear(out_f: int, in_f: int, bias: bool, dtype: torch.dtype, device: torch.device) -> Linear:
    layer = Linear(in_f, out_f, bias=bias, dtype=dtype, device=device)
    layer.requires_grad_(False)
    return layer


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays e4m3 with one fp32 scale per 128x128 tile.

    Parameter names are the checkpoint's (``weight`` e4m3, ``weight_scale_inv`` fp32:
    ``w = weight * weight_scale_inv`` per tile), so DeepSeek's FP8 tensors load as they are.
    Activations are quantized per token and 128-channel group on every call
    (:mod:`libs.engine.kernels.fp8_gemm`); the output has ``dtype`` (the model's).
    """

    def __init__(
        self, out_f: int, in_f: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        from ..kernels.fp8_gemm import FP8_BLOCK, FP8_DTYPE

        self.in_features, self.out_features = in_f, out_f
        blocks = (-(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK))
        self.weight = nn.Parameter(
            torch.empty(out_f, in_f, dtype=FP8_DTYPE, device=device), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.ones(blocks, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_f, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.use_kernels = False

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Fp8Linear:
        """The block-quantized copy of ``layer`` (its weight's dtype becomes the output's)."""
        from ..kernels.fp8_gemm import quantize_fp8_blocks

        w = layer.weight.data
        out = cls(w.shape[0], w.shape[1], layer.bias is not None, w.dtype, w.device)
        q = quantize_fp8_blocks(w)
        out.weight.data.copy_(q.q)
        out.weight_scale_inv.data.copy_(q.scale)
        if layer.bias is not None and out.bias is not None:
            out.bias.data.copy_(layer.bias.data)
        return out

    @property
    def fp8(self) -> Fp8Weight:
        from ..kernels.fp8_gemm import Fp8Weight

        return Fp8Weight(self.weight, self.weight_scale_inv)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as ``dtype`` (for code that needs the matrix itself: MLA's absorption)."""
        from ..kernels.fp8_gemm import dequantize_fp8_blocks

        return dequantize_fp8_blocks(self.fp8, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.fp8_gemm import fp8_linear

        return fp8_linear(x, self.fp8, self.bias, kernel=self.use_kernels and x.is_cuda)


def linear_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight matrix of an ``nn.Linear`` or :class:`Fp8Linear` (dequantized) as ``dtype``."""
    if isinstance(layer, Fp8Linear):
        return layer.dequantized(dtype)
    w = layer.weight
    assert isinstance(w, torch.Tensor)
    return w if w.dtype == dtype else w.to(dtype)


class MLP(SummedBy, nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_proj = _linear(inter, hidden, False, dtype, device)
        self.up_proj = _linear(inter, hidden, False, dtype, device)
        self.down_proj = _linear(hidden, inter, False, dtype, device)
        self.use_kernels = False
        self._gate_up: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels and not isinstance(self.gate_proj, Fp8Linear):
            from ..kernels.fused_ops import silu_mul

            # One GEMM for gate and up (their weights stacked once), one kernel for silu * up.
            w = self._gate_up
            if w is None or w.data_ptr() != self.gate_proj.weight.data_ptr():
                w = self._gate_up = stack_weights(self.gate_proj, self.up_proj)
            gate_up = self.arith.linear(x, w, None, True)
            y: torch.Tensor = self.down_proj(silu_mul(gate_up))
            return y
        gate = self.arith.silu(self.gate_proj(x))
        out: torch.Tensor = self.down_proj(gate * self.up_proj(x))
        return out
