"""EPLB and GPUs in the engine services with --ep: the --eplb flag (and its environment twin)
reaches the rank's engine, the balance gauge each rank exports comes from the engine
thread's stats, and on CUDA each rank gets a GPU of its own (argv, refusals) -- all on a CPU."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.ep.eplb import Balance, EplbConfig
from libs.engine.ep.group import EPGroup
from libs.serving.engine_loop import EngineLoop
from libs.serving.engine_stats import EngineStats
from libs.serving.ep import EPFlags, rank_engine_config, rank_flags
from libs.serving.ep_metrics import EPBalanceCollector
from services.decode.config import build_parser as decode_parser
from services.decode.config import config_from as decode_config
from services.prefill.config import build_parser as prefill_parser
from services.prefill.config import config_from as prefill_config

RANK = ["--ep-rank", "1", "--ep-rendezvous", "127.0.0.1:1234"]
ENGINE = dict(model="tiny", block_size=16, num_kv_blocks=64, time_budget_s=None)


def _decode(*argv: str) -> EPFlags:
    return decode_config(decode_parser().parse_args(list(argv))).ep


def _prefill(*argv: str) -> EPFlags:
    return prefill_config(prefill_parser().parse_args(list(argv))).ep


# -- --eplb ------------------------------------------------------------------------------------
def test_eplb_defaults_to_the_services_role_with_ep_and_off_without() -> None:
    assert _decode("--ep", "2").eplb_config() == EplbConfig.decode()
    assert _prefill("--ep", "2").eplb_config() == EplbConfig.prefill()
    assert _decode().eplb_config() is None  # --ep 1: no EP, nothing to balance
    assert _decode("--ep", "2", "--eplb", "off").eplb_config() is None
    assert _decode("--ep", "2", "--eplb", "prefill").eplb_config() == EplbConfig.prefill()
    tuned = _decode("--ep", "2", "--eplb-window", "50", "--eplb-every", "200").eplb_config()
    assert tuned == EplbConfig(window_steps=50, rebalance_every=200, redundant_per_rank=1)


def test_eplb_has_an_environment_twin_and_bad_values_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEEPSERVE_EPLB", "off")
    assert _decode("--ep", "2").eplb_config() is None
    assert _decode("--ep", "2", "--eplb", "decode").eplb_config() == EplbConfig.decode()
    with pytest.raises(ValueError, match="--eplb must be off, decode or prefill"):
        _decode("--ep", "2", "--eplb", "sometimes")
    with pytest.raises(ValueError, match="--eplb-window and --eplb-every must be >= 0"):
        _decode("--ep", "2", "--eplb-every", "-1")


def test_a_rank_engine_built_with_eplb_decode_balances(tiny_loaded) -> None:
    flags = _decode("--ep", "2", "--eplb", "decode", *RANK)
    model = decode_config(decode_parser().parse_args(["--ep", "2", *RANK])).model
    config = rank_engine_config(model, flags)
    assert config.eplb_config == EplbConfig.decode() and config.device == "cpu"
    group = EPGroup.single()  # the same engine at N = 1, in process
    try:
        engine = Engine(
            EngineConfig(**ENGINE, eplb=config.eplb_config), copy.deepcopy(tiny_loaded), ep=group
        )
        assert engine.eplb is not None and engine.ep_balance() is not None
    finally:
        group.close()
    off = rank_engine_config(model, _decode("--ep", "2", "--eplb", "off", *RANK))
    assert off.eplb_config is None


# -- the gauge ---------------------------------------------------------------------------------
def _scrape(stats: EngineStats) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(EPBalanceCollector(lambda: stats))
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("deepserve_ep_"):
            name, value = line.split()
            out[name] = float(value)
    return out


def test_the_gauge_and_counters_come_from_the_published_stats() -> None:
    balance = Balance(1.3, (1.2, 1.4), 1000, rebalances=2, moved_slots=7, last=None)
    got = _scrape(EngineStats(ep_balance=balance))
    assert got["deepserve_ep_balance_max_mean"] == 1.3
    assert got["deepserve_ep_balance_window_steps"] == 1000
    assert got["deepserve_ep_rebalances_total"] == 2
    assert got["deepserve_ep_moved_slots_total"] == 7
    assert math.isnan(_scrape(EngineStats())["deepserve_ep_balance_max_mean"])


async def test_a_serving_rank_publishes_its_balance_through_the_engine_thread(
    tiny_loaded,
) -> None:
    fast = EplbConfig(window_steps=4, rebalance_every=4, redundant_per_rank=1)
    group = EPGroup.single()
    loop = EngineLoop(
        Engine(EngineConfig(**ENGINE, eplb=fast), copy.deepcopy(tiny_loaded), ep=group)
    )
    loop.start()
    try:
        assert loop.stats.ep_balance is not None and loop.stats.ep_balance.window_steps == 0
        stream = await loop.add("r", [5, 6, 7, 8], SamplingParams(max_tokens=9, ignore_eos=True))
        _ = [ev async for ev in stream]
        await asyncio.sleep(0.05)  # the snapshot after the last step
        got = _scrape(loop.stats)
    finally:
        await loop.close()
        group.close()
    assert got["deepserve_ep_balance_max_mean"] == 1.0  # one rank is always even
    assert got["deepserve_ep_balance_window_steps"] == 4
    assert got["deepserve_ep_rebalances_total"] == 0  # nothing to move on one rank


# -- a GPU of its own per rank -----------------------------------------------------------------
def _flags(ep: EPFlags, rank: int, device: str) -> list[str]:
    return rank_flags(
        ep,
        rank,
        ep.size,
        rendezvous="127.0.0.1:9",
        instance_id=f"d-r{rank}",
        ops_port=1000 + rank,
        device=device,
        own_grpc_port=True,
    )


def test_each_rank_gets_its_own_gpu_from_ep_gpus() -> None:
    ep = _decode("--ep", "2", "--device", "cuda", "--ep-gpus", "2,3")
    argv = _flags(ep, 1, "cuda")
    assert argv[argv.index("--device") + 1] == "cuda:3"
    assert argv[argv.index("--instance-id") + 1] == "d-r1"
    assert argv[-2:] == ["--grpc-port", "0"]
    plain = _decode("--ep", "2", "--device", "cuda")
    assert [_flags(plain, k, "cuda")[-3] for k in (0, 1)] == ["cuda:0", "cuda:1"]
    assert "--device" not in _flags(_decode("--ep", "2"), 1, "cpu")  # gloo: as given


def test_a_rank_process_runs_its_engine_on_its_gpu() -> None:
    # What rank 1 parses: the supervisor's argv plus its own flags (the last --device wins).
    argv = ["--ep", "2", "--device", "cuda", "--ep-gpus", "2,3", *RANK, "--device", "cuda:3"]
    cfg = decode_config(decode_parser().parse_args(argv))
    assert rank_engine_config(cfg.model, cfg.ep).device == "cuda:3"
    assert cfg.ep.eplb_config() == EplbConfig.decode()


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--ep", "2", "--device", "cuda:1"], "puts every rank on one GPU"),
        (["--ep", "3", "--device", "cuda", "--ep-gpus", "0,1"], "each rank needs a GPU"),
        (["--ep", "2", "--device", "cuda", "--ep-gpus", "1,1"], "distinct GPU indices"),
        (["--ep", "2", "--ep-gpus", "0,1"], "applies to --device cuda"),
        (["--device", "cuda", "--ep-gpus", "0"], "applies with --ep > 1"),
        (["--ep", "2", "--device", "cuda", "--ep-gpus", "a,b"], "must list GPU indices"),
    ],
)
def test_ranks_that_would_share_or_lack_a_gpu_are_refused(argv: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_config(decode_parser().parse_args(argv))


def test_a_ranks_log_lines_say_which_rank_wrote_them() -> None:
    import logging

    from libs.serving.ep import tag_rank_logs

    root = logging.getLogger()
    handler = logging.StreamHandler()
    saved = [(h, h.formatter) for h in root.handlers]
    root.addHandler(handler)
    try:
        tag_rank_logs("decode", 1)
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "serving", None, None)
        assert " decode r1 INFO x: serving" in handler.format(record)
    finally:
        root.removeHandler(handler)
        for h, fmt in saved:
            h.setFormatter(fmt)
