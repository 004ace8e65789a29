"""Block-scaled weights as DeepSeek releases them, back to full precision, or MXFP4 into the
fused MoE's FP4 layout (:func:`mxfp4_as_kernel_fp4`) (no I/O).

A quantized weight is stored as ``weight`` plus ``weight_scale_inv``, one scale per block of the
[out, in] matrix; the value is ``element * scale`` block by block. What varies:

* the elements: ``float8_e4m3fn`` (V3, R1, V4's dense projections), or FP4 e2m1 packed two to a
  byte (V4's routed experts, MXFP4) -- stored as ``int8``/``uint8`` or
  ``float4_e2m1fn_x2``, the element at an even index in the low nibble, its neighbour in the
  high one; a nibble is a sign bit over the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6;
* the scales: float32 (V3, R1), ``float8_e8m0fnu`` (powers of two: UE8M0), or ``uint8``
  exponent bytes (2^(byte - 127));
* the block: read off the scale grid's shape -- 128x128 tiles, the last row and column of
  tiles partial where the matrix is not a multiple of 128 (V3's ``kv_a_proj_with_mqa``: 576 rows
  under 5 tile rows), or blocks that divide the matrix exactly (MXFP4: 1x32).
"""

from __future__ import annotations

import math

import torch

FP8_TILE = 128
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PACKED_FP4 = {torch.int8, torch.uint8}
if hasattr(torch, "float4_e2m1fn_x2"):
    _PACKED_FP4.add(torch.float4_e2m1fn_x2)


def is_packed_fp4(t: torch.Tensor) -> bool:
    return t.dtype in _PACKED_FP4


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 values a byte -> float32, the last dimension twice as wide."""
    b = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=b.device)
    pairs = torch.stack((lut[(b & 0xF).long()], lut[(b >> 4).long()]), dim=-1)
    return pairs.reshape(*b.shape[:-1], 2 * b.shape[-1])


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as float32 multipliers (``uint8``: UE8M0 exponent bytes)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight`` (e4m3 or packed FP4, [..., out, in]) times its block scales, float32."""
    w = unpack_fp4(weight) if is_packed_fp4(weight) else weight.float()
    s = scale_values(scale)
    rows, cols = w.shape[-2:]
    grid_r, grid_c = s.shape[-2:]
    if (grid_r, grid_c) == (math.ceil(rows / FP8_TILE), math.ceil(cols / FP8_TILE)):
        br = bc = FP8_TILE  # 128x128 tiles, the last ones partial
    elif rows % grid_r == 0 and cols % grid_c == 0:
        br, bc = rows // grid_r, cols // grid_c
    else:
        raise ValueError(
            f"a {rows}x{cols} weight has a {grid_r}x{grid_c} scale grid: neither 128x128 tiles "
            "nor blocks that divide it"
        )
    full = s.repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]
    return w * full


def mxfp4_as_kernel_fp4(
    packed: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 matrix as the release stores it (``packed`` [N, K/2]: two e2m1 codes a byte,
    element ``2i`` in the low nibble; ``scale`` [N, K/32] UE8M0 bytes or float) in the fused
    MoE's FP4 layout (:class:`~libs.engine.kernels.fused_moe.Fp4Weight`: per 64 elements along
    K, byte ``j`` holds element ``j`` low and ``j + 32`` high; bf16 scales, exact for powers
    of two). The codes are the same e2m1 codes, moved: nothing is rounded."""
    b = packed.contiguous().view(torch.uint8)
    n, half = b.shape
    k = 2 * half
    if k % 64 or scale.shape != (n, k // 32):
        raise ValueError(
            f"an MXFP4 weight of {n}x{k} needs K a multiple of 64 and a {n}x{k // 32} scale "
            f"grid, got {tuple(scale.shape)}"
        )
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).view(n, k // 64, 2, 32)
    repacked = codes[:, :, 0] | (codes[:, :, 1] << 4)
    return repacked.reshape(n, half), scale_values(scale).to(torch.bfloat16)
