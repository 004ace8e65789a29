"""The checkpoint stream both loaders read through (V3 ``loader.py``, V4 ``v4/load.py``):
a weight comes with its scale wherever the scale sits, whatever the weight's dtype (V4's FP4
experts are int8), and a load reports its progress from nothing to the whole checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from libs.engine.checkpoint_stream import stream_tensors
from libs.engine.load_progress import LoadProgress


def _checkpoint(root: Path) -> Path:
    """Three shards; ``a.weight`` (packed int8, as V4's FP4) in the first, its scale in the
    last; ``b.weight`` and its scale together in the second."""
    g = torch.Generator().manual_seed(0)
    shards = [
        {"a.weight": torch.randint(-100, 100, (64, 16), generator=g, dtype=torch.int8)},
        {
            "b.weight": torch.randn(32, 32, generator=g),
            "b.weight_scale_inv": torch.ones(1, 1),
            "c.bias": torch.randn(300_000, generator=g),  # 1.2 MB: the shards differ in size
        },
        {"a.weight_scale_inv": torch.rand(64, 1, generator=g)},
    ]
    weight_map = {}
    for i, tensors in enumerate(shards, 1):
        name = f"model-{i:05d}-of-00003.safetensors"
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def test_a_weight_waits_for_its_scale_in_a_later_shard_whatever_its_dtype(
    tmp_path: Path,
) -> None:
    got = {k: (t.clone(), s) for k, t, s in stream_tensors(_checkpoint(tmp_path), workers=2)}
    assert set(got) == {"a.weight", "b.weight", "c.bias"}  # scales come with their weights
    assert got["a.weight"][0].dtype == torch.int8
    assert got["a.weight"][1] is not None and got["a.weight"][1].shape == (64, 1)
    assert got["b.weight"][1] is not None and got["c.bias"][1] is None


@pytest.mark.parametrize("workers", [1, 3])
def test_progress_goes_from_nothing_to_the_whole_checkpoint(tmp_path: Path, workers: int) -> None:
    root = _checkpoint(tmp_path)
    total = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    seen: list[LoadProgress] = []
    for _ in stream_tensors(root, workers=workers, progress=seen.append):
        pass
    assert [p.shards_done for p in seen] == [0, 1, 2, 3]
    assert {p.shards_total for p in seen} == {3} and {p.bytes_total for p in seen} == {total}
    first, last = seen[0], seen[-1]
    assert first.fraction == 0 and first.eta_s is None and not first.done
    assert last.bytes_done == total and last.fraction == 1 and last.done and last.eta_s == 0
    done = [p.bytes_done for p in seen]
    assert done == sorted(done) and 0 < seen[1].fraction < seen[2].fraction < 1
    assert 0 < last.bytes_read <= total and last.read_bytes_per_s > 0
