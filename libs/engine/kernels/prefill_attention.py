"""Prompt attention through PyTorch's fused scaled-dot-product attention.

The expanded MLA prompt path is ordinary multi-head attention with query/key head dim
``qk_nope + qk_rope`` (192 for DeepSeek-V3) and value head dim 128, which PyTorch's fused
flash kernel already serves, so this wraps it rather than adding a Triton kernel (whole
prefill steps reach 0.56-0.63 MFU on an H200 at 16K-32K tokens; docs/benchmarks.md).
Queries are the last ``L`` positions of an ``S``-token context, so the causal mask is aligned
to the bottom right (query ``i`` sees keys ``0 .. S - L + i``).

Flash attention wants one head dim for q, k and v: on CUDA the values are zero-padded to the
query's head dim (the padded output columns are zero and dropped) unless ``PAD_VALUES`` is off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

PAD_VALUES = True


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q`` [L, H, D], ``k`` [S, H, D], ``v`` [S, H, Dv] with S >= L -> [L, H, Dv]."""
    length, ctx = q.shape[0], k.shape[0]
    dv = v.shape[-1]
    if PAD_VALUES and q.is_cuda and dv != q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if length == ctx:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=causal_lower_right(length, ctx), scale=scale
        )
    return o[0, ..., :dv].transpose(0, 1)
