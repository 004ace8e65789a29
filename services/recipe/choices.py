"""Several choices of one request (OpenAI's ``n``), as data: the count, each choice's seed and
the merged output (no I/O).

``n`` generations of one prompt are ``n`` backend requests with the same prompt ids; the later
ones find the prompt's KV in the prefix cache, so nothing else is needed to share the prefill.
The protocol output is merged here: choice ``i`` carries ``index: i`` (in every streamed chunk
too) and the usage counts the prompt once and sums the completion tokens of every choice.

deepseek-recipe refuses ``n != 1`` itself ("currently only n = 1 is supported"), so the recipe
reads ``n`` off the body (:func:`read_n`) and converts the rest; each choice gets its own chunk
generator and ``StreamProcessor``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from libs.common.sampling import MAX_SEED

from .api import invalid

# Each choice is a full generation: 16 of a 4K-token answer hold 64K tokens of KV at once.
MAX_N = 16


def read_n(body: dict[str, Any]) -> int:
    """The request's ``n`` (1 when absent or null); a 400 naming ``n`` outside 1..MAX_N."""
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool):
        raise invalid(f"n must be an integer from 1 to {MAX_N}, got {n!r}", "n")
    if not 1 <= n <= MAX_N:
        raise invalid(
            f"n must be from 1 to {MAX_N} (choices generated for one prompt), got {n}; "
            f"send several requests for more",
            "n",
        )
    return n


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index``: ``seed`` itself for choice 0 (so ``n=1`` samples as
    before), a SHA-256-derived one in [0, 2**63) for the others, so choices differ and the
    choices of seed s never repeat those of seed s + 1."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"deepserve-choice/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % MAX_SEED


def usage_body(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    """OpenAI usage, with the cache fields DeepSeek's API adds (as deepseek-recipe writes it)."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "prompt_cache_hit_tokens": cached,
        "prompt_cache_miss_tokens": prompt - cached,
    }


def merged_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """One usage of several choices' usages: the first's prompt counts, completion counts
    (and ``completion_tokens_details``) summed."""
    out = dict(usages[0])
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    out["completion_tokens"] = completion
    out["total_tokens"] = int(out.get("prompt_tokens") or 0) + completion
    details: dict[str, int] = {}
    for u in usages:
        for k, v in (u.get("completion_tokens_details") or {}).items():
            if isinstance(v, int):
                details[k] = details.get(k, 0) + v
    if details:
        out["completion_tokens_details"] = details
    return out


def reindex_chunk(data: str, index: int) -> tuple[str, dict[str, Any]]:
    """A Chat Completions chunk of one choice as choice ``index``'s, its ``usage`` taken out
    (the merged usage comes once, at the end): (JSON, the parsed chunk as it came)."""
    chunk = json.loads(data)
    parsed = dict(chunk)
    for c in chunk.get("choices") or ():
        c["index"] = index
    if "usage" in chunk:
        chunk["usage"] = None
    return json.dumps(chunk, ensure_ascii=False), parsed


def usage_chunk(template: dict[str, Any], usage: dict[str, Any]) -> str:
    """The last chunk of a stream of several choices: no choices, the merged usage (the shape
    OpenAI sends for ``stream_options.include_usage``)."""
    keep = ("id", "object", "created", "model", "system_fingerprint")
    body = {k: template[k] for k in keep if k in template}
    return json.dumps({**body, "choices": [], "usage": usage}, ensure_ascii=False)


def merged_chat(bodies: list[str]) -> str:
    """One Chat Completions response of several choices' responses."""
    parsed = [json.loads(b) for b in bodies]
    out = parsed[0]
    choices = []
    for i, body in enumerate(parsed):
        choice = dict(body["choices"][0])
        choice["index"] = i
        choices.append(choice)
    out["choices"] = choices
    usages = [b["usage"] for b in parsed if isinstance(b.get("usage"), dict)]
    if usages:
        out["usage"] = merged_usage(usages)
    return json.dumps(out, ensure_ascii=False)
