"""What the deployment files do once rendered (issue 38 item 2, issue 37 item 5): the k8s set,
as `kubectl kustomize docker/k8s` renders it, names exactly the images scripts/docker/build.sh
builds; the kvstore's blocks and Redis's metadata live on claims that outlive their pods; compose
and k8s name the model once and mount the Hugging Face cache where the image looks for it; and
compose's monitoring profile scrapes every service into the provisioned dashboard.

Rendering uses kubectl where it is installed; elsewhere a small renderer of the parts of
kustomize this set uses (resources, namespace, the images transformer), checked against kubectl
where both exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .service_flags import SERVICES, parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
GPU_ENGINES = {"prefill", "decode", "aggregated"}
MODEL_LOADERS = {"recipe", "prefill", "decode", "aggregated"}  # services with --model


def build_sh_images() -> set[str]:
    """The tags scripts/docker/build.sh gives: ``deepserve:<variant>`` for each variant."""
    text = (ROOT / "scripts" / "docker" / "build.sh").read_text()
    (repo,) = re.findall(r"tag=\$\{IMAGE_TAG:-([\w./-]+):\$variant\}", text)
    block = text.split("case $variant in", 1)[1].split("esac", 1)[0]
    variants = re.findall(r"^\s+(\w+)\)", block, re.M)
    assert variants, "no variants in build.sh"
    return {f"{repo}:{v}" for v in variants}


def _split_image(image: str) -> tuple[str, str]:
    name, sep, tag = image.rpartition(":")
    return (name, sep + tag) if sep and "/" not in tag else (image, "")


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec")
    return [spec] if spec else []


def render_python(path: Path = K8S) -> list[dict[str, Any]]:
    """kustomize's resources, ConfigMap generators (without the content hash kustomize adds to
    their names and references), namespace and images transformer: all this set uses."""
    kz = yaml.safe_load((path / "kustomization.yaml").read_text())
    docs = [d for r in kz["resources"] for d in yaml.safe_load_all((path / r).read_text()) if d]
    for gen in kz.get("configMapGenerator", []):  # named as written (kustomize adds a hash)
        data = dict(lit.split("=", 1) for lit in gen.get("literals", []))
        data |= {f: (path / f).read_text() for f in gen.get("files", [])}
        meta = {"name": gen["name"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for doc in docs:
        if doc["kind"] != "Namespace" and kz.get("namespace"):
            doc["metadata"]["namespace"] = kz["namespace"]
        for spec in _pod_specs(doc):
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                name, tag = _split_image(c["image"])
                for rule in kz.get("images", []):
                    if rule["name"] == name:
                        new = rule.get("newName", name)
                        tag = f"@{rule['digest']}" if "digest" in rule else tag
                        tag = f":{rule['newTag']}" if "newTag" in rule else tag
                        c["image"] = new + tag
    return docs


def render_kubectl(path: Path = K8S) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def rendered() -> list[dict[str, Any]]:
    return render_kubectl() if shutil.which("kubectl") else render_python()


def images(docs: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    return {
        (d["kind"], c["name"]): c["image"]
        for d in docs
        for spec in _pod_specs(d)
        for c in spec["containers"]
    }


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def test_kustomize_renders_exactly_the_images_build_sh_builds() -> None:
    built = build_sh_images()
    assert built == {"deepserve:cpu", "deepserve:cuda"}
    used = images(rendered())
    assert set(used.values()) == built  # each built image used, nothing else to pull
    for (_, name), image in used.items():
        # The GPU engines run the CUDA image; the rest (nats, redis too) the CPU one.
        assert image == ("deepserve:cuda" if name in GPU_ENGINES else "deepserve:cpu"), name


def test_the_image_check_sees_a_retag(tmp_path: Path) -> None:
    """What the rendered check guards against: a kustomization that retags the images."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    kz = copy / "kustomization.yaml"
    kz.write_text(kz.read_text() + "images:\n  - name: deepserve\n    newTag: latest\n")
    assert set(images(render_python(copy)).values()) == {"deepserve:latest"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_the_python_renderer_agrees_with_kubectl(tmp_path: Path) -> None:
    assert images(render_python()) == images(render_kubectl())
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    kz = copy / "kustomization.yaml"
    rule = "images:\n  - name: deepserve\n    newName: registry.example/ds\n    newTag: v1\n"
    kz.write_text(kz.read_text() + rule)
    assert images(render_python(copy)) == images(render_kubectl(copy))


def _claim_mounted_at(workload: dict[str, Any], path: str) -> str:
    """The volumeClaimTemplate of ``workload`` mounted where ``path`` lives."""
    claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    for m in container.get("volumeMounts", []):
        if (path + "/").startswith(m["mountPath"].rstrip("/") + "/") and m["name"] in claims:
            return str(m["name"])
    raise AssertionError(f"{workload['metadata']['name']}: {path} is on no claim")


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_kvstore_blocks_and_redis_metadata_live_on_claims() -> None:
    w = workloads(rendered())
    kv, redis = w["kvstore"], w["redis"]
    assert kv["kind"] == redis["kind"] == "StatefulSet"  # claims that outlive the pods
    (kv_c,) = kv["spec"]["template"]["spec"]["containers"]
    (redis_c,) = redis["spec"]["template"]["spec"]["containers"]
    _claim_mounted_at(kv, _arg(kv_c["args"], "--data-dir"))
    assert _arg(redis_c["args"], "--appendonly") == "yes"
    _claim_mounted_at(redis, _arg(redis_c["args"], "--dir"))
    for name in ("kvstore", "redis", "nats"):  # the image runs as uid 10001, not root
        assert w[name]["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001
    for spec in (s for d in w.values() for s in _pod_specs(d)):
        assert not any("emptyDir" in v for v in spec.get("volumes", [])), "data on emptyDir"


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_k8s_names_the_model_once_and_mounts_the_cache() -> None:
    docs = rendered()
    w = workloads(docs)
    sources = {p.name: p.read_text() for p in K8S.glob("*.yaml")}
    for value in ("v3-slice", "deepseek-v3-slice"):
        assert [n for n, text in sources.items() if value in text] == ["kustomization.yaml"]
    model_maps = [
        d
        for d in docs
        if d["kind"] == "ConfigMap"
        and {"DEEPSERVE_MODEL", "DEEPSERVE_MODEL_NAME"} <= d["data"].keys()
    ]
    assert len(model_maps) == 1
    (model_map,) = model_maps
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for service in SERVICES:
        (c,) = w[service]["spec"]["template"]["spec"]["containers"]
        env = _env(c)
        assert "--model" not in c.get("args", []) and "--model-name" not in c.get("args", [])
        wanted = {"DEEPSERVE_MODEL", "DEEPSERVE_MODEL_NAME"} if service in MODEL_LOADERS else set()
        if service == "entrypoint":
            wanted = {"DEEPSERVE_MODEL_NAME", "DEEPSERVE_VOCAB_SIZE"}
        for name in wanted:
            ref = env[name]["valueFrom"]["configMapKeyRef"]
            assert ref == {"name": model_map["metadata"]["name"], "key": name}, service
        if service in MODEL_LOADERS:
            cache = env["HF_HOME"]["value"]
            (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == cache]
            (volume,) = [
                v
                for v in w[service]["spec"]["template"]["spec"]["volumes"]
                if v["name"] == mount["name"]
            ]
            assert volume["persistentVolumeClaim"]["claimName"] in claims, service
    # The vocabulary bound is the entrypoint's flag, and it is told the model's.
    vocab = int(model_map["data"]["DEEPSERVE_VOCAB_SIZE"])
    assert vocab > 0 and "--vocab-size" in parser("entrypoint")._option_string_actions


# -- compose ----------------------------------------------------------------------------------


def _compose_config(*profiles: str) -> dict[str, Any]:
    """compose.yaml as docker-compose resolves it (anchors, merges, defaults), else as YAML."""
    env = {"PATH": "/usr/bin:/bin"}
    from libs.common import nats_auth

    env |= {nats_auth.password_env(r): "x" for r in nats_auth.ROLES}
    if shutil.which("docker-compose"):
        args = ["docker-compose", "-f", str(ROOT / "compose.yaml")]
        for p in profiles:
            args += ["--profile", p]
        out = subprocess.run(
            [*args, "config"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
        )
        assert out.returncode == 0, out.stderr
        doc = yaml.safe_load(out.stdout)
    else:
        text = re.sub(
            r"\$\{(\w+)(?::?[-?]([^}]*))?\}",
            lambda m: env.get(m[1], m[2] or ""),
            (ROOT / "compose.yaml").read_text(),
        )
        doc = yaml.safe_load(text)
    assert isinstance(doc, dict)
    return doc


def test_compose_names_the_model_once_and_mounts_the_cache() -> None:
    text = (ROOT / "compose.yaml").read_text()
    for var in ("DEEPSERVE_MODEL", "DEEPSERVE_MODEL_NAME"):
        assert text.count("${" + var + ":-") == 1, f"{var} is named more than once"
    services = _compose_config("gpu", "aggregated")["services"]
    model_loaders = [n for n in services if n.split("-")[0] in MODEL_LOADERS]
    assert {"recipe", "prefill", "decode", "prefill-gpu", "decode-gpu", "aggregated-gpu"} <= set(
        model_loaders
    )
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    (cache,) = re.findall(r"HF_HOME=(\S+)", dockerfile)
    for name in model_loaders:
        env = services[name]["environment"]
        assert env["DEEPSERVE_MODEL"] == "tiny" and env["DEEPSERVE_MODEL_NAME"] == "deepseek-tiny"
        volumes = [
            str(v) if isinstance(v, str) else f"{v['source']}:{v['target']}"
            for v in services[name]["volumes"]
        ]
        assert any(v.split(":")[:2] == ["model-cache", cache] for v in volumes), name
    assert services["entrypoint"]["environment"]["DEEPSERVE_MODEL_NAME"] == "deepseek-tiny"


def test_compiled_kernels_live_on_the_model_cache_volume() -> None:
    """The image keeps Triton's JIT cache under HF_HOME, the path compose and the manifests
    mount the model-cache volume on (the two tests above): restarts do not compile again."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    (cache,) = re.findall(r"HF_HOME=(\S+)", dockerfile)
    (triton,) = re.findall(r"TRITON_CACHE_DIR=(\S+)", dockerfile)
    assert Path(triton).is_relative_to(cache)


def test_monitoring_profile_scrapes_every_service_into_the_dashboard() -> None:
    services = _compose_config("monitoring", "gpu", "aggregated")["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    assert prom["profiles"] == grafana["profiles"] == ["monitoring"]
    mounts = {}
    for svc in (prom, grafana):
        for v in svc["volumes"]:
            src, dst = v.split(":")[:2] if isinstance(v, str) else (v["source"], v["target"])
            mounts[dst] = Path(src) if src.startswith(("/", ".")) else None
    config_file = mounts["/etc/prometheus/prometheus.yml"]
    assert config_file is not None
    config = yaml.safe_load((ROOT / config_file).read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    deepserve = {
        n
        for n, s in services.items()
        if "command" in s and "services." in " ".join(map(str, s["command"]))
    }
    assert set(sd["names"]) == deepserve  # every service container, GPU ones included
    for name in deepserve:
        args = [str(a) for a in services[name]["command"]]
        assert _arg(args, "--http-port") == str(sd["port"]), name
    # Grafana: the Prometheus above as the default source, the dashboard file provisioned.
    (ds_file,) = [p for d, p in mounts.items() if "provisioning/datasources" in d]
    (source,) = yaml.safe_load((ROOT / ds_file).read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert source["url"] == "http://prometheus:9090"
    (dash_file,) = [p for d, p in mounts.items() if "provisioning/dashboards" in d]
    (provider,) = yaml.safe_load((ROOT / dash_file).read_text())["providers"]
    folder = provider["options"]["path"]
    dashboards = [p for d, p in mounts.items() if d.startswith(folder + "/")]
    assert [p.name for p in dashboards] == ["deepserve.json"]
    board = json.loads((ROOT / dashboards[0]).read_text())
    (ds_var,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert ds_var["query"] == source["type"]  # the variable picks the provisioned source
