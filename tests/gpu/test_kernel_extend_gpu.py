"""The varlen extend-attention kernel compiled on a CUDA device at DeepSeek's head dims (128 +
64 keys, 128 values) and 16 / 128 heads, bf16, against fp32 PyTorch on the same inputs
(||out - ref|| / ||ref|| < 1e-2: the kernel rounds probabilities and its output to bf16).
Chunks with and without a cached prefix, one row and longer than a query tile, in one launch."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.engine.kernels.extend_attention import ExtendPlan, extend_attention  # noqa: E402

DN, DR, DV = 128, 64, 128


@pytest.mark.parametrize("heads", [16, 128])
def test_extend_kernel_matches_fp32_attention(heads: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(heads)
    shapes = [(300, 0), (17, 4000), (1, 130), (700, 2500), (64, 64)]  # (new rows, prefix)
    q_len = [n for n, _ in shapes]
    k_len = [n + p for n, p in shapes]
    q_start = [sum(q_len[:i]) for i in range(len(q_len))]
    k_start = [sum(k_len[:i]) for i in range(len(k_len))]
    t, s = sum(q_len), sum(k_len)
    bf = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    qn, qp = torch.randn(t, heads, DN, **bf), torch.randn(t, heads, DR, **bf)
    kv, kpe = torch.randn(s, heads, DN + DV, **bf), torch.randn(s, DR, **bf)
    out = torch.empty(t, heads, DV, device="cuda", dtype=torch.bfloat16)
    scale = (DN + DR) ** -0.5
    extend_attention(qn, qp, kv, kpe, out, ExtendPlan(q_start, q_len, k_len, qn.device), scale)
    for q0, nq, k0, nk in zip(q_start, q_len, k_start, k_len, strict=True):
        sc = torch.einsum(
            "qhd,khd->hqk", qn[q0 : q0 + nq].float(), kv[k0 : k0 + nk, :, :DN].float()
        ) + torch.einsum("qhd,kd->hqk", qp[q0 : q0 + nq].float(), kpe[k0 : k0 + nk].float())
        pos = nk - nq + torch.arange(nq, device="cuda")
        sc = (sc * scale).masked_fill(
            torch.arange(nk, device="cuda")[None, :] > pos[:, None], float("-inf")
        )
        ref = torch.einsum("hqk,khd->qhd", sc.softmax(-1), kv[k0 : k0 + nk, :, DN:].float())
        got = out[q0 : q0 + nq].float()
        assert float((got - ref).norm() / ref.norm()) < 1e-2, (nq, nk)
