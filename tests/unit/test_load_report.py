"""Loading a checkpoint is visible while it happens (issue 37): the loader's progress becomes
the ``LoadStatus`` an instance publishes and the row the ``/status`` page shows -- from nothing
to the whole checkpoint, then loaded (or failed, with why) -- and gauges on its ``/metrics``;
and ``--read-workers`` reaches the loader of either model family."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.common import subjects
from libs.engine import loader
from libs.engine.checkpoint_stream import stream_tensors
from libs.engine.load_progress import LoadProgress
from libs.engine.v4 import load as v4_load
from libs.proto.deepserve.v1 import control_pb2
from libs.serving.engines import build_engine
from libs.serving.load_report import LoadReport, publish_load
from libs.serving.model_flags import add_model_flags, model_flags_from
from services.recipe.status import Counters, StatusBoard

from .test_checkpoint_stream import _checkpoint
from .test_hub_models import HF_CONFIG


def _loading_rows(board: StatusBoard, t: float) -> list[dict[str, Any]]:
    """What ``/status.json`` says after a collector tick at ``t``."""
    board.tick(Counters(t, 0, 0, 0, 0, 0), [], [], [], (True, "connected"))
    rows: list[dict[str, Any]] = board.snapshot()["loading"]
    return rows


def _gauges(report: LoadReport) -> dict[str, float]:
    return {m.name: m.samples[0].value for m in report.collector().collect()}


def test_a_load_shows_on_the_status_page_from_nothing_to_loaded(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path)
    total = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    clock = [0.0]
    board = StatusBoard(interval=1.0, clock=lambda: clock[0], wall=lambda: 1e9)
    report = LoadReport("prefill-7", "prefill", "deepseek-test")
    assert _gauges(report)["deepserve_model_load_fraction"] == 0.0
    rows: list[dict[str, Any]] = []
    lines: list[str] = []

    def publish(progress: LoadProgress) -> None:  # what the instance sends, as it goes
        report(progress)
        lines.append(report.line())  # /readyz's reason meanwhile
        board.observe_load(report.message())
        clock[0] += 0.5
        rows.extend(_loading_rows(board, clock[0]))

    for _ in stream_tensors(root, workers=2, progress=publish):
        pass
    assert [r["shards_done"] for r in rows] == [0, 1, 2, 3]
    assert [r["fraction"] for r in rows][0] == 0 and rows[-1]["fraction"] == 1
    assert [r["fraction"] for r in rows] == sorted(r["fraction"] for r in rows)
    assert {r["state"] for r in rows} == {"loading"}
    assert {(r["id"], r["role"], r["model"], r["source"]) for r in rows} == {
        ("prefill-7", "prefill", "deepseek-test", root.name)
    }
    assert rows[-1]["bytes_done"] == rows[-1]["bytes_total"] == total
    assert rows[0]["eta_s"] is None and rows[-1]["read_bytes_per_s"] > 0
    assert "(1/3 shards, " in lines[1] and lines[1].startswith("loading the model: ")
    assert lines[-1].startswith("weights loaded (3 shards, ")

    report.finish()  # the engine is built: one last message
    board.observe_load(report.message())
    (row,) = _loading_rows(board, clock[0] + 1)
    assert (row["state"], row["fraction"], row["error"]) == ("loaded", 1.0, "")
    assert _gauges(report)["deepserve_model_load_fraction"] == 1.0
    clock[0] += 40
    assert _loading_rows(board, clock[0]) == []  # forgotten once it has long loaded


def test_a_failed_load_says_why() -> None:
    board = StatusBoard(interval=1.0, clock=lambda: 5.0)
    report = LoadReport("decode-1", "decode", "deepseek-test")
    report.finish("cannot load model: checkpoint x lacks 3 tensor(s)")
    board.observe_load(report.message())
    (row,) = _loading_rows(board, 5.0)
    assert row["state"] == "failed" and "lacks 3 tensor(s)" in row["error"]
    assert _gauges(report)["deepserve_model_load_fraction"] == 0.0


V4_CONFIG = {**v4_load.V4_PRESETS["v4-tiny"], "model_type": "deepseek_v4", "vocab_size": 512}


class _Stop(Exception):
    """Raised by the stand-in stream once it has seen its arguments."""


@pytest.mark.parametrize("family", ["v3", "v4"])
def test_read_workers_and_the_progress_sink_reach_the_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG if family == "v3" else V4_CONFIG))
    seen: list[tuple[int, object]] = []

    def stream(path: Path, wanted: object = None, workers: int = 4, *a: Any, **kw: Any) -> None:
        seen.append((kw.get("workers", workers), kw.get("progress", a[-1] if a else None)))
        raise _Stop

    monkeypatch.setattr(loader if family == "v3" else v4_load, "stream_tensors", stream)
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    flags = model_flags_from(parser.parse_args(["--model", str(tmp_path), "--read-workers", "3"]))
    report = LoadReport("i", "prefill", "m")
    with pytest.raises(_Stop):
        build_engine(flags, report)
    assert seen == [(3, report)]
    default = model_flags_from(parser.parse_args(["--model", str(tmp_path)]))
    assert default.engine_config().read_workers == 4  # unchanged unless asked
    with pytest.raises(ValueError, match="--read-workers must be positive"):
        model_flags_from(parser.parse_args(["--model", str(tmp_path), "--read-workers", "0"]))


class _Client:
    """What ``publish_load`` needs of a NATS client."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, control_pb2.LoadStatus]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append((subject, control_pb2.LoadStatus.FromString(data)))


