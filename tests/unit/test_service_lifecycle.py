"""The lifecycle every service shares (``libs/common/service.py``): one validated common
config, and one exit stack that closes what a service opened in reverse order on SIGTERM, on
Ctrl-C and when starting fails half-way."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from libs.common.config import ServiceConfig, common_flags, service_config_from
from libs.common.service import ServiceContext, run_service

SERVICES = ("recipe", "entrypoint", "balancer", "prefill", "decode", "kvstore")


@dataclass(frozen=True)
class _Config:
    service: ServiceConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="test-service")
    common_flags(p, "test")
    return p


def _config(args: argparse.Namespace) -> _Config:
    return _Config(service_config_from(args, "test"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"http_port": 70000}, "--http-port must lie in [0, 65535], got 70000"),
        ({"http_port": -1}, "--http-port must lie in [0, 65535], got -1"),
        ({"drain_seconds": -0.5}, "--drain-seconds must be >= 0, got -0.5"),
        ({"host": ""}, "--host must name an address"),
        ({"nats_url": "http://x:4222"}, "--nats-url must be a nats:// or tls:// URL"),
        ({"instance_id": "prefill.0"}, "--instance-id must not contain '.'"),
        ({"log_level": "LOUD"}, "--log-level must be one of"),
    ],
)
def test_common_config_names_the_bad_flag(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        ServiceConfig(**kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_common_config_takes_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSERVE_DRAIN_SECONDS", "2.5")
    monkeypatch.setenv("NATS_URL", "nats://nats.example:4222")
    cfg = service_config_from(_parser().parse_args(["--http-port", "9100"]), "balancer")
    assert (cfg.http_port, cfg.drain_seconds, cfg.nats_url) == (
        9100,
        2.5,
        "nats://nats.example:4222",
    )
    assert cfg.instance_id.startswith("balancer-")


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--http-port", "70000"], "--http-port must lie in [0, 65535], got 70000"),
        (["--drain-seconds", "-1"], "--drain-seconds must be >= 0, got -1.0"),
    ],
)
def test_every_service_refuses_bad_common_flags_the_same_way(
    service: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(f"services.{service}.main").main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"python -m services.{service}: error: {message}\n"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_closes_everything_in_reverse_order(sig: signal.Signals) -> None:
    ops_port = _free_port()
    closed: list[str] = []
    seen: dict[str, object] = {}

    async def serve(cfg: _Config, ctx: ServiceContext) -> int:
        assert await ctx.start_ops(lambda: (True, "ok")) == ops_port
        pinger = ctx.background(asyncio.sleep(3600), "forever")
        seen["pinger"] = pinger

        async def close(name: str) -> None:
            closed.append(name)
            if name == "nats":  # opened after the ops port: the ops port still answers now
                seen["healthz while closing nats"] = await asyncio.to_thread(_healthz, ops_port)

        for name in ("model", "nats", "grpc"):
            ctx.stack.push_async_callback(close, name)
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), sig)
        await asyncio.wait_for(ctx.stop.wait(), 10)
        assert not pinger.done()
        return 0

    rc = run_service("test", ["--http-port", str(ops_port)], _parser, _config, serve)
    assert rc == 0
    assert closed == ["grpc", "nats", "model"]
    assert seen["healthz while closing nats"] == 200
    assert seen["pinger"].cancelled()  # type: ignore[attr-defined]
    with pytest.raises(urllib.error.URLError):  # the ops port was closed last
        _healthz(ops_port)


def test_an_exception_while_starting_closes_what_was_opened(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ops_port = _free_port()
    closed: list[str] = []

    async def serve(cfg: _Config, ctx: ServiceContext) -> int:
        await ctx.start_ops(lambda: (True, "ok"))

        async def close(name: str) -> None:
            closed.append(name)

        ctx.stack.push_async_callback(close, "model")
        ctx.stack.push_async_callback(close, "nats")
        raise RuntimeError("the gRPC port is taken")

    with caplog.at_level(logging.ERROR):
        rc = run_service("test", ["--http-port", str(ops_port)], _parser, _config, serve)
    assert rc == 1
    assert closed == ["nats", "model"]
    assert "the gRPC port is taken" in caplog.text
    with pytest.raises(urllib.error.URLError):
        _healthz(ops_port)


def test_sigterm_exits_promptly_when_a_background_task_loses_its_cancellation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CI saw the kvstore never exit after SIGTERM: its Redis ping loop lost its cancel (on
    Python 3.11 ``asyncio.wait_for``, also inside redis-py, returns the answer when the cancel
    lands as the command finishes) and pinged on, and closing waited for it forever. The loop
    here loses its first cancel the same way and would run on for 20 s; the service must still
    exit at once, and say which task it had to cancel again and where it was."""
    import time

    ended: list[str] = []

    async def pinger() -> None:
        lost = False
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            try:
                await asyncio.sleep(0.01)  # stands for one ping
            except asyncio.CancelledError:
                if lost:
                    ended.append("cancelled")
                    raise
                lost = True  # the first cancel lost, as wait_for loses it
        ended.append("ran on")

    async def serve(cfg: _Config, ctx: ServiceContext) -> int:
        ctx.background(pinger(), "redis-ping", stop_within=1.0)
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(ctx.stop.wait(), 10)
        return 0

    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert run_service("test", [], _parser, _config, serve) == 0
    assert time.monotonic() - t0 < 5, f"exit took {time.monotonic() - t0:.1f}s"
    assert ended == ["cancelled"]
    assert "task 'redis-ping' still running" in caplog.text
    assert "in pinger" in caplog.text  # where it was: its stack


