"""Incremental detokenization and stop strings (minivllm/engine/detokenizer.py, chapter 02).

The specification: feeding a request's generated ids to `IncrementalDetokenizer` in any
chunking yields pieces that, joined, are exactly the tokenizer's own decode of those ids, and
no piece ever shows a half character. Checked on the two tokenizer families that split
characters into byte tokens: byte-level BPE (the demo model, GPT-2 style) and SentencePiece
with byte fallback (Llama 2 style; a tiny model trained here at test time).
"""

from __future__ import annotations

import io
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings

# Pieces of multilingual text; several are surely missing from both vocabularies (龍, 🦀, the
# ZWJ family, the rainbow flag), so they are spelled as one token per UTF-8 byte.
FRAGMENTS = [
    "hello", " world", "The", " cat", ",", ".", "!", "?", "42",  # ASCII
    "café", " naïve", "über", "e\u0301", "straße", "Ωmega",  # Latin accents (one combining)
    "你好", "世界", "模型", "龍", "こんにちは", "カタカナ", "日本語",  # Chinese, Japanese
    "😀", "🦀", "👍🏽", "👨\u200d👩\u200d👧", "🏳️\u200d🌈",  # emoji, skin tone, ZWJ sequences
    " ", "  ", "\n", "\n\n", "\t",
]  # fmt: skip
CHARS = sorted(set("".join(FRAGMENTS)))
texts = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join),
    st.text(alphabet=st.sampled_from(CHARS), max_size=24),
)
# Tests share module-scoped tokenizers, which hypothesis cannot see; they are read-only.
PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir):
    """Byte-level BPE: the demo model's own tokenizer (SmolLM2, GPT-2 style)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A Llama-style tokenizer built from a SentencePiece BPE model trained here (~0.1 s).

    byte_fallback=True and a small vocabulary, so rare characters become byte tokens; the
    transformers `LlamaTokenizer` (Metaspace, ByteFallback, Fuse, Strip decoders -- what Llama
    2 checkpoints load) is built from the trained vocab and merges directly, which avoids
    transformers' protobuf-based .model converter.
    """
    spm = pytest.importorskip("sentencepiece", reason="a test dependency: pip install it")
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "mat", "hello", "world", "café", "über",
             "你好", "世界", "中文", "こんにちは", "カタカナ", "😀", "\n"]  # fmt: skip
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=0.99, hard_vocab_limit=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False,  # keep text as is
        unk_id=0, bos_id=1, eos_id=2, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    return LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, scores))


@pytest.fixture(scope="module", params=["byte_level_bpe", "sentencepiece_byte_fallback"])
def tokenizer(request):
    name = "demo_tokenizer" if request.param == "byte_level_bpe" else "sentencepiece_tokenizer"
    return request.getfixturevalue(name)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def detokenize(tokenizer, prompt_ids: list[int], ids: list[int], chunks: list[int]) -> list[str]:
    """Feed `ids` in chunks of the given sizes (the last chunk takes the rest)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces, start = [], 0
    for size in chunks + [len(ids)]:
        pieces.append(detok.update(ids[start : start + size]))
        start += size
    assert detok.output_text == "".join(pieces), "output_text must be the joined pieces"
    return pieces


@PROPERTY
@given(text=texts)
def test_one_token_at_a_time_joins_to_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    pieces = detokenize(tokenizer, [], ids, [1] * len(ids))
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == expected, f"pieces {pieces} of ids {ids} do not join to {expected!r}"
    assert not any("\ufffd" in p for p in pieces), f"a half character leaked out: {pieces}"


@PROPERTY
@given(text=texts, data=st.data())
def test_any_chunking_joins_to_decode(tokenizer, text, data):
    ids = encode(tokenizer, text)
    chunks = data.draw(st.lists(st.integers(0, 5), max_size=len(ids)), label="chunk sizes")
    pieces = detokenize(tokenizer, [], ids, chunks)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), (
        f"chunks {chunks} gave pieces {pieces}"
    )


@PROPERTY
@given(prompt=texts, text=texts)
def test_after_a_prompt_the_text_continues_the_prompts_decode(tokenizer, prompt, text):
    """With context, the output is what decode(prompt + output) adds after the prompt's text;
    for SentencePiece that includes the first token's leading space."""
    prompt_ids, ids = encode(tokenizer, prompt), encode(tokenizer, text)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full_text = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
    assert full_text.startswith(prompt_text), "test premise: decoding is prefix-stable"
    pieces = detokenize(tokenizer, prompt_ids, ids, [1] * len(ids))
    assert "".join(pieces) == full_text[len(prompt_text) :], f"prompt {prompt!r}: {pieces}"


@PROPERTY
@given(fragments=st.lists(st.sampled_from(FRAGMENTS), max_size=10), data=st.data())
def test_non_canonical_token_sequences_join_to_decode(tokenizer, fragments, data):
    """A model may emit ids the tokenizer itself would never produce for that text (here:
    each fragment encoded alone, so merges across fragment borders are missing)."""
    ids = [i for fragment in fragments for i in encode(tokenizer, fragment)]
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)), label="chunk sizes")
    pieces = detokenize(tokenizer, [], ids, chunks)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), f"{pieces}"


