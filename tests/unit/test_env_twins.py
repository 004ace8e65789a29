"""Environment twins in a Kubernetes pod (``libs/common/config.py``): a Service named
``deepserve`` injects ``DEEPSERVE_PORT=tcp://10.0.0.1:8000`` into every pod of its namespace;
that, or any twin that does not parse, is skipped with one warning and the flag keeps its
default, while a bad value on the command line still stops start-up."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from services.entrypoint.config import build_parser as entrypoint_parser
from services.recipe.config import build_parser as recipe_parser

# What Kubernetes sets for a Service "deepserve" exposing 8000/TCP (docker link variables).
SERVICE_LINKS = {
    "DEEPSERVE_SERVICE_HOST": "10.0.0.1",
    "DEEPSERVE_SERVICE_PORT": "8000",
    "DEEPSERVE_PORT": "tcp://10.0.0.1:8000",
    "DEEPSERVE_PORT_8000_TCP": "tcp://10.0.0.1:8000",
    "DEEPSERVE_PORT_8000_TCP_PROTO": "tcp",
    "DEEPSERVE_PORT_8000_TCP_PORT": "8000",
    "DEEPSERVE_PORT_8000_TCP_ADDR": "10.0.0.1",
}


def _set(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_recipe_starts_with_kubernetes_service_links(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _set(monkeypatch, SERVICE_LINKS)
    args = recipe_parser().parse_args([])
    assert args.port == 8000  # the default, not the service link
    err = capsys.readouterr().err
    assert err.count("DEEPSERVE_PORT") == 1
    assert "ignoring environment variable DEEPSERVE_PORT" in err
    assert "10.0.0.1" not in err  # the value is never echoed: a twin may hold a secret


def test_entrypoint_ignores_service_link_on_grpc_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A Service named "deepserve-grpc" would set this one.
    monkeypatch.setenv("DEEPSERVE_GRPC_PORT", "tcp://10.0.0.7:50051")
    monkeypatch.setenv("DEEPSERVE_HTTP_PORT", "udp://10.0.0.7:9000")
    args = entrypoint_parser().parse_args([])
    assert (args.grpc_port, args.http_port) == (50051, 0)
    err = capsys.readouterr().err
    assert "DEEPSERVE_GRPC_PORT" in err and "DEEPSERVE_HTTP_PORT" in err
    assert "Kubernetes service link" in err


@pytest.mark.parametrize(
    ("parser", "env", "value", "dest", "default"),
    [
        (recipe_parser, "DEEPSERVE_PORT", "eighty", "port", 8000),
        (recipe_parser, "DEEPSERVE_BODY_TIMEOUT", "soon", "body_timeout", 60.0),
        (recipe_parser, "DEEPSERVE_DEFAULT_THINKING", "perhaps", "default_thinking", False),
        (entrypoint_parser, "DEEPSERVE_MAX_INFLIGHT", "12x", "max_inflight", 256),
    ],
)
def test_unparsable_twin_keeps_default(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    parser: Callable[[], argparse.ArgumentParser],
    env: str,
    value: str,
    dest: str,
    default: object,
) -> None:
    monkeypatch.setenv(env, value)
    assert getattr(parser().parse_args([]), dest) == default
    err = capsys.readouterr().err
    assert f"ignoring environment variable {env}: its value is not a valid" in err
    assert value not in err
    assert len(err.strip().splitlines()) == 1


def test_secret_twin_is_never_echoed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "tcp://s3cr3t-token:1"  # an unlucky secret with a service link's shape
    monkeypatch.setenv("DEEPSERVE_SERVICE_TOKEN", secret)
    assert entrypoint_parser().parse_args([]).service_token == ""
    assert "s3cr3t" not in capsys.readouterr().err


def test_valid_twins_still_apply(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _set(
        monkeypatch,
        {
            "DEEPSERVE_PORT": "9123",
            "DEEPSERVE_BODY_TIMEOUT": "2.5",
            "DEEPSERVE_DEFAULT_THINKING": "yes",
            "DEEPSERVE_ENTRYPOINT_ADDRESS": "entrypoint:50051",
        },
    )
    args = recipe_parser().parse_args([])
    assert (args.port, args.body_timeout, args.default_thinking) == (9123, 2.5, True)
    assert args.entrypoint_address == "entrypoint:50051"
    monkeypatch.setenv("DEEPSERVE_CAPACITY_ADMISSION", "off")
    monkeypatch.setenv("DEEPSERVE_GRPC_PORT", "50099")
    ep = entrypoint_parser().parse_args([])
    assert (ep.capacity_admission, ep.grpc_port) == (False, 50099)
    assert capsys.readouterr().err == ""


def test_command_line_wins_over_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSERVE_PORT", "tcp://10.0.0.1:8000")
    assert recipe_parser().parse_args(["--port", "8100"]).port == 8100
    monkeypatch.setenv("DEEPSERVE_PORT", "9000")
    assert recipe_parser().parse_args(["--port", "8100"]).port == 8100


@pytest.mark.parametrize(
    ("parser", "argv"),
    [
        (recipe_parser, ["--port", "tcp://x"]),
        (recipe_parser, ["--port", "tcp://10.0.0.1:8000"]),
        (entrypoint_parser, ["--grpc-port", "fifty"]),
        (entrypoint_parser, ["--admit-wait", "later"]),
    ],
)
def test_bad_command_line_value_still_fails(
    capsys: pytest.CaptureFixture[str],
    parser: Callable[[], argparse.ArgumentParser],
    argv: list[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2
    assert "invalid" in capsys.readouterr().err
