from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tinyvllm.engine.detokenizer import IncrementalDetokenizer, decode_token, special_token_ids
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

FFFD = "\ufffd"
TEXT = "The héllo wörld says 日本語 is fun 🙂, naïve café, Ünïcödé tests: ½ → ∞ done."


def _corpus() -> list[str]:
    rng = random.Random(0)
    text = (
        "héllo wörld 日本語 🙂 the quick brown fox jumps over lazy dogs naïve café Ünïcödé "
        "½ → ∞ 中文 字符 émoji 🎉 🚀 tests says is fun done STOP stop, . : ! ? \n"
    )
    words = text.split(" ")
    return [" ".join(rng.choice(words) for _ in range(40)) for _ in range(60)]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE (GPT-2 style) whose merges split multi-byte chars."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return _wrap(tok)


@pytest.fixture(scope="module")
def sp_tokenizer() -> PreTrainedTokenizerFast:
    """A sentencepiece-style (Metaspace) BPE: decode() drops a window's first leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<|endoftext|>"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return _wrap(tok)


def _stream(
    tokenizer: Any,
    prompt: list[int],
    ids: list[int],
    params: SamplingParams,
    chunk: int | None = 1,
    rng: random.Random | None = None,
    stop_terminated: bool = False,
) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed ids in chunks as an engine would; return the DELTA pieces and the stop string."""
    det = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas: list[str] = []
    stop = None
    i = 0
    while i < len(ids) and not det.finished:
        size = rng.randint(1, 4) if rng is not None else (chunk or 1)
        new = ids[i : i + size]
        i += len(new)
        last = i >= len(ids)
        stop = det.update(new, finished=last, stop_terminated=last and stop_terminated)
        deltas.append(det.get_next_output_text(finished=det.finished, delta=True))
    return deltas, stop, det


def _assert_never_retracts(deltas: list[str], final: str) -> None:
    shown = ""
    for piece in deltas:
        shown += piece
        assert final.startswith(shown), (shown, final)
    assert shown == final


def test_random_ids_deltas_concatenate_to_full_decode(tokenizer: Any) -> None:
    rng = random.Random(1234)
    vocab = len(tokenizer)
    for trial in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        skip = trial % 2 == 0
        params = SamplingParams(skip_special_tokens=skip, output_kind=RequestOutputKind.DELTA)
        deltas, stop, det = _stream(tokenizer, prompt, ids, params, rng=rng)
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert stop is None
        assert "".join(deltas) == expected, (prompt, ids)
        assert det.output_text == expected


