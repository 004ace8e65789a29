"""Tenant labels (libs/common/tenant_label.py): one salted hash names a tenant in every log line,
metric and usage subject of the recipe and the entrypoint; the same within a deployment, another
under another deployment's secret, never the tenant's name or its key."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.testclient import TestClient

from libs.common.auth import KeyTable
from libs.common.tenant_label import SECRET_ENV, UNSALTED, TenantLabels, label_of
from services.recipe.access_log import access_log
from services.recipe.app import build_app
from services.recipe.encoding import PromptEncoder
from services.recipe.handlers import AppConfig, Metrics
from services.recipe.usage import UsageRecord, subject_of

from ..sdk_strict import strict_http
from .recipe_fakes import MODEL, FakeBackend
from .test_entrypoint_handlers import FakeBus, FakeContext, make, req

KEY = "sk-acme-very-secret-key"
KEYS = {KEY: "acme"}
SALT = b"deployment-one-secret"


def test_one_tenant_one_label_per_deployment_and_another_under_another_secret() -> None:
    one, again, other = TenantLabels(SALT), TenantLabels(SALT), TenantLabels(b"deployment-two")
    assert one("acme") == again("acme") == label_of(SALT, "acme")  # recipe and entrypoint agree
    assert len(one("acme")) == 8 and int(one("acme"), 16) >= 0
    assert one("acme") != other("acme")  # another deployment: another label
    assert one("acme") != one("globex")
    unsalted = hashlib.sha256(b"acme").hexdigest()[:8]  # what anyone could compute before
    assert unsalted not in (one("acme"), other("acme"), UNSALTED("acme"))
    assert one("") == one(None) == one("-") == "-"  # no tenant
    assert repr(SALT.decode()) not in repr(one)  # the secret stays out of reprs


class Sink:
    def __init__(self) -> None:
        self.records: list[UsageRecord] = []

    def submit(self, record: UsageRecord) -> None:
        self.records.append(record)


def test_the_recipe_names_a_tenant_by_its_salted_label_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    labels = TenantLabels(SALT)
    registry, sink = CollectorRegistry(), Sink()
    encoder = PromptEncoder([MODEL], default_thinking=False)
    cfg = AppConfig(model_name=MODEL, default_max_tokens=16, keys=KeyTable(KEYS), labels=labels)
    app = build_app(cfg, encoder, FakeBackend(encoder), Metrics(registry), usage=sink)
    client = strict_http(
        TestClient(access_log(app, KeyTable(KEYS), labels), raise_server_exceptions=False)
    )
    caplog.set_level(logging.INFO)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    auth = {"authorization": f"Bearer {KEY}"}
    assert client.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
    assert client.post("/v1/messages/count_tokens", json=body, headers=auth).status_code == 200
    label = labels("acme")
    metrics = generate_latest(registry).decode()
    assert f'tenant="{label}"' in metrics
    access = [r for r in caplog.records if r.name == "recipe.access"]
    assert access and all(r.fields["tenant_hash"] == label for r in access)  # type: ignore[attr-defined]
    (record,) = sink.records
    assert subject_of(record.tenant, labels) == f"ds.usage.{label}"
    logged = "\n".join(r.getMessage() + repr(getattr(r, "fields", "")) for r in caplog.records)
    for secret in (KEY, "acme", UNSALTED("acme")):
        assert secret not in metrics and secret not in logged


async def test_the_entrypoint_logs_the_same_label_as_the_recipe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    labels = TenantLabels(SALT)
    h = make(FakeBus(), api_keys=KEYS, labels=labels)
    context: Any = FakeContext((("authorization", f"Bearer {KEY}"),))
    with caplog.at_level(logging.INFO, logger="entrypoint"):
        events = [ev async for ev in h.Generate(req([1, 2, 3], request_id="r-l"), context)]
    assert events[-1].WhichOneof("event") == "finish"
    (line,) = [r for r in caplog.records if r.getMessage().startswith("request r-l ")]
    assert line.fields["tenant_hash"] == labels("acme")  # type: ignore[attr-defined]
    assert f"tenant={labels('acme')}" in line.getMessage()
    text = line.getMessage() + repr(line.fields)  # type: ignore[attr-defined]
    assert KEY not in text and "acme" not in text


def test_the_secret_reaches_recipe_and_entrypoint_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deepserve.up import SERVICE_SECRETS
    from services.entrypoint import config as entrypoint_config
    from services.recipe import config as recipe_config

    monkeypatch.setenv(SECRET_ENV, "from-env")
    recipe = recipe_config.config_from(recipe_config.build_parser().parse_args([]))
    entry = entrypoint_config.config_from(entrypoint_config.build_parser().parse_args([]))
    assert recipe.app.labels == entry.handler.labels == TenantLabels(b"from-env")
    # `deepserve up` makes one per stack and hands it to these two services only
    assert {s for s, names in SERVICE_SECRETS.items() if SECRET_ENV in names} == {
        "recipe",
        "entrypoint",
    }
