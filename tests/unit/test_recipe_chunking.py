"""Long prompts are tokenized in bounded pieces (issue 33 item 3): the ids are exactly those of
the whole text, tokenizing never holds the GIL for long, and a prompt found past the context
stops being tokenized."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import deepseek_recipe as dr
import pytest
from tokenizers import Tokenizer

from services.recipe.api import APIError
from services.recipe.chunking import encode_pieces, pieces_of, splittable
from services.recipe.encoding import PromptEncoder

MODEL = "deepseek-tiny"

TRICKY = [
    "Hello, world! It's 2024-05-06T12:34:56Z; pi=3.14159265358979 and 1,234,567.89 USD.",
    "1234567890" * 40 + "abc" + "98765" * 7 + " 7 77 777 7777 77777",
    "x1y22z333w4444 _a_ __init__ foo.bar-baz/qux?k=v&x=1#frag ''quoted'' \"dq\" `tick`",
    "naïve café déjà vu — e\u0301 a\u0308\u0323 n\u0303o Z\u0351\u0352a\u036b\u0350lgo",
    "Привет, мир! Съешь же ещё этих мягких французских булок. Ελληνικά κείμενα.",
    "مرحبا بالعالم، هذا نص عربي. हिन्दी में पाठ, किताब। ภาษาไทยไม่มีช่องว่าง 한국어 문장입니다.",
    "日本語のテキスト、カタカナ。中文，标点！「引用」・ー゠ヽゞ〇一二三 abc中def１２３",
    "中" * 300 + "文字" * 50 + "。" + "あ" * 40 + "ア" * 40 + "ｱ" * 20,
    "a" * 1000 + "." + "B" * 700 + "9" * 50 + "é" * 300,
    " " * 300 + "x" + " " * 129 + "\n" * 5 + "\t" * 7 + " \r\n \r\n" + "\u00a0\u3000\u2003" * 20,
    "emoji 👩\u200d👩\u200d👧 🎉🎉🎉 flags 🇫🇷🇯🇵 keycap 1\ufe0f\u20e3 ok👍🏽ok",
    "½⅓¾ Ⅳ Ⅻ ①②③ ١٢٣ ۴۵۶ ४५६ ๑๒๓ ²³ x²+y³",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n" * 5,
    "....!!!???---___===***+++" * 20 + "<｜User｜> <|im_end|> </s> [INST]",
    "mixedCASEwords\u200bzero\u200cwidth\u2060joiner\ufeffbom soft\u00adhyphen",
]

ALPHABET = [*"aZ09 \n\t\r.,!'_-", "é", "e\u0301", "中", "あ", "ア", "，", "。", "１", "½"]
ALPHABET += ["\u00a0", "\u3000", "🎉", "\u200d", "Я", "ि", "゠", "・", "ー", "  ", "123"]


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder([MODEL])


def whole(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def test_the_bundled_tokenizer_is_one_the_cuts_are_exact_for(encoder: PromptEncoder) -> None:
    assert encoder.split and splittable(encoder.plain)
    # one with added tokens (they cut text before pre-tokenizing) is not
    assert not splittable(encoder.full)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_cut_texts_give_identical_ids(encoder: PromptEncoder, chunk: int) -> None:
    for text in TRICKY:
        pieces = list(pieces_of(text, chunk))
        assert "".join(pieces) == text
        got = encode_pieces(
            encoder.plain, text, [(0, len(text))], split=True, chunk=chunk, batch_chars=97
        )
        assert got == whole(encoder.plain, text), (chunk, text[:40], pieces[:8])
    # the cuts happen: plain prose is cut near every space
    assert len(list(pieces_of(TRICKY[0], 1))) > 10


def test_random_tricky_texts_give_identical_ids(encoder: PromptEncoder) -> None:
    rng = random.Random(33)
    for _ in range(300):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 120)))
        got = encode_pieces(
            encoder.plain, text, [(0, len(text))], split=True, chunk=1, batch_chars=50
        )
        assert got == whole(encoder.plain, text), repr(text)


def test_long_message_ids_identical_to_the_library_encode(encoder: PromptEncoder) -> None:
    text = " ".join(TRICKY) * 40  # ~70,000 characters: cut into several pieces
    assert len(list(pieces_of(text))) > 2
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    conv = dr.ChatCompletionRequest(body).convert(encoder.options).conversation
    ref = encoder.encode_reference(conv)
    assert encoder.encode(conv) == ref == encoder.encode(conv, parallel=False)


def test_prompt_past_the_context_stops_being_tokenized(
    encoder: PromptEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``--max-context`` the rest is never tokenized: time and memory stay bounded."""
    seen: list[int] = []
    real = Tokenizer.encode_batch_fast
    plain = encoder.plain

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(plain, name)

        def encode_batch_fast(self, texts: list[str], **kw: Any) -> Any:
            seen.append(sum(map(len, texts)))
            return real(plain, texts, **kw)

    monkeypatch.setattr(encoder, "plain", Spy())
    text = "word " * 400_000  # 2,000,000 characters, 400,000 tokens
    with pytest.raises(APIError) as err:
        encoder.encode_text(text, max_prompt_tokens=1000)
    assert err.value.status == 400 and "--max-context" in str(err.value)
    assert sum(seen) < 300_000, seen  # one batch, not the 2,000,000 characters


