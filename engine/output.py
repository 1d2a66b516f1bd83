"""Turning engine token ids into what an OpenAI client sees: text streamed piece by piece, stop strings,
and logprobs in the chat and legacy completion shapes.

Incremental detokenisation follows vLLM/TGI: decoding a growing window of ids and emitting only the
part that has become stable. A byte-level BPE token can hold half of a UTF-8 character, and a
SentencePiece-style tokenizer drops a leading space when a sequence is decoded from its middle, so a
token's text is only known from its neighbours; the window keeps a few earlier tokens as context and holds
text back while it still ends in an incomplete character (U+FFFD)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
SENTENCEPIECE_SPACE = "\u2581"  # "▁", a space in SentencePiece vocabularies
# Earlier tokens decoded with each window; enough for any tokenizer's look-behind (vLLM uses 5).
CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Yields the text of a stream of token ids, delta by delta, so that the deltas always concatenate to
    `decode(all ids)` (minus any trailing incomplete character, released once it completes)."""

    def __init__(self, tokenizer: Decoder, context_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(context_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = len(self._ids)  # ids before this are already emitted as text

    def add(self, token_ids: Iterable[int]) -> str:
        self._ids.extend(token_ids)
        if len(self._ids) == self._read_offset:
            return ""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character (or a token with no text yet): wait for the next token
        delta = full[len(prefix) :]
        self._prefix_offset = max(self._read_offset, len(self._ids) - CONTEXT_TOKENS)
        self._read_offset = len(self._ids)
        return delta

    def held(self) -> str:
        """The text of the ids held back so far (an incomplete character as U+FFFD), still held."""
        if len(self._ids) == self._read_offset:
            return ""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (an incomplete character stays U+FFFD)."""
        text = self.held()
        self._read_offset = len(self._ids)
        return text


class TextOffsets:
    """The legacy `text_offset`: where each token's text starts in the text of the tokens before it,
    counted on the incremental detokenizer's text. Each token decoded alone (as before) counted a
    character split over several tokens once per piece and dropped a SentencePiece word's leading
    space, so the offsets drifted from the text after the first such token."""

    def __init__(self, tokenizer: Decoder, context_ids: Sequence[int] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, context_ids)
        self._released = 0  # characters the detokenizer has released

    def next(self, token_id: int) -> int:
        """The offset of `token_id`, the token after those seen so far."""
        start = self._released + len(self._detokenizer.held())
        self._released += len(self._detokenizer.add([token_id]))
        return start


@dataclass
class TextStream:
    """One request's generated text: detokenised, cut at the first stop string, and released only when
    no stop string can still begin in it, so a client never sees text that is later taken back."""

    detokenizer: IncrementalDetokenizer
    stop: Sequence[str] = ()
    hidden_ids: frozenset[int] = frozenset()  # EOS / stop tokens: counted, never shown (as vLLM)
    keep_stop: bool = False  # vLLM's include_stop_str_in_output: the matched stop string stays in the text
    min_tokens: int = 0  # vLLM's: a stop string must end past the text of the first min_tokens tokens
    num_tokens: int = 0  # token ids fed so far (hidden ones included)
    stop_from: int = 0  # a stop string ending at or before this offset of `text` does not count
    text: str = ""
    sent: int = 0  # characters of `text` already released
    stopped: bool = False  # a stop string matched; the caller aborts the request in the engine
    matched: str | None = None  # which one (vLLM's `stop_reason`: an Anthropic client's stop_sequence)

    def add(self, token_ids: Sequence[int], finished: bool = False) -> str:
        """Feeds new ids; returns the text that may be released now. With `finished`, releases the rest.
        Once a stop string matches, the ids after the one that completed it are not fed (`num_tokens`
        stops there): a speculative step emits several ids at once, and those past the stop string
        were never part of the answer, as they are not without speculation."""
        if self.stop and len(token_ids) > 1:
            last = len(token_ids) - 1
            released = []
            for i in range(len(token_ids)):
                released.append(self._add(token_ids[i : i + 1], finished and i == last))
                if self.stopped:
                    break
            return "".join(released)
        return self._add(token_ids, finished)

    def _add(self, token_ids: Sequence[int], finished: bool) -> str:
        if self.stopped:
            return ""
        if self.num_tokens < self.min_tokens:
            head = self.min_tokens - self.num_tokens
            self.text += self.detokenizer.add([t for t in token_ids[:head] if t not in self.hidden_ids])
            self.stop_from = len(self.text)
            self.num_tokens += len(token_ids[:head])
            token_ids = token_ids[head:]
        self.num_tokens += len(token_ids)
        visible = [t for t in token_ids if t not in self.hidden_ids]
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += self.detokenizer.add(visible)
        if finished:
            self.text += self.detokenizer.flush()
        hit = self._first_stop(searched_from)
        if hit is not None:
            cut, self.matched = hit
            self.text = self.text[: cut + len(self.matched) if self.keep_stop else cut]
            self.stopped = True
            finished = True
        end = len(self.text) if finished else len(self.text) - self._partial_stop_len()
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    def _first_stop(self, start: int) -> tuple[int, str] | None:
        """Where the first stop string in the text begins, and which it is (the first listed of
        those that begin there)."""
        hits = [
            (i, s)
            for s in self.stop
            if s and (i := self.text.find(s, max(start, self.stop_from - len(s) + 1))) >= 0
        ]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest


# --- logprobs -----------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes (`Ġ` is a space), reversed: how byte-level BPE vocabularies
    spell a token that holds part of a character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes of one token. Its decoded text when that is whole; for a token holding part of a
    UTF-8 character, the bytes its vocabulary entry spells (byte-level BPE `Ġ`-style or `<0xE2>`)."""
    text = tokenizer.decode([token_id])
    piece = getattr(tokenizer, "id_to_token", lambda _: None)(token_id)
    if piece and piece.startswith(SENTENCEPIECE_SPACE) and not text.startswith(" "):
        # SentencePiece decoders strip the leading space of what they decode, so a word's token decoded
        # alone lost it (OpenAI and vLLM show " world"); its vocabulary entry still has it
        text = " " + text
    if text and REPLACEMENT_CHAR not in text:
        return text.encode()
    if not piece:
        return text.encode()
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
        return bytes([int(piece[3:5], 16)])
    if len(piece) == 1 and ord(piece) < 256 and piece not in _gpt2_byte_decoder():  # one-byte vocabularies
        return bytes([ord(piece)])
    decoder = _gpt2_byte_decoder()
    if all(c in decoder for c in piece):
        return bytes(decoder[c] for c in piece)
    return text.encode()


def token_str(tokenizer: Any, token_id: int) -> str:
    """A token as OpenAI shows it: its text, or `bytes:\\xe2\\x80` when it is part of a character."""
    data = token_bytes(tokenizer, token_id)
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def safe_logprob(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999.0 is what OpenAI itself returns.
    return max(value, -9999.0)


def chat_logprobs(tokenizer: Any, logprobs: Sequence[Any], top_n: int) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` entries of a chat completion, from engine `TokenLogprob`s."""
    content = []
    for lp in logprobs:
        content.append(
            {
                "token": token_str(tokenizer, lp.token_id),
                "logprob": safe_logprob(lp.logprob),
                "bytes": list(token_bytes(tokenizer, lp.token_id)),
                "top_logprobs": [
                    {
                        "token": token_str(tokenizer, tid),
                        "logprob": safe_logprob(value),
                        "bytes": list(token_bytes(tokenizer, tid)),
                    }
                    for tid, value in lp.top[:top_n]
                ],
            }
        )
    return content


@dataclass
class CompletionLogprobs:
    """The legacy `choices[].logprobs` object: parallel lists of tokens, their logprobs, top
    alternatives and character offsets into the returned text."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def extend(
        self, tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[Any | None], offsets: TextOffsets
    ) -> None:
        """Appends one entry per token (a None logprob, as for the first prompt token, is shown as null);
        `offsets` follows the choice's text across calls."""
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = token_str(tokenizer, token_id)
            self.tokens.append(text)
            self.text_offset.append(offsets.next(token_id))
            if lp is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(safe_logprob(lp.logprob))
            top = {token_str(tokenizer, tid): safe_logprob(v) for tid, v in lp.top}
            top.setdefault(text, safe_logprob(lp.logprob))
            self.top_logprobs.append(top)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


# --- tool calls ---------------------------------------------------------------------------------------

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Splits a reply into its content and its tool calls, for models whose chat template asks for
    Hermes-style calls (Qwen2.5, Hermes, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
    A block that is not valid JSON stays in the content, so nothing the model wrote is lost."""
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    rest = text
    while (start := rest.find(TOOL_CALL_OPEN)) >= 0:
        end = rest.find(TOOL_CALL_CLOSE, start)
        body = rest[start + len(TOOL_CALL_OPEN) : end if end >= 0 else len(rest)]
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            break
        content.append(rest[:start])
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
        rest = rest[end + len(TOOL_CALL_CLOSE) :] if end >= 0 else ""
    content.append(rest)
    joined = "".join(content).strip()
    return (joined or None) if calls else text, calls
