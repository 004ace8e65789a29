"""The varlen extend-attention kernel (Triton's interpreter on CPU) against plain PyTorch: prompt
chunks over cached prefixes of different lengths in one launch, each row seeing exactly its own
request's context up to its position."""

from __future__ import annotations

import torch

from libs.engine.kernels.extend_attention import ExtendPlan, extend_attention

H, DN, DR, DV = 2, 32, 16, 32


def _reference(qn, qp, kv, kpe, q_start, q_len, k_start, k_len, scale):
    out = torch.zeros(qn.shape[0], H, DV)
    for q0, nq, k0, nk in zip(q_start, q_len, k_start, k_len, strict=True):
        q_n, q_p = qn[q0 : q0 + nq].float(), qp[q0 : q0 + nq].float()
        k_n, v = kv[k0 : k0 + nk, :, :DN].float(), kv[k0 : k0 + nk, :, DN:].float()
        s = torch.einsum("qhd,khd->hqk", q_n, k_n) + torch.einsum(
            "qhd,kd->hqk", q_p, kpe[k0 : k0 + nk].float()
        )
        pos = nk - nq + torch.arange(nq)
        s = (s * scale).masked_fill(torch.arange(nk)[None, :] > pos[:, None], float("-inf"))
        out[q0 : q0 + nq] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def test_chunks_over_prefixes_of_every_length_attend_to_their_own_context() -> None:
    g = torch.Generator().manual_seed(3)
    # (new rows, cached prefix): no prefix, a prefix inside one key tile, across tiles, a chunk
    # longer than a query tile, a one-row chunk
    shapes = [(5, 0), (7, 20), (70, 131), (3, 64), (1, 200)]
    q_len = [n for n, _ in shapes]
    k_len = [n + p for n, p in shapes]
    # the step's rows in a different order from the contexts' (a decode row between them)
    q_start = [90, 0, 10, 81, 84]
    k_start = [sum(k_len[:i]) for i in range(len(k_len))]
    t = 100
    qn = torch.randn(t, H, DN, generator=g)
    qp = torch.randn(t, H, DR, generator=g)
    kv = torch.randn(sum(k_len), H, DN + DV, generator=g)
    kpe = torch.randn(sum(k_len), DR, generator=g)
    scale = DN**-0.5
    out = torch.full((t, H, DV), 7.0)
    extend_attention(
        qn, qp, kv, kpe, out, ExtendPlan(q_start, q_len, k_len, torch.device("cpu")), scale
    )
    ref = _reference(qn, qp, kv, kpe, q_start, q_len, k_start, k_len, scale)
    rows = torch.cat([torch.arange(q0, q0 + n) for q0, n in zip(q_start, q_len, strict=True)])
    torch.testing.assert_close(out[rows], ref[rows], atol=2e-5, rtol=2e-5)
    others = torch.ones(t, dtype=torch.bool)
    others[rows] = False
    assert (out[others] == 7.0).all(), "rows of no listed request are left as they were"


def test_strided_inputs_as_the_model_passes_them() -> None:
    """Queries split out of one projection, ``k_pe`` a view of the gathered latents: the kernel
    reads the strides, so no copy is needed."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(12, H, DN + DR, generator=g)
    ctx = torch.randn(40, 64 + DR, generator=g)
    kv = torch.randn(40, H, DN + DV, generator=g)
    qn, qp = q.split([DN, DR], dim=-1)
    kpe = ctx[:, 64:]
    out = torch.empty(12, H, DV)
    plan = ExtendPlan([0, 4], [4, 8], [10, 30], torch.device("cpu"))
    extend_attention(qn, qp, kv, kpe, out, plan, 0.2)
    ref = _reference(qn, qp, kv, kpe, [0, 4], [4, 8], [0, 10], [10, 30], 0.2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_the_plan_s_index_arrays_start_16_bytes_apart_for_any_count() -> None:
    # Triton specializes a kernel on each pointer's 16-byte alignment: arrays placed after
    # counts that vary step by step would compile new kernels mid-serving.
    for n in range(1, 9):
        for rows in (1, 63, 64, 65, 130):
            plan = ExtendPlan(
                list(range(n)), [rows] * n, [rows + 3] * n, torch.device("cpu"), block_m=64
            )
            views = (plan.q_start, plan.q_len, plan.k_start, plan.k_len)
            k_start = [(rows + 3) * i for i in range(n)]
            assert [v.tolist() for v in views] == [
                list(range(n)),
                [rows] * n,
                k_start,
                [rows + 3] * n,
            ]
            for v in (*views, plan.tile_seq, plan.tile_row):
                assert v.data_ptr() % 16 == 0
            assert plan.tile_seq.numel() == plan.num_tiles == n * -(-rows // 64)
