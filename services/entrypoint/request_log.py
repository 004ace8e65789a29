"""One log line per Generate call when it ends: what an operator greps for a request.

``request req-1 ok: tenant=3f2a9c1b prompt=812 cached=768 completion=64 ttft=0.094s
duration=1.210s attempts=1 trace=4bf92f3577b34da6a3ce929d0e0e4736`` (where decode speculated,
`` drafted=90 verified=72 accepted=55`` after it); with ``--log-format json`` the same values
are fields of the line's JSON object. The tenant appears only as its label, the deployment's
salted hash (``libs/common/tenant_label.py``: as the recipe's metric labels and access log),
never its name or key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from libs.common.logs import FIELDS_ATTR
from libs.common.tenant_label import NO_TENANT


@dataclass
class RequestRecord:
    """Filled in as a call goes; logged once by :func:`log_request` when it ends."""

    request_id: str = "-"  # "-": refused before it had one
    tenant_label: str = NO_TENANT  # the verified tenant's label (never its name)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # call started -> first token sent to the client
    attempts: int = 0
    trace_id: str = ""
    speculative: tuple[int, ...] = ()  # decode's (drafted, verified, accepted); () none
    finish_reason: str = ""  # the engine's (stop, length), once the request finished

    def fields(self, outcome: str, duration_s: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tenant_hash": self.tenant_label,
            "outcome": outcome,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "duration_s": round(duration_s, 6),
            "attempts": self.attempts,
            "trace_id": self.trace_id,
            **(
                dict(zip(("spec_drafted", "spec_verified", "spec_accepted"), self.speculative))
                if self.speculative
                else {}
            ),
        }


def log_request(
    log: logging.Logger, record: RequestRecord, outcome: str, duration_s: float
) -> None:
    f = record.fields(outcome, duration_s)
    ttft = "-" if f["ttft_s"] is None else f"{f['ttft_s']:.3f}s"
    spec = (
        " drafted={} verified={} accepted={}".format(*record.speculative)
        if record.speculative
        else ""
    )
    log.info(
        "request %s %s: tenant=%s prompt=%d cached=%d completion=%d ttft=%s duration=%.3fs "
        "attempts=%d trace=%s%s",
        f["request_id"],
        outcome,
        f["tenant_hash"],
        f["prompt_tokens"],
        f["cached_tokens"],
        f["completion_tokens"],
        ttft,
        duration_s,
        f["attempts"],
        f["trace_id"] or "-",
        spec,
        extra={FIELDS_ATTR: f},
    )
