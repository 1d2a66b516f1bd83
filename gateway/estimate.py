"""What an attempt that ended without a usage report still cost: an estimate to bill instead of zero.

Vendors report usage only in a stream's last chunk. When the client goes away (or the upstream
breaks) before it, the backend has still produced, and billed, the tokens that reached the gateway.
The gateway cancels the upstream at once (draining it would pay for tokens nobody reads) and bills
an estimate, marked `estimated` in the usage event and the ledger:

- prompt: the upstream request body at 4 bytes per token, the same rule admission uses to reserve
  budget (an over-estimate by the JSON framing: the tenant pays at most a little more, never zero);
- output: the larger of the count of chunks that carried text (OpenAI-compatible servers send about
  one token per chunk) and the generated text at 4 bytes per token (vendors that batch tokens).

A whole (non-streamed) answer whose body was not read to its end (its attempt cancelled once its
status line came, or its body broke off) was generated in full: the prompt as above, and the output
from the body's size less its vendor's envelope (`whole_answer`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.types import ChatChunk, ChatRequest
from gateway.usage import Usage

BYTES_PER_TOKEN = 4


def _ceil_tokens(size: int) -> int:
    return -(-size // BYTES_PER_TOKEN)


def input_tokens(request: ChatRequest) -> int:
    """A chat's input tokens from the size of what would be sent (messages and tools as JSON), by the
    same rule: coarse, and high for prose, but never zero for a real request. For count_tokens where
    no backend can count."""
    return _ceil_tokens(len(msgspec.json.encode([request.messages, request.tools or []])))


def chunk_text_bytes(chunk: Any) -> int:
    """UTF-8 bytes of generated text (content, refusal, reasoning, tool-call names and arguments) in
    a chunk: reasoning is output the vendor bills too."""
    if isinstance(chunk, ChatChunk):
        size = 0
        for choice in chunk.choices:
            delta = choice.delta
            size += len((delta.content or "").encode()) + len((delta.refusal or "").encode())
            size += len((delta.reasoning_content or "").encode())
            for call in delta.tool_calls or ():
                if call.function is not None:
                    size += len((call.function.name or "").encode())
                    size += len((call.function.arguments or "").encode())
        return size
    data = getattr(chunk, "data", None)  # a passed-through legacy /completions chunk
    if isinstance(data, dict):
        return sum(
            len(str(choice.get("text") or "").encode())
            for choice in data.get("choices") or ()
            if isinstance(choice, dict)
        )
    return 0


class Produced:
    """Counts what a stream generated so far, to estimate its output if no usage report comes."""

    __slots__ = ("chunks", "text_bytes")

    def __init__(self) -> None:
        self.chunks = 0
        self.text_bytes = 0

    def add(self, chunk: Any) -> None:
        size = chunk_text_bytes(chunk)
        if size:
            self.chunks += 1
            self.text_bytes += size

    def estimate(self, request_body: bytes) -> Usage:
        """The usage to bill for a stream cut before the vendor reported any."""
        output = max(self.chunks, _ceil_tokens(self.text_bytes))
        return Usage(input_tokens=_ceil_tokens(len(request_body)), output_tokens=output)


# Tokens admission reserves for a request that sets no output limit (`output_estimate`), and what an
# answer whose size nothing tells is billed then (`whole_answer`).
DEFAULT_OUTPUT_ESTIMATE = 1024


class _GenerationConfig(msgspec.Struct):
    maxOutputTokens: int | None = None
    candidateCount: int | None = None


class _OutputLimit(msgspec.Struct):
    """The output cap and the number of choices as each vendor's request body spells them; every other
    field is skipped."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None
    n: int | None = None
    generationConfig: _GenerationConfig | None = None


_output_limit = msgspec.json.Decoder(_OutputLimit)


def _cap_and_choices(body: bytes) -> tuple[int | None, int]:
    """An upstream request's output cap per choice (None: it sets none, or its body is unreadable) and
    the choices it asks for (`n`, Gemini's `candidateCount`): every choice is billed."""
    try:
        found = _output_limit.decode(body)
    except msgspec.MsgspecError:
        return None, 1
    config = found.generationConfig
    nested = config.maxOutputTokens if config else None
    cap = found.max_completion_tokens or found.max_tokens or found.max_output_tokens or nested
    choices = found.n or (config.candidateCount if config else None) or 1
    return cap, max(choices, 1)


def output_estimate(body: bytes) -> int:
    """The output tokens to reserve for an upstream request: its cap (DEFAULT_OUTPUT_ESTIMATE without
    one) for each choice it asks for."""
    cap, choices = _cap_and_choices(body)
    return (cap or DEFAULT_OUTPUT_ESTIMATE) * choices


def whole_answer(request_body: bytes, answer_bytes: int | None, envelope_bytes: int) -> Usage:
    """The usage to bill for a whole answer its vendor generated and the gateway did not read to its
    end: the prompt as for a stream; the output from `answer_bytes`, the answer's size (or the least
    it is known to be), less `envelope_bytes`, what its vendor's answer holds besides the text (ids,
    model, usage...: the size of one with no text), at 4 bytes per token, never below 0 and never
    above the output the request allowed (its cap for every choice). With no size at all
    (`answer_bytes` None: a chunked answer none of which came), the output the request allowed, as
    admission reserved it (`output_estimate`): with a cap, the most its vendor can bill for it."""
    if answer_bytes is None:
        output = output_estimate(request_body)
    else:
        output = _ceil_tokens(max(0, answer_bytes - envelope_bytes))
        cap, choices = _cap_and_choices(request_body)
        if cap is not None:
            output = min(output, cap * choices)
    return Usage(input_tokens=_ceil_tokens(len(request_body)), output_tokens=output)
