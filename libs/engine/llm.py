"""Offline generation: ``LLM(model).generate(prompts, params)`` drives an Engine to the end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from libs.common.sampling import SamplingParams

from .engine import Engine, EngineConfig
from .scheduler import TokenEvent
from .tokenizer import load_tokenizer


@dataclass(frozen=True)
class GenerationOutput:
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    num_cached_tokens: int


class LLM:
    def __init__(
        self, model: str = "tiny", engine: Engine | None = None, **engine_kwargs: Any
    ) -> None:
        self.engine = engine or Engine(EngineConfig(model=model, **engine_kwargs))
        self._next_id = 0

    def encode(self, text: str) -> list[int]:
        return list(
            load_tokenizer(self.engine.tokenizer_source).encode(text, add_special_tokens=False).ids
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(
            load_tokenizer(self.engine.tokenizer_source).decode(
                list(token_ids), skip_special_tokens=True
            )
        )

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        decode_text: bool = True,
        on_step: Callable[[int], None] | None = None,
    ) -> list[GenerationOutput]:
        """Run all prompts together (continuous batching) and return outputs in prompt order.

        With an expert-parallel engine every rank calls this (with its own prompts, maybe
        none) and the ranks step in lockstep until none has work. ``on_step(n)``: called
        after the ``n``-th step (1, 2, ...), between steps (live re-placement goes there).
        """
        plist = (
            list(params)
            if isinstance(params, Sequence)
            else [params or SamplingParams()] * len(prompts)
        )
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        order: list[str] = []
        prompt_ids: dict[str, list[int]] = {}
        for prompt, p in zip(prompts, plist):
            tokens = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            rid = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, tokens, p)
            order.append(rid)
            prompt_ids[rid] = tokens
        generated: dict[str, list[int]] = {rid: [] for rid in order}
        finals: dict[str, TokenEvent] = {}
        steps = 0
        while self.engine.group_has_unfinished():
            for ev in self.engine.step():
                if ev.token_id is not None:
                    generated[ev.request_id].append(ev.token_id)
                if ev.finished:
                    finals[ev.request_id] = ev
            steps += 1
            if on_step is not None:
                on_step(steps)
        return [
            GenerationOutput(
                tuple(prompt_ids[rid]),
                tuple(generated[rid]),
                self.decode(generated[rid]) if decode_text else "",
                finals[rid].finish_reason,
                finals[rid].num_cached_tokens,
            )
            for rid in order
        ]


__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
