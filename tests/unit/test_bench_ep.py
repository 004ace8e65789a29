"""``deepserve bench ep`` on the CPU at the smallest sizes: every path measured at every batch
size, the EP paths' greedy tokens equal the single-device path's, the JSON written."""

from __future__ import annotations

import json
from pathlib import Path

from deepserve.cli import main as cli


def test_bench_ep_cpu_compares_the_paths(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ep.json"
    args = ["bench", "ep", "--model", "tiny", "--device", "cpu", "--batch", "2,3"]
    args += ["--steps", "1", "--warmup", "1", "--context", "8", "--redundant", "2"]
    assert cli([*args, "--match-prompts", "2", "--match-tokens", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "ep" and [row["batch"] for row in r["decode"]] == [2, 3]
    for row in r["decode"]:
        for name in ("single", "ep", "ep_redundant"):
            assert row[f"{name}_ms"] > 0
        assert row["ep_over_single"] == row["ep_ms"] / row["single_ms"]
    paths = {p["name"]: p for p in r["paths"]}
    assert paths["ep"]["ep_ranks"] == 1 and paths["ep"]["backend"] == "gloo"
    assert paths["ep"]["slots_per_rank"] == 16 and paths["ep_redundant"]["slots_per_rank"] == 18
    assert paths["single"]["ep_ranks"] is None
    for p in r["paths"]:  # the batch stayed whole while it was timed
        assert [d["running_at_end"] for d in p["decode"]] == [2, 3]
    for m in r["greedy_match"].values():  # fp32 PyTorch experts on both paths: same tokens
        assert m["matching_prefix_tokens"] == m["tokens"] == 4 and m["matching_sequences"] == 2
    assert "ep_redundant" in capsys.readouterr().out


def test_bench_ep_takes_a_v4_model(tmp_path: Path) -> None:
    """V4's experts placed by the family's own config: 8 experts, one spare slot each."""
    out = tmp_path / "ep.json"
    args = ["bench", "ep", "--model", "v4-tiny", "--batch", "2", "--steps", "1", "--warmup", "1"]
    args += ["--context", "8", "--redundant", "1", "--match-prompts", "2", "--match-tokens", "2"]
    assert cli([*args, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    paths = {p["name"]: p for p in r["paths"]}
    assert paths["ep"]["slots_per_rank"] == 8 and paths["ep_redundant"]["slots_per_rank"] == 9
    for m in r["greedy_match"].values():
        assert m["matching_prefix_tokens"] == m["tokens"] == 4
