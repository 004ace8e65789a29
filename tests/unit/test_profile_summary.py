"""scripts/gpu/profile_summary.py: the share of a thread's samples under each function."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "profile_summary.py"
_spec = importlib.util.spec_from_file_location("profile_summary", _PATH)
assert _spec is not None and _spec.loader is not None
profile_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_summary)

RAW = "\n".join(
    [
        "thread (10): engine;Thread.run (t.py:1010);Engine.step (e.py:344);launch (r.py:9) 6",
        "thread (10): engine;Thread.run (t.py:1010);Engine.step (e.py:344);sync (c.py:20) 2",
        "thread (10): engine;Thread.run (t.py:1010);Loop._apply (l.py:372);f (a.py:1);f (a.py:2) 2",
        "thread (7): MainThread;main (svc.py:1);select (selectors.py:468) 5",
    ]
)


def test_each_function_s_share_of_its_thread() -> None:
    threads = profile_summary.summarize(RAW.splitlines())
    total, funcs = threads["thread (10): engine"]
    assert total == 10
    assert funcs["Engine.step"] == 8 and funcs["sync"] == 2
    assert funcs["f"] == 2  # a recursion counts once per sample
    assert threads["thread (7): MainThread"][0] == 5


def test_a_line_that_is_not_py_spy_output_is_refused() -> None:
    with pytest.raises(ValueError, match="not a py-spy raw line"):
        profile_summary.summarize(["Samples: 7503 Errors: 67"])


def test_the_command_prints_largest_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "r.txt"
    record.write_text(RAW)
    assert profile_summary.main([str(record), "--thread", "engine", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "== thread (10): engine: 10 samples"
    assert lines[1].split() == ["100.0%", "Thread.run"]
    assert lines[2].split() == ["80.0%", "Engine.step"]
