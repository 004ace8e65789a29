"""The multi-host EP example (``docker/k8s-ep``, issue 36 item 3) matches the code: one pod per
host in a StatefulSet whose pods all start at once, each running its host's ranks with the
decode service's own EP flags (``--ep-master`` naming pod 0 through a headless Service that
resolves before the pods are ready, ``--ep-node-rank`` from the pod's ordinal), as many GPUs
as ranks per host, and the rest of the stack from ``docker/k8s`` with the model named once."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.decode.config import config_from as decode_config

from .service_flags import MODEL_CACHE_ENVS, NATS_CREDENTIAL_ENVS, env_twins, flag_value, parser
from .test_k8s_manifests import SCHEMAS, _validate

EP_DIR = Path(__file__).resolve().parents[2] / "docker" / "k8s-ep"


def _docs() -> dict[str, dict[str, Any]]:
    docs = yaml.safe_load_all((EP_DIR / "decode-ep.yaml").read_text())
    return {d["kind"]: d for d in docs if d is not None}


def _schemas() -> dict[str, dict[str, Any]]:
    """The base set's schemas plus the two fields a group across hosts needs."""
    out = copy.deepcopy(SCHEMAS)
    sts = out["StatefulSet"]["properties"]["spec"]["properties"]
    sts["podManagementPolicy"] = {"enum": ["Parallel"]}
    out["Service"]["properties"]["spec"]["properties"]["publishNotReadyAddresses"] = {
        "type": "boolean"
    }
    return out


def test_the_group_s_pods_meet_at_pod_0_with_the_service_s_own_flags() -> None:
    docs = _docs()
    sts, svc = docs["StatefulSet"], docs["Service"]
    for kind, obj in docs.items():
        assert _validate(obj, _schemas()[kind]) == [], kind
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["python", "-m", "services.decode"]
    args, p = c["args"], parser("decode")
    assert all(a in p._option_string_actions for a in args if a.startswith("--"))
    twins = env_twins(p) | NATS_CREDENTIAL_ENVS | MODEL_CACHE_ENVS
    env = {e["name"]: e for e in c["env"]}
    assert set(env) <= twins
    # --ep-node-rank is the pod's ordinal: pod i runs global ranks i*per_host...
    assert env["DEEPSERVE_EP_NODE_RANK"]["valueFrom"]["fieldRef"] == {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"
    }
    per_host = int(flag_value(args, "--ep-ranks-per-host"))
    assert int(flag_value(args, "--ep")) == sts["spec"]["replicas"] * per_host
    assert c["resources"]["limits"]["nvidia.com/gpu"] == per_host  # one GPU per rank
    for node in range(sts["spec"]["replicas"]):  # every pod's flags make a valid config
        ep = decode_config(p.parse_args([*args, "--ep-node-rank", str(node)])).ep
        assert ep.supervises and ep.first_rank == node * per_host
    # ... and every pod names pod 0, where rank 0 serves the rendezvous.
    host, port = flag_value(args, "--ep-master").rsplit(":", 1)
    assert host == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    assert svc["metadata"]["name"] == sts["spec"]["serviceName"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert int(port) in {p["containerPort"] for p in c["ports"]}
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # no pod is ready until all met


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl renders the overlay")
def test_the_overlay_renders_on_the_base_with_the_model_named_once() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(EP_DIR)], capture_output=True, text=True, check=True
    ).stdout
    objs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out) if o}
    assert objs[("Deployment", "decode")]["spec"]["replicas"] == 0  # the group replaces it
    sts = objs[("StatefulSet", "decode-ep")]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    refs = {
        e["valueFrom"]["configMapKeyRef"]["name"]
        for e in c["env"]
        if "configMapKeyRef" in e.get("valueFrom", {})
    }
    (model,) = [n for kind, n in objs if kind == "ConfigMap" and n.startswith("deepserve-model")]
    assert refs == {model}  # the generated (hashed) name: the base's one model
