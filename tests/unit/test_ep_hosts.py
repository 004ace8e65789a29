"""One EP group over two "hosts" (issue 36 item 3): two separate ``deepserve generate`` process
trees on this machine, each starting two gloo ranks of one 4-rank group that meets at
``--ep-master``; the host of rank 0 prints the greedy tokens of one engine without EP, the
other prints nothing. And the service flags that say which ranks a host runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepserve.cli import main
from libs.common.sampling import SamplingParams
from libs.engine.engine import Engine, EngineConfig
from libs.engine.llm import LLM
from libs.serving.ep import rank_flags
from libs.serving.ep.launch import free_port
from services.decode.config import build_parser as decode_parser
from services.decode.config import config_from as decode_config

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [(i * 7919 + 3) % 120000 + 3 for i in range(11)]
MAX_TOKENS = 4


def _generate(node: int, master: str) -> list[str]:
    ids = ",".join(map(str, PROMPT))
    return [
        "generate",
        "--model",
        "tiny",
        "--prompt-ids",
        ids,
        "--max-tokens",
        str(MAX_TOKENS),
        "--ignore-eos",
        "--json",
        "--ep",
        "4",
        "--ep-ranks-per-host",
        "2",
        "--ep-node-rank",
        str(node),
        "--ep-master",
        master,
    ]


def test_one_group_on_two_hosts_gives_the_tokens_of_one_engine(tiny_loaded, capsys) -> None:
    engine = Engine(
        EngineConfig(model="tiny", block_size=16, num_kv_blocks=16, time_budget_s=None),
        loaded=tiny_loaded,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    (want,) = LLM(engine=engine).generate([PROMPT], params, decode_text=False)

    master = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    # "Host" 1: a process tree of its own (its own forkserver and rank processes).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    host1 = subprocess.Popen(
        [sys.executable, "-m", "deepserve.cli", *_generate(1, master)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        rc0 = main(_generate(0, master))  # "host" 0, rank 0's rendezvous, in this process
        out1, err1 = host1.communicate(timeout=120)
    finally:
        if host1.poll() is None:
            host1.kill()
            host1.wait()
    out0 = capsys.readouterr().out
    print(f"two hosts x two ranks: {time.monotonic() - t0:.1f}s")
    assert rc0 == 0 and host1.returncode == 0, err1
    assert tuple(json.loads(out0)["token_ids"]) == want.token_ids
    assert out1 == ""  # the output is printed once, by the host of rank 0


def test_a_host_runs_its_own_global_ranks_at_the_shared_master() -> None:
    argv = ["--ep", "4", "--ep-ranks-per-host", "2", "--ep-node-rank", "1"]
    argv += ["--ep-master", "head:29500"]
    cfg = decode_config(decode_parser().parse_args(argv))
    ep = cfg.ep
    assert (ep.hosts, ep.local_ranks, ep.first_rank, ep.supervises) == (2, 2, 2, True)
    flags = rank_flags(
        ep,
        3,
        4,
        rendezvous=ep.master,
        instance_id="d-r3",
        ops_port=1,
        device="cuda",
        own_grpc_port=False,
        gpu=1,
        local_ranks=2,
        node_rank=1,
    )
    rank = decode_config(decode_parser().parse_args([*argv, "--device", "cuda", *flags])).ep
    assert (rank.rank, rank.rendezvous, rank.node_rank) == (3, "head:29500", 1)
    assert flags[flags.index("--device") + 1] == "cuda:1"  # its host's second GPU


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--ep", "4", "--ep-ranks-per-host", "3"], "must divide --ep 4"),
        (["--ep", "4", "--ep-ranks-per-host", "2"], "needs --ep-master host:port"),
        (["--ep", "4", "--ep-ranks-per-host", "2", "--ep-node-rank", "2"], "outside 2 hosts"),
        (["--ep", "2", "--ep-master", "nohost"], "--ep-master must be host:port"),
        (["--ep", "2", "--ep-regrow-s", "0"], "--ep-regrow-s must be positive"),
    ],
)
def test_bad_host_flags_are_refused_with_the_flag_named(argv: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_config(decode_parser().parse_args(argv))
