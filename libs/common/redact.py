"""Credentials out of logs and health output: ``nats://user:pass@host`` → ``nats://user:***@host``.

:func:`redact` hides the secret parts of one URL; :func:`redact_text` does it to every URL in
a piece of text (a log line, a /healthz detail, an exception message); :func:`redacted_repr`
is a dataclass ``__repr__`` that shows no credentials; :func:`install_log_redaction` makes
every log record of the process pass through :func:`redact_text`, whichever handler (ours,
uvicorn's, pytest's) writes it.

What counts as secret: the userinfo of a URL (``user:pass@`` → ``user:***@``; a lone
``name@`` is a NATS token or an API key, so it becomes ``***@``) and the values of query
parameters whose name says so (``?token=``, ``?password=``, ``X-Amz-Signature=``, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

MASK = "***"
# A query parameter whose name contains one of these holds a secret (compared lower-case):
# token, password/passwd/pass, pwd, secret, key (api_key, access_key, X-Amz-...), signature
# and sig, auth, credential (X-Amz-Credential names the access key).
_SECRET_PARAM_PARTS = ("token", "pass", "pwd", "secret", "key", "sig", "auth", "credential")
# scheme://... up to whitespace, a quote or an angle bracket (how URLs end inside text/reprs).
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_QUERY_PARAM = re.compile(r"([^&;=]+)=([^&;]*)")


def redact(url: str) -> str:
    """``url`` with its password, token and secret query values replaced by ``***``.

    Follows RFC 3986: the authority ends at the first ``/``, ``?`` or ``#`` after
    ``scheme://``, and its userinfo ends at the authority's last ``@`` (so an unescaped
    ``@`` or ``:`` inside a password is hidden with the rest of it). A URL without
    ``scheme://`` (``user:pass@host:4222``, which NATS accepts) is read as authority first.
    A userinfo with an unescaped ``@`` is hidden whole (the user name's end is a guess).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    end = len(rest)
    for stop in "/?#":
        i = rest.find(stop)
        if i != -1:
            end = min(end, i)
    authority, tail = rest[:end], rest[end:]
    userinfo, at, hostport = authority.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        # An unescaped '@' in the userinfo: where the user name ends is a guess; show none.
        keep_user = colon and "@" not in userinfo
        authority = f"{user}:{MASK}@{hostport}" if keep_user else f"{MASK}@{hostport}"
    return f"{scheme}{sep}{authority}{_redact_query(tail)}"


def _redact_query(tail: str) -> str:
    path, q, query = tail.partition("?")
    if not q:
        return tail
    query, hash_, fragment = query.partition("#")

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        secret = any(part in name.lower() for part in _SECRET_PARAM_PARTS)
        return f"{name}={MASK}" if secret and m.group(2) else m.group(0)

    return f"{path}?{_QUERY_PARAM.sub(one, query)}{hash_}{fragment}"


def redact_text(text: str) -> str:
    """``text`` with every ``scheme://...`` URL in it passed through :func:`redact`."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


def redacted_repr(obj: Any) -> str:
    """A dataclass ``__repr__`` like the generated one, with credentials in URLs hidden
    (nested configs included: their reprs are redacted as text)."""
    fields = ", ".join(
        f"{f.name}={redact_text(repr(getattr(obj, f.name)))}"
        for f in dataclasses.fields(obj)
        if f.repr
    )
    return f"{type(obj).__qualname__}({fields})"


def install_log_redaction() -> None:
    """From now on every log record in this process is redacted when it is made: message
    with its arguments, exception text and stack. Idempotent.

    A record factory rather than a handler filter, so handlers set up by others (uvicorn's,
    a test's) never see the secret either; records exist only once a logger decided to emit
    them, so formatting the message early costs nothing for suppressed levels.
    """
    previous = logging.getLogRecordFactory()
    if getattr(previous, "_deepserve_redacts", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        _redact_record(record)
        return record

    factory._deepserve_redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def _redact_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a bad format: leave it for the handler to report
        return
    record.msg, record.args = redact_text(message), None
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = redact_text(record.exc_text)
    if record.stack_info:
        record.stack_info = redact_text(record.stack_info)
