"""The text side of a DeepSeek-V3 / R1 release, for chat-template tests (no weights).

``chat_templates/deepseek-v3.jinja`` and ``deepseek-r1.jinja`` are the ``chat_template`` strings
of DeepSeek-V3's and DeepSeek-R1's ``tokenizer_config.json`` as published (JSON-decoded). The
tokenizer is the bundled DeepSeek one cut back to the V3 family's added tokens, with R1's
``<think>`` / ``</think>`` at 128798 / 128799 where V3 has placeholders -- the shape of the
released tokenizer.json (their BPE vocabulary is the same 128,000 entries).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from libs.engine.tokenizer import bundled_tokenizer_path

TEMPLATES = Path(__file__).parent / "chat_templates"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
LAST_V3_ADDED = 128820  # ids above are V4's additions (DSML, search, image tokens...)


def template(name: str) -> str:
    """``deepseek-v3`` or ``deepseek-r1``: the released chat template."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def v3_tokenizer_json() -> str:
    spec = json.loads(bundled_tokenizer_path().read_text(encoding="utf-8"))
    added = [t for t in spec["added_tokens"] if t["id"] <= LAST_V3_ADDED]
    for t in added:
        if t["id"] in (128798, 128799):
            t.update(content="<think>" if t["id"] == 128798 else "</think>", special=False)
    spec["added_tokens"] = added
    return json.dumps(spec, ensure_ascii=False)


def v3_checkpoint(root: Path, chat_template: str | None, model_type: str = "deepseek_v3") -> Path:
    """config.json, tokenizer.json and tokenizer_config.json as a V3-family release has them."""
    root.mkdir(parents=True)
    config = {"model_type": model_type, "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1}
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text(v3_tokenizer_json(), encoding="utf-8")

    def added(content: str) -> dict[str, object]:
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": True,
            "rstrip": False,
            "single_word": False,
        }

    tok_config: dict[str, object] = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": added(BOS),
        "eos_token": added(EOS),
        "pad_token": added(EOS),
        "legacy": True,
        "model_max_length": 16384,
        "tokenizer_class": "LlamaTokenizerFast",
    }
    if chat_template is not None:
        tok_config["chat_template"] = chat_template
    (root / "tokenizer_config.json").write_text(json.dumps(tok_config, ensure_ascii=False))
    return root
