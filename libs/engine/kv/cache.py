"""Paged KV tensors laid out by a :class:`CacheSpec`, and block (de)serialization."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import block_views, peer
from .layout import CacheSpec
from .pinned import PinnedRows, to_device

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of ``x`` [N, D]: ``(x / scale as e4m3, scale [N] fp32)``.

    ``scale = amax / 448`` per row (a zero row gets the smallest normal scale and stays zero),
    so ``q.float() * scale[:, None]`` approximates ``x``. Plain tensor ops, graph-capturable.
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@dataclass
class LayerCache:
    """One attention layer's pages as the model reads and writes them.

    ``kv`` [slots, r + rope] holds both parts in one dtype (``latent``/``rope`` are column
    views of it); the FP8 layout has e4m3 ``latent`` [slots, r], float32 ``scale`` [slots]
    and bfloat16 ``rope`` [slots, rope] instead (``kv`` is None).
    """

    latent: torch.Tensor
    rope: torch.Tensor
    kv: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.scale is not None

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` [n, r + rope] (latent then rotated key) at ``slots``."""
        if self.kv is not None:
            self.kv.index_copy_(0, slots, values.to(self.kv.dtype))
            return
        assert self.scale is not None
        r = self.latent.shape[1]
        q, scale = quantize_fp8(values[:, :r])
        # Through a byte view: index_copy_ has no float8 kernel on every device.
        self.latent.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
        self.scale.index_copy_(0, slots, scale)
        self.rope.index_copy_(0, slots, values[:, r:].to(self.rope.dtype))

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values at ``slots`` (any index shape) as [..., r + rope] in ``dtype``, dequantized."""
        if self.kv is not None:
            return self.kv[slots].to(dtype)
        assert self.scale is not None
        latent = self.latent.view(torch.uint8)[slots].view(torch.float8_e4m3fn).to(
            torch.float32
        ) * self.scale[slots].unsqueeze(-1)
        return torch.cat((latent.to(dtype), self.rope[slots].to(dtype)), dim=-1)


TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class PagedKVCache:
    """One tensor per paged entry, [(num_blocks + 1) * block_size, *token_shape].

    The extra block after the managed ones is scratch: padding rows of a CUDA-graph batch
    write there (``scratch_slot``), so they never touch a request's pages.

    All entries are views of one byte buffer (``backing``), so another process on this host
    can map the whole pool with one handle (:meth:`share`; :mod:`.peer`) and copy blocks out
    of it without a host round trip: on CUDA through a CUDA IPC handle, on CPU because the
    buffer lives in an anonymous shared-memory file (memfd).
    """

    ALIGN = 256

    def __init__(
        self, spec: CacheSpec, num_blocks: int, device: torch.device, rope_dim: int
    ) -> None:
        self.spec = spec
        self.rope_dim = rope_dim
        self.num_blocks = num_blocks
        self.device = device
        bs = spec.block_size
        self.scratch_slot = num_blocks * bs
        self.offsets, total = pool_offsets(spec, num_blocks, self.ALIGN)
        self.backing = peer.allocate(total, device)
        self.tensors = pool_views(self.backing, spec, num_blocks, self.offsets)
        # The same bytes a block at a time (block_views): exports, imports and peer copies.
        self.blocks = block_views.block_views(self.backing, spec, num_blocks, self.offsets)
        self.layers = self._layer_views()
        self._handle: bytes | None = None
        self._copy_stream: Any = None  # gather_async's device-to-host copies (CUDA)
        self._pinned: PinnedRows | None = None  # gather_async's host buffers (CUDA)

    def _layer_views(self) -> list[LayerCache]:
        by_layer: dict[int, dict[str, torch.Tensor]] = {}
        for entry, t in zip(self.spec.paged, self.tensors):
            by_layer.setdefault(entry.layer, {})[entry.name] = t
        views = []
        for layer in sorted(by_layer):
            parts = by_layer[layer]
            if "mla" in parts:
                kv = parts["mla"]
                r = kv.shape[1] - self.rope_dim
                views.append(LayerCache(kv[:, :r], kv[:, r:], kv=kv))
            else:
                views.append(
                    LayerCache(
                        parts["mla_latent"], parts["mla_rope"], scale=parts["mla_scale"].view(-1)
                    )
                )
        return views

    def _ids(self, blocks: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
        # Not waiting for the step in flight: this runs on the engine thread between steps.
        return to_device(np.asarray(blocks, dtype=np.int64).reshape(-1), device or self.device)

    def _gather(self, blocks: Sequence[int]) -> torch.Tensor:
        """[n, bytes_per_block] uint8 on the cache's device: block-major, entries in order."""
        return block_views.gather(self.blocks, self._ids(blocks))

    def _scatter(self, blocks: Sequence[int], raw: torch.Tensor) -> None:
        block_views.scatter(self.blocks, self._ids(blocks), raw)

    def read_blocks(self, blocks: Sequence[int]) -> bytes:
        """Block-major bytes: for each block, its slice of every entry in spec order."""
        if not blocks:
            return b""
        return self._gather(blocks).cpu().numpy().tobytes()

    def write_blocks(self, blocks: Sequence[int], payload: bytes | memoryview) -> None:
        n = len(blocks)
        if not n:
            return
        bpb = self.spec.bytes_per_block
        if len(payload) != n * bpb:
            raise ValueError(f"payload is {len(payload)} bytes, expected {n} x {bpb}")
        self._scatter(blocks, self.stage([payload]).wait())

    # -- off the engine thread ------------------------------------------------------------------
    def gather_async(self, blocks: Sequence[int]) -> Pending:
        """Start copying ``blocks`` out (engine thread); :meth:`Pending.result` (any thread)
        waits for the copy and returns the bytes :meth:`read_blocks` would.

        On CUDA the blocks are gathered on the engine's stream, then copied to pinned host
        memory on a stream of their own, so the copy overlaps the next steps' kernels: copied
        to pageable memory on the default stream, a request's new blocks (for the kvstore or a
        hand-off) stalled the engine ~76 ms per copy on an H100 at 250 agent sessions."""
        if not blocks:
            return Pending(None, None)
        raw = self._gather(blocks)
        if raw.device.type != "cuda":
            return Pending(raw, None)
        if self._pinned is None:
            self._pinned = PinnedRows(self.spec.bytes_per_block)
        buf = self._pinned.take(len(blocks))  # reused: allocating page-locked memory is slow
        host = buf[: len(blocks)]
        with torch.cuda.device(raw.device):
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            copy = self._copy_stream
            copy.wait_stream(torch.cuda.current_stream(raw.device))
            with torch.cuda.stream(copy):
                host.copy_(raw, non_blocking=True)
                raw.record_stream(copy)  # its memory stays ours until the copy ran
                event = _record(raw.device)
        pool = self._pinned
        return Pending(host, event, lambda: pool.give(buf))

    def stage(self, payloads: Sequence[bytes | memoryview]) -> Staged:
        """Upload whole blocks (``payloads`` joined) to the cache's device: any thread, touches
        no page; :meth:`write_staged` then places them on the engine thread."""
        bpb = self.spec.bytes_per_block
        total = sum(len(p) for p in payloads)
        if total % bpb:
            raise ValueError(f"payload is {total} bytes, not a whole number of {bpb}-byte blocks")
        n = total // bpb
        host = torch.empty((n, bpb), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        flat = host.numpy().reshape(-1)
        pos = 0
        for p in payloads:
            flat[pos : pos + len(p)] = np.frombuffer(p, dtype=np.uint8)
            pos += len(p)
        if self.device.type != "cuda":
            return Staged(host, None)
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(stream):
                dev = host.to(self.device, non_blocking=True)
                event = _record(self.device)
        return Staged(dev, event, keep=host)

    def write_staged(self, blocks: Sequence[int], staged: Staged, start: int = 0) -> None:
        """Write rows ``start .. start + len(blocks)`` of ``staged`` into ``blocks``."""
        if not blocks:
            return
        if staged.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(staged.event)
            staged.raw.record_stream(stream)  # its memory stays ours until the copy ran
        self._scatter(blocks, staged.raw[start : start + len(blocks)])

    # -- another process's pool ------------------------------------------------------------------
    def share(self) -> bytes | None:
        """A handle another process on this host opens with :meth:`open_peer` (None if the
        pool cannot be shared from here)."""
        if self._handle is None:
            self._handle = peer.share(self.backing, self.num_blocks)
        return self._handle

    def open_peer(self, handle: bytes) -> PeerPool:
        """Map another pool of this layout; raises :class:`peer.PeerUnavailable` if it is not
        reachable from this process (another host, another device kind)."""
        backing, num_blocks = peer.open_shared(handle)
        offsets, total = pool_offsets(self.spec, num_blocks, self.ALIGN)
        if backing.numel() < total:
            raise peer.PeerUnavailable(
                f"peer pool is {backing.numel()} bytes; {num_blocks} blocks need {total}"
            )
        views = block_views.block_views(backing, self.spec, num_blocks, offsets)
        return PeerPool(views, num_blocks)

    def copy_from_peer(
        self, src: PeerPool, src_blocks: Sequence[int], dst_blocks: Sequence[int]
    ) -> Any:
        """Copy blocks of another process's pool into ours (enqueued on this device's stream);
        returns an event (None on CPU) that completes when the source may be reused."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError("copy_from_peer needs as many source as destination blocks")
        if not dst_blocks:
            return None
        if any(not 0 <= b < src.num_blocks for b in src_blocks):
            raise ValueError(f"peer block ids must lie in [0, {src.num_blocks})")
        raw = block_views.gather(src.blocks, self._ids(src_blocks, src.blocks[0].device))
        self._scatter(dst_blocks, raw.to(self.device))
        return _record(self.device)


@dataclass
class PeerPool:
    """Another process's pool, mapped into this one (same spec, its own size), as
    :mod:`.block_views`' views."""

    blocks: list[torch.Tensor]
    num_blocks: int


@dataclass
class Staged:
    """Blocks uploaded to the device, ready for :meth:`PagedKVCache.write_staged`."""

    raw: torch.Tensor  # [n, bytes_per_block] uint8
    event: Any  # torch.cuda.Event the upload records, None on CPU
    keep: torch.Tensor | None = None  # the pinned source, alive until the upload is done

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.raw


@dataclass
class Pending:
    """Blocks gathered and being copied to host memory; :meth:`result` waits for the copy and
    returns them as bytes."""

    raw: torch.Tensor | None  # on the host (pinned on CUDA, where ``event`` marks the copy)
    event: Any
    release: Callable[[], None] | None = None  # gives a reused host buffer back, once read
    done: bool = False  # read, and its buffer given back

    def result(self) -> bytes:
        """The blocks' bytes. With ``release``, once: the buffer then goes back to its pool
        (a second read could see another export's blocks, so it raises)."""
        if self.done:
            raise RuntimeError("these blocks were read already; their buffer is reused")
        if self.raw is None:
            return b""
        if self.event is not None:
            self.event.synchronize()
        out = self.raw.numpy().tobytes()
        if self.release is not None:
            self.done, self.raw = True, None
            self.release()
        return out


def _record(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def pool_offsets(spec: CacheSpec, num_blocks: int, align: int) -> tuple[list[int], int]:
    """Byte offset of each entry's tensor in the backing buffer, and the buffer's size."""
    rows = (num_blocks + 1) * spec.block_size
    offsets, pos = [], 0
    for e in spec.paged:
        offsets.append(pos)
        pos += -(-(rows * e.bytes_per_token) // align) * align
    return offsets, max(pos, align)


def pool_views(
    backing: torch.Tensor, spec: CacheSpec, num_blocks: int, offsets: list[int]
) -> list[torch.Tensor]:
    rows = (num_blocks + 1) * spec.block_size
    out = []
    for e, off in zip(spec.paged, offsets):
        raw = backing[off : off + rows * e.bytes_per_token]
        out.append(raw.view(TORCH_DTYPES[e.dtype]).view(rows, *e.token_shape))
    return out
