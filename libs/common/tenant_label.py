"""What logs, metrics labels and usage subjects call a tenant: a salted hash, never its name.

``label = first 8 hex digits of HMAC-SHA-256(secret, "deepserve/tenant-label/v1/" + tenant)``

The secret is the deployment's ``DEEPSERVE_TENANT_LABEL_SECRET`` (``deepserve up``,
``scripts/docker/env.sh`` and the k8s Secret make one; every service of a deployment that names
tenants -- the recipe and the entrypoint -- gets the same, so a tenant has one label across their
lines and series). Without the secret anyone could hash a list of likely tenant names and read
off whose series and lines are whose; with it, a label says nothing outside the deployment, and
an operator who holds the secret finds a tenant's label with :func:`label_of` (docs/security.md).

With no secret (local use) labels are the same keyed hash under an empty key: stable, but
computable by anyone; :func:`warn_if_unsalted` says so at start. A request without a tenant
(an open API, no or a wrong key) is ``-``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
from dataclasses import dataclass, field

from libs.common.config import flag

SECRET_ENV = "DEEPSERVE_TENANT_LABEL_SECRET"
NO_TENANT = "-"
_DOMAIN = b"deepserve/tenant-label/v1/"
_LABEL_HEX = 8  # 32 bits: distinct for any realistic number of tenants, short in a log line


def label_of(secret: bytes, tenant: str | None) -> str:
    """``tenant``'s label under ``secret``; ``-`` for no tenant ("" or None or "-")."""
    if not tenant or tenant == NO_TENANT:
        return NO_TENANT
    digest = hmac.new(secret, _DOMAIN + tenant.encode(), hashlib.sha256).hexdigest()
    return digest[:_LABEL_HEX]


@dataclass(frozen=True)
class TenantLabels:
    """The deployment's labeller: ``labels(tenant)`` -> 8 hex digits (``-`` for none)."""

    secret: bytes = field(default=b"", repr=False)

    def __call__(self, tenant: str | None) -> str:
        return label_of(self.secret, tenant)

    @property
    def salted(self) -> bool:
        return bool(self.secret)


UNSALTED = TenantLabels()  # no secret configured (local use, tests)


def add_tenant_label_flag(parser: argparse.ArgumentParser) -> None:
    flag(
        parser,
        "--tenant-label-secret",
        default="",
        env=SECRET_ENV,
        help="secret salting the tenant labels of logs, metrics and usage subjects (the same "
        "on the recipe and the entrypoint; pass it through the environment). Empty: unsalted "
        "labels, which anyone can compute from a tenant name",
    )


def labels_from(args: argparse.Namespace) -> TenantLabels:
    return TenantLabels(args.tenant_label_secret.encode())


def warn_if_unsalted(labels: TenantLabels, log: logging.Logger) -> None:
    if not labels.salted:
        log.warning(
            "no %s: tenant labels in logs and metrics are unsalted hashes (anyone can hash a "
            "tenant name to find its lines); set one secret per deployment",
            SECRET_ENV,
        )
