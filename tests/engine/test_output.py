"""Incremental detokenisation, stop strings and logprobs formatting, with a byte-level tokenizer (every
byte a token, so multi-byte characters arrive in pieces) and a real byte-level BPE vocabulary."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine.output import (
    CompletionLogprobs,
    IncrementalDetokenizer,
    TextOffsets,
    TextStream,
    chat_logprobs,
    parse_tool_calls,
    token_bytes,
    token_str,
)

EOS = 0


class ByteTokenizer:
    """UTF-8 bytes as ids, id 0 is EOS and decodes to nothing (as the engine's tiny-model tokenizer)."""

    eos_token_ids = frozenset({EOS})

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        return chr(token_id)


class BPETokenizer:
    """A small byte-level BPE (GPT-2 style, `Ġ` for spaces) built in memory."""

    def __init__(self, corpus: list[str]) -> None:
        from tokenizers import trainers

        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        backend.train_from_iterator(corpus, trainer)
        self._backend = backend

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)


TEXT = "héllo wörld, 日本語のテキスト 🎉🎉 naïve café!"


def stream(
    tokenizer, ids: list[int], stop: tuple[str, ...] = (), chunk: int = 1
) -> tuple[list[str], TextStream]:
    ts = TextStream(
        IncrementalDetokenizer(tokenizer), stop, frozenset(getattr(tokenizer, "eos_token_ids", ()))
    )
    deltas = []
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        deltas.append(ts.add(part, finished=i + chunk >= len(ids)))
        if ts.stopped:
            break
    return deltas, ts


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_multibyte_characters_are_never_split_across_deltas(chunk: int) -> None:
    tok = ByteTokenizer()
    deltas, _ = stream(tok, tok.encode(TEXT), chunk=chunk)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 5  # it really streamed, not one blob at the end


def test_bpe_merges_stream_to_the_same_text_as_a_full_decode() -> None:
    tok = BPETokenizer([TEXT * 3, "hello world " * 20, "the quick brown fox jumps over the lazy dog"])
    for text in (TEXT, "hello world, the quick brown fox", "  spaced   out\n\nlines\t🎉"):
        ids = tok.encode(text)
        deltas, _ = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)


def test_prompt_context_does_not_leak_into_the_output() -> None:
    tok = ByteTokenizer()
    prompt = [*tok.encode("the prompt ends mid-character: "), 0xE6, 0x97]
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.add([0xA5]) == ""  # the prompt's character completes, but it is not ours to show
    assert detok.add(tok.encode("ok")) == "ok"


def test_stop_string_cuts_the_text_and_finishes() -> None:
    tok = ByteTokenizer()
    deltas, ts = stream(tok, tok.encode("hello world, and more"), stop=("world",))
    assert "".join(deltas) == "hello "
    assert ts.stopped and ts.text == "hello "


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot() -> None:
    tok = ByteTokenizer()
    ts = TextStream(IncrementalDetokenizer(tok), ("</end>",))
    assert ts.add(tok.encode("answer: 42 <")) == "answer: 42 "
    assert ts.add(tok.encode("/e")) == ""
    assert ts.add(tok.encode("x")) == "</ex"  # not the stop string after all: released at once
    assert ts.add(tok.encode(" </en")) == " "
    assert ts.add(tok.encode("d> tail")) == ""
    assert ts.stopped and ts.text == "answer: 42 </ex "


def test_earliest_of_several_stop_strings_wins_even_within_one_delta() -> None:
    tok = ByteTokenizer()
    deltas, ts = stream(tok, tok.encode("one two three four"), stop=("four", "two"), chunk=50)
    assert "".join(deltas) == "one "
    assert ts.stopped and ts.matched == "two"  # which one matched: the API's `stop_reason`


def test_held_text_is_released_when_the_stream_finishes() -> None:
    tok = ByteTokenizer()
    ts = TextStream(IncrementalDetokenizer(tok), ("STOP",))
    assert ts.add(tok.encode("almost ST")) == "almost "
    assert ts.add([], finished=True) == "ST"
    assert not ts.stopped and ts.matched is None


def test_eos_and_stop_tokens_are_counted_but_never_shown() -> None:
    tok = ByteTokenizer()
    ts = TextStream(IncrementalDetokenizer(tok), (), frozenset({EOS, ord("#")}))
    out = ts.add(tok.encode("done#"), finished=False) + ts.add([EOS], finished=True)
    assert out == "done"


