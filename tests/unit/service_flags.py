"""What the deployment files (docker/k8s, compose.yaml) are checked against: each service's
own flag parser, the environment twins its flags document, and the secrets it reads."""

from __future__ import annotations

import argparse
import importlib
import re

from deepserve.up import SERVICE_SECRETS
from libs.common import nats_auth

SERVICES = ("recipe", "entrypoint", "balancer", "prefill", "decode", "aggregated", "kvstore")
SECRET_ENVS = {  # docs/security.md: the secrets and their environment twins
    "DEEPSERVE_SERVICE_TOKEN",
    "DEEPSERVE_CACHE_SALT_SECRET",
    "DEEPSERVE_KV_MAC_KEY",
    "DEEPSERVE_TENANT_LABEL_SECRET",
    "DEEPSERVE_API_KEYS",
}


# The NATS login every service container gets (libs/common/natsutil.py reads them): the only
# environment a deployment file may give a service that is no flag's twin.
NATS_CREDENTIAL_ENVS = {nats_auth.USER_ENV, nats_auth.PASSWORD_ENV}

# huggingface_hub's own variables (libs/engine/hub.py reads them through it): where the model
# cache lives and the token of gated repos, given to the services that load the model.
MODEL_CACHE_ENVS = {"HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE"}


def nats_secret_key(role: str) -> str:
    """The key of ``role``'s NATS password in docker/k8s/secret.yaml."""
    return f"nats-password-{role}"


def parser(service: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"services.{service}.config")
    return module.build_parser()  # type: ignore[no-any-return]


def env_twins(p: argparse.ArgumentParser) -> set[str]:
    return {m for a in p._actions for m in re.findall(r"\[env (\w+)\]", a.help or "")}


def secrets_read_by(service: str) -> set[str]:
    """The secrets ``service`` reads: its flags' twins among them (the API keys included)."""
    return SECRET_ENVS & env_twins(parser(service))


def flag_value(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


__all__ = [
    "SERVICES",
    "SECRET_ENVS",
    "SERVICE_SECRETS",
    "NATS_CREDENTIAL_ENVS",
    "MODEL_CACHE_ENVS",
    "nats_secret_key",
    "parser",
    "env_twins",
    "flag_value",
]
