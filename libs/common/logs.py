"""Log output of every service, in one place: plain text lines (the default) or one JSON
object per line (``--log-format json`` / ``DEEPSERVE_LOG_FORMAT=json``) for log collectors.

Text: ``2026-12-01 21:00:00,123 decode INFO decode: message``. JSON: ``{"ts": "...Z",
"level": "INFO", "service": "decode", "logger": "decode", "msg": "message"}`` plus ``rank``
for an EP rank, ``exc`` for a traceback and every field a caller passed as
``extra={"fields": {...}}`` (the entrypoint's request lines: ``request_id``, ``ttft_s``, ...).
Redaction (:mod:`.redact`) is a record factory, so both formats only ever see redacted text.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from .redact import install_log_redaction

LOG_FORMATS = ("text", "json")
FIELDS_ATTR = "fields"  # logger.info(msg, extra={"fields": {...}}): structured fields


class JsonFormatter(logging.Formatter):
    """One JSON object per record; keys are stable, values JSON types (others as ``str``)."""

    def __init__(self, service: str, rank: int | None = None) -> None:
        super().__init__()
        self.service, self.rank = service, rank

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.rank is not None:
            out["rank"] = self.rank
        fields = getattr(record, FIELDS_ATTR, None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                out.setdefault(str(key), value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, default=str, ensure_ascii=False)


def text_formatter(service: str, rank: int | None = None) -> logging.Formatter:
    who = service if rank is None else f"{service} r{rank}"
    return logging.Formatter(f"%(asctime)s {who} %(levelname)s %(name)s: %(message)s")


def formatter(fmt: str, service: str, rank: int | None = None) -> logging.Formatter:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    return JsonFormatter(service, rank) if fmt == "json" else text_formatter(service, rank)


def setup_logging(level: str, service: str, fmt: str = "text") -> logging.Logger:
    """Log lines on stderr in ``fmt`` (text or json); no line shows a URL's credentials."""
    install_log_redaction()
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig: handlers someone else set up stay theirs
        handler = logging.StreamHandler()
        handler.setFormatter(formatter(fmt, service))
        root.addHandler(handler)
        root.setLevel(getattr(logging, level.upper(), logging.INFO))
    return logging.getLogger(service)


def tag_rank(service: str, rank: int) -> None:
    """Every line from now on names EP rank ``rank`` (the N ranks write into their
    supervisor's log), in whichever format the handlers already use."""
    for handler in logging.getLogger().handlers:
        fmt = "json" if isinstance(handler.formatter, JsonFormatter) else "text"
        handler.setFormatter(formatter(fmt, service, rank))