def test_sigterm_ends_a_service_still_waiting_for_nats() -> None:
    dead = _free_port()  # nothing listens: connect_nats retries every second until stopped
    closed: list[str] = []

    async def serve(cfg: _Config, ctx: ServiceContext) -> int:
        ctx.stack.push_async_callback(asyncio.sleep, 0)  # something opened before NATS
        asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGTERM)
        nc = await asyncio.wait_for(ctx.connect_nats(), 10)
        closed.append("returned" if nc is None else "connected")
        return 0

    argv = ["--nats-url", f"nats://127.0.0.1:{dead}"]
    assert run_service("test", argv, _parser, _config, serve) == 0
    assert closed == ["returned"]


def test_no_log_line_or_healthz_shows_the_nats_password(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 13: the NATS password was in the logs and in /healthz."""
    ops_port, dead = _free_port(), _free_port()
    url = f"nats://svc:hunter2@127.0.0.1:{dead}"
    seen: dict[str, str] = {}

    async def serve(cfg: _Config, ctx: ServiceContext) -> int:
        await ctx.start_ops(lambda: (False, f"not connected to NATS at {ctx.config.nats_url}"))
        ctx.log.info("config %r, NATS %s", cfg, ctx.config.nats_url)

        async def probe() -> None:
            await asyncio.sleep(1.5)  # connect_nats has failed and logged at least once
            try:
                seen["healthz"] = await asyncio.to_thread(_healthz_body, ops_port)
            finally:  # whatever /healthz did, SIGTERM must end the connect loop
                os.kill(os.getpid(), signal.SIGTERM)

        ctx.background(probe(), "probe")
        assert await asyncio.wait_for(ctx.connect_nats(), 60) is None  # generous: a busy host
        return 0

    with caplog.at_level(logging.INFO):
        assert (
            run_service(
                "test", ["--nats-url", url, "--http-port", str(ops_port)], _parser, _config, serve
            )
            == 0
        )
    shown = f"nats://svc:***@127.0.0.1:{dead}"
    assert shown in seen["healthz"] and "hunter2" not in seen["healthz"]
    assert f"NATS {shown}: " in caplog.text  # the failed connects, logged by connect_nats
    assert f"nats_url='{shown}'" in caplog.text
    assert "hunter2" not in caplog.text + capsys.readouterr().err

    assert run_service("test", ["--nats-url", "http://svc:hunter2@h"], _parser, _config, serve) == 2
    err = capsys.readouterr().err
    assert "http://svc:***@h" in err and "hunter2" not in err


def _healthz_body(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return str(r.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


def test_sigterm_during_a_long_model_load_exits_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large model loads for minutes: SIGTERM then ends the service at once (exit 0), not
    after the load, and it never connects to NATS."""
    import threading
    import time

    from libs.serving import engines
    from libs.serving.instance import InstanceRuntime
    from libs.serving.model_flags import ModelFlags

    loading = threading.Event()

    def slow_build(flags: ModelFlags, progress: object = None) -> object:
        loading.set()
        time.sleep(30)
        raise AssertionError("the load should have been abandoned")

    monkeypatch.setattr(engines, "build_engine", slow_build)
    seen: list[object] = []

    async def serve(cfg: _Config, ctx: ServiceContext) -> int:
        def signal_when_loading() -> None:
            loading.wait(10)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=signal_when_loading, daemon=True).start()
        rt = InstanceRuntime(ctx, ModelFlags(model="fake"), 1.0)
        rc = await rt.start()
        seen.append(rc)
        seen.append(rt.nc)
        return 0 if rc is None else rc

    t0 = time.monotonic()
    argv = ["--nats-url", f"nats://127.0.0.1:{_free_port()}"]
    assert run_service("test", argv, _parser, _config, serve) == 0
    assert time.monotonic() - t0 < 10
    assert seen == [0, None]


def test_every_service_exports_its_loop_lag_and_no_created_series() -> None:
    ops_port = _free_port()
    seen: dict[str, str] = {}

    async def serve(cfg: _Config, ctx: ServiceContext) -> int:
        await ctx.start_ops(lambda: (True, "ok"))
        await asyncio.sleep(0.1)  # a few of the lag timer's 20 ms rounds

        def scrape() -> str:
            url = f"http://127.0.0.1:{ops_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                return str(resp.read().decode())

        seen["metrics"] = await asyncio.to_thread(scrape)
        return 0

    assert run_service("test", ["--http-port", str(ops_port)], _parser, _config, serve) == 0
    lines = seen["metrics"].splitlines()
    count = next(x for x in lines if x.startswith("deepserve_event_loop_lag_seconds_count"))
    assert float(count.split()[-1]) >= 1
    assert not [x for x in lines if x.split("{")[0].split(" ")[0].endswith("_created")]
