"""``deepserve bench spec`` on the CPU at the smallest sizes: every mode measured at every batch
and level, the speculative rows' counters consistent with each other, the JSON written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deepserve.bench import spec


def test_bench_spec_reports_every_mode_and_consistent_counters(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    out = tmp_path / "spec.json"
    args = p.parse_args(
        ["--batches", "1,3", "--acceptance", "0.9,0.5", "--speculative-tokens", "2"]
        + ["--prompt-tokens", "12", "--max-tokens", "8", "--json", str(out)]
    )
    assert spec.main(args) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    # One baseline per batch (shared by the levels), two speculative modes per batch and level.
    assert sorted((r["batch"], r["mode"]) for r in rows if r["mode"] == "off") == [
        (1, "off"),
        (3, "off"),
    ]
    assert len(rows) == 2 + 2 * 2 * 2
    for r in rows:
        assert r["output_tokens_per_s"] > 0 and r["decode_steps"] > 0
        assert set(r["graph_replays"]) >= {"decode"}  # none replayed on the CPU
        if r["mode"] == "off":
            continue
        # (a single short request can meet only remapped tokens: none accepted)
        assert 0 <= r["accepted"] <= r["verified"] <= r["drafted"] and r["verified"] > 0
        assert r["acceptance"] == r["accepted"] / r["verified"]
        # Each verification emits its accepted drafts plus one token of its own.
        assert 1 <= r["tokens_per_verification"] <= 1 + r["verified_per_verification"] + 1e-9
        assert r["speedup"] > 0 and r["per_user_speedup"] > 0
    pooled = {}
    for lvl in (0.9, 0.5):
        spec_rows = [r for r in rows if r.get("target_acceptance") == lvl and "accepted" in r]
        pooled[lvl] = sum(r["accepted"] for r in spec_rows) / sum(r["verified"] for r in spec_rows)
    # A head with less of the vocabulary remapped is accepted more often.
    assert pooled[0.9] > pooled[0.5] + 0.1
    assert result["head"] == "confident"  # the default: confidence separates right from wrong
