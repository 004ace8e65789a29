"""A checkpoint directory's tensors as a stream, shards read in parallel (no model knowledge):
what the V3 loader (``loader.py``) and the V4 loader (``v4/load.py``) both read through.

:func:`stream_tensors` keeps ``workers`` shards in flight on threads
(:class:`~.shard_reader.ShardReader`) while the caller's thread places the shard before; on a
CUDA device each tensor is copied from page-locked memory without blocking, so the copies
overlap the next shards' reads. Each weight comes with its ``weight_scale_inv`` (block-scaled
FP8 or FP4), which may sit in a later shard than the weight: the shards' headers are read first
(a few KB each), so a weight whose scale is still to come waits for it, whatever its dtype.
Progress goes to the log and, if given, to a :data:`~.load_progress.ProgressSink`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .load_progress import LoadProgress, ProgressSink
from .shard_reader import ShardReader, read_header

DEFAULT_READ_WORKERS = 4  # shards read at once (shard_reader.py: what each one holds)
SCALE = "_scale_inv"
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded as given (fatal; the message says why)."""


def weight_files(path: Path) -> list[Path]:
    """A checkpoint directory's safetensors shards: the index's, else every one there."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"index names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path}")
    return files


def stream_tensors(
    path: Path,
    wanted: Callable[[str], bool] = lambda name: True,
    workers: int = DEFAULT_READ_WORKERS,
    device: torch.device | None = None,
    progress: ProgressSink | None = None,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """Yield (name, tensor, its ``weight_scale_inv`` or None) for every ``wanted`` tensor that
    is not a scale, shards read ``workers`` at a time (pinned for a CUDA ``device``). Tensors
    are on ``device`` already where it is CUDA (copied without blocking); otherwise views of
    the files, for the caller to copy. Logs each shard as it is done -- bytes read, GB/s,
    progress -- and the whole load; ``progress`` hears the same (before the first shard, then
    after each)."""
    files = weight_files(path)
    sizes = [f.stat().st_size for f in files]
    if device is not None and device.type != "cuda":
        device = None  # tensors stay where they were read; the caller copies them
    cuda = device is not None

    def wanted_or_scale(name: str) -> bool:
        return wanted(name.removesuffix(SCALE)) if name.endswith(SCALE) else wanted(name)

    # Weights whose scale the checkpoint holds (in any shard): they wait for it.
    scaled = {
        e.name.removesuffix(SCALE)
        for f in files
        for e in read_header(f)
        if e.name.endswith(SCALE) and wanted_or_scale(e.name)
    }
    meter = _Meter(path.name, sizes, progress)
    scales: dict[str, torch.Tensor] = {}
    waiting: dict[str, torch.Tensor] = {}

    def kept(t: torch.Tensor) -> torch.Tensor:
        """On the device, or (host) out of the shard's memory: it outlives the shard."""
        return t.to(device, non_blocking=True) if device is not None else t.clone()

    with ShardReader(files, wanted_or_scale, workers, pin=cuda) as reader:
        for shard in reader:
            t0 = time.monotonic()
            for k, t in shard.tensors.items():
                if k.endswith(SCALE):
                    scales[k] = kept(t)
            for k in [k for k in waiting if k + SCALE in scales]:
                yield k, waiting.pop(k), scales[k + SCALE]
            for k, t in shard.tensors.items():
                if k.endswith(SCALE):
                    continue
                if k in scaled and k + SCALE not in scales:
                    waiting[k] = kept(t)
                    continue
                yield k, t.to(device, non_blocking=True) if cuda else t, scales.get(k + SCALE)
            if cuda:
                torch.cuda.current_stream(device).synchronize()  # the buffer is read out
            reader.release(shard)
            meter.shard(shard.path.name, shard.nbytes, shard.seconds, time.monotonic() - t0)
    if waiting:  # cannot happen: every scale named in a header has been read
        raise CheckpointError(f"{next(iter(waiting))}: its {SCALE} was never read")
    meter.finish(workers)


class _Meter:
    """Counts a load's shards and bytes; logs them and tells ``sink``."""

    def __init__(self, source: str, sizes: list[int], sink: ProgressSink | None) -> None:
        self.source, self.sizes, self.sink = source, sizes, sink
        self.start = time.monotonic()
        self.done = self.done_bytes = self.read = 0
        self._tell()

    def _tell(self) -> None:
        if self.sink is not None:
            self.sink(
                LoadProgress(
                    self.source,
                    self.done,
                    len(self.sizes),
                    self.done_bytes,
                    sum(self.sizes),
                    self.read,
                    time.monotonic() - self.start,
                )
            )

    def shard(self, name: str, nbytes: int, read_s: float, placed_s: float) -> None:
        self.done_bytes += self.sizes[self.done]
        self.done += 1
        self.read += nbytes
        log.info(
            "loading %s: shard %d/%d %s: %.2f GB read in %.1f s (%.2f GB/s), placed in "
            "%.1f s; %.1f of %.1f GB in %.0f s",
            self.source,
            self.done,
            len(self.sizes),
            name,
            nbytes / 1e9,
            read_s,
            nbytes / 1e9 / max(read_s, 1e-9),
            placed_s,
            self.done_bytes / 1e9,
            sum(self.sizes) / 1e9,
            time.monotonic() - self.start,
        )
        self._tell()

    def finish(self, workers: int) -> None:
        spent = time.monotonic() - self.start
        log.info(
            "loaded %s: %.2f GB read from %d shard(s) in %.1f s (%.2f GB/s, %d reading at once)",
            self.source,
            self.read / 1e9,
            len(self.sizes),
            spent,
            self.read / 1e9 / max(spent, 1e-9),
            workers,
        )
