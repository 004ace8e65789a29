"""The recipe's ops routes beside every service's ``/livez``, ``/readyz`` (``/healthz``) and
``/metrics`` (``libs/common/telemetry.py: OpsServer``): ``GET /status`` (the page,
``status_page.py``) and ``GET /status.json`` (the board's latest snapshot, built by the
collector's tick: a request only serializes it).

Private like ``/metrics``: no key is asked. The page and its data carry no tenant, key or
prompt (``status.py`` sums over tenants), and the page loads nothing from elsewhere (its
Content-Security-Policy allows only itself).
"""

from __future__ import annotations

import json

from libs.common.telemetry import OpsRoute

from .status import StatusBoard
from .status_page import PAGE

HEADERS = (
    "Cache-Control: no-store\r\n"
    "X-Content-Type-Options: nosniff\r\n"
    "Content-Security-Policy: default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src data:\r\n"
)


def status_routes(board: StatusBoard) -> dict[str, OpsRoute]:
    """``/status`` and ``/status.json`` for ``ServiceContext.start_ops(health, routes)``."""
    page = PAGE.encode()

    def snapshot() -> tuple[str, bytes, str]:
        body = json.dumps(board.snapshot(), separators=(",", ":")).encode()
        return "application/json", body, HEADERS

    return {
        "/status": lambda: ("text/html; charset=utf-8", page, HEADERS),
        "/status.json": snapshot,
    }
