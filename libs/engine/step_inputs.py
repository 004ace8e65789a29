"""A scheduled step's inputs on the device: token ids, positions, cache slots, attention metadata.

:class:`EagerInputs` lays out an eager step (prompt chunks and decodes; with the kernels, the
decodes as the contiguous tail the decode kernel reads, with their page tables and lengths;
batch-invariant: every row as a decode row). The helpers beside it are shared with the graph
path (``graphs.py``): host arrays go to the device pinned and non-blocking, and a
:data:`~.scheduler.PLACEHOLDER` id (sampled by the step still in flight) is gathered on the
device from that step's sampled-id tensor, so nothing here waits for the device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from .kv.pinned import to_device
from .model.attention import AttentionMetadata, SeqAttention
from .scheduler import PLACEHOLDER, ScheduledSeq


class InFlight(Protocol):
    """The step still on the device, as a later step reads its sampled ids."""

    @property
    def tokens(self) -> torch.Tensor | None: ...  # [n] int64 on the device

    @property
    def index(self) -> Mapping[str, int]: ...  # request id -> row of ``tokens``


def fill_placeholders(
    ids: torch.Tensor,
    rows: list[int],
    srcs: list[int],
    prev: InFlight | None,
    device: torch.device,
) -> None:
    """``ids[rows]`` = the ids the step in flight sampled at its rows ``srcs``, on the device."""
    if not rows:
        return
    if prev is None or prev.tokens is None:
        raise RuntimeError("a placeholder token without the step that samples it")
    # Pinned + non_blocking: a plain .to() would wait for the step in flight.
    dst = to_device(np.asarray(rows, dtype=np.int64), device)
    src = to_device(np.asarray(srcs, dtype=np.int64), device)
    ids.index_copy_(0, dst, prev.tokens.index_select(0, src))


def fill_page_tables(
    table: np.ndarray, seqs: Sequence[ScheduledSeq], pages: np.ndarray
) -> np.ndarray:
    """Row ``i`` of ``table`` gets the first ``pages[i]`` entries of ``seqs[i]``'s block table
    (entries past them are left as they are), with whole-array operations (a Python loop of
    per-row writes took twice as long for 1,024 rows); returns each row's last page."""
    flat = np.fromiter(
        chain.from_iterable(s.block_table[:k] for s, k in zip(seqs, pages.tolist(), strict=True)),
        np.int64,
        int(pages.sum()),
    )
    ends = np.cumsum(pages)
    rows = np.repeat(np.arange(len(seqs)), pages)
    table[rows, np.arange(len(flat)) - np.repeat(ends - pages, pages)] = flat
    last: np.ndarray = flat[ends - 1]
    return last