async def test_an_instance_publishes_its_progress_until_it_has_loaded() -> None:
    client = _Client()
    connected: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    report = LoadReport("decode-2", "decode", "deepseek-test")
    subject = subjects.load_status("decode", "decode-2")
    task = asyncio.create_task(publish_load(connected, subject, report, logging.getLogger(), 0.01))
    await asyncio.sleep(0.03)
    assert client.sent == []  # nothing before NATS is up
    connected.set_result(client)
    for done in range(3):  # the loader's calls, from its thread in a service
        report(LoadProgress("ckpt", done, 2, done * 100, 200, done * 90, 1.0 + done))
        await asyncio.sleep(0.03)
    report.finish()
    await asyncio.wait_for(task, 1.0)
    assert {s for s, _ in client.sent} == {"ds.load.decode.decode-2"}
    msgs = [m for _, m in client.sent]
    assert [m.shards_done for m in msgs][-1] == 2 and msgs[-1].done
    assert not any(m.done for m in msgs[:-1]) and msgs[0].shards_done < 2
    assert {(m.instance_id, m.role, m.model) for m in msgs} == {
        ("decode-2", "decode", "deepseek-test")
    }


def test_an_ep_rank_hands_its_loader_the_progress_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    """An EP rank builds its engine in ``ep/service.py``: the sink and the flag reach it too."""
    from libs.engine import engine as engine_mod
    from libs.engine.ep import group as group_mod
    from libs.serving.ep import EPFlags, build_rank_engine
    from libs.serving.model_flags import ModelFlags

    seen: list[Any] = []

    def engine(config: Any, **_: Any) -> None:
        seen.append(config)
        raise _Stop

    monkeypatch.setattr(group_mod.EPGroup, "init", staticmethod(lambda *a, **k: object()))
    monkeypatch.setattr(engine_mod, "Engine", engine)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process's, not a rank's
    report = LoadReport("d-r1", "decode", "m")
    ep = EPFlags(size=2, rank=1, rendezvous="127.0.0.1:1")
    with pytest.raises(_Stop):
        build_rank_engine(ModelFlags(model="tiny", read_workers=2), ep, report)
    assert (seen[0].load_progress, seen[0].read_workers) == (report, 2)
