"""Safetensors shards read in parallel, only the bytes a loader wants (no model knowledge).

A DeepSeek-V3 release is 163 shards, 689 GB. Read one tensor at a time through a memory map, a
load runs at the speed of one thread faulting pages in, and every copy waits for its read.
:class:`ShardReader` keeps ``workers`` shards in flight on a thread pool while the caller -- one
thread -- turns the shard before into parameters:

* ``buffered`` (always with ``pin``: a CUDA model): each shard's wanted bytes are read (file
  ``readinto``, which releases the GIL) into a page-locked buffer from a pool of ``workers``
  (allocating pinned memory costs about what copying it does), so the caller's
  ``non_blocking`` copies to the device overlap the next shards' reads; the caller hands a
  shard back (:meth:`ShardReader.release`) once its copies have completed. The buffers are the
  memory this costs: ``workers`` x the largest shard's wanted bytes (about 17 GB at 4 workers
  for V3's 4.3 GB shards).
* otherwise (a host model): tensors are views of a private memory map of the file -- the one
  copy is the caller's, into its parameters, as with ``safe_open`` -- and the workers ask the
  kernel to read the wanted ranges ahead (``posix_fadvise(WILLNEED)``), so the disk reads the
  next shards while the caller copies this one. A buffer would add a second copy as costly as
  the first: on the 2-core host where this was written, memory copies ran at about 1.6 GB/s,
  barely above its disk's 1.3 GB/s.

Only wanted tensors are read (an expert-parallel rank reads its own experts): the header is read
first, wanted tensors' byte ranges sorted and merged where the gap between them is under
:data:`GAP_BYTES` (one longer read costs less than a seek), then read. A range lands in a buffer
at the same offset modulo 8 as in the file, so the tensors -- views, no copy -- keep the
alignment their writer gave them (safetensors writes the widest dtypes first); one that is not
aligned for its dtype is copied out.
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

GAP_BYTES = 1 << 20  # merge two wanted ranges closer than this into one read
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (
    ("F8_E8M0", "float8_e8m0fnu"),
    ("F4", "float4_e2m1fn_x2"),
    ("U16", "uint16"),
    ("U32", "uint32"),
):
    if hasattr(torch, _attr):  # newer dtypes: absent from older torch builds
        _DTYPES[_name] = getattr(torch, _attr)


class ShardFormatError(ValueError):
    """A file that is not a safetensors file this reader understands."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a shard: absolute byte range in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class Shard:
    """One shard's wanted tensors: views into ``buffer``, valid until it is released."""

    path: Path
    tensors: dict[str, torch.Tensor]
    nbytes: int  # bytes read from the file (wanted tensors, and the gaps merged between them)
    seconds: float  # time this shard's reads (pinned) or read-ahead requests took on their thread
    buffer: torch.Tensor | None  # the pinned buffer (returned to the pool on release)


