"""A request's sampling settings: one value object from the wire to the sampler (no torch).

:class:`SamplingParams` is built from the proto (:meth:`SamplingParams.from_proto`) where a
request comes in, checked once on creation, and turned back into the proto
(:meth:`SamplingParams.to_proto`) where it goes out. Adding a sampling field touches
``proto/deepserve/v1/common.proto``, this class and the sampler.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import NoReturn

from libs.common.errors import InvalidArgument
from libs.proto.deepserve.v1 import common_pb2

MAX_SEED = 2**63  # the sampler keys draws by a signed 64-bit seed
MAX_LOGPROBS = 20  # most likely tokens returned per position (OpenAI's top_logprobs limit)
CONSTRAINT_KINDS = ("json_schema", "json", "regex", "ebnf", "tool_call")
MAX_CONSTRAINT_BYTES = 256 * 1024  # a schema or grammar; compiled per distinct value (cached)


@dataclass(frozen=True)
class Constraint:
    """What the output must be (``common.proto: OutputConstraint``); the engine compiles it
    into token masks (``libs/engine/grammar.py``)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            _bad(
                "constraint.kind",
                f"must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}",
            )
        if len(self.spec.encode()) > MAX_CONSTRAINT_BYTES:
            _bad("constraint.spec", f"is longer than {MAX_CONSTRAINT_BYTES} bytes")
        if self.kind in ("json_schema", "tool_call"):
            try:
                value = json.loads(self.spec)
            except ValueError as exc:
                _bad("constraint.spec", f"must be JSON for kind {self.kind!r}: {exc}")
            if self.kind == "tool_call" and not (
                isinstance(value, dict)
                and isinstance(value.get("tools"), list)
                and value["tools"]
                and all(
                    isinstance(t, dict)
                    and isinstance(t.get("begin", ""), str)
                    and isinstance(t.get("end", ""), str)
                    and isinstance(t.get("schema", {}), (dict, bool))
                    for t in value["tools"]
                )
            ):
                _bad(
                    "constraint.spec",
                    'for kind "tool_call" must be {"tools": [{"begin": str, "schema": object, '
                    '"end": str}, ...]} with at least one tool',
                )
        elif self.kind in ("regex", "ebnf") and not self.spec:
            _bad("constraint.spec", f"must hold the {self.kind} for kind {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    First the penalties change the logits (greedy rows too): ``repetition_penalty`` (HF/vLLM)
    divides the positive and multiplies the negative logit of every token seen in the prompt
    or the output; ``frequency_penalty`` times a token's count in the output plus
    ``presence_penalty`` if it occurs there at all is subtracted (OpenAI). Until
    ``min_tokens`` tokens were generated, EOS (unless ``ignore_eos``) and ``stop_token_ids``
    cannot be drawn. ``temperature == 0`` is greedy (argmax). Otherwise logits are divided by
    the temperature, cut to the ``top_k`` most likely tokens (0 = no cut), to tokens whose
    probability is at least ``min_p`` times the top one's (0 = off) and to the smallest set
    whose probability reaches ``top_p``, then sampled. With ``seed`` set, the draw for sequence
    position ``n`` depends only on (seed, n) and the logits: the same seed gives the same
    tokens whatever requests share the batch, and after a KV handoff or a preemption.

    ``logprobs`` (None: off; N in [0, 20]) asks for each generated token's log probability and
    the N most likely tokens', under the distribution the token was drawn from (after the
    penalties, the masking, the temperature and the cuts; a greedy row's at temperature 1).

    A bad value raises :class:`~libs.common.errors.InvalidArgument` (a ``ValueError``) whose
    ``field`` names the proto field, e.g. ``sampling.top_p``. Checks that need context (the
    context limit, the vocabulary) belong to whoever knows it: the entrypoint and the engine.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        t = self.temperature
        if not math.isfinite(t) or t < 0:
            _bad("temperature", f"must be a finite number >= 0 (0 = greedy), got {t}")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails too
            _bad("top_p", f"must lie in (0, 1] (0 on the wire means 1), got {self.top_p}")
        if self.top_k < 0:
            _bad("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            _bad("seed", f"must lie in [0, 2**63), got {self.seed}")
        if self.max_tokens <= 0:
            _bad("max_tokens", f"must be > 0, got {self.max_tokens}")
        for i, tok in enumerate(self.stop_token_ids):
            if tok < 0:
                _bad(f"stop_token_ids[{i}]", f"token id {tok} is negative; token ids are >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _bad("logprobs", f"must lie in [0, {MAX_LOGPROBS}] (absent = off), got {self.logprobs}")
        self._check_penalties()

    def _check_penalties(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:  # NaN fails too
            _bad("min_p", f"must lie in [0, 1] (0 = off), got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            _bad(
                "min_tokens",
                f"must lie in [0, max_tokens] = [0, {self.max_tokens}], got {self.min_tokens}",
            )
        r = self.repetition_penalty
        if not (math.isfinite(r) and r > 0):
            _bad("repetition_penalty", f"must be a finite number > 0 (1 = off), got {r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:  # NaN fails too
                _bad(name, f"must lie in [-2, 2] (0 = off), got {v}")

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the request's token history (a penalty is on)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_proto(
        cls, msg: common_pb2.SamplingParams, max_tokens: int | None = None
    ) -> SamplingParams:
        """The settings a wire message carries; ``max_tokens`` overrides the message's.

        Raises InvalidArgument naming the field (``sampling.<name>``) for a value out of range.
        """
        return cls(
            temperature=msg.temperature,
            top_p=msg.top_p if msg.top_p != 0 else 1.0,  # 0 on the wire means "not set"
            top_k=msg.top_k,
            seed=msg.seed if msg.HasField("seed") else None,
            max_tokens=msg.max_tokens if max_tokens is None else max_tokens,
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            min_p=msg.min_p,
            min_tokens=msg.min_tokens,
            # 0 on the wire means "not set" (an older sender), as for top_p
            repetition_penalty=msg.repetition_penalty if msg.repetition_penalty != 0 else 1.0,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            logprobs=msg.logprobs if msg.HasField("logprobs") else None,
            constraint=Constraint(msg.constraint.kind, msg.constraint.spec)
            if msg.HasField("constraint")
            else None,
        )

    def to_proto(self) -> common_pb2.SamplingParams:
        msg = common_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        if self.seed is not None:
            msg.seed = self.seed
        if self.logprobs is not None:
            msg.logprobs = self.logprobs
        if self.constraint is not None:
            msg.constraint.kind, msg.constraint.spec = self.constraint.kind, self.constraint.spec
        return msg


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability and the most likely tokens' (``logprobs`` above);
    ``top_ids``/``top_logprobs`` most likely first."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def to_proto(self) -> common_pb2.TokenLogprobs:
        return common_pb2.TokenLogprobs(
            logprob=self.logprob, top_ids=list(self.top_ids), top_logprobs=list(self.top_logprobs)
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.TokenLogprobs) -> TokenLogprob:
        return cls(msg.logprob, tuple(msg.top_ids), tuple(msg.top_logprobs))


def _bad(name: str, message: str) -> NoReturn:
    raise InvalidArgument(message, field=f"sampling.{name}")