def test_no_replacement_char_mid_stream(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    # The test only means something if some tokens hold part of a character.
    assert any(FFFD in decode_token(tokenizer, t) for t in ids)
    for prompt_text in ["", "Prompt: 日本", "🙂"]:
        prompt = tokenizer.encode(prompt_text)
        deltas, _, _ = _stream(tokenizer, prompt, ids, SamplingParams())
        assert all(FFFD not in d for d in deltas)
        assert "".join(deltas) == TEXT


def test_prompt_ending_inside_a_character(tokenizer: Any) -> None:
    ids = tokenizer.encode("日本語 🙂 wörld")
    # Split right after a partial-character token: the prompt ends inside a character.
    cut = next(i for i, t in enumerate(ids) if FFFD in decode_token(tokenizer, t)) + 1
    prompt, output = ids[:cut], ids[cut:]
    deltas, _, _ = _stream(tokenizer, prompt, output, SamplingParams())
    assert "".join(deltas) == tokenizer.decode(output)


def test_flush_incomplete_character_at_finish(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 🙂")
    partial = ids[:-1]
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    det.update(partial)
    assert FFFD not in det.output_text
    det.update([], finished=True)
    assert det.output_text == tokenizer.decode(partial)
    assert det.output_text.endswith(FFFD)


def test_stop_string_split_across_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    stop = "wörld says"
    start = TEXT.index(stop)
    params = SamplingParams(stop=[stop], output_kind=RequestOutputKind.DELTA)
    # Precondition: no single token holds the whole stop string.
    assert all(stop not in decode_token(tokenizer, t) for t in ids)
    for chunk in (1, 2, 3, 7):
        deltas, hit, det = _stream(tokenizer, [], ids, params, chunk=chunk)
        assert hit == stop and det.finished
        assert det.output_text == TEXT[:start]
        _assert_never_retracts(deltas, TEXT[:start])

    included = SamplingParams(stop=stop, include_stop_str_in_output=True)
    deltas, hit, det = _stream(tokenizer, [], ids, included)
    assert hit == stop
    assert det.output_text == TEXT[: start + len(stop)]
    _assert_never_retracts(deltas, TEXT[: start + len(stop)])


def test_hold_back_releases_text_that_cannot_start_a_stop(tokenizer: Any) -> None:
    params = SamplingParams(stop=["STOP"], output_kind=RequestOutputKind.DELTA)
    det = IncrementalDetokenizer(tokenizer, [], params)
    det.update(tokenizer.encode("fun ST"))
    assert det.output_text == "fun "  # "ST" may begin "STOP"
    assert det.get_next_output_text(finished=False, delta=True) == "fun "
    det.update(tokenizer.encode("x"))
    assert det.get_next_output_text(finished=False, delta=True) == "STx"  # it did not
    assert det.update(tokenizer.encode(" STO")) is None
    assert det.get_next_output_text(finished=False, delta=True) == " "
    assert det.update(tokenizer.encode("P done")) == "STOP"
    assert det.get_next_output_text(finished=True, delta=True) == ""
    assert det.output_text == "fun STx "


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    # Character-by-character: the first stop string to complete wins.
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end if include else end - len(stop)], stop
    return text, None


def test_random_stop_strings_never_leak(tokenizer: Any) -> None:
    rng = random.Random(99)
    corpus = _corpus()
    for trial in range(150):
        text = rng.choice(corpus)[: rng.randint(20, 120)]
        ids = tokenizer.encode(text)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 8)])
        if rng.random() < 0.3:
            stops.append("no such string ✗")
        include = trial % 3 == 0
        params = SamplingParams(
            stop=stops, include_stop_str_in_output=include, output_kind=RequestOutputKind.DELTA
        )
        expected, expected_stop = _reference_stop(text, stops, include)
        deltas, hit, det = _stream(tokenizer, [], ids, params, rng=rng)
        assert hit == expected_stop, (text, stops)
        assert det.output_text == expected, (text, stops)
        # Every streamed prefix is a prefix of the final text: no partial stop string leaked.
        _assert_never_retracts(deltas, expected)


