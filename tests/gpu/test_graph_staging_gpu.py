"""Graph staging on a CUDA device: the host may run far ahead of the device, and a graph set
may replay several times in one step (the MTP layer once per draft depth). Each replay must
still read the rows staged for it, not a later replay's rows written into the same pinned
staging copy while its transfer was queued behind the device's work.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.engine.engine import Engine, EngineConfig  # noqa: E402
from libs.engine.scheduler import ScheduledSeq  # noqa: E402


def test_each_replay_reads_its_own_rows_while_the_device_is_behind() -> None:
    eng = Engine(
        EngineConfig(
            model="tiny", device="cuda", num_kv_blocks=64, max_running=4, time_budget_s=None
        )
    )
    runner = eng.runner
    assert runner.cuda_graphs and runner.graph_sets["decode"].graphs, "graphs must be captured"
    g = runner.graph_sets["decode"].graphs[4]

    def rows(k: int) -> list[ScheduledSeq]:  # replay k: 4 decode rows with ids 100k + i
        return [
            ScheduledSeq(f"r{i}", k + i, 1, (100 * k + i,), (i,), True, k + i + 1) for i in range(4)
        ]

    seen = []
    torch.cuda._sleep(400_000_000)  # ~0.2 s of device time: every transfer below queues behind it
    for k in range(3):  # the third refills the first one's staging copy
        assert runner.replay("decode", rows(k)) is not None
        seen.append(g.inputs[:4].clone())  # after the replay, on the same stream
    torch.cuda.synchronize()
    assert [s.tolist() for s in seen] == [[100 * k + i for i in range(4)] for k in range(3)]
