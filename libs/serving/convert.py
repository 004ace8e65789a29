"""The token-stream edge of prefill and decode: an error as a TokenEvent (no I/O, no torch).

Sampling settings cross the wire through :class:`libs.common.sampling.SamplingParams`
(``from_proto`` / ``to_proto``).
"""

from __future__ import annotations

from libs.common.errors import DeepserveError, InvalidArgument
from libs.proto.deepserve.v1 import control_pb2


def error_event(
    request_id: str, error: DeepserveError, *, index: int = 0
) -> control_pb2.TokenEvent:
    """A TokenEvent that fails the request with ``error``'s message.

    ``retryable`` comes from the error's kind: the entrypoint retries a retryable failure on
    other instances and ends the request on a fatal one.
    """
    return control_pb2.TokenEvent(
        request_id=request_id,
        index=index,
        finished=True,
        error=str(error),
        retryable=error.retryable,
        invalid_argument=isinstance(error, InvalidArgument),
    )