class Ticker:
    """A thread that wakes every millisecond and records the longest wait between wakes: how
    long the GIL (or the CPU) was kept from it."""

    def __init__(self) -> None:
        self.stop, self.gaps = threading.Event(), [0.0]
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self.stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now


@contextmanager
def ticking() -> Iterator[Ticker]:
    t = Ticker()
    t.thread.start()
    time.sleep(0.02)
    try:
        yield t
    finally:
        t.stop.set()
        t.thread.join()


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(seconds ``fn`` took, the ticker's longest gap meanwhile)."""
    with ticking() as t:
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
    return took, max(t.gaps)


def test_a_prompt_at_the_size_limit_never_holds_the_gil_long(encoder: PromptEncoder) -> None:
    """A prompt the character check lets through (~20 MB at the default 163,840-token context)
    is tokenized while another thread keeps ticking; the old single ``encode`` call held the GIL
    for the whole call (the control below shows the ticker sees that)."""
    limit = 163_840
    rng = random.Random(0)
    words = ["hello", "world", "naïve", "über", "12345", "数据", "the", "quick,", "fox."]
    text = " ".join(rng.choice(words) for _ in range(100_000))
    text = (text + " ") * (encoder.chars_per_token * limit // (len(text) + 1))
    assert encoder.chars_per_token * limit - len(text) < 1_000_000  # near the limit, under it

    def encode() -> None:
        with pytest.raises(APIError, match="--max-context"):
            encoder.encode_text(text, max_prompt_tokens=limit)

    took, gap = timed(encode)
    sample = text[:200_000]
    ctl_took, ctl_gap = timed(lambda: encoder.plain.encode(sample, add_special_tokens=False))
    print(
        f"\n{len(text):,} characters: encode {took * 1000:.0f} ms, longest tick gap "
        f"{gap * 1000:.1f} ms; control (one encode call, {len(sample):,} characters): "
        f"{ctl_took * 1000:.0f} ms, gap {ctl_gap * 1000:.1f} ms"
    )
    assert ctl_gap > 0.8 * ctl_took  # the ticker does see a call that holds the GIL
    # 50 ms on an idle machine (docs/security.md); the margin is for a loaded CI runner
    assert gap < max(0.1, took / 5), (gap, took)


def test_a_tokenizer_panic_is_a_400_not_a_500(
    encoder: PromptEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """~10.5 million spaces pass the character check and make Oniguruma panic ("retry-limit-in-
    match over", a BaseException through pyo3): that was an empty 500 after 5 s."""

    class PanicException(BaseException):  # pyo3_runtime's, which cannot be imported
        pass

    class Panics:
        def encode_batch_fast(self, texts: list[str], **kw: Any) -> Any:
            raise PanicException("Onig: Regex search error: retry-limit-in-match over")

    monkeypatch.setattr(encoder, "plain", Panics())
    with pytest.raises(APIError) as err:
        encoder.encode_text("x", max_prompt_tokens=1000)
    assert err.value.status == 400 and "backtracking limit" in str(err.value)
