"""The parallel shard reader returns exactly what safetensors reads, reads only wanted tensors,
keeps shards in order, and copes with a tensor the writer left misaligned."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from libs.engine.shard_reader import GAP_BYTES, ShardReader, read_header


def _shards(root: Path, n: int) -> list[Path]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tensors = {
            f"s{i}.w": torch.randn(300, 257, generator=g).to(torch.bfloat16),
            f"s{i}.q": torch.randn(129, 131, generator=g).to(torch.float8_e4m3fn),
            f"s{i}.w_scale_inv": torch.rand(2, 2, generator=g),
            f"s{i}.big": torch.randn(1 << 19, generator=g),  # 2 MiB: more than the read gap
            f"s{i}.odd": torch.arange(7, dtype=torch.uint8),
        }
        path = root / f"model-{i + 1:05d}-of-{n:06d}.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        out.append(path)
    return out


@pytest.mark.parametrize("buffered", [False, True])  # mapped (a host model) or read into buffers
def test_every_tensor_as_safetensors_reads_it_in_order(tmp_path: Path, buffered: bool) -> None:
    files = _shards(tmp_path, 5)
    with ShardReader(files, workers=3, buffered=buffered) as reader:
        shards = list(reader)
    assert [s.path for s in shards] == files
    for shard in shards:
        want = load_file(str(shard.path))
        assert shard.tensors.keys() == want.keys()
        for k, t in want.items():
            assert shard.tensors[k].dtype == t.dtype and shard.tensors[k].shape == t.shape
            assert torch.equal(shard.tensors[k].view(torch.uint8), t.view(torch.uint8)), k


def test_only_wanted_tensors_are_read(tmp_path: Path) -> None:
    (path,) = _shards(tmp_path, 1)
    entries = {e.name: e for e in read_header(path)}
    assert entries["s0.big"].end - entries["s0.big"].start > GAP_BYTES
    with ShardReader([path], lambda name: name != "s0.big", workers=1, buffered=True) as reader:
        (shard,) = list(reader)
    assert "s0.big" not in shard.tensors
    assert shard.nbytes < path.stat().st_size - (1 << 21)  # the 2 MiB tensor was skipped


def test_a_misaligned_tensor_is_copied_out(tmp_path: Path) -> None:
    """A hand-written file: 3 bytes, then a bf16 pair at an odd offset."""
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "BF16", "shape": [2], "data_offsets": [3, 7]},
    }
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(
        struct.pack("<Q", len(blob))
        + blob
        + bytes([7, 8, 9])
        + b.view(torch.uint8).numpy().tobytes()
    )
    for buffered in (False, True):
        with ShardReader([path], workers=2, buffered=buffered) as reader:
            (shard,) = list(reader)
        assert shard.tensors["a"].tolist() == [7, 8, 9]
        assert torch.equal(shard.tensors["b"], b)
