"""What an attempt that ended without a usage report still cost: an estimate to bill instead of zero.

Vendors report usage only in a stream's last chunk. When the client goes away (or the upstream
breaks) before it, the backend has still produced, and billed, the tokens that reached the gateway.
The gateway cancels the upstream at once (draining it would pay for tokens nobody reads) and bills
an estimate, marked `estimated` in the usage event and the ledger:

- prompt: the upstream request body at 4 bytes per token, the same rule admission uses to reserve
  budget (an over-estimate by the JSON framing: the tenant pays at most a little more, never zero);
- output: the larger of the count of chunks that carried text (OpenAI-compatible servers send about
  one token per chunk) and the generated text at 4 bytes per token (vendors that batch tokens).

A whole (non-streamed) answer cancelled after its status line, whose body did not come in time, was
generated in full: the prompt as above, and the output from the body's announced length
(`whole_answer`).
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


def whole_answer(request_body: bytes, answer_bytes: int) -> Usage:
    """The usage to bill for a whole answer its vendor generated and the gateway never read: the
    prompt as for a stream, the output from the answer's size (its `content-length`; 0 unknown) at 4
    bytes per token, high by the JSON around the text as the prompt is by the request's (a compressed
    answer's length is the compressed size: low)."""
    return Usage(input_tokens=_ceil_tokens(len(request_body)), output_tokens=_ceil_tokens(answer_bytes))
