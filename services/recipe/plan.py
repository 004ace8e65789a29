"""A request body -> what goes to the backend: the prompt ids, the sampling settings, how many
choices and how to make each one's output (no I/O; the app runs it in the encode pool).

Chat Completions, Responses and Messages are converted and rendered by deepseek-recipe
(:meth:`Planner.chat`); Completions is read by ``completions.py`` and its prompt tokenized with
no template (:meth:`Planner.completion`). Every refusal is an :class:`~.api.APIError` in the
caller's protocol: bad JSON, an unknown model, what the library or this module refuses.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr

from libs.common.sampling import Constraint
from libs.proto.deepserve.v1 import common_pb2, generate_pb2

from . import fields
from .answer import Choice
from .api import CHAT, RESPONSES, APIError, Protocol, conversion_error, invalid
from .choices import choice_seed, read_n
from .completions import CompletionJob, CompletionRequest, TextDecoder, parse_completion
from .constraints import output_constraint
from .encoding import Encoder
from .events import Job
from .guided import conflict, guided_constraint
from .logprobs import CompletionLogprobs, check_chat_logprobs
from .sampling import checked, extra_sampling
from .schemas import for_library


@dataclass
class Plan:
    """One request, ready for the backend. ``choices`` builds the jobs (on the event loop:
    deepseek-recipe's ``StreamProcessor`` is made where it is used)."""

    model: str
    prompt: list[int]
    sampling: common_pb2.SamplingParams  # choice 0's; choice i's seed is derived (choice_seed)
    n: int
    stream: bool
    include_usage: bool  # Completions' stream_options.include_usage
    agent: bool  # the request declares tools
    choices: Callable[[], Sequence[Choice]]

    def request(
        self, rid: str, index: int, tenant: str, agent: bool
    ) -> generate_pb2.GenerateRequest:
        """Choice ``index``'s backend request: its own request id and seed."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.sampling)
        if index and sampling.HasField("seed"):
            sampling.seed = choice_seed(sampling.seed, index)
        return generate_pb2.GenerateRequest(
            request_id=rid if index == 0 else f"{rid}-{index}",
            prompt_token_ids=self.prompt,
            sampling=sampling,
            model=self.model,
            tenant=tenant,
            traffic_class=common_pb2.TRAFFIC_CLASS_AGENT
            if agent
            else common_pb2.TRAFFIC_CLASS_CHAT,
        )


def decode_body(body: bytes, served: str) -> dict[str, Any]:
    """The JSON object of a request naming the served model; APIError otherwise."""
    try:
        decoded = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(
            f"could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    except RecursionError:  # json's C scanner counts its depth and gives up (~1000 deep)
        raise invalid(
            "could not parse the JSON body of your request: it is nested too deeply",
            code="invalid_json",
        ) from None
    if not isinstance(decoded, dict):
        raise invalid("the request body must be a JSON object")
    model = decoded.get("model")
    if not isinstance(model, str) or not model:
        raise invalid(
            "model is required (a string naming the served model)",
            "model",
            "missing_required_parameter",
        )
    if model != served:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
    return decoded


def greedy_if_no_nucleus(temperature: float, top_p: float) -> tuple[float, float]:
    """A nucleus of zero mass keeps only the most likely token: greedy."""
    return (0.0, 1.0) if top_p == 0.0 else (temperature, top_p)


class Planner:
    """Request bodies -> :class:`Plan`. Thread-safe (it only reads its encoder)."""

    def __init__(
        self, encoder: Encoder, model_name: str, default_max_tokens: int, max_context: int
    ) -> None:
        self.encoder, self.model_name = encoder, model_name
        self.default_max_tokens, self.max_context = default_max_tokens, max_context

    # -- Chat Completions, Responses, Messages ---------------------------------------------------
    def convert(
        self, proto: Protocol, body: bytes, rid: str
    ) -> tuple[str, dr.ConversationRequest, list[Any], dict[str, Any]]:
        """(model, conversation request, one chunk generator per choice, the decoded body);
        APIError for what the caller got wrong."""
        decoded = decode_body(body, self.model_name)
        # max_completion_tokens folded in; strict tools beside a structured answer unflagged
        sent = for_library(fields.check(decoded, proto.name), proto.name)
        n = 1
        if proto is CHAT and "n" in sent:
            # deepseek-recipe refuses n != 1: the recipe makes the choices itself.
            n = read_n(sent)
            sent = {k: v for k, v in sent.items() if k != "n"}
        if sent is not decoded:
            body = json.dumps(sent).encode()
        if proto is CHAT:
            check_chat_logprobs(decoded)
        model = str(decoded["model"])
        try:
            req = proto.request_cls(body)
            extra = (
                (req.namespace_tool_map(self.encoder.options), req.echo())
                if proto is RESPONSES
                else None
            )
            conv = req.convert(self.encoder.options)
            gens = [
                proto.request_cls.chunk_generator(conv, proto.id_prefix + rid, model)
                for _ in range(n)
            ]
        except (dr.ConversionError, ValueError, TypeError, OverflowError) as exc:
            raise conversion_error(exc) from None
        except RecursionError:  # only a body that nests deeper than any request needs
            raise invalid("the request is nested too deeply", code="invalid_json") from None
        # Images: the V4 conversion itself replaces them with "[Unsupported Image]" text.
        # conv.inference_options.output_constraint: the engine enforces what constraints.py maps.
        if extra is not None:
            gens = [g.with_namespace_tool_map(extra[0]).with_echo(extra[1]) for g in gens]
        return model, conv, gens, decoded

    def prompt_ids(self, conv: dr.ConversationRequest) -> list[int]:
        return self.encoder.encode(conv.conversation, max_prompt_tokens=self.max_context)

    def chat(self, proto: Protocol, body: bytes, rid: str, tenant: str) -> Plan:
        model, conv, gens, decoded = self.convert(proto, body, rid)
        prompt = self.prompt_ids(conv)
        sampling = self.chat_sampling(conv, len(prompt), decoded, proto.name)
        encoder = self.encoder

        def choices() -> list[Choice]:
            return [
                Job(
                    proto,
                    proto.id_prefix + rid,
                    model,
                    tenant,
                    conv,
                    encoder.stream_processor(gen, conv),
                )
                for gen in gens
            ]

        return Plan(
            model,
            prompt,
            sampling,
            len(gens),
            conv.stream,
            False,
            bool(conv.conversation.tools),
            choices,
        )

    def chat_sampling(
        self, conv: dr.ConversationRequest, prompt_len: int, body: dict[str, Any], protocol: str
    ) -> common_pb2.SamplingParams:
        """The sampling settings of a converted request; ``body``: the decoded request (its
        extra sampling fields and schemas as sent)."""
        extra = extra_sampling(body, protocol)
        io = conv.inference_options
        try:
            max_tokens = conv.resolve_max_tokens(prompt_len, self.max_context)
        except dr.ConversionError as exc:
            raise conversion_error(exc) from None
        if io.max_tokens is None:  # the library's default (8K..128K) is too much for a tiny model
            max_tokens = min(max_tokens, self.default_max_tokens)
        temperature, top_p = greedy_if_no_nucleus(
            1.0 if io.temperature is None else io.temperature, 1.0 if io.top_p is None else io.top_p
        )
        sp = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        if io.seed is not None:
            sp.seed = io.seed
        if io.logprobs:  # the library builds the protocol's logprobs from the events' pairs
            sp.logprobs = io.top_logprobs or 0
        thinking = self.encoder.parsing_options(conv).thinking_initial_stage is not None
        guided = guided_constraint(body)
        if guided is None:
            constraint = output_constraint(conv, thinking, body, protocol)
        else:
            constraint = _guided(guided[0], guided[1], conv, thinking, body)
        if constraint is not None:
            sp.constraint.kind, sp.constraint.spec = constraint.kind, constraint.spec
        return checked(sp, extra)

    # -- Completions -----------------------------------------------------------------------------
    def completion(self, proto: Protocol, body: bytes, rid: str) -> Plan:
        decoded = fields.check(decode_body(body, self.model_name), proto.name)
        req = parse_completion(decoded, extra_sampling(decoded, proto.name))
        prompt, echo = self.completion_prompt(req)
        sampling = self.completion_sampling(req, len(prompt))
        model, tokenizer, created = str(decoded["model"]), self.encoder.full, int(time.time())

        def choices() -> list[Choice]:
            return [
                CompletionJob(
                    i,
                    proto.id_prefix + rid,
                    model,
                    created,
                    TextDecoder(tokenizer, req.stop),
                    echo,
                    req.include_usage,
                    None if req.logprobs is None else CompletionLogprobs(tokenizer),
                )
                for i in range(req.n)
            ]

        return Plan(model, prompt, sampling, req.n, req.stream, req.include_usage, False, choices)

    def completion_prompt(self, req: CompletionRequest) -> tuple[list[int], str | None]:
        """(prompt ids, the text ``echo`` repeats, None without echo)."""
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            bad = next((t for t in ids if not 0 <= t < self.encoder.vocab_size), None)
            if bad is not None:
                raise invalid(
                    f"prompt holds token id {bad}; this model's ids are 0 to "
                    f"{self.encoder.vocab_size - 1}",
                    "prompt",
                )
            echo = self.encoder.full.decode(ids, skip_special_tokens=False) if req.echo else None
        else:
            assert req.prompt_text is not None
            ids = self.encoder.encode_text(req.prompt_text, max_prompt_tokens=self.max_context)
            echo = req.prompt_text if req.echo else None
        if not ids:
            raise invalid("the prompt is empty: send at least one token", "prompt")
        return ids, echo

    def completion_sampling(
        self, req: CompletionRequest, prompt_len: int
    ) -> common_pb2.SamplingParams:
        if prompt_len + req.max_tokens > self.max_context:
            raise APIError(
                400,
                f"the prompt is {prompt_len} tokens and max_tokens is {req.max_tokens}: "
                f"together more than this server's context limit of {self.max_context} tokens; "
                "shorten the prompt or lower max_tokens",
                param="max_tokens" if prompt_len < self.max_context else "prompt",
                code="context_length_exceeded",
            )
        temperature, top_p = greedy_if_no_nucleus(
            1.0 if req.temperature is None else req.temperature,
            1.0 if req.top_p is None else req.top_p,
        )
        sp = common_pb2.SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=req.max_tokens
        )
        if req.seed is not None:
            sp.seed = req.seed
        if req.logprobs is not None:
            sp.logprobs = req.logprobs
        if req.constraint is not None:
            sp.constraint.kind, sp.constraint.spec = req.constraint.kind, req.constraint.spec
        return checked(sp, req.extra)


def _guided(
    name: str,
    constraint: Constraint,
    conv: dr.ConversationRequest,
    thinking: bool,
    body: dict[str, Any],
) -> Constraint:
    """A chat request's vLLM guided field ``name`` (``guided.py``), refused beside another
    constraint (``response_format``, a required or named ``tool_choice``) or in thinking mode."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise conflict("response_format", name)
    oc = conv.inference_options.output_constraint
    if oc is not None and oc.kind == "tool_call_required":
        raise conflict("tool_choice", name)
    if thinking:
        raise invalid(
            f"{name} cannot be enforced in thinking mode (the constraint would cover the "
            'reasoning too): send "thinking": {"type": "disabled"}',
            name,
            "unsupported_value",
        )
    return constraint
