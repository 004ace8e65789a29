"""How a layer's weights are stored and multiplied: methods given to layers once, at load.

Two kinds, each a small object a layer holds and calls, so no layer tests a mode flag:

* :class:`Arithmetic` -- how products and reductions are summed. :data:`PLAIN` is the
  library's way (fastest; a row's result may depend on the rows beside it); :data:`INVARIANT`
  sums every product and reduction in one order fixed by the row itself
  (:mod:`libs.engine.kernels.invariant`, ``--batch-invariant``), so a request's logits do not
  depend on its batch. ``Linear``, ``MLP``, ``RMSNorm``, the router and the experts take one.
* :class:`ExpertsMethod` -- how routed experts are stored and run: :class:`Bf16Experts` (the
  module's own ``w13``/``w2``), :class:`Fp8Experts` (e4m3 with 128x128 block scales, as
  DeepSeek's FP8 release stores them) and :class:`Fp4Experts` (e2m1 with one scale per 32
  weights). Each gives the fused kernel its weights, runs the PyTorch reference, and says
  which tensors hold one slot's expert (what expert parallelism moves).

Dense linears are chosen the same way by module class: ``Linear`` (model dtype) or
``Fp8Linear`` (:mod:`.layers`), swapped in once by ``quantize_weights_fp8``. Which
combinations run at all is :mod:`libs.engine.features`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..kernels.fp8_gemm import Fp8Weight
    from ..kernels.fused_moe import Fp4Weight

Ffn = Callable[[torch.Tensor, int], torch.Tensor]  # (rows routed to expert e, e) -> outputs
if TYPE_CHECKING:
    KernelWeight = torch.Tensor | Fp8Weight | Fp4Weight  # what the fused kernel takes


class Experts(Protocol):
    """What a method reads of the experts module (:class:`.moe.Experts`): its own weights."""

    w13: torch.nn.Parameter
    w2: torch.nn.Parameter


class Arithmetic:
    """The library's products and reductions (:data:`PLAIN`)."""

    invariant = False

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, kernels: bool = False
    ) -> torch.Tensor:
        return F.linear(x, w, b)

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """A row-wise function of ``x``."""
        return fn(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def row_sum(self, w: torch.Tensor) -> torch.Tensor:
        """Each row's sum, ``[T, 1]``."""
        return w.sum(dim=-1, keepdim=True)


class InvariantArithmetic(Arithmetic):
    """Every product and reduction in one order fixed by the row (:data:`INVARIANT`):
    Triton with ``kernels``, else PyTorch in fixed-shape chunks."""

    invariant = True

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, kernels: bool = False
    ) -> torch.Tensor:
        from ..kernels.invariant import linear

        return linear(x, w, b, kernel=kernels)

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        from ..kernels.invariant import rows_fixed

        return rows_fixed(fn, x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(F.silu, x)

    def row_sum(self, w: torch.Tensor) -> torch.Tensor:
        """Left to right (a library reduction may split a row differently for another ``T``)."""
        total = w[:, :1].clone()
        for j in range(1, w.shape[1]):
            total += w[:, j : j + 1]
        return total


PLAIN = Arithmetic()
INVARIANT = InvariantArithmetic()


def arithmetic(batch_invariant: bool) -> Arithmetic:
    return INVARIANT if batch_invariant else PLAIN


class SummedBy:
    """A layer that sums its products by an :class:`Arithmetic`: ``arith``, set once at load
    (``set_batch_invariant``)."""

    arith: Arithmetic = PLAIN

    @property
    def batch_invariant(self) -> bool:
        return self.arith.invariant


class ExpertsMethod:
    """Routed experts as the module's own ``w13`` [E, 2I, H] and ``w2`` [E, H, I] (bf16 or the
    model's dtype): :class:`Bf16Experts`. Subclasses hold quantized copies instead."""

    name = "bf16"
    param_bytes: float | None = None  # bytes per weight with its scales; None: the model dtype's

    def kernel_weights(self, experts: Experts) -> tuple[KernelWeight, KernelWeight]:
        """``(w13, w2)`` as the fused kernel takes them."""
        return experts.w13, experts.w2

    def slot_state(self, experts: Experts) -> list[torch.Tensor]:
        """The tensors that hold the experts, one row per slot."""
        return [experts.w13.data, experts.w2.data]

    def with_slot_state(self, experts: Experts, state: list[torch.Tensor]) -> ExpertsMethod:
        """This method over ``state`` (laid out as :meth:`slot_state`)."""
        experts.w13 = torch.nn.Parameter(state[0], requires_grad=False)
        experts.w2 = torch.nn.Parameter(state[1], requires_grad=False)
        return self

    def ffn(self, experts: Experts, x: torch.Tensor, arith: Arithmetic) -> tuple[Ffn, int]:
        """The reference per-expert FFN and the number of experts it holds."""
        return _swiglu(experts.w13, experts.w2, arith), experts.w13.shape[0]


def _swiglu(w13: torch.Tensor, w2: torch.Tensor, arith: Arithmetic) -> Ffn:
    """``down(silu(gate) * up)`` of expert ``e`` from the fused ``w13`` / ``w2`` matrices."""

    def ffn(xe: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = arith.linear(xe, w13[e]).chunk(2, dim=-1)
        return arith.linear(arith.silu(gate) * up, w2[e])

    return ffn


class Bf16Experts(ExpertsMethod):
    pass


class QuantizedExperts(ExpertsMethod):
    """Experts held as quantized copies (``w13``, ``w2``), which the fused kernel takes as
    they are; the module's own parameters are freed."""

    def __init__(self, w13: Any, w2: Any) -> None:
        self.w13, self.w2 = w13, w2

    def kernel_weights(self, experts: Experts) -> tuple[KernelWeight, KernelWeight]:
        return self.w13, self.w2


class Fp8Experts(QuantizedExperts):
    """e4m3 experts with one fp32 scale per 128x128 tile of each expert's matrices."""

    name = "fp8"
    param_bytes = 1 + 4 / 128**2  # an e4m3 byte, and an fp32 scale per 128x128 tile
    w13: Fp8Weight
    w2: Fp8Weight

    @classmethod
    def quantize(cls, experts: Experts) -> Fp8Experts:
        from ..kernels.fp8_gemm import quantize_fp8_blocks

        return cls(quantize_fp8_blocks(experts.w13.data), quantize_fp8_blocks(experts.w2.data))

    def slot_state(self, experts: Experts) -> list[torch.Tensor]:
        return [self.w13.q, self.w13.scale, self.w2.q, self.w2.scale]

    def with_slot_state(self, experts: Experts, state: list[torch.Tensor]) -> ExpertsMethod:
        from ..kernels.fp8_gemm import Fp8Weight

        return Fp8Experts(Fp8Weight(state[0], state[1]), Fp8Weight(state[2], state[3]))

    def ffn(self, experts: Experts, x: torch.Tensor, arith: Arithmetic) -> tuple[Ffn, int]:
        """One block-scaled FP8 linear pair per expert hit in plain PyTorch, activations
        quantized as the fused kernels do."""
        from ..kernels.fp8_gemm import Fp8Weight, fp8_linear

        w13, w2 = self.w13, self.w2

        def ffn(xe: torch.Tensor, e: int) -> torch.Tensor:
            gate, up = fp8_linear(xe, Fp8Weight(w13.q[e], w13.scale[e]), kernel=False).chunk(2, -1)
            return fp8_linear(F.silu(gate) * up, Fp8Weight(w2.q[e], w2.scale[e]), kernel=False)

        return ffn, w13.q.shape[0]


class Fp4Experts(QuantizedExperts):
    """e2m1 experts with one scale per 32 weights, dequantized inside the fused kernel's GEMMs
    (the reference dequantizes them whole)."""

    name = "fp4"
    param_bytes = 0.5 + 2 / 32  # an e2m1 nibble, and a 2-byte scale entry per 32 weights
    w13: Fp4Weight
    w2: Fp4Weight

    @classmethod
    def quantize(cls, experts: Experts) -> Fp4Experts:
        from ..kernels.fused_moe import quantize_fp4

        return cls(quantize_fp4(experts.w13.data), quantize_fp4(experts.w2.data))

    def slot_state(self, experts: Experts) -> list[torch.Tensor]:
        return [self.w13.packed, self.w13.scales, self.w2.packed, self.w2.scales]

    def with_slot_state(self, experts: Experts, state: list[torch.Tensor]) -> ExpertsMethod:
        from ..kernels.fused_moe import Fp4Weight

        return Fp4Experts(Fp4Weight(state[0], state[1]), Fp4Weight(state[2], state[3]))

    def ffn(self, experts: Experts, x: torch.Tensor, arith: Arithmetic) -> tuple[Ffn, int]:
        from ..kernels.fused_moe import dequantize_fp4

        w13, w2 = dequantize_fp4(self.w13, x.dtype), dequantize_fp4(self.w2, x.dtype)
        return _swiglu(w13, w2, PLAIN), w13.shape[0]


BF16_EXPERTS = Bf16Experts()
