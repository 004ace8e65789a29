"""Paged MLA decode attention with absorbed weights (FlashMLA-like, split-KV flash decoding).

One query token per sequence attends over the paged latent cache as is: ``kv_b_proj``'s key
half has been folded into the query (``q_lat``) and its value half is applied by the caller
after attention, so keys and values are the same cached latents.

Shapes: B sequences, H heads, R = ``kv_lora_rank`` (512 for DeepSeek), P = ``qk_rope_head_dim``
(64). For sequence ``b`` with ``L = seq_lens[b]`` context tokens::

    scores[b, h, n] = sm_scale * (q_lat[b, h] . latent[n] + q_pe[b, h] . rope[n])   n < L
    out[b, h]       = softmax_n(scores[b, h]) @ latent[n]

in fp32, written in ``q_lat``'s dtype; rows with ``L == 0`` (CUDA-graph padding) give zeros.
Context token ``n`` of sequence ``b`` lives in cache slot
``block_table[b, n // block_size] * block_size + n % block_size``.

Cache formats:

* bf16 / fp32: one tensor ``kv [num_slots, R + P]``; pass ``latent = kv[:, :R]`` and
  ``rope = kv[:, R:]`` (views; the row strides are used);
* fp8: ``latent [num_slots, R]`` ``float8_e4m3fn`` with a per-token fp32 dequantization scale
  ``kv_scale [num_slots]`` (``latent = latent8.float() * scale``, see
  :func:`quantize_latent_fp8`) and ``rope [num_slots, P]`` bf16. The kernel multiplies each
  token's score by its scale before the softmax and each token's probability by its scale
  before the P @ V product, which equals attending over the dequantized latents. By default
  each latent tile is widened to the query's dtype for bf16 products; that made the kernel
  slower than on a bf16 cache (281 against 193 us per layer at batch 256 x 2K on the H200),
  though it reads half the bytes. With ``fp8_dots`` both products take e4m3 operands, as FP8
  attention kernels do: the query is quantized per head in the kernel (scale = amax / 448)
  and each tile's ``p * scale`` is divided by the tile's largest token scale (times 256, clear
  of e4m3's subnormals) before its e4m3 product, then multiplied back. It stays off
  (:data:`FP8_DOTS`) until the H200 has timed it (``scripts/gpu/bench_mla_decode.py``).

Kernel design: stage 1 runs on the grid ``(cdiv(H, BLOCK_H) * B, num_splits)``, a sequence's
head blocks adjacent (so with V3's 128 heads they share its cache tiles through L2). A program
holds ``BLOCK_H`` heads of one sequence (extra heads masked), so a latent tile loaded once serves
all of them, and it walks its share of the context in ``BLOCK_N``-token tiles
(``BLOCK_N`` divides ``block_size``, so a tile lies in one page and needs one block-table
lookup). Per tile it computes ``S = Q_lat @ K^T + Q_pe @ K_pe^T`` with ``tl.dot``, updates an
online softmax in base 2 (``exp2``, scores pre-multiplied by ``sm_scale * log2(e)``) and
accumulates ``acc [BLOCK_H, R] += P @ K`` in fp32. Each split derives its token range from
``seq_lens`` in the kernel, so the launch depends only on B, H and ``num_splits`` and never
synchronizes with the host (CUDA-graph capturable). With one split stage 1 writes the output
directly; otherwise it writes normalized partial outputs ``[B, H, splits, R]`` and their
base-2 log-sum-exp ``[B, H, splits]`` (fp32 scratch), and stage 2 (grid ``(B, H)``) merges them:
``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s``; empty splits
carry ``lse = -inf`` and weigh nothing.

Constraints: R and P are powers of two >= 16; ``BLOCK_N`` is a power of two >= 16 dividing
``block_size``; ``BLOCK_H`` a power of two >= 16.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..kv.cache import FP8_MAX, quantize_fp8

_LOG2E = 1.4426950408889634
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 32
# Whether an fp8 cache's products take e4m3 operands by default: off until the H200 has timed
# and checked them (written and tested under the interpreter only).
FP8_DOTS = False
# Kernels run on Triton's interpreter (read by Triton when the kernels are decorated).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _attend_tile(
    q_lat,
    q_pe,
    q_scale,
    m_i,
    l_i,
    acc,
    n0,
    end,
    bt_row,
    latent_ptr,
    rope_ptr,
    scale_ptr,
    qk_scale,
    stride_ls,
    stride_lr,
    stride_rs,
    stride_rd,
    stride_scale,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP8_DOTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold context tokens ``[n0, min(n0 + BLOCK_N, end))`` (one page) into the online softmax.

    ``m_i``/``l_i`` are the running base-2 row maxima and sums, ``acc`` the unnormalized
    ``[BLOCK_H, R]`` output; returns their updated values. ``FP8_DOTS``: ``q_lat`` is e4m3
    with per-head scales ``q_scale`` and both latent products run on e4m3 operands.
    """
    offs_r = tl.arange(0, R)
    offs_d = tl.arange(0, P)
    offs_n = tl.arange(0, BLOCK_N)
    page = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
    slots = page * BLOCK_SIZE + (n0 % BLOCK_SIZE) + offs_n
    mask_n = (n0 + offs_n) < end
    k = tl.load(
        latent_ptr + slots[:, None] * stride_ls + offs_r[None, :] * stride_lr,
        mask=mask_n[:, None],
        other=0.0,
    )
    if not FP8_DOTS:
        k = k.to(q_lat.dtype)
    k_pe = tl.load(
        rope_ptr + slots[:, None] * stride_rs + offs_d[None, :] * stride_rd,
        mask=mask_n[:, None],
        other=0.0,
    ).to(q_pe.dtype)

    if FP8_DOTS:
        s_lat = tl.dot(q_lat, tl.trans(k)) * q_scale[:, None]
    else:
        s_lat = tl.dot(q_lat, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_SCALE:
        tok_scale = tl.load(scale_ptr + slots * stride_scale, mask=mask_n, other=0.0)
        s_lat = s_lat * tok_scale[None, :]
    s = s_lat + tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
    s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if HAS_SCALE:
        p = p * tok_scale[None, :]
    if FP8_DOTS:
        # p * scale over the tile's largest scale lies in [0, 1]; times 256 (exact) it stays
        # above e4m3's subnormals (2^-6) down to p = 2^-14. Scaled back after the product.
        top = tl.maximum(tl.max(tok_scale, axis=0), 1e-30)
        pv = tl.dot((p * (256.0 / top)).to(k.dtype), k) * (top / 256.0)
    else:
        pv = tl.dot(p.to(k.dtype), k, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _mla_decode_stage1(
    q_lat_ptr,
    q_pe_ptr,
    latent_ptr,
    rope_ptr,
    scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    num_heads,
    num_splits,
    stride_qb,
    stride_qh,
    stride_qr,
    stride_pb,
    stride_ph,
    stride_pd,
    stride_ls,
    stride_lr,
    stride_rs,
    stride_rd,
    stride_scale,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_or,
    stride_lseb,
    stride_lseh,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP8_DOTS: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
):
    """One (sequence, head block, split): online softmax over the split's context tiles.

    ``DIRECT``: a single split, write ``acc / l`` to the final output (``stride_os`` unused);
    otherwise write the normalized partial output and its base-2 log-sum-exp.
    """
    # Head blocks vary fastest: a sequence's head blocks run side by side, so with more heads
    # than one block holds (V3's 128) the second block reads the cache tiles from L2.
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    pid_h = tl.program_id(0) % head_blocks
    pid_b = tl.program_id(0) // head_blocks
    pid_s = tl.program_id(1)

    seq_len = tl.load(seq_lens_ptr + pid_b)
    # Tiles are split evenly (a multiple of BLOCK_N tokens each) so every tile is page-local.
    tiles = tl.cdiv(seq_len, BLOCK_N)
    tokens_per_split = tl.cdiv(tiles, num_splits) * BLOCK_N
    start = pid_s * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_r = tl.arange(0, R)
    offs_d = tl.arange(0, P)

    q_lat = tl.load(
        q_lat_ptr + pid_b * stride_qb + offs_h[:, None] * stride_qh + offs_r[None, :] * stride_qr,
        mask=mask_h[:, None],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + pid_b * stride_pb + offs_h[:, None] * stride_ph + offs_d[None, :] * stride_pd,
        mask=mask_h[:, None],
        other=0.0,
    )
    q_scale = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    if FP8_DOTS:  # per head: scale = amax / 448, as the cache quantizes each token
        q32 = q_lat.to(tl.float32)
        q_scale = tl.maximum(tl.max(tl.abs(q32), axis=1) / 448.0, 1e-30)
        q_lat = (q32 / q_scale[:, None]).to(latent_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, R], dtype=tl.float32)

    bt_row = block_table_ptr + pid_b * stride_bt
    if WHILE_LOOP:  # Triton's interpreter on numpy >= 2.4 rejects tensor bounds in range()
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _attend_tile(
                q_lat,
                q_pe,
                q_scale,
                m_i,
                l_i,
                acc,
                n0,
                end,
                bt_row,
                latent_ptr,
                rope_ptr,
                scale_ptr,
                qk_scale,
                stride_ls,
                stride_lr,
                stride_rs,
                stride_rd,
                stride_scale,
                R,
                P,
                BLOCK_SIZE,
                BLOCK_N,
                HAS_SCALE,
                FP8_DOTS,
                DOT_PRECISION,
            )
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q_lat,
                q_pe,
                q_scale,
                m_i,
                l_i,
                acc,
                n0,
                end,
                bt_row,
                latent_ptr,
                rope_ptr,
                scale_ptr,
                qk_scale,
                stride_ls,
                stride_lr,
                stride_rs,
                stride_rd,
                stride_scale,
                R,
                P,
                BLOCK_SIZE,
                BLOCK_N,
                HAS_SCALE,
                FP8_DOTS,
                DOT_PRECISION,
            )

    has_ctx = l_i > 0.0
    o = acc / tl.where(has_ctx, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + pid_b * stride_ob + offs_h[:, None] * stride_oh + offs_r[None, :] * stride_or
    if DIRECT:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
    else:
        tl.store(o_ptrs + pid_s * stride_os, o, mask=mask_h[:, None])
        lse = tl.where(has_ctx, m_i + tl.log2(tl.where(has_ctx, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + pid_b * stride_lseb + offs_h * stride_lseh + pid_s, lse, mask=mask_h)


@triton.jit
def _mla_decode_combine(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lseb,
    stride_lseh,
    stride_ob,
    stride_oh,
    stride_or,
    R: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Merge one (sequence, head)'s split partial outputs by their base-2 log-sum-exp."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_r = tl.arange(0, R)
    mask_s = offs_s < NUM_SPLITS

    lse = tl.load(
        lse_ptr + pid_b * stride_lseb + pid_h * stride_lseh + offs_s,
        mask=mask_s,
        other=float("-inf"),
    )
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights 0, output 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    w = w / tl.where(denom > 0.0, denom, 1.0)

    base = part_ptr + pid_b * stride_pb + pid_h * stride_ph
    acc = tl.zeros([R], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        w_s = tl.sum(tl.where(offs_s == s, w, 0.0), axis=0)
        acc += w_s * tl.load(base + s * stride_ps + offs_r)
    tl.store(
        out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_r * stride_or,
        acc.to(out_ptr.dtype.element_ty),
    )


def _default_block_h(num_heads: int) -> int:
    return max(16, min(triton.next_power_of_2(num_heads), 64))


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def choose_num_splits(batch: int, num_heads: int, max_seq_len_hint: int, num_sms: int = 132) -> int:
    """Splits of the context per (sequence, head block) so the stage-1 grid fills the GPU.

    Aims at about two waves of programs (``2 * num_sms``): measured on the H200 (V2-Lite
    heads, 2K context), batch 64 runs best with 4 splits (64 us vs 70 us with 2) and batch 256
    with 1. No split is made shorter than 128 tokens of ``max_seq_len_hint``; at most 32.
    Always a power of two (:data:`SPLITS`, rounded down): the count is a compile-time constant
    of the combining kernel, so every other value compiled a kernel of its own -- on an H100,
    profiled under the chat and agent traces, mid-serving on the engine thread (0.1-1.9 s in
    15 s), whereas these few are compiled by :func:`warm` before an engine serves.
    """
    programs = batch * triton.cdiv(num_heads, _default_block_h(num_heads))
    cap = min(_MAX_SPLITS, max(1, triton.cdiv(max_seq_len_hint, _MIN_TOKENS_PER_SPLIT)))
    n = max(1, min(cap, (2 * num_sms) // programs))
    return 1 << (n.bit_length() - 1)


# Every value choose_num_splits returns.
SPLITS = tuple(1 << i for i in range(_MAX_SPLITS.bit_length()))

# Rows of the eager path's page tables are padded to a multiple of this many pages, so the
# table's row stride keeps one divisibility (Triton specializes integer arguments on it).
TABLE_ALIGN = 16


def warm(
    latent: torch.Tensor,
    rope: torch.Tensor,
    kv_scale: torch.Tensor | None,
    num_heads: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    """Launch the decode kernel once per split count it can be given (:data:`SPLITS`), over
    this cache's tensors (read only), so that each specialization is compiled before the
    engine serves rather than when a batch first needs it."""
    dev = latent.device
    r, p = latent.shape[-1], rope.shape[-1]
    q_lat = torch.zeros(1, num_heads, r, dtype=dtype, device=dev)
    q_pe = torch.zeros(1, num_heads, p, dtype=dtype, device=dev)
    table = torch.zeros(1, TABLE_ALIGN, dtype=torch.int32, device=dev)
    lens = torch.ones(1, dtype=torch.int32, device=dev)
    for n in SPLITS:
        mla_decode(
            q_lat, q_pe, latent, rope, table, lens,
            block_size=block_size, sm_scale=1.0, kv_scale=kv_scale, num_splits=n,
        )  # fmt: skip


# The cache's own quantizer (one per token: scale = amax / 448), under the name the kernel's
# callers and tests use.
quantize_latent_fp8 = quantize_fp8


def unsupported(kv_lora_rank: int, rope_dim: int, block_size: int) -> str | None:
    """Why this kernel cannot serve a model/cache shape, or None when it can."""
    if not (
        _is_pow2(kv_lora_rank) and _is_pow2(rope_dim) and kv_lora_rank >= 16 and rope_dim >= 16
    ):
        return (
            f"kv_lora_rank={kv_lora_rank} and qk_rope_head_dim={rope_dim} "
            "must be powers of two >= 16"
        )
    if not _is_pow2(block_size) or block_size < 16:
        return f"block_size={block_size} must be a power of two >= 16"
    return None


def _check(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    kv_scale: torch.Tensor | None,
) -> None:
    b, h, r = q_lat.shape
    p = q_pe.shape[-1]
    if q_pe.shape[:2] != (b, h) or latent.shape[-1] != r or rope.shape[-1] != p:
        raise ValueError(
            f"shape mismatch: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, "
            f"latent {tuple(latent.shape)}, rope {tuple(rope.shape)}"
        )
    if latent.shape[0] != rope.shape[0]:
        raise ValueError("latent and rope must cover the same slots")
    if block_table.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError("block_table / seq_lens batch does not match q_lat")
    if (latent.dtype == torch.float8_e4m3fn) != (kv_scale is not None):
        raise ValueError("an fp8 latent cache needs kv_scale, and only an fp8 one takes it")
    if not (_is_pow2(r) and _is_pow2(p) and r >= 16 and p >= 16):
        raise ValueError(f"R={r} and P={p} must be powers of two >= 16")
    if not _is_pow2(block_size) or block_size < 16:
        raise ValueError(f"block_size={block_size} must be a power of two >= 16")


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    sm_scale: float,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    fp8_dots: bool | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode attention over the paged cache (see the module docstring).

    ``q_lat [B, H, R]``, ``q_pe [B, H, P]`` (any strides), ``latent [S, R]``, ``rope [S, P]``
    (row-strided views), ``block_table`` int32 ``[B, max_blocks]``, ``seq_lens`` int32 ``[B]``,
    ``kv_scale [S]`` fp32 for an fp8 ``latent``. ``num_splits`` defaults to
    :func:`choose_num_splits` with the block table's capacity as the length hint. ``out``
    ``[B, H, R]`` (any strides, ``q_lat``'s dtype) receives the result. ``config`` overrides
    the launch parameters ``BLOCK_N`` (default ``min(32, block_size)``), ``BLOCK_H``,
    ``num_warps`` and ``num_stages``. ``fp8_dots`` (an fp8 ``latent`` only; default
    :data:`FP8_DOTS` for one): both latent products on e4m3 operands (see the module
    docstring); off, each latent tile is widened to ``q_lat``'s dtype first. No host
    synchronization: graph-capturable.
    """
    _check(q_lat, q_pe, latent, rope, block_table, seq_lens, block_size, kv_scale)
    fp8 = latent.dtype == torch.float8_e4m3fn
    if fp8_dots is None:
        fp8_dots = fp8 and FP8_DOTS
    if fp8_dots and not fp8:
        raise ValueError("fp8_dots takes an fp8 latent cache")
    b, h, r = q_lat.shape
    p = q_pe.shape[-1]
    cfg = dict(config or {})
    block_n = int(cfg.pop("BLOCK_N", min(32, block_size)))
    block_h = int(cfg.pop("BLOCK_H", _default_block_h(h)))
    num_warps = int(cfg.pop("num_warps", 8 if block_h >= 64 else 4))
    num_stages = int(cfg.pop("num_stages", 2))
    if cfg:
        raise ValueError(f"unknown config keys {sorted(cfg)}")
    if not _is_pow2(block_n) or block_n < 16 or block_size % block_n:
        raise ValueError(f"BLOCK_N={block_n} must be a power of two >= 16 dividing {block_size}")
    if not _is_pow2(block_h) or block_h < 16:
        raise ValueError(f"BLOCK_H={block_h} must be a power of two >= 16")
    if num_splits is None:
        num_splits = choose_num_splits(
            b, h, block_table.shape[1] * block_size, _num_sms(q_lat.device)
        )
    if out is None:
        out = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
    elif out.shape != q_lat.shape or out.dtype != q_lat.dtype:
        raise ValueError("out must have q_lat's shape and dtype")

    has_scale = kv_scale is not None
    scale_arg = kv_scale if kv_scale is not None else seq_lens  # dummy pointer, never read
    direct = num_splits == 1
    if direct:
        part, lse = out, seq_lens  # lse pointer unused
        part_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        lse_strides = (0, 0)
    else:
        part = torch.empty(b, h, num_splits, r, device=q_lat.device, dtype=torch.float32)
        lse = torch.empty(b, h, num_splits, device=q_lat.device, dtype=torch.float32)
        part_strides = (part.stride(0), part.stride(1), part.stride(2), part.stride(3))
        lse_strides = (lse.stride(0), lse.stride(1))
    precision = "ieee" if q_lat.dtype == torch.float32 else "tf32"

    grid = (triton.cdiv(h, block_h) * b, num_splits)
    _mla_decode_stage1[grid](
        q_lat,
        q_pe,
        latent,
        rope,
        scale_arg,
        block_table,
        seq_lens,
        part,
        lse,
        sm_scale * _LOG2E,
        h,
        num_splits,
        *q_lat.stride(),
        *q_pe.stride(),
        *latent.stride(),
        *rope.stride(),
        kv_scale.stride(0) if kv_scale is not None else 0,
        block_table.stride(0),
        *part_strides,
        *lse_strides,
        R=r,
        P=p,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        HAS_SCALE=has_scale,
        FP8_DOTS=fp8_dots,
        DIRECT=direct,
        DOT_PRECISION=precision,
        WHILE_LOOP=_INTERPRET,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        _mla_decode_combine[(b, h)](
            part,
            lse,
            out,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            *out.stride(),
            R=r,
            NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 132


def mla_decode_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    sm_scale: float,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch :func:`mla_decode` (gathers every slot, fp32 math); for tests.

    ``num_splits`` is accepted for signature parity and ignored.
    """
    del num_splits
    b, max_blocks = block_table.shape
    pos = torch.arange(max_blocks * block_size, device=block_table.device)
    valid = pos[None, :] < seq_lens[:, None].long()  # [B, L]
    slots = block_table.long()[:, pos // block_size] * block_size + pos % block_size
    slots = torch.where(valid, slots, torch.zeros_like(slots))  # unused table entries may be junk
    lat = latent[slots].float()  # [B, L, R]
    if kv_scale is not None:
        lat = lat * kv_scale[slots].float()[..., None]
    scores = (
        torch.einsum("bhr,blr->bhl", q_lat.float(), lat)
        + torch.einsum("bhd,bld->bhl", q_pe.float(), rope[slots].float())
    ) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: 0, not NaN
    result = torch.einsum("bhl,blr->bhr", probs, lat).to(q_lat.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


__all__ = [
    "FP8_MAX",
    "choose_num_splits",
    "mla_decode",
    "mla_decode_reference",
    "quantize_latent_fp8",
]
