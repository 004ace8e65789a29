"""The stack as processes: work spreads over several prefill/decode instances, and
``deepserve up`` starts everything, serves, and leaves nothing running after SIGTERM.

(Separate from test_stack.py so that module's shared stack is down before these start:
the machine has two cores.)
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest

from deepserve.procs import free_port
from deepserve.up import REPO_ROOT, RestartPolicy, Stack, StackError

from ..sdk_strict import openai_client, strict_http
from .conftest import MODEL_NAME, AuthorizedStub, grpc_generate, start_stack

pytestmark = pytest.mark.timeout(900)

PROMPT = [(i * 7919 + 1000) % 120000 + 100 for i in range(16)]


def test_requests_spread_over_two_prefill_and_two_decode_instances(tmp_path: Path) -> None:
    stack = start_stack(tmp_path / "run", prefill=2, decode=2)
    try:
        channel = grpc.insecure_channel(stack.grpc_address)
        stub = AuthorizedStub(channel, stack.call_metadata)
        rids = [f"spread-{i}-{uuid.uuid4().hex[:6]}" for i in range(8)]
        outputs = [grpc_generate(stub, PROMPT, 3, request_id=rid).token_ids for rid in rids]
        channel.close()
        assert all(out == outputs[0] for out in outputs), (
            "same prompt, different instances, other tokens"
        )
        # Per instance, from its /metrics: prefill tasks that produced a first token
        # (handed to decode, or finished right there), KV pushes decode accepted.
        counted = {
            "prefill": ("deepserve_prefill_requests_total", {"handed_over", "finished"}),
            "decode": ("deepserve_decode_requests_total", {"accepted"}),
        }
        for role, (metric, outcomes) in counted.items():
            handled = {
                c.name: _counter(c.health_port, metric, outcomes)
                for c in stack.children
                if c.service == role
            }
            assert len(handled) == 2
            assert all(n >= 1 for n in handled.values()), f"a {role} got no work: {handled}"
            if role == "prefill":
                assert sum(handled.values()) == 8, handled
    finally:
        stack.stop()
    # SIGTERM drains: every service exits by itself, with 0, inside the drain time.
    codes = {c.name: c.proc.poll() if c.proc else None for c in stack.children}
    assert all(code == 0 for code in codes.values()), f"exit codes after SIGTERM: {codes}"
    assert stack.nats_proc is None or stack.nats_proc.poll() is not None
    assert stack.redis_proc is None or stack.redis_proc.poll() is not None


def _counter(port: int, name: str, outcomes: set[str]) -> float:
    """Sum of a labelled counter's samples whose ``outcome`` is in ``outcomes``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            if any(f'outcome="{o}"' in labels for o in outcomes):
                total += float(value)
    return total


