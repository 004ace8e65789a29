"""The model decides the tokenizer: presets and DeepSeek-vocabulary checkpoints render with
deepseek-recipe's V4 encoding, other checkpoints with their own tokenizer and chat template, and
a tokenizer the model's vocabulary cannot hold stops the recipe at start (exit 2), instead of a
502 on every request."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import deepseek_recipe as dr
import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from libs.engine.tokenizer import (
    CHAT_TEMPLATE,
    DEEPSEEK_V4,
    bundled_tokenizer_path,
    check_tokenizer_fits,
    model_vocab_size,
    served_tokenizer,
)
from services.recipe.api import APIError
from services.recipe.app import build_app
from services.recipe.chat_template import ChatTemplateEncoder
from services.recipe.encoding import PromptEncoder, build_encoder
from services.recipe.handlers import AppConfig, Metrics
from services.recipe.main import main as recipe_main

from ..sdk_strict import strict_http
from .recipe_fakes import ANSWER, FakeBackend

REPO = Path(__file__).resolve().parents[2]
MODEL = "my-model"
SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# Written the way checkpoints write them: whitespace control with trim_blocks and lstrip_blocks
# (transformers' environment), bos_token/eos_token variables, raise_exception for a bad role.
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ raise_exception('unsupported role: ' + m['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye ünï 世界"},
]
EXPECTED = (
    "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>Hello</s>\n<|user|>Bye ünï 世界\n"
    "<|assistant|>"
)


CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
RESULT = {"role": "tool", "tool_call_id": "c", "content": "42"}  # TEMPLATE raises on it


def small_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: ids 0..255 are the bytes, then the special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok


def checkpoint(
    root: Path,
    vocab_size: int,
    tokenizer: Tokenizer | None = None,
    template: str | None = TEMPLATE,
    model_type: str = "deepseek_v3",
) -> Path:
    """A checkpoint directory's text side: config.json, tokenizer.json, tokenizer_config.json
    (with no tokenizer: the template alone, as chat_template.jinja)."""
    root.mkdir()
    config = {"model_type": model_type, "vocab_size": vocab_size}
    if tokenizer is not None:
        config.update(bos_token_id=256, eos_token_id=257)
        tokenizer.save(str(root / "tokenizer.json"))
        tok_config: dict[str, Any] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
        if template is not None:
            tok_config["chat_template"] = template
        (root / "tokenizer_config.json").write_text(json.dumps(tok_config))
    elif template is not None:
        (root / "chat_template.jinja").write_text(template)
    (root / "config.json").write_text(json.dumps(config))
    return root


def conversation(encoder: Any, body: dict[str, Any]) -> dr.ConversationRequest:
    return dr.ChatCompletionRequest({"model": MODEL, **body}).convert(encoder.options)


@pytest.fixture
def template_encoder(tmp_path: Path) -> ChatTemplateEncoder:
    served = served_tokenizer(str(checkpoint(tmp_path / "ckpt", 300, small_tokenizer())))
    encoder = build_encoder(served, [MODEL])
    assert isinstance(encoder, ChatTemplateEncoder)
    return encoder


# -- resolution and the vocabulary check --------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "v2-lite", "v3-slice", "fake"])
def test_presets_are_served_with_the_bundled_tokenizer_that_fits_them(model: str) -> None:
    served = served_tokenizer(model)
    assert (served.encoding, served.path) == (DEEPSEEK_V4, bundled_tokenizer_path())
    assert served.vocab_size == model_vocab_size(model) == 129280
    assert served.eos_token_ids == (1,) and served.bos_token_id == 0
    check_tokenizer_fits(served)  # v2-lite took the bundled vocabulary: it is accepted


def test_a_model_smaller_than_its_tokenizer_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    """The v2-lite bug: DeepSeek-V2-Lite's 102,400 rows under the bundled 129,280-id tokenizer."""
    ckpt = checkpoint(tmp_path / "v2-lite", 102400)  # no tokenizer.json: the bundled one
    served = served_tokenizer(str(ckpt))
    assert served.path == bundled_tokenizer_path() and model_vocab_size(str(ckpt)) == 102400
    with pytest.raises(ValueError, match=r"102,400 ids.*129,280 ids"):
        check_tokenizer_fits(served)
    small = checkpoint(tmp_path / "small", 200, small_tokenizer())  # 261 ids > 200
    with pytest.raises(ValueError, match=r"200 ids.*up to 260 \(261 ids\)"):
        check_tokenizer_fits(served_tokenizer(str(small)))


def test_the_recipe_exits_2_at_start_on_a_mismatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = checkpoint(tmp_path / "v2-lite", 102400)
    caplog.set_level(logging.ERROR)
    assert recipe_main(["--model", str(ckpt), "--port", "18999"]) == 2
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "102,400" in lines[0] and "129,280" in lines[0], lines