def test_skip_special_tokens(tokenizer: Any) -> None:
    eos, im_start = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"])
    assert {eos, im_start} <= special_token_ids(tokenizer)
    hello, world = tokenizer.encode("héllo"), tokenizer.encode(" wörld")
    ids = [im_start, *hello, eos, *world, im_start]
    prompt = [*tokenizer.encode("Q: 日本"), im_start, eos]
    deltas, _, _ = _stream(tokenizer, prompt, ids, SamplingParams(skip_special_tokens=True))
    assert "".join(deltas) == "héllo wörld"
    deltas, _, _ = _stream(tokenizer, prompt, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "<|im_start|>héllo<|endoftext|> wörld<|im_start|>"


def test_stop_token_text_is_left_out(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = [*tokenizer.encode("done."), eos]
    keep = SamplingParams(skip_special_tokens=False)
    _, _, det = _stream(tokenizer, [], ids, keep, chunk=2, stop_terminated=True)
    assert det.finished and det.output_text == "done."
    newline = tokenizer.encode("\n")
    assert len(newline) == 1  # a plain (non-special) stop token id
    ids = [*tokenizer.encode("fun"), *newline]
    stop_on_newline = SamplingParams(stop_token_ids=newline)
    _, _, det = _stream(tokenizer, [], ids, stop_on_newline, stop_terminated=True)
    assert det.output_text == "fun"
    include = SamplingParams(stop_token_ids=newline, include_stop_str_in_output=True)
    _, _, det = _stream(tokenizer, [], ids, include, stop_terminated=True)
    assert det.output_text == "fun\n"


def test_min_tokens_delays_stop_strings(tokenizer: Any) -> None:
    ids = tokenizer.encode("fun fun fun")
    n_first = len(tokenizer.encode("fun"))
    params = SamplingParams(stop="fun", min_tokens=n_first)
    for chunk in (1, 100):  # also when min_tokens is crossed inside one update
        _, hit, det = _stream(tokenizer, [], ids, params, chunk=chunk)
        assert hit == "fun"
        assert det.output_text == "fun "


def test_earliest_ending_stop_wins_regardless_of_chunking(tokenizer: Any) -> None:
    ids = tokenizer.encode("the quick brown fox")
    params = SamplingParams(stop=["quick brown", "ick"])
    for chunk in (1, 100):
        _, hit, det = _stream(tokenizer, [], ids, params, chunk=chunk)
        assert hit == "ick" and det.output_text == "the qu"


def test_detokenize_false_is_a_no_op(tokenizer: Any) -> None:
    det = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams(detokenize=False))
    assert det.update(tokenizer.encode("héllo")) is None
    assert det.output_text == "" and not det.finished
    det.update([3], finished=True)
    assert det.finished
    assert IncrementalDetokenizer(None, [], SamplingParams()).update([1]) is None
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        IncrementalDetokenizer(None, [], SamplingParams(stop="x"))


def test_sentencepiece_first_token_keeps_its_space(sp_tokenizer: Any) -> None:
    prompt = sp_tokenizer.encode("the quick")
    output = sp_tokenizer.encode("brown fox jumps")
    assert not sp_tokenizer.decode(output).startswith(" ")  # decode alone drops the space
    deltas, _, _ = _stream(sp_tokenizer, prompt, output, SamplingParams())
    text = "".join(deltas)
    assert text == " brown fox jumps"
    assert sp_tokenizer.decode(prompt) + text == sp_tokenizer.decode(prompt + output)


class _SpyTokenizer:
    """Delegates to a real tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.backend_tokenizer = inner.backend_tokenizer
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, **kwargs)


def test_decode_window_stays_small(tokenizer: Any) -> None:
    spy = _SpyTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(_corpus()[:10]))
    assert len(ids) > 500
    eos = tokenizer.eos_token_id
    ids = ids + [eos] * 200  # ignore_eos runs emit long runs of skipped specials
    det = IncrementalDetokenizer(spy, tokenizer.encode("prompt 日本語"), SamplingParams())
    for t in ids:
        det.update([t])
    assert spy.longest <= 12
    assert det.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_decode_token(tokenizer: Any) -> None:
    assert decode_token(tokenizer, tokenizer.eos_token_id) == "<|endoftext|>"
    ascii_ids = tokenizer.encode("the quick fox")
    assert "".join(decode_token(tokenizer, t) for t in ascii_ids) == "the quick fox"
    pieces = [decode_token(tokenizer, t) for t in tokenizer.encode("🙂")]
    assert len(pieces) > 1 and all(p == FFFD for p in pieces)


class _CountingTokenizer(_SpyTokenizer):
    """A `_SpyTokenizer` that also counts its decode calls."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.calls += 1
        return super().decode(ids, **kwargs)


@pytest.mark.parametrize("stop_terminated", [False, True])
def test_final_only_without_stop_strings_decodes_once_at_the_end(
    tokenizer: Any, stop_terminated: bool
) -> None:
    """A final-only request's text is not needed before it finishes: no decode per step (each
    one costs cache misses after a model step), the same text in the end."""
    ids = [*tokenizer.encode(TEXT), tokenizer.eos_token_id]
    prompt = tokenizer.encode("prompt 日本語")
    final = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    spy = _CountingTokenizer(tokenizer)
    deferred = IncrementalDetokenizer(spy, prompt, final)
    eager = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    seeded = spy.calls
    for t in ids[:-1]:
        assert deferred.update([t]) is None
        eager.update([t])
    assert spy.calls == seeded  # nothing decoded per step
    assert deferred.update([ids[-1]], finished=True, stop_terminated=stop_terminated) is None
    eager.update([ids[-1]], finished=True, stop_terminated=stop_terminated)
    assert spy.calls > seeded
    assert deferred.finished and eager.finished
    assert deferred.get_next_output_text(True, False) == eager.get_next_output_text(True, False)
    assert deferred.get_next_output_text(True, False) == tokenizer.decode(
        ids[:-1] if stop_terminated else ids, skip_special_tokens=True
    )


def test_deferred_text_is_caught_up_when_asked_for_early(tokenizer: Any) -> None:
    """An abort asks a final-only request for its text before its last update."""
    ids = tokenizer.encode(TEXT)
    final = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    deferred = IncrementalDetokenizer(tokenizer, [], final)
    eager = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for t in ids[:20]:
        deferred.update([t])
        eager.update([t])
    assert deferred.output_text == eager.output_text != ""
    for t in ids[20:]:
        deferred.update([t])
        eager.update([t])
    assert deferred.output_text == eager.output_text


def test_stop_strings_and_streams_still_decode_every_step(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    for params in (
        SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, stop=["zzz"]),
        SamplingParams(output_kind=RequestOutputKind.DELTA),
    ):
        spy = _CountingTokenizer(tokenizer)
        det = IncrementalDetokenizer(spy, [], params)
        for t in ids:
            det.update([t])
        assert spy.calls >= len(ids)