@dataclass
class LP:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def test_chat_logprobs_shape_and_partial_characters() -> None:
    tok = ByteTokenizer()
    e_acute = tok.encode("é")  # two bytes, two tokens
    content = chat_logprobs(
        tok,
        [LP(ord("a"), -0.5, [(ord("a"), -0.5), (ord("b"), -1.5)]), LP(e_acute[0], float("-inf"), [])],
        top_n=1,
    )
    assert content[0] == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [ord("a")],
        "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [ord("a")]}],
    }
    assert content[1]["token"] == "bytes:\\xc3"
    assert content[1]["bytes"] == [0xC3]
    assert content[1]["logprob"] == -9999.0  # JSON has no -inf
    continuation = tok.encode("é")[1]
    assert token_bytes(tok, continuation) == bytes([continuation])


def test_bpe_token_bytes_of_a_partial_character_come_from_the_vocabulary() -> None:
    tok = BPETokenizer(["plain ascii text only"])  # 🎉 stays four byte-level tokens
    ids = tok.encode("🎉")
    assert len(ids) > 1
    assert b"".join(token_bytes(tok, i) for i in ids) == "🎉".encode()
    assert token_str(tok, ids[0]).startswith("bytes:\\xf0")


def test_completion_logprobs_offsets_follow_the_text() -> None:
    tok = ByteTokenizer()
    prompt = tok.encode("ab")
    lp = CompletionLogprobs()
    offsets = TextOffsets(tok)
    lp.extend(tok, prompt, [None, LP(prompt[1], -2.0, [(ord("c"), -0.1)])], offsets)
    lp.extend(tok, [ord("c")], [LP(ord("c"), -0.1, [(ord("c"), -0.1)])], offsets)
    assert lp.to_dict() == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [None, -2.0, -0.1],
        "top_logprobs": [None, {"c": -0.1, "b": -2.0}, {"c": -0.1}],
        "text_offset": [0, 1, 2],
    }


def offsets_of(tokenizer: object, ids: list[int]) -> list[int]:
    offsets = TextOffsets(tokenizer)  # type: ignore[arg-type]
    return [offsets.next(i) for i in ids]


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), BPETokenizer(["plain ascii text only"])])
def test_text_offsets_count_a_split_character_once(tokenizer: object) -> None:
    """A character split over several tokens is one character of the text: every whole token is found
    at its offset (each piece counted as one character, so the offsets ran ahead of the text)."""
    ids = tokenizer.encode(TEXT)  # type: ignore[attr-defined]
    offsets = offsets_of(tokenizer, ids)
    assert offsets == sorted(offsets) and offsets[-1] < len(TEXT)
    whole = [
        (i, o) for i, o in zip(ids, offsets, strict=True) if not token_str(tokenizer, i).startswith("bytes:")
    ]
    assert len(whole) > 10
    for token_id, offset in whole:
        piece = tokenizer.decode([token_id])  # type: ignore[attr-defined]
        assert TEXT[offset : offset + len(piece)] == piece, (piece, offset)


def sentencepiece_words() -> HFTokenizer:
    """Whole words as SentencePiece spells them (`▁` for the space before a word), with its decoder."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3, "▁": 4}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return backend


def test_sentencepiece_tokens_keep_their_leading_space() -> None:
    """A SentencePiece decoder strips the leading space of what it decodes: a word's token decoded
    alone lost it ("world"); OpenAI and vLLM show " world", and its bytes hold the space."""
    tok = sentencepiece_words()
    assert [token_str(tok, i) for i in (1, 2, 4)] == [" Hello", " world", " "]
    [entry] = chat_logprobs(tok, [LP(2, -0.5, [(3, -1.5)])], 1)
    assert (entry["token"], entry["bytes"], entry["top_logprobs"][0]["token"]) == (
        " world",
        list(b" world"),
        " again",
    )


def test_text_offsets_keep_sentencepiece_spaces() -> None:
    """SentencePiece drops a word's leading space when its token is decoded alone; in the text it is
    there (offsets lost one character per word)."""
    backend = sentencepiece_words()
    ids = backend.encode("Hello world again").ids
    assert offsets_of(backend, ids) == [0, 5, 11]
    # a completion's offsets start at its own text, the prompt decoded only as context
    offsets = TextOffsets(backend, ids[:1])
    assert [offsets.next(i) for i in ids[1:]] == [0, 6]


def test_hermes_tool_calls_are_parsed_out_of_the_reply() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"tz": "CET"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_text_without_a_valid_tool_call_is_left_alone() -> None:
    assert parse_tool_calls("just words") == ("just words", [])
    broken = "<tool_call>{not json</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": "{}"}
