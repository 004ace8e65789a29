"""Prompt attention over cached prefixes for a whole step in one launch (varlen, expanded MLA).

A step's prompt chunks each attend over their request's whole context: the cached prefix and
the chunk itself. The context's latents have been up-projected through ``kv_b_proj`` (one GEMM
for every request of the step), so each head has its own keys ``[k_nope | k_pe]`` and values;
``k_pe`` is one rotated key per token shared by all heads and is read as is, never broadcast.

Shapes: ``T`` query rows and ``S`` context rows of all the step's sequences, H heads, ``DN =
qk_nope_head_dim`` (128 for DeepSeek), ``DR = qk_rope_head_dim`` (64), ``DV = v_head_dim``
(128). Sequence ``b`` has query rows ``q_start[b] .. q_start[b] + q_len[b]`` of ``q_nope``/
``q_pe``/``out``, context rows ``k_start[b] .. k_start[b] + k_len[b]`` of ``kv``/``k_pe``, and
its queries are the context's last ``q_len[b]`` positions: query ``i`` sees context rows
``0 .. k_len - q_len + i`` (causal, aligned to the bottom right)::

    scores[i, h, n] = scale * (q_nope[i, h] . kv[n, h, :DN] + q_pe[i, h] . k_pe[n])
    out[i, h]       = softmax_n(scores[i, h]) @ kv[n, h, DN:]

in fp32 (online softmax in base 2), written in ``out``'s dtype. ``kv`` is ``kv_b_proj``'s
output as it comes, ``[S, H, DN + DV]``.

Kernel design (FlashAttention-2's forward): one program per ``(BLOCK_M`` query rows of one
sequence, head``)``; the host lists the tiles (``tile_seq``, ``tile_row``) so the grid covers
only real rows, longest contexts first. A program walks its sequence's keys in ``BLOCK_N``
tiles up to its last row's position: tiles wholly before its first row need no mask, the
rest (the chunk's diagonal) are masked. This replaces a loop of one fused attention call per
request -- each with its own key/value copies (``k_pe`` broadcast to every head, values padded
to the key's width) -- by one launch per layer whatever the step's requests.

Constraints: DN, DR and DV are powers of two >= 16.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Kernels run on Triton's interpreter (read by Triton when the kernels are decorated).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Tile shapes and launch settings (module-level so scripts/gpu/profile_extend.py can sweep them).
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _key_tile(
    qn, qp, m_i, l_i, acc, n0, free_end, q_pos, KV, KPE, k0, nk, head, qk_scale,
    s_kv_t, s_kv_h, s_kpe_t,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_N`` tile of keys into the online softmax; only the tiles reaching past the
    query tile's first row (its diagonal) are masked."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ctx = (k0 + offs_n).to(tl.int64)
    key_ok = offs_n < nk
    d_n = tl.arange(0, DN)
    d_r = tl.arange(0, DR)
    d_v = tl.arange(0, DV)
    k_n = tl.load(
        KV + ctx[None, :] * s_kv_t + head * s_kv_h + d_n[:, None], mask=key_ok[None, :], other=0.0
    )
    k_r = tl.load(KPE + ctx[None, :] * s_kpe_t + d_r[:, None], mask=key_ok[None, :], other=0.0)
    s = tl.dot(qn, k_n, input_precision=DOT_PRECISION)
    s = (s + tl.dot(qp, k_r, input_precision=DOT_PRECISION)) * qk_scale
    if n0 + BLOCK_N > free_end:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        KV + ctx[:, None] * s_kv_t + head * s_kv_h + DN + d_v[None, :],
        mask=key_ok[:, None],
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    QN,
    QP,
    KV,
    KPE,
    OUT,
    tile_seq,
    tile_row,
    q_start,
    q_len,
    k_start,
    k_len,
    qk_scale,
    s_qn_t,
    s_qn_h,
    s_qp_t,
    s_qp_h,
    s_kv_t,
    s_kv_h,
    s_kpe_t,
    s_o_t,
    s_o_h,
    DN: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seq + tile)
    m0 = tl.load(tile_row + tile)
    q0 = tl.load(q_start + seq)
    nq = tl.load(q_len + seq)
    k0 = tl.load(k_start + seq)
    nk = tl.load(k_len + seq)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < nq
    q_pos = nk - nq + offs_m  # context position of each query row
    d_n = tl.arange(0, DN)
    d_r = tl.arange(0, DR)
    d_v = tl.arange(0, DV)
    rows = (q0 + offs_m).to(tl.int64)
    qn = tl.load(
        QN + rows[:, None] * s_qn_t + head * s_qn_h + d_n[None, :], mask=row_ok[:, None], other=0.0
    )
    qp = tl.load(
        QP + rows[:, None] * s_qp_t + head * s_qp_h + d_r[None, :], mask=row_ok[:, None], other=0.0
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    # keys every row of the tile sees (before its first row) / keys any row sees
    free_end = nk - nq + m0 + 1
    end = tl.minimum(nk, nk - nq + m0 + BLOCK_M)
    if WHILE_LOOP:  # Triton's interpreter on numpy >= 2.4 rejects tensor bounds in range()
        n0 = end * 0
        while n0 < end:
            m_i, l_i, acc = _key_tile(
                qn, qp, m_i, l_i, acc, n0, free_end, q_pos, KV, KPE, k0, nk, head, qk_scale,
                s_kv_t, s_kv_h, s_kpe_t, DN, DR, DV, BLOCK_N, DOT_PRECISION,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(0, end, BLOCK_N):
            m_i, l_i, acc = _key_tile(
                qn, qp, m_i, l_i, acc, n0, free_end, q_pos, KV, KPE, k0, nk, head, qk_scale,
                s_kv_t, s_kv_h, s_kpe_t, DN, DR, DV, BLOCK_N, DOT_PRECISION,
            )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        OUT + rows[:, None] * s_o_t + head * s_o_h + d_v[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None],
    )


def supports(cfg: Any) -> bool:
    """Whether a model's head dims fit the kernel (powers of two >= 16: every DeepSeek MLA)."""
    dims = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    return all(d >= 16 and d & (d - 1) == 0 for d in dims)


