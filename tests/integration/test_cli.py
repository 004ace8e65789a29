"""`deepserve generate`, `deepserve bench engine` and `deepserve up`'s flag checks as a user runs
them (real processes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from libs.common.sampling import SamplingParams
from libs.engine.llm import LLM


def deepserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deepserve.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_tokens_and_text_equal_to_the_library(tiny_loaded) -> None:
    out = deepserve(
        "generate", "--model", "tiny", "--prompt-ids", "5,6,7,8,9", "--max-tokens", "6", "--json"
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    from libs.engine.engine import Engine, EngineConfig

    ref = LLM(engine=Engine(EngineConfig(model="tiny"), loaded=tiny_loaded)).generate(
        [[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6)
    )[0]
    assert (
        got["token_ids"] == list(ref.token_ids)
        and got["text"] == ref.text
        and len(got["token_ids"]) == 6
    )


def test_generate_with_text_and_sampling_is_reproducible() -> None:
    args = (
        "generate",
        "--model",
        "tiny",
        "--prompt",
        "Hello, world",
        "--max-tokens",
        "5",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--top-k",
        "40",
        "--seed",
        "11",
        "--json",
    )
    a, b = deepserve(*args), deepserve(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout) == json.loads(b.stdout)


def test_generate_refuses_bad_input_with_a_message() -> None:
    out = deepserve(
        "generate", "--model", "tiny", "--prompt-ids", "1,2,99999999", "--max-tokens", "2"
    )
    assert out.returncode == 2 and "outside the vocabulary" in out.stderr
    out = deepserve("generate", "--model", "tiny", "--prompt-ids", "1,x", "--max-tokens", "2")
    assert out.returncode == 2 and "comma-separated integers" in out.stderr
    out = deepserve("generate", "--model", "/nonexistent", "--prompt-ids", "1", "--max-tokens", "2")
    assert out.returncode == 2 and "neither a preset" in out.stderr


def test_bench_engine_writes_its_figures(tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    out = deepserve(
        "bench",
        "engine",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--prefill-tokens",
        "256",
        "--decode-batches",
        "1,4",
        "--context",
        "128",
        "--decode-steps",
        "3",
        "--json",
        str(path),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(path.read_text())
    assert (
        set(result["decode_tokens_per_s"]) == {"1", "4"}
        and result["prefill_tokens_per_s"]["256"] > 0
    )
    assert 0 < result["decode_roofline_fraction"]["4"] and 0 < result["prefill_mfu"]["256"]


def test_up_help_lists_the_gpu_flags() -> None:
    out = deepserve("up", "--help")
    assert out.returncode == 0, out.stderr
    for name in ("--device", "--gpus", "--gpu-memory-fraction", "--model", "--model-name"):
        assert name in out.stdout, name


def test_up_refuses_bad_gpu_flags_in_one_line_before_starting_anything(tmp_path: Path) -> None:
    import torch

    cases = [
        (["--device", "cuda", "--gpus", "0,x"], "--gpus must list GPU indices"),
        (["--device", "cuda", "--gpus", "0,0"], "--gpus names a GPU twice"),
        (["--gpus", "0"], "--gpus and --gpu-memory-fraction apply to --device cuda"),
        (["--gpu-memory-fraction", "0.5"], "apply to --device cuda"),
        # No GPU here: "no CUDA device is visible"; on a GPU machine: "no GPU 99".
        (["--device", "cuda", "--gpus", "99"], "no CUDA device is visible|no GPU 99"),
    ]
    if not torch.cuda.is_available():  # with a GPU this would start the stack
        cases.append((["--device", "cuda"], "no CUDA device is visible"))
    run_dir = tmp_path / "run"
    for flags, why in cases:
        out = deepserve("up", "--run-dir", str(run_dir), *flags)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (flags, out.stderr)
        assert lines[0].startswith("deepserve up: ") and re.search(why, lines[0]), lines[0]
        assert "starting" not in out.stdout
    assert not run_dir.exists()
