"""API keys -> tenant ids, and the service credential of the internal APIs.

The recipe (HTTP) and the entrypoint (gRPC ``Generate``) take the same key sources.

Keys come from ``--api-keys`` (``DEEPSERVE_API_KEYS``) and/or the file ``--api-keys-file``:
entries separated by commas or newlines, each ``KEY=TENANT`` or a bare ``KEY`` (its tenant is
then ``key-`` + the first 8 hex digits of the key's SHA-256, stable and not the key itself);
``#`` starts a comment. A client sends its key as ``Authorization: Bearer KEY`` (OpenAI
SDKs) or ``x-api-key: KEY`` (Anthropic SDKs); either header works on every route. With no
keys configured the API is open and every request is tenant ``""``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field


def parse_keys(text: str) -> dict[str, str]:
    """``KEY=TENANT`` / ``KEY`` entries -> {key: tenant}; raises ValueError on a bad entry."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        for entry in line.split(","):
            entry = entry.strip()
            if not entry:
                continue
            key, _, tenant = entry.partition("=")
            key, tenant = key.strip(), tenant.strip()
            if not key or any(c.isspace() for c in key):
                raise ValueError(
                    f"API key entry {entry[:4]!r}...: a key is one word without spaces"
                )
            out[key] = tenant or "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]
    return out


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` value (HTTP header or gRPC metadata)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


@dataclass(frozen=True)
class KeyTable:
    keys: Mapping[str, str] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return not self.keys

    @staticmethod
    def presented(headers: Mapping[str, str]) -> str | None:
        token = bearer_token(headers.get("authorization", ""))
        if token is not None:
            return token
        key = headers.get("x-api-key", "").strip()
        return key or None

    def tenant(self, headers: Mapping[str, str]) -> str | None:
        """The caller's tenant; None when keys are configured and none of them was presented."""
        if self.open:
            return ""
        key = self.presented(headers)
        return None if key is None else self.tenant_of(key)

    def tenant_of(self, key: str) -> str | None:
        """The tenant of ``key``; None if it is not one of the keys."""
        found = None
        for known, tenant in self.keys.items():  # compare every key: no early exit to time
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        return found


def load_keys(inline: str, path: str) -> dict[str, str]:
    """Keys of ``--api-keys`` and the file ``--api-keys-file`` (when given), as
    {key: tenant}; ValueError names the flag that is wrong (a config error)."""
    keys = parse_keys(inline)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                keys.update(parse_keys(f.read()))
        except OSError as exc:
            raise ValueError(f"--api-keys-file: {exc}") from None
    return keys