@pytest.mark.parametrize("char", ["龍", "🦀"])
def test_a_character_split_into_bytes_is_held_back_until_complete(tokenizer, char):
    prompt_ids, ids = encode(tokenizer, "hello"), encode(tokenizer, char)
    assert len(ids) >= 2, f"test premise: {char!r} should be several byte tokens, got {ids}"
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.update([i]) for i in ids]
    early = "".join(pieces[:-1])
    assert "\ufffd" not in early and char not in early, (
        f"{char!r} (or a broken part of it) was emitted before its last byte token: {pieces}"
    )
    assert pieces[-1].endswith(char), f"the whole character comes with its last byte: {pieces}"


def test_sentencepiece_first_token_keeps_its_leading_space_after_a_prompt(
    sentencepiece_tokenizer,
):
    tok = sentencepiece_tokenizer
    prompt_ids, ids = encode(tok, "The capital is"), encode(tok, "hello")
    assert tok.convert_ids_to_tokens(ids)[0].startswith("▁"), "premise: '▁' marks a space"
    assert "".join(detokenize(tok, prompt_ids, ids, [1] * len(ids))) == " hello", (
        "after a prompt, the first word's space must appear (decode of the ids alone drops it)"
    )
    assert "".join(detokenize(tok, [], ids, [1] * len(ids))) == "hello", (
        "with no prompt there is nothing before the word, so no space"
    )


def test_a_prompt_ending_in_byte_tokens_does_not_corrupt_the_first_character(
    sentencepiece_tokenizer,
):
    """SentencePiece's byte fallback turns a whole run of byte tokens into "\ufffd"s if the run
    starts mid-character; the first window must therefore start on a character boundary."""
    tok = sentencepiece_tokenizer
    prompt_ids = encode(tok, "龍龍")
    full = encode(tok, "龍龍🦀")
    ids = full[len(prompt_ids) :]
    assert full[: len(prompt_ids)] == prompt_ids, "premise: the prompt's ids are a prefix"
    assert tok.decode(prompt_ids[-5:]).startswith("\ufffd"), (
        "premise: a window of the prompt's last 5 tokens starts inside a character"
    )
    assert "".join(detokenize(tok, prompt_ids, ids, [1] * len(ids))) == "🦀"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_are_skipped_or_kept_like_decode(demo_tokenizer, skip_special_tokens):
    tok = demo_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tok, "Hi") + [end] + encode(tok, " there 🦀")
    detok = IncrementalDetokenizer(tok, encode(tok, "Say hi"), skip_special_tokens)
    text = "".join(detok.update([i]) for i in ids)
    assert text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in text) != skip_special_tokens, f"skip={skip_special_tokens}: {text!r}"


def test_update_with_no_ids_returns_nothing(demo_tokenizer):
    detok = IncrementalDetokenizer(demo_tokenizer, encode(demo_tokenizer, "a"))
    assert detok.update([]) == "" and detok.output_text == ""


# -- stop strings -------------------------------------------------------------------------


def test_no_stop_string_in_the_text_means_no_stop():
    assert check_stop_strings("Hello world", 5, ["bye"], False) is None


def test_a_stop_string_split_across_two_updates_is_found_when_completed():
    assert check_stop_strings("Hello wor", 9, ["world"], False) is None
    assert check_stop_strings("Hello world!", 3, ["world"], False) == ("world", 6), (
        "the text is cut just before the stop string, and what followed it is dropped"
    )


def test_include_stop_str_in_output_cuts_after_the_stop_string():
    assert check_stop_strings("Hello world!", 3, ["world"], True) == ("world", 11)


def test_only_stop_strings_ending_in_the_new_characters_are_searched():
    assert check_stop_strings("stop here", 4, ["stop"], False) is None, (
        "'stop' lies wholly in old text, which an earlier step already searched"
    )


@pytest.mark.parametrize("stop", [["de", "bc"], ["bc", "de"], ["abc", "b"], ["b", "abc"]])
def test_with_several_stop_strings_the_first_completed_wins(stop):
    """'bc' ends before 'de'; 'b' ends before 'abc' -- whatever the list order."""
    winner = "bc" if "bc" in stop else "b"
    assert check_stop_strings("abcdef", 6, stop, False) == (winner, "abcdef".index(winner))


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc xy", max_size=30),
    stop=st.lists(st.text(alphabet="abc xy", min_size=1, max_size=3), min_size=1, max_size=3),
    include=st.booleans(),
    data=st.data(),
)
def test_streamed_stop_check_matches_a_search_of_the_whole_text(text, stop, include, data):
    """However the text arrives, the cut equals the one found by a plain search of the whole
    text for the stop string that is completed first."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    expected = None
    if found:
        end, start, s = min(found)
        expected = (s, end if include else start)
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=len(text)), label="chunk sizes")
    result, seen = None, 0
    for size in chunks + [len(text)]:
        new = text[seen : seen + size]
        seen += len(new)
        result = check_stop_strings(text[:seen], len(new), stop, include)
        if result is not None:
            break
    assert result == expected, f"chunks {chunks}: got {result}, want {expected}"
