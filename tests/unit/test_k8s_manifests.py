"""The example Kubernetes manifests in ``docker/k8s`` match the code: they parse, each object
has the fields Kubernetes needs (a compact structural schema of the subset used), every
container runs a real ``services.<name>`` with flags and environment twins that service
has, each Deployment gets only the secrets its service reads and logs in to NATS as its own
role with that role's password only, nats runs the generated ``nats.conf`` (a ConfigMap)
with every role's password from the Secret, and probes and Services point at the ports the
flags open."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
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
    nats_secret_key,
)
from .service_flags import env_twins as _env_twins
from .service_flags import flag_value as _flag_value
from .service_flags import parser as _parser

K8S = Path(__file__).resolve().parents[2] / "docker" / "k8s"

_STR = {"type": "string", "minLength": 1}
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABELS = {"type": "object", "additionalProperties": _STR}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _NAME, "labels": _LABELS},
    "additionalProperties": False,
}
_PROBE = {
    "type": "object",
    "properties": {
        "httpGet": {
            "type": "object",
            "required": ["path", "port"],
            "properties": {"path": _STR, "port": {"type": ["integer", "string"]}},
            "additionalProperties": False,
        },
        "exec": {"type": "object", "required": ["command"]},
        "periodSeconds": {"type": "integer", "minimum": 1},
        "failureThreshold": {"type": "integer", "minimum": 1},
    },
    "additionalProperties": False,
}
_ENV = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Z_][A-Z0-9_]*$"},
        "value": {"type": "string"},
        "valueFrom": {
            "type": "object",
            "properties": {
                "secretKeyRef": {
                    "type": "object",
                    "required": ["name", "key"],
                    "properties": {"name": _NAME, "key": _STR, "optional": {"type": "boolean"}},
                    "additionalProperties": False,
                },
                "configMapKeyRef": {
                    "type": "object",
                    "required": ["name", "key"],
                    "properties": {"name": _NAME, "key": _STR},
                    "additionalProperties": False,
                },
                "fieldRef": {
                    "type": "object",
                    "required": ["fieldPath"],
                    "properties": {"fieldPath": _STR},
                    "additionalProperties": False,
                },
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}
_CONTAINER = {
    "type": "object",
    "required": ["name", "image"],
    "properties": {
        "name": _NAME,
        "image": _STR,
        "command": {"type": "array", "items": _STR},
        "args": {"type": "array", "items": {"type": "string"}},
        "env": {"type": "array", "items": _ENV},
        "ports": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["containerPort"],
                "properties": {"name": _NAME, "containerPort": _PORT},
                "additionalProperties": False,
            },
        },
        "resources": {"type": "object"},
        "startupProbe": _PROBE,
        "livenessProbe": _PROBE,
        "readinessProbe": _PROBE,
        "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    },
    "additionalProperties": False,
}
_TEMPLATE = {
    "type": "object",
    "required": ["metadata", "spec"],
    "properties": {
        "metadata": {"type": "object", "required": ["labels"]},
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {
                "enableServiceLinks": {"type": "boolean"},
                "securityContext": {"type": "object"},
                "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
                "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            },
            "additionalProperties": False,
        },
    },
}
_SELECTOR = {"type": "object", "required": ["matchLabels"], "properties": {"matchLabels": _LABELS}}


def _object(api: str, kind: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    props: dict[str, Any] = {
        "apiVersion": {"const": api},
        "kind": {"const": kind},
        "metadata": _META,
    }
    if spec is not None:
        props["spec"] = spec
    return {"type": "object", "required": ["apiVersion", "kind", "metadata"], "properties": props}


SCHEMAS: dict[str, dict[str, Any]] = {
    "Namespace": _object("v1", "Namespace"),
    "PersistentVolumeClaim": _object(
        "v1",
        "PersistentVolumeClaim",
        {
            "type": "object",
            "required": ["accessModes", "resources"],
            "properties": {"accessModes": {"type": "array", "minItems": 1}, "resources": {}},
            "additionalProperties": False,
        },
    ),
    "Secret": {
        **_object("v1", "Secret"),
        "required": ["apiVersion", "kind", "metadata", "stringData"],
    },
    "Deployment": _object(
        "apps/v1",
        "Deployment",
        {
            "type": "object",
            "required": ["selector", "template"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "selector": _SELECTOR,
                "template": _TEMPLATE,
            },
            "additionalProperties": False,
        },
    ),
    "StatefulSet": _object(
        "apps/v1",
        "StatefulSet",
        {
            "type": "object",
            "required": ["serviceName", "selector", "template"],
            "properties": {
                "serviceName": _NAME,
                "replicas": {"type": "integer", "minimum": 0},
                "selector": _SELECTOR,
                "template": _TEMPLATE,
                "volumeClaimTemplates": {"type": "array"},
            },
            "additionalProperties": False,
        },
    ),
    "Service": _object(
        "v1",
        "Service",
        {
            "type": "object",
            "required": ["selector", "ports"],
            "properties": {
                "clusterIP": {"const": "None"},
                "selector": _LABELS,
                "ports": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port", "targetPort"],
                        "properties": {
                            "name": _NAME,
                            "port": _PORT,
                            "targetPort": {"type": ["integer", "string"]},
                        },
                        "additionalProperties": False,
                    },
                },
            },
            "additionalProperties": False,
        },
    ),
}
KUSTOMIZATION = {
    "type": "object",
    "required": ["apiVersion", "kind", "resources"],
    "properties": {
        "apiVersion": {"const": "kustomize.config.k8s.io/v1beta1"},
        "kind": {"const": "Kustomization"},
        "namespace": _NAME,
        "resources": {"type": "array", "minItems": 1, "items": _STR},
        "labels": {"type": "array"},
        "images": {"type": "array"},
        "configMapGenerator": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": _NAME,
                    "files": {"type": "array", "items": _STR},
                    "literals": {"type": "array", "items": _STR},
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}

_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "integer": int,
}


def _errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """The JSON-schema subset used above, checked by hand (jsonschema is not a dependency)."""
    out: list[str] = []
    if "const" in schema and value != schema["const"]:
        return [f"{where}: {value!r} is not {schema['const']!r}"]
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(
            isinstance(value, _TYPES[t]) and not (t == "integer" and isinstance(value, bool))
            for t in types
        )
        if not ok:
            return [f"{where}: {value!r} is not of type {schema['type']}"]
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            out.append(f"{where}: empty")
        if "pattern" in schema and not re.match(schema["pattern"], value):
            out.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, int) and not isinstance(value, bool):
        if not schema.get("minimum", value) <= value <= schema.get("maximum", value):
            out.append(f"{where}: {value} out of range")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            out.append(f"{where}: fewer than {schema['minItems']} items")
        for i, item in enumerate(value):
            out += _errors(item, schema.get("items", {}), f"{where}[{i}]")
    if isinstance(value, dict):
        out += [f"{where}: {k} is missing" for k in schema.get("required", []) if k not in value]
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                out += _errors(v, props[k], f"{where}.{k}")
            elif extra is False:
                out.append(f"{where}: unexpected field {k}")
            elif isinstance(extra, dict):
                out += _errors(v, extra, f"{where}.{k}")
    return out


def _validate(value: Any, schema: dict[str, Any]) -> list[str]:
    try:
        import jsonschema
    except ImportError:
        return _errors(value, schema)
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(value)]


def _kustomization() -> dict[str, Any]:
    doc = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def _objects() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name in _kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc is not None:
                out.append((name, doc))
    return out


def _deployments() -> dict[str, dict[str, Any]]:
    """The workload of each service: a Deployment, or a StatefulSet where it keeps data."""
    return {
        o["metadata"]["name"]: o
        for _, o in _objects()
        if o["kind"] == "Deployment"
        or (o["kind"] == "StatefulSet" and o["metadata"]["name"] in SERVICES)
    }


def _container(dep: dict[str, Any]) -> dict[str, Any]:
    containers = dep["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def test_every_file_is_listed_and_parses() -> None:
    assert _validate(_kustomization(), KUSTOMIZATION) == []
    listed = set(_kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "every manifest is in kustomization.yaml and exists"


def test_objects_match_schema() -> None:
    objects = _objects()
    assert objects
    for name, obj in objects:
        assert {"apiVersion", "kind", "metadata"} <= obj.keys(), name
        assert obj["metadata"].get("name"), name
        assert obj["kind"] in SCHEMAS, f"{name}: no schema for {obj['kind']}"
        errors = _validate(obj, SCHEMAS[obj["kind"]])
        assert errors == [], f"{name} {obj['metadata']['name']}: {errors}"
    kinds = [o["metadata"]["name"] for _, o in objects if o["kind"] == "StatefulSet"]
    assert sorted(kinds) == ["kvstore", "nats", "redis"]  # the three that keep data


def test_schema_check_catches_mistakes() -> None:
    dep = _deployments()["recipe"]
    broken = {**dep, "spec": {**dep["spec"], "replica": 2}}  # typo of replicas
    assert _validate(broken, SCHEMAS["Deployment"])
    assert _validate({**dep, "apiVersion": "apps/v1beta1"}, SCHEMAS["Deployment"])


def test_one_deployment_per_service_running_its_module() -> None:
    deps = _deployments()
    assert sorted(deps) == sorted(SERVICES)
    for name, dep in deps.items():
        c = _container(dep)
        # scripts/docker/build.sh's tags: the GPU engines on cuda, the rest on cpu
        gpu = name in ("prefill", "decode", "aggregated")
        assert c["image"] == ("deepserve:cuda" if gpu else "deepserve:cpu"), name
        assert c["command"] == ["python", "-m", f"services.{name}"]
        # A real package with a __main__ (found, not run: running it would start the service).
        assert importlib.util.find_spec(f"services.{name}.__main__") is not None, name
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        # No <SERVICE>_PORT=tcp://... in the pod (env twins would skip them anyway).
        assert dep["spec"]["template"]["spec"]["enableServiceLinks"] is False


@pytest.mark.parametrize("service", SERVICES)
def test_flags_and_env_exist_in_the_service(service: str) -> None:
    c = _container(_deployments()[service])
    parser = _parser(service)
    options = parser._option_string_actions
    for arg in c.get("args", []):
        if arg.startswith("--"):
            assert arg in options, f"{service}: no flag {arg}"
    parser.parse_args(c.get("args", []))  # values of the right type, too
    # Besides the twins: the NATS login (no flag on purpose: never on a command line), and
    # where a service loads the model, the Hugging Face cache's own variables.
    twins = _env_twins(parser) | NATS_CREDENTIAL_ENVS
    if "DEEPSERVE_MODEL" in twins:
        twins |= MODEL_CACHE_ENVS
    for env in c.get("env", []):
        assert env["name"] in twins, f"{service}: {env['name']} is no flag's twin"


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_gets_only_its_secrets_from_the_secret(service: str) -> None:
    c = _container(_deployments()[service])
    twins = _env_twins(_parser(service))
    secret_keys = {
        o["metadata"]["name"]: set(o["stringData"]) for _, o in _objects() if o["kind"] == "Secret"
    }
    given = set()
    for env in c.get("env", []):
        if env["name"] in SECRET_ENVS:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            assert ref is not None, f"{service}: {env['name']} must come from a Secret"
            assert ref["key"] in secret_keys[ref["name"]]
            given.add(env["name"])
    assert given == SECRET_ENVS & twins, f"{service} reads {SECRET_ENVS & twins}"
    # NATS: its own role's user, and that role's password (the only nats-password-* key it gets)
    env = {e["name"]: e for e in c["env"]}
    assert env[nats_auth.USER_ENV] == {"name": nats_auth.USER_ENV, "value": service}
    password = env[nats_auth.PASSWORD_ENV]["valueFrom"]["secretKeyRef"]
    assert password == {"name": "deepserve-secrets", "key": nats_secret_key(service)}
    assert password["key"] in secret_keys["deepserve-secrets"]
    keys = [
        e["valueFrom"]["secretKeyRef"]["key"]
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    assert [k for k in keys if k.startswith("nats-password-")] == [password["key"]], service


@pytest.mark.parametrize("service", SERVICES)
def test_probes_and_ports_follow_the_flags(service: str) -> None:
    c = _container(_deployments()[service])
    ops = int(_flag_value(c["args"], "--http-port"))
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": ops}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": ops}
    if "startupProbe" in c:
        assert c["startupProbe"]["httpGet"]["port"] == ops
    ports = {p["containerPort"] for p in c["ports"]}
    assert ops in ports
    for f in ("--grpc-port", "--port"):
        if f in c["args"]:
            assert int(_flag_value(c["args"], f)) in ports


def test_services_target_container_ports() -> None:
    deps = _deployments()
    sets = {o["metadata"]["name"]: o for _, o in _objects() if o["kind"] == "StatefulSet"}
    services = {o["metadata"]["name"]: o for _, o in _objects() if o["kind"] == "Service"}
    assert {"recipe", "entrypoint", "kvstore", "decode", "nats", "redis"} <= services.keys()
    assert services["decode"]["spec"].get("clusterIP") == "None"  # instances dialled one by one
    for name, svc in services.items():
        owners = [
            w
            for w in {
                (w["kind"], w["metadata"]["name"]): w for w in (*deps.values(), *sets.values())
            }.values()
            if svc["spec"]["selector"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(owners) == 1, f"Service {name} selects {len(owners)} workloads"
        ports = owners[0]["spec"]["template"]["spec"]["containers"][0]["ports"]
        by_number = {p["containerPort"] for p in ports}
        by_name = {p.get("name") for p in ports}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in (by_number | by_name), f"Service {name}: {p}"
            assert p["targetPort"] != 9090 and p.get("name") != "ops", "never expose ops"


def test_gpus_on_engines_only() -> None:
    for name, dep in _deployments().items():
        c = _container(dep)
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus is not None) == (name in ("prefill", "decode", "aggregated")), name
        if gpus is not None:
            assert _flag_value(c["args"], "--device").startswith("cuda")


@pytest.mark.parametrize("name", ["decode", "aggregated"])
def test_kv_receivers_advertise_their_pod_ip(name: str) -> None:
    c = _container(_deployments()[name])
    assert "--host" not in c["args"]
    host = [e for e in c["env"] if e["name"] == "DEEPSERVE_HOST"]
    assert host == [
        {"name": "DEEPSERVE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    ]


def _nats() -> dict[str, Any]:
    (sts,) = [
        o for _, o in _objects() if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "nats"
    ]
    return sts


def test_nats_runs_the_generated_config_from_a_config_map() -> None:
    (gen,) = [g for g in _kustomization()["configMapGenerator"] if g["name"] == "nats-config"]
    assert gen["files"] == ["nats.conf"]
    text = (K8S / "nats.conf").read_text()
    assert text == nats_auth.deployment_config(), "regenerate docker/k8s/nats.conf"
    spec = _nats()["spec"]["template"]["spec"]
    c = _container(_nats())
    conf = _flag_value(c["args"], "-c")
    (mount,) = [m for m in c["volumeMounts"] if conf.startswith(m["mountPath"] + "/")]
    assert conf == f"{mount['mountPath']}/nats.conf" and mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"] == {"name": gen["name"]}


def test_nats_gets_every_role_s_password_from_the_secret() -> None:
    c = _container(_nats())
    secret = {o["metadata"]["name"]: o for _, o in _objects() if o["kind"] == "Secret"}
    keys = secret["deepserve-secrets"]["stringData"]
    referenced = set(re.findall(r"password: \$(\w+)", (K8S / "nats.conf").read_text()))
    env = {e["name"]: e for e in c["env"]}
    assert set(env) == referenced == {nats_auth.password_env(r) for r in nats_auth.ROLES}
    for role in nats_auth.ROLES:
        e = env[nats_auth.password_env(role)]
        ref = e["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "deepserve-secrets", "key": nats_secret_key(role)}, role
        assert keys[ref["key"]], f"{ref['key']}: empty (nats-server would take an empty password)"
    nats_keys = {k for k in keys if k.startswith("nats-password-")}
    assert nats_keys == {nats_secret_key(r) for r in nats_auth.ROLES}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_and_points_nats_at_the_generated_config_map() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "nats.conf" in d["data"]]
    assert cm["data"]["nats.conf"] == (K8S / "nats.conf").read_text()
    assert cm["metadata"]["namespace"] == "deepserve"
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats"]
    volumes = sts["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": cm["metadata"]["name"]}} in volumes
