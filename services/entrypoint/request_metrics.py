"""Request-level metrics of the entrypoint: each whole request as its client sees it, in
vLLM's names (``vllm:`` -> ``deepserve:``) with a ``model_name`` label.

The engines export per-instance series of their own (``libs/serving/engine_metrics.py``):
``deepserve:time_to_first_token_seconds`` (prefill: task taken -> first token) and
``deepserve:e2e_request_latency_seconds`` (decode: KV push taken -> last token). Where vLLM's
name is taken that way, the entrypoint's series carries ``request_`` in front
(``deepserve:request_time_to_first_token_seconds``, ``deepserve:request_e2e_latency_seconds``),
so a sum over all jobs never mixes the two and one process may hold both; the others keep
vLLM's name (``request_time_per_output_token_seconds`` is vLLM's per-request TPOT).

All are observed once per request, when it ends (a request retried on other instances is one
request; its times span its attempts), by :meth:`RequestMetrics.finished`. Counted are the
requests that passed validation; those refused before (credentials, malformed, an id already
in flight) are only in ``deepserve_entrypoint_requests_total``. Each histogram is observed
for a request that reached both ends of its interval, whatever its outcome: one that failed
after 5 tokens has its prefill and decode time, one refused at admission only its end-to-end
time. Intervals (``time.monotonic``):

* received: the Generate call came in; admitted: the request left the admission queue (the
  first attempt's grant; a retry keeps it); first / last token: handed to the client;
  finished: the call ended.
* queue = waiting at admission; prefill = admitted -> first token; decode = first -> last
  token; inference = admitted -> last token; e2e = received -> finished; TTFT = received ->
  first token; TPOT = (last - first token) / (tokens - 1), for 2 tokens or more.
* ``deepserve:request_success_total{finished_reason}``: the engine's reason for a request
  that finished (``stop``, ``length``), ``abort`` (the client went away, or shutdown cancelled
  it), ``rejected`` (refused at admission: no capacity within ``--admit-wait``, queue full, or
  larger than any instance) or ``error`` (failed: no instance, instances failed past the
  retries, a deadline, an internal error).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram

PREFIX = "deepserve:"
LABELS = ("model_name",)

# vLLM's buckets (vllm/v1/metrics/loggers.py), as libs/serving/engine_metrics.py's (not
# imported from there: it pulls in the engine).
TTFT_BUCKETS: tuple[float, ...] = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5),
    *(5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
TPOT_BUCKETS: tuple[float, ...] = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0, 20.0, 40.0, 80.0),
)
LATENCY_BUCKETS: tuple[float, ...] = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0),
    *(60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)

_WHOLE = "the whole request as its client sees it (entrypoint; retries included)"
QUEUE_TIME = Histogram(
    PREFIX + "request_queue_time_seconds",
    f"Time waiting at admission, of {_WHOLE}",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
PREFILL_TIME = Histogram(
    PREFIX + "request_prefill_time_seconds",
    f"Admitted -> first token, of {_WHOLE}",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
DECODE_TIME = Histogram(
    PREFIX + "request_decode_time_seconds",
    f"First -> last token, of {_WHOLE}",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
INFERENCE_TIME = Histogram(
    PREFIX + "request_inference_time_seconds",
    f"Admitted -> last token, of {_WHOLE}",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
E2E_LATENCY = Histogram(
    PREFIX + "request_e2e_latency_seconds",
    f"Received -> finished, of {_WHOLE}; vLLM's e2e_request_latency_seconds, renamed: the "
    "decode engines' deepserve:e2e_request_latency_seconds is their own part (KV push -> last "
    "token)",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
TTFT = Histogram(
    PREFIX + "request_time_to_first_token_seconds",
    f"Received -> first token, of {_WHOLE}; vLLM's time_to_first_token_seconds, renamed: the "
    "prefill engines' deepserve:time_to_first_token_seconds is their own part (task taken -> "
    "first token)",
    LABELS,
    buckets=TTFT_BUCKETS,
)
TPOT = Histogram(
    PREFIX + "request_time_per_output_token_seconds",
    f"(last - first token) / (tokens - 1), of {_WHOLE} with 2 tokens or more",
    LABELS,
    buckets=TPOT_BUCKETS,
)
SUCCESS = Counter(
    PREFIX + "request_success",
    "Requests ended, by finished_reason: the engine's (stop, length), abort (the client went "
    "away), rejected (refused at admission), error (failed); once per request, retries included",
    (*LABELS, "finished_reason"),
)
HISTOGRAMS = (QUEUE_TIME, PREFILL_TIME, DECODE_TIME, INFERENCE_TIME, E2E_LATENCY, TTFT, TPOT)
REASONS = ("stop", "length", "abort", "rejected", "error")


@dataclass
class RequestTimes:
    """One request's moments (``time.monotonic``), filled in as it goes; None: not reached."""

    received: float
    queued_s: float | None = None  # waited at admission (set when admitted)
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0  # tokens handed to the client

    def admit(self, waited_from: float, now: float) -> None:
        self.queued_s, self.admitted = now - waited_from, now

    def sent(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self.first_token is None:
            self.first_token = now
        self.last_token, self.tokens = now, self.tokens + count


def finished_reason(outcome: str, finish_reason: str) -> str:
    """The success counter's label for a call whose outcome (the requests metric's label) is
    ``outcome``; ``finish_reason``: the engine's, for one that finished."""
    if outcome == "ok":
        return finish_reason or "stop"
    if outcome == "cancelled":
        return "abort"
    if outcome in ("overloaded", "invalid"):  # after validation: only admission refuses
        return "rejected"
    return "error"


class RequestMetrics:
    """The series of one served model, every one exported (at 0) from the start."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        for h in HISTOGRAMS:
            h.labels(model_name)
        for reason in REASONS:
            SUCCESS.labels(model_name, reason)

    def finished(self, t: RequestTimes, reason: str, now: float) -> None:
        """A request ended at ``now`` with ``reason`` (:func:`finished_reason`)."""
        m = self.model_name
        SUCCESS.labels(m, reason).inc()
        E2E_LATENCY.labels(m).observe(now - t.received)
        if t.queued_s is not None:
            QUEUE_TIME.labels(m).observe(t.queued_s)
        if t.first_token is not None:
            TTFT.labels(m).observe(t.first_token - t.received)
        if t.admitted is not None and t.first_token is not None:
            PREFILL_TIME.labels(m).observe(t.first_token - t.admitted)
        if t.admitted is not None and t.last_token is not None:
            INFERENCE_TIME.labels(m).observe(t.last_token - t.admitted)
        if t.first_token is not None and t.last_token is not None:
            DECODE_TIME.labels(m).observe(t.last_token - t.first_token)
            if t.tokens > 1:
                TPOT.labels(m).observe((t.last_token - t.first_token) / (t.tokens - 1))
