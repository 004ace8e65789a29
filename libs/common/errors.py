"""The errors every layer raises, in two kinds (torch-free, no I/O).

*Retryable* errors say the request may succeed if sent again (elsewhere, or later): an
instance is unavailable or failed, or the system is overloaded (with a hint of when to come
back). *Fatal* errors say the request itself, or the caller, is wrong: sending it again
unchanged gives the same answer.

Inner code raises these and never decides the wire format. Each service maps them once, at
its edge: to a gRPC status (:mod:`libs.common.grpc_errors`), to an HTTP body in the caller's
protocol (the recipe), or to a token-stream error event (prefill/decode).
"""

from __future__ import annotations

from typing import ClassVar


class DeepserveError(Exception):
    """Base of the two kinds; ``retryable`` tells them apart."""

    retryable: ClassVar[bool] = False


class RetryableError(DeepserveError):
    retryable = True


class Unavailable(RetryableError):
    """A dependency (NATS, the balancer, an instance, the kvstore) cannot be reached now."""


class Overloaded(RetryableError):
    """No capacity now; come back after ``retry_after_ms``."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class InstanceFailed(RetryableError):
    """The instance serving a request died or failed it; another instance may serve it."""


class DeadlineExceeded(RetryableError):
    """No answer came within the time allowed; the work was abandoned (sending again may fit)."""


class FatalError(DeepserveError):
    retryable = False


class InvalidArgument(FatalError, ValueError):
    """The request is wrong as sent; ``field`` names what to fix ("" when no one field)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class NotFound(FatalError, LookupError):
    """What the request names (a model, a request id, a block) does not exist here."""


class AlreadyExists(FatalError):
    """What the request would start exists already (say, a request id still in flight)."""


class Unauthenticated(FatalError):
    """The caller's credentials are missing or not accepted."""


class Internal(FatalError):
    """A bug or broken invariant: the message is for the operator's log."""