class ExtendPlan:
    """The host-side description of one launch: each sequence's rows and the query tiles, made
    once per step (every layer reuses it) from lengths the step already knows."""

    def __init__(
        self,
        q_starts: list[int],
        q_lens: list[int],
        k_lens: list[int],
        device: torch.device,
        block_m: int | None = None,
    ) -> None:
        block_m = block_m or BLOCK_M
        k_starts = [0]
        for n in k_lens[:-1]:
            k_starts.append(k_starts[-1] + n)
        # longest contexts first: their tiles take longest, so they start first
        order = sorted(range(len(q_lens)), key=lambda b: -k_lens[b])
        tiles = [(b, m) for b in order for m in range(0, q_lens[b], block_m)]
        n, t = len(q_lens), len(tiles)
        # Each part starts 16 bytes in (4 int32s): Triton specializes pointers on 16-byte
        # alignment, so parts at offsets that followed the sequence and tile counts made a
        # kernel of their own per remainder -- compiled mid-serving on an H100 (chat trace:
        # 1.9-2.5 s in 15 s of the engine thread).
        pn, pt = -(-n // 4) * 4, -(-t // 4) * 4
        fill_n, fill_t = [0] * (pn - n), [0] * (pt - t)
        rows = [
            *q_starts, *fill_n,
            *q_lens, *fill_n,
            *k_starts, *fill_n,
            *k_lens, *fill_n,
            *(b for b, _ in tiles), *fill_t,
            *(m for _, m in tiles), *fill_t,
        ]  # fmt: skip
        packed = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
        self.q_start, self.q_len, self.k_start, self.k_len = packed[: 4 * pn].view(4, pn)[:, :n]
        self.tile_seq, self.tile_row = packed[4 * pn :].view(2, pt)[:, :t]
        self.num_tiles = t
        self.block_m = block_m


def extend_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    k_pe: torch.Tensor,
    out: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
) -> None:
    """Writes ``out``'s rows of the plan's sequences (see the module's docstring for shapes)."""
    if plan.num_tiles == 0:
        return
    heads = q_nope.shape[1]
    dn, dr, dv = q_nope.shape[-1], q_pe.shape[-1], out.shape[-1]
    assert kv.shape[-1] == dn + dv and kv.shape[1] == heads
    assert q_nope.stride(-1) == q_pe.stride(-1) == kv.stride(-1) == k_pe.stride(-1) == 1
    assert out.stride(-1) == 1
    _extend_kernel[(plan.num_tiles, heads)](
        q_nope,
        q_pe,
        kv,
        k_pe,
        out,
        plan.tile_seq,
        plan.tile_row,
        plan.q_start,
        plan.q_len,
        plan.k_start,
        plan.k_len,
        scale * _LOG2E,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv.stride(0),
        kv.stride(1),
        k_pe.stride(0),
        out.stride(0),
        out.stride(1),
        DN=dn,
        DR=dr,
        DV=dv,
        BLOCK_M=plan.block_m,
        BLOCK_N=BLOCK_N,
        WHILE_LOOP=_INTERPRET,
        # fp32 inputs (the tests' fp32 engines) in full precision, not TF32
        DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
