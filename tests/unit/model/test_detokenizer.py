"""Incremental detokenization: multi-byte characters split over tokens, stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvrelay.model.formats.hf_loader import load_hf_tokenizer
from kvrelay.model.text.detokenizer import IncrementalDetokenizer
from kvrelay.model.text.tokenizer import Tokenizer
from kvrelay.testing.models import write_tiny_hf_model

TEXT = "What is the capital of France? Ωmega 中文 🚀 naïve café, Paris!\nDone."


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = write_tiny_hf_model(tmp_path_factory.mktemp("d") / "m")
    return load_hf_tokenizer(d, 384)


def _stream(tok: Tokenizer, ids: list[int], detok: IncrementalDetokenizer, seed: int) -> list[str]:
    rng = random.Random(seed)
    deltas, i = [], 0
    while i < len(ids) and not detok.stopped:
        n = rng.choice([1, 1, 2, 3])
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("seed", range(4))
def test_stream_equals_full_decode_and_never_splits_a_character(tok: Tokenizer, seed: int) -> None:
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(TEXT)
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)  # the test needs split chars
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(tok, ids, detok, seed)
    assert "".join(deltas) == TEXT == detok.text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize(
    "stop,include,expect",
    [
        (["capital"], False, "What is the "),
        (["capital"], True, "What is the capital"),
        (["Paris", "France"], False, "What is the capital of "),
        (["中文"], True, "What is the capital of France? Ωmega 中文"),
        (["not there"], False, TEXT),
    ],
)
def test_stop_strings(tok: Tokenizer, stop: list[str], include: bool, expect: str) -> None:
    for seed in range(3):
        detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
        deltas = _stream(tok, tok.encode(TEXT), detok, seed)
        assert "".join(deltas) == expect == detok.text
        assert detok.stopped == (expect != TEXT)


def test_min_tokens_defers_stop_strings(tok: Tokenizer) -> None:
    """vLLM: stop strings count once more than min_tokens tokens are out; a stop
    string in the text before then is passed over."""
    ids = tok.encode("a, b, c, d", add_special_tokens=False)
    comma = next(i for i in range(1, len(ids) + 1) if "," in tok.decode(ids[:i]))
    plain = IncrementalDetokenizer(tok, [], stop=[","])
    assert plain.add(ids) == "a" and plain.stopped
    late = IncrementalDetokenizer(tok, [], stop=[","], min_tokens=comma)
    text = "".join(late.add([t]) for t in ids)
    assert late.stopped and text == "a, b", text


def test_text_that_may_start_a_stop_string_is_held_back(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["Paris!"])
    out = detok.add(tok.encode("I like Par"))
    assert out == "I like "
    assert detok.add(tok.encode("ma")) == "Parma"
    assert detok.add(tok.encode(" Pa")) == " "
    assert detok.finish() == "Pa"
    assert detok.text == "I like Parma Pa" and not detok.stopped


def test_special_tokens_are_not_shown(tok: Tokenizer, tmp_path: Path) -> None:
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(tok.encode("Hi<|im_end|>")) + detok.finish() == "Hi"


class _NoRawTokenizer:
    """The same tokenizer without its ``tokenizers`` object: the window decoding path."""

    def __init__(self, tok: Tokenizer) -> None:
        self.decode = tok.decode


@pytest.mark.parametrize("seed", range(3))
def test_decode_stream_and_window_paths_agree_even_on_a_cut_character(
    tok: Tokenizer, seed: int
) -> None:
    prompt = tok.encode("hi")
    ids = tok.encode(TEXT + "🚀")
    cut = ids[:-1]  # the rocket's last byte never arrives: finish() shows U+FFFD, as decode
    for tokens in (ids, cut):
        fast = IncrementalDetokenizer(tok, prompt)
        assert fast._stream is not None
        slow = IncrementalDetokenizer(_NoRawTokenizer(tok), prompt)  # type: ignore[arg-type]
        assert slow._stream is None
        a, b = _stream(tok, tokens, fast, seed), _stream(tok, tokens, slow, seed)
        assert "".join(a) == "".join(b) == tok.decode(tokens)
