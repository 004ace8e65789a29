"""The gRPC edge of :mod:`libs.common.errors`: each kind <-> a ``grpc.StatusCode``.

Servers end a call with :func:`abort` (the kind's status, the message as details, and for
:class:`~libs.common.errors.Overloaded` the retry hint as trailing metadata ``retry-after-ms``).
Clients turn a failed call back into the kind with :func:`from_status`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import grpc

from libs.common.errors import (
    AlreadyExists,
    DeadlineExceeded,
    DeepserveError,
    InstanceFailed,
    Internal,
    InvalidArgument,
    NotFound,
    Overloaded,
    Unauthenticated,
    Unavailable,
)

RETRY_AFTER_KEY = "retry-after-ms"

_CODE_OF: dict[type[DeepserveError], grpc.StatusCode] = {
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InstanceFailed: grpc.StatusCode.UNAVAILABLE,  # the client retries; another instance serves
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Internal: grpc.StatusCode.INTERNAL,
}

# Codes our servers do not send but a peer might: read as the nearest kind.
_KIND_OF: dict[grpc.StatusCode, type[DeepserveError]] = {
    **{code: kind for kind, code in _CODE_OF.items() if kind is not InstanceFailed},
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.ABORTED: Unavailable,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidArgument,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
}


def status_code(exc: DeepserveError) -> grpc.StatusCode:
    """The status for ``exc``: its own class's, else the nearest base class's."""
    for cls in type(exc).__mro__:
        code = _CODE_OF.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.UNAVAILABLE if exc.retryable else grpc.StatusCode.INTERNAL


def trailing_metadata(exc: DeepserveError) -> tuple[tuple[str, str], ...]:
    """``retry-after-ms`` for an :class:`Overloaded` with a hint; nothing otherwise."""
    if isinstance(exc, Overloaded) and exc.retry_after_ms > 0:
        return ((RETRY_AFTER_KEY, str(exc.retry_after_ms)),)
    return ()


async def abort(context: Any, exc: DeepserveError) -> NoReturn:
    """End the RPC on ``context`` (a ``grpc.aio.ServicerContext``) with ``exc``'s status."""
    trailing = trailing_metadata(exc)
    if trailing:
        context.set_trailing_metadata(trailing)
    await context.abort(status_code(exc), str(exc))
    raise exc  # unreachable: abort raises


def from_status(
    code: grpc.StatusCode, details: str, trailing: Iterable[tuple[str, Any]] | None = None
) -> DeepserveError:
    """The kind a failed call's status stands for (a client's view of :func:`abort`).

    An unknown code becomes :class:`Internal` with the code's name in the message.
    """
    message = details or code.name
    kind = _KIND_OF.get(code)
    if kind is Overloaded:
        return Overloaded(message, _retry_after_ms(trailing))
    if kind is None or kind is Internal:
        return Internal(f"{code.name}: {message}")
    return kind(message)


def _retry_after_ms(trailing: Iterable[tuple[str, Any]] | None) -> int:
    for key, value in trailing or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0, int(value))
            except (TypeError, ValueError):
                return 0
    return 0
