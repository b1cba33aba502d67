"""Incremental detokenization and stop strings: exact text, no broken characters, stops across tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.text.detokenizer import (
    ByteLevelDetokenizer,
    OffsetsDetokenizer,
    StopStringMatcher,
    TextStream,
    make_detokenizer,
)
from services.gateway.text.tokenizer import GatewayTokenizer, gateway_tokenizer_dir
from tests.unit.gateway.test_gateway_support import build_tiny_tokenizer

HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> GatewayTokenizer:
    return GatewayTokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def smollm() -> GatewayTokenizer:
    return GatewayTokenizer(gateway_tokenizer_dir("smollm2-135m-instruct"))


def run(detok: ByteLevelDetokenizer | OffsetsDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids] + [detok.flush()]


# -- the tokenizer itself ------------------------------------------------------


def test_token_bytes_match_the_library_decoder_for_every_smollm_token(smollm: GatewayTokenizer) -> None:
    assert smollm.is_byte_level
    mismatched = [
        i for i in range(smollm.tokenizer.get_vocab_size())
        if i not in smollm.special_ids
        and smollm.token_bytes(i).decode("utf-8", errors="replace") != smollm.decode([i])
    ]
    assert mismatched == []


def test_smollm_chat_template_and_eos(smollm: GatewayTokenizer) -> None:
    text = smollm.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # the template adds a default system prompt
    assert smollm.eos_token_ids == [2]
    assert smollm.encode(text, add_special_tokens=False)[0] == 1  # <|im_start|> is one token


# -- byte-level path -------------------------------------------------------------


def test_emoji_split_over_tokens_is_released_whole(smollm: GatewayTokenizer) -> None:
    text = "ok 🎉🚀 日本語 done"
    ids = smollm.encode(text, add_special_tokens=False)
    pieces = run(ByteLevelDetokenizer(smollm), ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len(text.split())  # the emoji really were split over several tokens


def test_special_tokens_are_skipped_or_kept(tiny: GatewayTokenizer) -> None:
    ids = [1] + tiny.encode("Hello", add_special_tokens=False) + [2]
    assert "".join(run(ByteLevelDetokenizer(tiny), ids)) == "Hello"
    kept = "".join(run(ByteLevelDetokenizer(tiny, skip_special_tokens=False), ids))
    assert kept == "<|im_start|>Hello<|im_end|>"


@HYP
@given(text=st.text(min_size=1, max_size=60))
def test_valid_text_never_yields_a_broken_character(tiny: GatewayTokenizer, text: str) -> None:
    ids = tiny.encode(text, add_special_tokens=False)
    for detok in (ByteLevelDetokenizer(tiny), OffsetsDetokenizer(tiny)):
        pieces = run(detok, ids)
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)


@HYP
@given(data=st.data())
def test_random_tokens_concatenate_to_the_full_decode(tiny: GatewayTokenizer, data: st.DataObject) -> None:
    vocab = tiny.tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    pieces = run(ByteLevelDetokenizer(tiny), ids)
    assert "".join(pieces) == tiny.decode(ids)


@HYP
@given(data=st.data())
def test_random_byte_tokens_only_emit_complete_characters(tiny: GatewayTokenizer, data: st.DataObject) -> None:
    # single-byte tokens (the 256 base symbols) cut UTF-8 anywhere; whenever the bytes
    # released so far are valid UTF-8 the released text must equal their decode exactly
    byte_ids = [tiny.tokenizer.token_to_id(c) for c in _byte_symbols()]
    ids = data.draw(st.lists(st.sampled_from(byte_ids), min_size=1, max_size=30))
    detok = ByteLevelDetokenizer(tiny)
    released = ""
    raw = b""
    for t in ids:
        released += detok.push(t)
        raw += tiny.token_bytes(t)
        assert raw.decode("utf-8", errors="replace").startswith(released)
        try:
            assert released == raw.decode("utf-8")
        except UnicodeDecodeError:
            pass  # an unfinished (or invalid) tail is held or shown as U+FFFD, never half a character
    released += detok.flush()
    assert released == raw.decode("utf-8", errors="replace") == tiny.decode(ids)


def _byte_symbols() -> list[str]:
    from services.gateway.text.tokenizer import CHAR_TO_BYTE

    return sorted(CHAR_TO_BYTE)


def build_sentencepiece_like(folder: Path) -> GatewayTokenizer:
    """A Llama-2 style tokenizer: Metaspace words, single characters, byte fallback for the rest."""
    import string

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *string.ascii_letters, *",.!? ", "日", "é", "▁the", "▁a"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "a")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text("{}")
    return GatewayTokenizer(folder)


@pytest.fixture(scope="module")
def sentencepiece_like(tmp_path_factory: pytest.TempPathFactory) -> GatewayTokenizer:
    return build_sentencepiece_like(tmp_path_factory.mktemp("sp"))


@HYP
@given(text=st.text(alphabet="ab the,日é🎉ü\n", min_size=1, max_size=30), data=st.data())
def test_offsets_path_on_a_byte_fallback_tokenizer(sentencepiece_like: GatewayTokenizer, text: str,
                                                   data: st.DataObject) -> None:
    tok = sentencepiece_like
    assert not tok.is_byte_level
    full = tok.encode(text, add_special_tokens=False)
    # split where the prompt ends on a whole character (else "the rest" is not defined)
    cuts = [k for k in range(len(full)) if "\ufffd" not in tok.decode(full[:k])]
    k = data.draw(st.sampled_from(cuts))
    prompt, out = full[:k], full[k:]
    pieces = run(make_detokenizer(tok, prompt), out)
    expected = tok.decode(full)[len(tok.decode(prompt)):] if k else tok.decode(full)
    assert "".join(pieces) == expected
    assert all("\ufffd" not in p for p in pieces)


def test_offsets_detokenizer_holds_an_unfinished_character(tiny: GatewayTokenizer) -> None:
    byte_ids = [tiny.tokenizer.token_to_id(c) for c in "ðŁİī"]  # the four bytes of 🎉 (F0 9F 8E 89)
    detok = OffsetsDetokenizer(tiny)
    assert [detok.push(t) for t in byte_ids] == ["", "", "", "🎉"]


# -- stop strings ----------------------------------------------------------------


def test_stop_string_split_over_increments() -> None:
    m = StopStringMatcher(["\n\n"])
    assert m.push("Hello\n") == "Hello"
    assert m.matched is None
    assert m.push("\nworld") == ""
    assert m.matched == "\n\n"
    assert m.push("more") == ""


def test_stop_string_included_when_asked() -> None:
    m = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert m.push("abc E") == "abc "
    assert m.push("NDx") == "END"


def test_held_prefix_is_released_when_it_cannot_match() -> None:
    m = StopStringMatcher(["stop"])
    assert m.push("a st") == "a "
    assert m.push("ay") == "stay"
    assert m.push("s") == ""
    assert m.flush() == "s"


def test_earliest_stop_wins() -> None:
    m = StopStringMatcher(["world", "lo w"])
    assert m.push("hello world") == "hel"
    assert m.matched == "lo w"


@HYP
@given(text=st.text(alphabet="ab\n c", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       stops=st.lists(st.text(alphabet="ab\n c", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_matching_is_independent_of_how_text_is_split(text: str, cuts: list[int], stops: list[str]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    m = StopStringMatcher(stops)
    out = "".join(m.push(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)) + m.flush()
    # The stop string that is complete first wins (as if the text came a character at a time).
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    assert out == (text[:min(ends)[1]] if ends else text)


def test_text_stream_stops_across_tokens_and_respects_min_tokens(tiny: GatewayTokenizer) -> None:
    ids = tiny.encode("Hello world, the quick brown fox", add_special_tokens=False)
    s = TextStream(tiny, [], ["d, t"])
    out = ""
    for t in ids:
        out += s.push(t)
        if s.stopped:
            break
    assert out == "Hello worl" and s.stopped
    late = TextStream(tiny, [], ["Hello"], min_tokens=len(ids))
    text = "".join(late.push(t) for t in ids) + late.finish()
    assert text == "Hello world, the quick brown fox" and not late.stopped


def test_text_stream_finish_releases_the_held_tail(tiny: GatewayTokenizer) -> None:
    ids = tiny.encode("the end", add_special_tokens=False)
    s = TextStream(tiny, [], ["end of story"])
    body = "".join(s.push(t) for t in ids)
    assert body == "the "  # "end" could still become the stop string
    assert s.finish() == "end"
    assert not s.stopped


def test_gateway_tokenizer_dir_of_a_folder_without_fast_tokenizer_fails(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        gateway_tokenizer_dir(str(tmp_path))


def test_the_stop_string_completed_first_wins_whatever_the_split() -> None:
    # Found by the property test above: "c" is complete before "aca" is.
    for pieces in (["aaca"], ["aac", "a"], ["a", "a", "c", "a"]):
        m = StopStringMatcher(["c", "aca"])
        out = "".join(m.push(p) for p in pieces) + m.flush()
        assert (out, m.matched) == ("aa", "c"), pieces
