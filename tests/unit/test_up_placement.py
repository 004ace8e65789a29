"""``deepserve up --device cuda``: which GPU each engine runs on and how much of it it may use,
and how an engine turns its share into KV blocks. Pure functions: no GPU, no processes."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import pytest

from deepserve import up
from deepserve.placement import (
    EnginePlacement,
    choose_mode,
    parse_gpus,
    place_aggregated,
    place_engines,
    shared_gpus,
)
from deepserve.up import Stack, chosen, default_model_name
from libs.engine.presets import PRESETS
from libs.engine.sizing import (
    kv_blocks_for_fraction,
    step_activation_bytes,
)
from libs.serving.model_flags import ModelFlags, add_model_flags, model_flags_from

GIB = 1 << 30


def devices(placements: list[EnginePlacement]) -> dict[str, tuple[str, float | None]]:
    return {p.name: (p.device, p.gpu_memory_fraction) for p in placements}


# -- placement -------------------------------------------------------------------------------
def test_one_gpu_is_shared_by_prefill_and_decode_at_045_each() -> None:
    assert devices(place_engines(1, 1, [0])) == {
        "prefill-0": ("cuda:0", 0.45),
        "decode-0": ("cuda:0", 0.45),
    }


def test_two_gpus_put_prefill_on_the_first_and_decode_on_the_second() -> None:
    assert devices(place_engines(1, 1, [0, 1])) == {
        "prefill-0": ("cuda:0", 0.9),
        "decode-0": ("cuda:1", 0.9),
    }
    # Two of each on two GPUs: still prefill on one, decode on the other, two per GPU.
    assert devices(place_engines(2, 2, [3, 5])) == {
        "prefill-0": ("cuda:3", 0.45),
        "decode-0": ("cuda:5", 0.45),
        "prefill-1": ("cuda:3", 0.45),
        "decode-1": ("cuda:5", 0.45),
    }


def test_uneven_counts_deal_the_extra_engines_last_and_shares_round_down() -> None:
    placed = place_engines(3, 1, [0, 1])
    assert [p.name for p in placed] == ["prefill-0", "decode-0", "prefill-1", "prefill-2"]
    assert devices(placed) == {
        "prefill-0": ("cuda:0", 0.45),
        "decode-0": ("cuda:1", 0.45),
        "prefill-1": ("cuda:0", 0.45),
        "prefill-2": ("cuda:1", 0.45),
    }
    three = place_engines(2, 1, [0])
    assert {p.gpu_memory_fraction for p in three} == {0.3}
    seven = place_engines(4, 3, [0])
    assert sum(p.gpu_memory_fraction or 0 for p in seven) <= 0.9
    assert {p.gpu_memory_fraction for p in seven} == {0.1285}


def test_a_given_fraction_is_used_as_is_unless_a_gpu_would_be_oversubscribed() -> None:
    assert {p.gpu_memory_fraction for p in place_engines(1, 1, [0], fraction=0.4)} == {0.4}
    with pytest.raises(ValueError, match=r"0.6 x 2 engines on cuda:0 .* at most 0.5"):
        place_engines(1, 1, [0], fraction=0.6)
    with pytest.raises(ValueError, match=r"must lie in \(0, 1\]"):
        place_engines(1, 1, [0], fraction=0.0)


def test_without_gpus_every_engine_is_on_the_cpu_with_no_fraction() -> None:
    placed = place_engines(1, 2)
    assert devices(placed) == {
        "prefill-0": ("cpu", None),
        "decode-0": ("cpu", None),
        "decode-1": ("cpu", None),
    }
    assert placed[0].flags() == ["--device", "cpu"]
    assert place_engines(1, 1, [1])[0].flags() == [
        "--device",
        "cuda:1",
        "--gpu-memory-fraction",
        "0.45",
    ]
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        place_engines(0, 1, [0])


def test_gpus_flag_parses_indices_and_refuses_anything_else() -> None:
    assert parse_gpus("0") == [0] and parse_gpus("1, 0") == [1, 0]
    for bad in ("", "a", "0,,1", "-1", "0.5"):
        with pytest.raises(ValueError, match="--gpus must list GPU indices"):
            parse_gpus(bad)
    with pytest.raises(ValueError, match="names a GPU twice"):
        parse_gpus("0,0")


def test_served_name_defaults_from_the_model() -> None:
    assert default_model_name("tiny") == "deepseek-tiny"
    assert default_model_name("v2-lite") == "deepseek-v2-lite"
    assert default_model_name("/models/DeepSeek-V2-Lite/") == "DeepSeek-V2-Lite"
    assert default_model_name("./ckpt") == "ckpt"


def test_stack_places_engines_on_the_gpus_torch_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Sequence[int] | None] = []

    def two_gpus(asked: Sequence[int] | None = None) -> list[int]:
        seen.append(asked)
        return [0, 1] if asked is None else list(asked)

    monkeypatch.setattr(up, "visible_gpus", two_gpus)
    stack = Stack("unused", device="cuda")  # builds the plan only: nothing starts
    assert devices(stack.placements) == {
        "prefill-0": ("cuda:0", 0.9),
        "decode-0": ("cuda:1", 0.9),
    }
    stack = Stack("unused", device="cuda", gpus=[1], gpu_memory_fraction=0.3)
    assert devices(stack.placements) == {
        "prefill-0": ("cuda:1", 0.3),
        "decode-0": ("cuda:1", 0.3),
    }
    assert seen == [None, [1]]
    assert devices(Stack("unused").placements)["decode-0"] == ("cpu", None)
    with pytest.raises(ValueError, match="apply to --device cuda"):
        Stack("unused", gpus=[0])
    with pytest.raises(ValueError, match="--device must be cpu or cuda"):
        Stack("unused", device="cuda:1")


# -- expert parallelism: N GPUs of its own per instance ---------------------------------------
def test_ep_instances_get_n_gpus_each_in_the_usual_order() -> None:
    placed = place_engines(1, 1, [0, 1, 2, 3], ep={"prefill-0": 2, "decode-0": 2})
    assert [(p.name, p.device, p.ep_gpus, p.gpu_memory_fraction) for p in placed] == [
        ("prefill-0", "cuda", (0, 1), 0.9),
        ("decode-0", "cuda", (2, 3), 0.9),
    ]
    # What the decode process gets: each rank then runs on --device cuda:<its GPU>.
    assert placed[1].flags() == [
        "--device",
        "cuda",
        "--ep-gpus",
        "2,3",
        "--gpu-memory-fraction",
        "0.9",
    ]
    # EP only for decode: prefill keeps one GPU, nobody shares one.
    mixed = place_engines(2, 1, [4, 5, 6, 7], ep={"decode-0": 2}, fraction=0.5)
    assert [(p.name, p.device, p.ep_gpus) for p in mixed] == [
        ("prefill-0", "cuda:4", ()),
        ("decode-0", "cuda", (5, 6)),
        ("prefill-1", "cuda:7", ()),
    ]


def test_too_few_gpus_for_the_ranks_is_refused_naming_the_counts() -> None:
    with pytest.raises(ValueError, match=r"4 ranks = 2 \(prefill-0\) \+ 2 \(decode-0\)"):
        place_engines(1, 1, [0, 1], ep={"prefill-0": 2, "decode-0": 2})
    with pytest.raises(ValueError, match=r"the GPUs are 1 \(0\)"):
        place_engines(1, 1, [0], ep={"decode-0": 2})
    # CPU: gloo ranks share the host, no GPUs involved.
    assert place_engines(1, 1, [], ep={"decode-0": 2})[1] == EnginePlacement("decode-0", "cpu")


def test_stack_deals_ep_ranks_over_gpus_and_refuses_too_few(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(up, "visible_gpus", lambda asked=None: list(asked or [0, 1, 2, 3]))
    stack = Stack("unused", device="cuda", ep=2)  # builds the plan only: nothing starts
    assert {p.name: p.ep_gpus for p in stack.placements} == {
        "prefill-0": (0, 1),
        "decode-0": (2, 3),
    }
    stack = Stack("unused", device="cuda", gpus=[3, 1, 2], ep={"decode": 2})
    assert {p.name: (p.device, p.ep_gpus) for p in stack.placements} == {
        "prefill-0": ("cuda:3", ()),
        "decode-0": ("cuda", (1, 2)),
    }
    with pytest.raises(ValueError, match="each rank needs a GPU of its own"):
        Stack("unused", device="cuda", gpus=[0, 1, 2], ep=2)


# -- the fraction as an engine flag ----------------------------------------------------------
def test_model_flag_overrides_num_kv_blocks_and_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    flags = model_flags_from(
        parser.parse_args(["--device", "cuda:1", "--gpu-memory-fraction", "0.45"])
    )
    cfg = flags.engine_config()
    assert cfg.num_kv_blocks is None and cfg.gpu_memory_fraction == 0.45
    default = model_flags_from(parser.parse_args([])).engine_config()
    assert default.num_kv_blocks == 2048 and default.gpu_memory_fraction is None


def test_model_flag_is_refused_on_the_cpu_and_outside_zero_to_one() -> None:
    with pytest.raises(ValueError, match="applies to CUDA devices.*--num-kv-blocks"):
        ModelFlags(device="cpu", gpu_memory_fraction=0.5)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"must lie in \(0, 1\]"):
            ModelFlags(device="cuda", gpu_memory_fraction=bad)


def test_the_fake_engine_still_builds_with_a_fraction() -> None:
    from libs.serving.engines import build_engine

    engine = build_engine(ModelFlags(model="fake", device="cuda:0", gpu_memory_fraction=0.45))
    assert engine.parts.num_blocks == 4096  # the fake's own cache: no GPU memory to size


# -- KV blocks from the fraction -------------------------------------------------------------
def test_blocks_are_what_is_left_of_the_share_after_weights_and_activations() -> None:
    n = kv_blocks_for_fraction(
        total_bytes=100 * GIB,
        fraction=0.5,
        held_bytes=20 * GIB,
        reserve_bytes=10 * GIB,
        bytes_per_block=GIB // 64,
        block_size=128,
        step_tokens=1024,
    )
    assert n == 20 * 64 - 1  # 20 GiB of 16 MiB blocks, less the cache's scratch block


def test_too_small_a_share_fails_at_start_naming_the_numbers() -> None:
    with pytest.raises(ValueError) as err:
        kv_blocks_for_fraction(
            total_bytes=140 * GIB,
            fraction=0.25,
            held_bytes=31 * GIB,
            reserve_bytes=4 * GIB,
            bytes_per_block=4 << 20,
            block_size=128,
            step_tokens=32768,
        )
    msg = str(err.value)
    assert "0.25 of 140.0 GiB = 35.00 GiB" in msg and "31.00 GiB held" in msg
    assert "4.00 GiB reserved" in msg and "one step needs 256" in msg


def test_activation_reserve_grows_with_the_step_and_the_context() -> None:
    cfg = PRESETS["v2-lite"]

    def reserve(step: int = 32768, rows: int = 256, ctx: int = 163840) -> int:
        return step_activation_bytes(
            cfg, step_tokens=step, sample_rows=rows, context_tokens=ctx, dtype_bytes=2
        )

    assert reserve(step=16384) < reserve() and reserve(ctx=32768) < reserve()
    assert reserve(rows=1) < reserve()
    # v2-lite, 32K-token steps, a 160K context: ~8.7 GiB, above the default path's estimate
    # (5.0 GiB: experts and hidden stream only); 0.45 of an H200 with its 31 GiB of weights
    # still leaves thousands of 3.8 MiB blocks.
    assert 8 * GIB < reserve() < 10 * GIB
    blocks = kv_blocks_for_fraction(
        total_bytes=143771 << 20,
        fraction=0.45,
        held_bytes=int(31.4e9),
        reserve_bytes=reserve(),
        bytes_per_block=int(3.796875 * (1 << 20)),
        block_size=128,
        step_tokens=32768,
    )
    assert 6000 < blocks < 7500


# -- modes -------------------------------------------------------------------------------------
def test_auto_aggregates_exactly_where_the_roles_would_share_a_gpu() -> None:
    assert choose_mode("auto", "cuda", [0], 1, 1) == "aggregated"  # one H100: one engine
    assert choose_mode("auto", "cuda", [0, 1, 2], 2, 2) == "aggregated"
    assert choose_mode("auto", "cuda", [0, 1], 1, 1) == "disaggregated"  # a GPU per role
    assert choose_mode("auto", "cpu", [], 1, 1) == "disaggregated"
    assert choose_mode("auto", "cuda", [0, 1], 1, 1, ep=2) == "disaggregated"
    assert choose_mode("disaggregated", "cuda", [0], 1, 1) == "disaggregated"
    with pytest.raises(ValueError, match="--mode aggregated .* expert parallelism"):
        choose_mode("aggregated", "cuda", [0, 1], 1, 1, ep=2)
    with pytest.raises(ValueError, match="--mode must be one of"):
        choose_mode("both", "cpu", [], 1, 1)


def test_aggregated_is_one_engine_per_gpu_with_the_whole_share() -> None:
    assert devices(place_aggregated(1, [0])) == {"aggregated-0": ("cuda:0", 0.9)}
    assert devices(place_aggregated(5, [2, 3], fraction=0.8)) == {
        "aggregated-0": ("cuda:2", 0.8),
        "aggregated-1": ("cuda:3", 0.8),
    }
    assert devices(place_aggregated(2)) == {
        "aggregated-0": ("cpu", None),
        "aggregated-1": ("cpu", None),
    }
    assert shared_gpus(place_aggregated(1, [0])) == []
    assert shared_gpus(place_engines(1, 1, [0])) == [0]  # where MPS is started


def test_up_on_one_gpu_starts_one_aggregated_engine_and_says_so(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(up, "visible_gpus", lambda asked=None: [0])
    stack = Stack(tmp_path, device="cuda", mode="auto")
    assert stack.mode == "aggregated"
    assert [(p.name, p.device) for p in stack.placements] == [("aggregated-0", "cuda:0")]
    stack.kv_blocks["aggregated-0-x"] = (1000, 128)
    lines = chosen(stack)
    assert lines[0] == "mode aggregated: cuda:0: 1 engine(s) (aggregated-0)"
    assert lines[-1] == "aggregated-0-x: 1000 KV blocks of 128 tokens (128,000 tokens)"
    forced = Stack(tmp_path, device="cuda", mode="disaggregated")
    assert [p.name for p in forced.placements] == ["prefill-0", "decode-0"]


def test_an_aggregated_engine_steps_by_tokens_not_by_a_time_budget() -> None:
    """Its steps mix prompt chunks into the decode batch: 8K prompt tokens a step, no time
    budget (the cost model's factor read fixed host work as slow tokens: module doc of
    services/aggregated/config.py); a prefill or decode engine keeps its 1 s budget."""
    from services.aggregated.config import build_parser, config_from

    agg = config_from(build_parser().parse_args([])).model.engine_config()
    assert (agg.max_tokens_per_step, agg.time_budget_s) == (8192, None)
    p = argparse.ArgumentParser()
    add_model_flags(p)
    plain = model_flags_from(p.parse_args([])).engine_config()
    assert (plain.max_tokens_per_step, plain.time_budget_s) == (32768, 1.0)
    with pytest.raises(ValueError, match="--step-time-budget must be >= 0"):
        model_flags_from(p.parse_args(["--step-time-budget", "-1"]))
