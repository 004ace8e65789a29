"""``deepserve bench load`` on a tiny release: every figure present, the loader's bytes counted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deepserve.bench.load import V2_LITE_CONFIG, add_arguments, main
from deepserve.bench.release import V3, synthetic_state, write_release

TINY = {
    **V2_LITE_CONFIG,
    "model_type": "deepseek_v3",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "vocab_size": 256,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "num_attention_heads": 2,
    "kv_lora_rank": 64,
    "q_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}


def test_bench_load_reports_the_loader_against_the_raw_read(tmp_path: Path, capsys) -> None:
    path = write_release(tmp_path / "v3", V3, TINY, synthetic_state(TINY), shards=3)
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "load.json"
    args = p.parse_args(["--model", str(path), "--workers", "2", "--json", str(out)])
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["checkpoint"]["files"] == 3 and result["device"] == "cpu"
    assert result["raw_read_cold"]["gb_s"] > 0 and result["raw_read_warm"]["workers"] == 2
    runs = {(r["page_cache"], r["read_workers"]) for r in result["loader"]}
    assert runs == {("cold", 1), ("cold", 2), ("warm", 1), ("warm", 2)}
    assert all(r["gb_s"] > 0 and r["vs_raw"] > 0 for r in result["loader"])
    assert "the raw read" in capsys.readouterr().out