# -- deepserve up -----------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped) per /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _members_of_groups(pgids: set[int]) -> list[int]:
    """Live pids whose process group is one of ``pgids`` (every child leads its own group)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:  # state, ppid, pgrp
            found.append(int(entry))
    return found


def test_deepserve_up_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("NATS_URL", None)
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deepserve.cli",
            "up",
            "--port",
            str(port),
            "--run-dir",
            str(run_dir),
        ],
        cwd=REPO_ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    pids: dict[str, int] = {}
    try:
        url = ""
        deadline = time.monotonic() + 300
        while not url and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, f"deepserve up exited early:\n{''.join(output)}"
                continue
            if line.startswith("deepserve is up:"):
                url = line.split()[3]
        assert url == f"http://127.0.0.1:{port}/v1", "".join(output)
        assert MODEL_NAME in line
        pids = json.loads((run_dir / "stack.json").read_text())["pids"]
        assert {
            "nats",
            "redis",
            "kvstore",
            "balancer",
            "prefill-0",
            "decode-0",
            "entrypoint",
            "recipe",
        } <= set(pids)
        resp = strict_http(httpx.Client()).get(f"{url}/models", timeout=30)
        assert resp.status_code == 200
        assert MODEL_NAME in [m["id"] for m in resp.json()["data"]]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(output)
        survivors = [name for name, pid in pids.items() if _alive(pid)]
        survivors += [f"pid {p}" for p in _members_of_groups(set(pids.values()))]
        assert not survivors, f"still running after deepserve up exited: {survivors}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in pids.values():  # never leak the children of a failed run
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_deepserve_up_refuses_a_taken_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "deepserve.cli",
                "up",
                "--port",
                str(port),
                "--run-dir",
                str(tmp_path / "run"),
            ],
            cwd=REPO_ROOT,
            text=True,
            capture_output=True,
            timeout=60,
            check=False,
        )
    assert res.returncode != 0
    assert f"port {port}" in res.stderr and "in use" in res.stderr
    assert not (tmp_path / "run" / "stack.json").exists()


def test_stack_reports_a_service_that_dies_while_starting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        Stack(tmp_path / "run", model="no-such-model")  # refused before anything starts
    broken = tmp_path / "broken-checkpoint"  # a config but no weights: engines die loading it
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "deepseek_v3", "vocab_size": 129280}')
    stack = Stack(tmp_path / "run", model=str(broken), ready_timeout=120, drain_seconds=2)
    with pytest.raises(RuntimeError) as err:
        stack.start()
    assert "prefill-0" in str(err.value) or "decode-0" in str(err.value)
    assert all(c.proc is not None and c.proc.poll() is not None for c in stack.children)
    assert stack.nats_proc is not None and stack.nats_proc.poll() is not None
    assert stack.redis_proc is not None and stack.redis_proc.poll() is not None


# -- supervision: restarts ----------------------------------------------------------------------


def _launch_up(port: int, run_dir: Path, *flags: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``deepserve up`` as a process; its output lines collect in the returned list."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("NATS_URL", None)
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepserve.cli", "up", "--port", str(port)]
        + ["--run-dir", str(run_dir), *flags],
        cwd=REPO_ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    output: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)

    threading.Thread(target=pump, daemon=True).start()
    return proc, output


def _wait_for(what: str, check: object, timeout: float, output: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s:\n{''.join(output)}"
        time.sleep(0.2)


def test_deepserve_up_restarts_a_killed_decode_and_keeps_serving(tmp_path: Path) -> None:

    port = free_port()
    run_dir = tmp_path / "run"
    proc, output = _launch_up(port, run_dir, "--model", "fake", "--decode", "2")
    state_file = run_dir / "stack.json"
    pids: set[int] = set()
    try:
        _wait_for(
            "'deepserve is up'",
            lambda: any(line.startswith("deepserve is up:") for line in output),
            120,
            output,
        )
        state = json.loads(state_file.read_text())
        pids = set(state["pids"].values())
        assert state["api_url"] == f"http://127.0.0.1:{port}/v1"
        assert state["kvstore_address"] and state["grpc_address"] and state["nats_url"]
        before = state["services"]["decode-1"]
        address = state["decode_addresses"]["decode-1"]
        assert before["grpc_address"] == address
        assert (before["status"], before["restarts"]) == ("running", 0)
        assert state_file.stat().st_mode & 0o077 == 0, "stack.json may hold credentials"

        client = openai_client(base_url=state["api_url"], api_key="local", timeout=60)

        def complete() -> str:
            # Greedy: a request caught by the kill mid-stream is retried on another decode
            # exactly (the retry rules cannot continue unseeded sampling after tokens went out).
            resp = client.chat.completions.create(
                model="deepseek-fake",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=8,
                temperature=0,
            )
            return resp.choices[0].message.content or ""

        want = complete()
        os.kill(before["pid"], signal.SIGKILL)
        # The stack keeps serving while decode-1 is down (the entrypoint routes around it).
        for _ in range(4):
            assert complete() == want

        def restarted() -> bool:
            svc = json.loads(state_file.read_text())["services"]["decode-1"]
            return bool(svc["restarts"] == 1 and svc["status"] == "running")

        _wait_for("restart of decode-1", restarted, 60, output)
        state = json.loads(state_file.read_text())
        after = state["services"]["decode-1"]
        pids |= set(state["pids"].values())
        assert after["pid"] != before["pid"] and _alive(after["pid"])
        assert after["last_exit_code"] == -signal.SIGKILL
        assert after["grpc_address"] == address == state["decode_addresses"]["decode-1"]
        assert state["services"]["decode-0"]["restarts"] == 0
        text = "".join(output)
        assert "decode-1 exited with code -9" in text and "decode-1 restarted" in text

        # Routing reaches the restarted instance again: it accepts KV for some request.
        def decode1_served() -> bool:
            assert complete() == want
            metric = "deepserve_decode_requests_total"
            return _counter(after["ops_port"], metric, {"accepted"}) >= 1

        _wait_for("request on the restarted decode-1", decode1_served, 30, output)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(output)
        survivors = [pid for pid in pids if _alive(pid)] + _members_of_groups(pids)
        assert not survivors, f"still running after deepserve up exited: {survivors}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_a_service_failing_at_every_restart_stops_the_stack(tmp_path: Path) -> None:
    policy = RestartPolicy(first_delay=0.2, max_delay=0.4, max_start_failures=2)
    stack = Stack(
        tmp_path / "run", model="fake", model_name="deepseek-fake", drain_seconds=3, restart=policy
    )
    stack.start()
    try:
        (victim,) = [c for c in stack.children if c.name == "decode-0"]
        victim.argv.append("--no-such-flag")  # every restart now dies at argument parsing
        os.kill(victim.pid, signal.SIGKILL)
        events: list[str] = []
        deadline = time.monotonic() + 30
        with pytest.raises(StackError) as err:
            while time.monotonic() < deadline:
                events += stack.supervise()
                time.sleep(0.1)
        message = str(err.value)
        assert "decode-0 failed 2 times in a row at start" in message, events
        assert "--no-such-flag" in message  # its log tail: argparse's complaint
        state = json.loads((tmp_path / "run" / "stack.json").read_text())
        assert state["services"]["decode-0"]["restarts"] == 2
        assert state["services"]["decode-0"]["last_exit_code"] == 2
        assert all(c.running() for c in stack.children if c.name != "decode-0")
    finally:
        stack.stop()
    assert not any(c.running() for c in stack.children)
