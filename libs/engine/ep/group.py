"""One expert-parallel group: this process's rank among N, and the collectives the EP code uses.

The instance initialises ``torch.distributed`` itself (:meth:`EPGroup.init`): gloo on CPU,
NCCL on GPUs, with ``timeout_s`` on every collective, so a rank whose peer died raises (gloo)
or is aborted by the NCCL watchdog instead of waiting forever; the instance then comes back
with the EP size the healthy ranks allow (the service's job, not this module's).

Every method here is a collective: all ranks call it, in the same order, with tensors of the
agreed shapes. Split sizes are always explicit: gloo's list form of all-to-all fails on
unequal sizes, ``all_to_all_single`` with split lists does not.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class EPGroup:
    """``rank`` of ``size`` ranks; collectives run on ``device`` tensors (CPU for gloo)."""

    def __init__(
        self, rank: int, size: int, device: torch.device, timeout_s: float, backend: str
    ) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout_s = timeout_s
        self.backend = backend

    @classmethod
    def init(
        cls,
        rank: int,
        size: int,
        addr: str,
        port: int,
        *,
        device: torch.device | str = "cpu",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> EPGroup:
        """Join the group whose rank 0 serves the rendezvous at ``addr:port`` (TCP store)."""
        return cls._start(
            rank,
            size,
            torch.device(device),
            timeout_s,
            init_method=f"tcp://{addr}:{port}",
        )

    @classmethod
    def single(cls, device: torch.device | str = "cpu", timeout_s: float = 10.0) -> EPGroup:
        """A group of one (in-process store, no sockets): the EP path at N = 1, for tests."""
        store = dist.HashStore()  # type: ignore[attr-defined]
        return cls._start(0, 1, torch.device(device), timeout_s, store=store)

    @classmethod
    def _start(
        cls,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
        *,
        init_method: str | None = None,
        store: Any = None,
    ) -> EPGroup:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            if device.index is None:  # one GPU per rank
                device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=init_method,
            store=store,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )
        log.info(
            "ep: rank %d of %d up (%s, %.0f s collective timeout)", rank, size, backend, timeout_s
        )
        return cls(rank, size, device, timeout_s, backend)

    def set_timeout(self, seconds: float) -> None:
        """From now on every collective of this group waits at most ``seconds`` (a service
        loads with a long timeout, then tightens it once every rank has its model).

        Wraps torch's private ``_set_pg_timeout`` (the default process group is this
        group's): no public API changes a live group's timeout."""
        if seconds <= 0:
            raise ValueError(f"timeout must be positive, got {seconds}")
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=seconds))
        self.timeout_s = seconds

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives --------------------------------------------------------------------------
    def all_to_all(
        self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]
    ) -> torch.Tensor:
        """Rows ``x`` cut by ``send_splits`` (one count per rank, in rank order) go out; the
        rows each rank sent here come back concatenated in rank order."""
        out = x.new_empty((int(sum(recv_splits)), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(recv_splits), list(send_splits))
        return out

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` [N * m] int64, ``m`` numbers meant for each rank; returns the ``m``
        numbers every rank meant for this one, in rank order."""
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous())
        return out

    def all_max(self, values: Sequence[int]) -> list[int]:
        """Element-wise maximum over the ranks (agreeing on flags: any rank has work...)."""
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the ranks (a copy on this group's device)."""
        out = t.to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out