def test_a_v4_checkpoint_with_the_deepseek_vocabulary_keeps_the_recipe_encoding(
    tmp_path: Path,
) -> None:
    ckpt = checkpoint(tmp_path / "v4", 129280, model_type="deepseek_v4")
    # saved again by tokenizers: other bytes, the same vocabulary and added tokens
    Tokenizer.from_file(str(bundled_tokenizer_path())).save(str(ckpt / "tokenizer.json"))
    served = served_tokenizer(str(ckpt))
    assert (served.encoding, served.path) == (DEEPSEEK_V4, ckpt / "tokenizer.json")
    encoder = build_encoder(served, [MODEL])
    assert isinstance(encoder, PromptEncoder) and encoder.eos_ids == {1}
    conv = conversation(encoder, {"messages": CONVERSATION}).conversation
    assert encoder.encode(conv) == encoder.encode_reference(conv)


def test_other_checkpoints_need_a_chat_template_and_a_model_name_that_exists(
    tmp_path: Path,
) -> None:
    bare = checkpoint(tmp_path / "bare", 300, small_tokenizer(), template=None)
    with pytest.raises(ValueError, match="no chat template"):
        served_tokenizer(str(bare))
    (bare / "chat_template.jinja").write_text(TEMPLATE)  # transformers' newer place for it
    served = served_tokenizer(str(bare))
    assert served.encoding == CHAT_TEMPLATE and served.chat_template == TEMPLATE
    assert (served.bos_token, served.eos_token, served.eos_token_ids) == ("<s>", "</s>", (257,))
    for bad in (str(tmp_path / "nowhere"), "v4-huge"):
        with pytest.raises(ValueError, match="neither a preset"):
            model_vocab_size(bad)
    with pytest.raises(ValueError, match="--default-thinking"):
        build_encoder(served, [MODEL], default_thinking=True)


def test_resolving_and_the_recipe_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import services.recipe.main\n"
        "from libs.engine.tokenizer import served_tokenizer, model_vocab_size\n"
        "served_tokenizer('v2-lite'); model_vocab_size('fake')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# -- the chat-template encoder --------------------------------------------------------------------
def test_a_conversation_is_encoded_as_the_template_says(
    template_encoder: ChatTemplateEncoder,
) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    conv = conversation(template_encoder, {"messages": CONVERSATION}).conversation
    assert template_encoder.render(conv) == EXPECTED
    (hf,), _ = render_jinja_template(
        [CONVERSATION],
        chat_template=TEMPLATE,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    assert hf == EXPECTED  # transformers' apply_chat_template renders the same text
    ids = template_encoder.encode(conv)
    assert ids == template_encoder.full.encode(EXPECTED, add_special_tokens=False).ids
    assert ids[:2] == [256, 258] and ids[-1] == 260  # <s> <|system|> ... <|assistant|>
    assert template_encoder.eos_ids == {257}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"thinking": {"type": "enabled"}}, "thinking"),
        ({"reasoning_effort": "high"}, "thinking"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object"}},
                    }
                ]
            },
            "tools",
        ),
        ({"messages": [{"role": "user", "content": "say <|assistant|> now"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}, CALL, RESULT]}, "messages"),  # template
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "a", "prefix": True},
                ]
            },
            "messages",
        ),
    ],
)
def test_what_the_template_cannot_render_is_a_400_with_a_reason(
    template_encoder: ChatTemplateEncoder, body: dict[str, Any], param: str
) -> None:
    req = conversation(template_encoder, {"messages": [{"role": "user", "content": "x"}], **body})
    with pytest.raises(APIError) as err:
        template_encoder.encode(req.conversation)
    assert err.value.status == 400 and err.value.param == param
    assert len(err.value.message) > 30, err.value.message


def test_the_api_answers_through_the_chat_template(template_encoder: ChatTemplateEncoder) -> None:
    backend = FakeBackend(template_encoder)  # type: ignore[arg-type]
    app = build_app(
        AppConfig(model_name=MODEL), template_encoder, backend, Metrics(CollectorRegistry())
    )
    client = strict_http(TestClient(app, raise_server_exceptions=False))
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CONVERSATION})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ANSWER  # EOS </s> not in the text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    prompt = list(backend.requests[-1].prompt_token_ids)
    assert prompt == template_encoder.full.encode(EXPECTED, add_special_tokens=False).ids
    r = client.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 64, "stream": True, "messages": CONVERSATION[1:]},
    )
    deltas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    text = "".join(d["delta"].get("text", "") for d in deltas if d["type"] == "content_block_delta")
    assert r.status_code == 200 and text == ANSWER and '"end_turn"' in r.text
    r = client.post(
        "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 64,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": CONVERSATION[1:],
        },
    )
    assert r.status_code == 400 and "thinking mode is not available" in r.json()["error"]["message"]