class EagerInputs:
    """The inputs of an eager step over the paged cache (module doc). ``num_heads``: the
    model's attention heads (the decode kernel's split count depends on them)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        use_kernels: bool,
        batch_invariant: bool,
        num_heads: int,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.use_kernels = use_kernels
        self.batch_invariant = batch_invariant
        self.num_heads = num_heads

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        return to_device(arr, self.device)

    def prepare(
        self, seqs: list[ScheduledSeq], prev: InFlight | None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(ids, positions, metadata, last row of each sampling seq) for ``seqs`` in order."""
        bs = self.block_size
        n = sum(s.num_tokens for s in seqs)
        ids = np.empty(n, dtype=np.int64)
        pos = np.empty(n, dtype=np.int64)
        slots = np.empty(n, dtype=np.int64)
        fix_rows: list[int] = []
        fix_srcs: list[int] = []
        sample_rows: list[int] = []
        prompt_seqs: list[tuple[int, ScheduledSeq]] = []
        decodes: list[ScheduledSeq] = []
        decode_rows: list[int] = []
        row = 0
        for s in seqs:
            k = s.num_tokens
            ids[row : row + k] = s.token_ids
            p = np.arange(s.start, s.start + k)
            pos[row : row + k] = p
            table = np.asarray(s.block_table, dtype=np.int64)
            slots[row : row + k] = table[p // bs] * bs + p % bs
            if s.token_ids[0] == PLACEHOLDER:
                assert k == 1 and prev is not None, "placeholders are single decode tokens"
                fix_rows.append(row)
                fix_srcs.append(prev.index[s.request_id])
            if k == 1:
                decodes.append(s)
                decode_rows.append(row)
            else:
                prompt_seqs.append((row, s))
            row += k
            if s.sample:
                sample_rows.append(row - 1)
        ids_d = self._to_device(ids)
        fill_placeholders(ids_d, fix_rows, fix_srcs, prev, self.device)
        meta = AttentionMetadata(self._to_device(slots), [], block_size=bs)
        if self.batch_invariant:
            self.describe_rows(meta, seqs, pos + 1)
            return ids_d, self._to_device(pos), meta, sample_rows
        for r0, s in prompt_seqs:
            ctx = s.start + s.num_tokens
            meta.seqs.append(
                SeqAttention(
                    r0,
                    s.num_tokens,
                    self.ctx_slots(s.block_table, ctx),
                    self._to_device(np.arange(s.start, ctx, dtype=np.int64)),
                )
            )
        if decodes:
            self._describe_decodes(meta, decodes, decode_rows, n)
        return ids_d, self._to_device(pos), meta, sample_rows

    def _describe_decodes(
        self,
        meta: AttentionMetadata,
        decodes: list[ScheduledSeq],
        decode_rows: list[int],
        n: int,
    ) -> None:
        """The decode rows' attention: the kernel's page tables and lengths (the decodes the
        last rows of the step), or PyTorch's padded slots and mask."""
        bs, dev = self.block_size, self.device
        lens = np.array([s.start + 1 for s in decodes], dtype=np.int32)
        if self.use_kernels:
            from .kernels.mla_decode import TABLE_ALIGN, choose_num_splits

            pages = -(-lens.astype(np.int64) // bs)
            width = -(-int(pages.max()) // TABLE_ALIGN) * TABLE_ALIGN  # one stride class
            table = np.zeros((len(decodes), width), dtype=np.int32)
            fill_page_tables(table, decodes, pages)
            meta.decode_start = n - len(decodes)
            meta.block_table = self._to_device(table)
            meta.seq_lens = self._to_device(lens)
            meta.num_splits = choose_num_splits(len(decodes), self.num_heads, int(lens.max()))
        else:
            width = int(lens.max())
            padded = torch.zeros(len(decodes), width, dtype=torch.int64)
            for i, s in enumerate(decodes):
                padded[i, : lens[i]] = self.ctx_slots(s.block_table, int(lens[i]), "cpu")
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.int64, device=dev)
            meta.decode_slots = padded.to(dev)
            meta.decode_mask = (torch.arange(width)[None, :] < torch.from_numpy(lens)[:, None]).to(
                dev
            )

    def describe_rows(
        self, meta: AttentionMetadata, seqs: list[ScheduledSeq], lens: np.ndarray
    ) -> None:
        """Batch-invariant steps: every row, prompt or decode, as a decode row of the kernel's
        layout (its sequence's block table, context length ``position + 1``), one split."""
        bs = self.block_size
        width = int(-(-int(lens.max()) // bs))
        table = np.zeros((len(lens), width), dtype=np.int32)
        row = 0
        for s in seqs:
            nb = min(width, len(s.block_table))
            table[row : row + s.num_tokens, :nb] = np.asarray(s.block_table[:nb], dtype=np.int32)
            row += s.num_tokens
        meta.decode_start = 0
        meta.block_table = self._to_device(table)
        meta.seq_lens = self._to_device(lens.astype(np.int32))
        meta.num_splits = 1

    def ctx_slots(
        self, table: tuple[int, ...], n: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        bs = self.block_size
        nb = -(-n // bs)
        t = np.asarray(table[:nb], dtype=np.int64)
        slots = (t[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)[:n]
        if device is not None and torch.device(device).type == "cpu":
            return torch.from_numpy(slots)
        return self._to_device(slots)