def read_header(path: Path) -> list[Entry]:
    """The tensors of a safetensors file, in file order."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ShardFormatError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > 100 << 20:
            raise ShardFormatError(f"{path}: a {length}-byte header is not a safetensors header")
        try:
            header = json.loads(fh.read(length))
        except ValueError as exc:
            raise ShardFormatError(f"{path}: unreadable header ({exc})") from None
    base = 8 + length
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ShardFormatError(f"{path}: {name} has dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if info["dtype"] == "F4":  # the header counts e2m1 values; torch's dtype holds two a byte
            shape = (*shape[:-1], shape[-1] // 2)
        out.append(Entry(name, dtype, shape, base + start, base + end))
    return sorted(out, key=lambda e: e.start)


def _runs(entries: list[Entry]) -> list[tuple[int, int, list[Entry]]]:
    """Wanted entries merged into (start, end, entries) reads."""
    runs: list[tuple[int, int, list[Entry]]] = []
    for e in entries:
        if runs and e.start - runs[-1][1] <= GAP_BYTES:
            start, _, members = runs[-1]
            runs[-1] = (start, max(runs[-1][1], e.end), [*members, e])
        else:
            runs.append((e.start, e.end, [e]))
    return runs


def _view(raw: torch.Tensor, e: Entry) -> torch.Tensor:
    """``raw`` (uint8 bytes of ``e``) as its tensor; copied out where misaligned."""
    size = torch.empty((), dtype=e.dtype).element_size()
    if raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(e.dtype).view(e.shape)


class ShardReader:
    """Iterate :class:`Shard` s of ``files`` in order, ``workers`` read ahead on threads.

    ``wanted(name)``: whether a tensor is read at all. Use as a context manager (or call
    :meth:`close`) so that reads still in flight are waited for.
    """

    def __init__(
        self,
        files: list[Path],
        wanted: Callable[[str], bool] = lambda name: True,
        workers: int = 4,
        pin: bool = False,
        buffered: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.files, self.wanted, self.workers, self.pin = files, wanted, workers, pin
        self.buffered = buffered or pin
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="shard-read")
        self._buffers: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(workers if pin else 0):
            self._buffers.put(torch.empty(0, dtype=torch.uint8))

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if not self.pin:
            return torch.empty(nbytes, dtype=torch.uint8)
        buf = self._buffers.get()  # waits for a shard the caller has released
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf

    def release(self, shard: Shard) -> None:
        """The caller is done with ``shard`` (its device copies have completed)."""
        shard.tensors.clear()
        if self.pin and shard.buffer is not None:
            self._buffers.put(shard.buffer)
            shard.buffer = None

    def read(self, path: Path) -> Shard:
        """One shard's wanted tensors (runs on a pool thread)."""
        t0 = time.monotonic()
        runs = _runs([e for e in read_header(path) if self.wanted(e.name)])
        nbytes = sum(end - start for start, end, _ in runs)
        if not self.buffered:
            return self._mapped(path, runs, nbytes, t0)
        at, places = 0, []
        for start, end, _ in runs:  # each run at its file offset modulo 8
            at += (start - at) % 8
            places.append(at)
            at += end - start
        buf = self._buffer(at)
        view = memoryview(buf.numpy())  # type: ignore[arg-type]
        tensors: dict[str, torch.Tensor] = {}
        with open(path, "rb", buffering=0) as fh:
            for (start, end, members), place in zip(runs, places, strict=True):
                fh.seek(start)
                got, size = 0, end - start
                while got < size:
                    n = fh.readinto(view[place + got : place + size])
                    if not n:
                        raise ShardFormatError(f"{path}: ends before byte {end}")
                    got += n
                for e in members:
                    lo = place + e.start - start
                    tensors[e.name] = _view(buf[lo : lo + e.end - e.start], e)
        return Shard(path, tensors, nbytes, time.monotonic() - t0, buf)

    def _mapped(
        self, path: Path, runs: list[tuple[int, int, list[Entry]]], nbytes: int, t0: float
    ) -> Shard:
        """Views of a private map of ``path``, its wanted ranges read ahead by the kernel."""
        tensors: dict[str, torch.Tensor] = {}
        if not runs:
            return Shard(path, tensors, 0, time.monotonic() - t0, None)
        with open(path, "rb") as fh:
            if hasattr(os, "posix_fadvise"):
                for start, end, _ in runs:
                    os.posix_fadvise(fh.fileno(), start, end - start, os.POSIX_FADV_WILLNEED)
            size = os.fstat(fh.fileno()).st_size
            if runs[-1][1] > size:
                raise ShardFormatError(f"{path}: ends before byte {runs[-1][1]}")
            # Copy-on-write: writable views (torch warns on read-only ones), the file untouched.
            mapped = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        for _, _, members in runs:
            for e in members:
                tensors[e.name] = _view(whole[e.start : e.end], e)
        return Shard(path, tensors, nbytes, time.monotonic() - t0, None)

    def __iter__(self) -> Iterator[Shard]:
        pending: list[Future[Shard]] = []
        files = iter(self.files)
        for path in files:  # the first `workers` reads start together
            pending.append(self._pool.submit(self.read, path))
            if len(pending) == self.workers:
                break
        while pending:
            shard = pending.pop(0).result()
            nxt = next(files, None)
            if nxt is not None:
                pending.append(self._pool.submit(self.read, nxt))
            yield shard
