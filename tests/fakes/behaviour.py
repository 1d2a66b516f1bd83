"""What every fake model "says": deterministic replies and token counts derived from the request.

Vendor modules parse their own wire format into a `Turn` and render the `Reply` back; the rules live
here once, so the three fakes agree.

Tokenizer: one token per whitespace-separated word (``len(text.split())``); an image counts a fixed
number of tokens per vendor (OpenAI 85, Anthropic 1600, Gemini 258); tool definitions count the words
of their JSON. Output tokens are the words of the reply text, or of the tool call's JSON arguments.

Replies, in order of precedence:
1. A tool call, when tools are offered and tool_choice forces one (``required``/``any`` -> the first
   tool, or the named tool), or when the last user message contains ``call <tool name>``. If that
   phrase is followed by a JSON object, the object is the arguments verbatim; otherwise the arguments
   are an example built from the tool's JSON schema (strings "example", numbers 1, enums their first
   value, every property filled).
2. After a tool result: ``Tool <name> returned: <result text>``.
3. JSON mode: ``{"echo": <last user text>}``; with a JSON schema, an example of the schema whose
   string fields hold the last user text.
4. Otherwise the last user message's text, verbatim, followed by ``[image]`` for each image in it
   (or "Hello! How can I help you today?" when there is no text).
When the conversation ends with an assistant message that the vendor continues (an Anthropic prefill,
vLLM's `continue_final_message`; OpenAI's own API answers it afresh), or with that message and then
Weir's user turn asking for the rest of it (`asks_to_continue`), the reply continues it: if the text
above starts with the partial answer, only the rest is sent, so it plus the reply is the whole echo
(asked in a user turn, a fake set to `continue_loosely` joins it as real models often do: `Rejoin`).
Then `stop` cuts the text before the first stop sequence (finish "stop"), and `max_tokens` keeps the
first max_tokens words (finish "length").
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.providers.base import CONTINUE_INSTRUCTION

GREETING = "Hello! How can I help you today?"


def asks_to_continue(text: str) -> bool:
    """A user turn asking for the rest of the reply above it, which the fake models obey as a real
    model does (near enough: a real one may word the join differently)."""
    return text.strip() == CONTINUE_INSTRUCTION


@functools.lru_cache(maxsize=64)
def count_tokens(text: str) -> int:
    # Cached: a HUGE fault's reply (`util.huge_words`) is split once, not on every request.
    return len(text.split())


def words(text: str) -> list[str]:
    return text.split()


def chunk_words(text: str, per_chunk: int = 1) -> list[str]:
    """Stream pieces of `per_chunk` words; spaces stay on the following piece, so pieces join back to
    `text` exactly (one word per chunk is how the fakes stream)."""
    parts = text.split(" ")
    pieces = [" ".join(parts[i : i + per_chunk]) for i in range(0, len(parts), per_chunk)]
    return [p if i == 0 else f" {p}" for i, p in enumerate(pieces) if p or i > 0]


@dataclass
class Tool:
    name: str
    schema: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    """The parts of a request that decide the reply, in vendor-neutral form."""

    last_user_text: str = ""
    images: int = 0  # images in the last user message
    tools: list[Tool] = field(default_factory=list)
    forced_tool: str | None = None  # tool_choice names a tool, or "required"/"any" (the first tool)
    tools_disabled: bool = False  # tool_choice "none"
    tool_result: tuple[str, str] | None = None  # (tool name, result text) when the last message is one
    json_mode: bool = False
    json_schema: dict[str, Any] | None = None
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    prefill: str | None = None  # text of a trailing assistant message: the reply continues it
    rejoin: Rejoin | None = None  # how a continuation asked for in a user turn is joined to `prefill`


@dataclass(frozen=True)
class Rejoin:
    """How a fake model joins a continuation it was asked for in a user turn onto its partial answer,
    the ways real models often do despite the instruction: it writes the answer's last `restate`
    words again first, starts the whole answer over (`restart`), or (neither) begins without the
    whitespace that joins the two, as a new message does."""

    restate: int = 0
    restart: bool = False

    def reply(self, prefill: str, rest: str) -> str:
        """The reply, for a partial answer `prefill` whose exact continuation is `rest`."""
        if self.restart:
            return prefill + rest
        if self.restate:
            return " ".join(words(prefill)[-self.restate :]) + rest
        return rest.lstrip()


@dataclass
class Reply:
    text: str = ""
    tool_name: str | None = None
    tool_args: dict[str, Any] | None = None
    finish: str = "stop"  # "stop" | "length" | "tool_calls" | "stop_sequence"
    stop_sequence: str | None = None

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.tool_args or {})

    @property
    def output_tokens(self) -> int:
        return count_tokens(self.arguments_json) if self.tool_name else count_tokens(self.text)


_CALL = re.compile(r"\bcall\s+([A-Za-z0-9_.\-]+)", re.IGNORECASE)


def plan_reply(turn: Turn) -> Reply:
    tool = _chosen_tool(turn)
    if tool is not None:
        return Reply(tool_name=tool.name, tool_args=_tool_arguments(turn, tool), finish="tool_calls")
    if turn.tool_result is not None and not turn.last_user_text:
        name, result = turn.tool_result
        text = f"Tool {name} returned: {result}"
    elif turn.json_schema is not None:
        text = json.dumps(example_for_schema(turn.json_schema, turn.last_user_text))
    elif turn.json_mode:
        text = json.dumps({"echo": turn.last_user_text})
    else:
        text = " ".join([turn.last_user_text, *["[image]"] * turn.images]).strip() or GREETING
    if turn.prefill and text.startswith(turn.prefill):
        text = text[len(turn.prefill) :]
        if turn.rejoin is not None:
            text = turn.rejoin.reply(turn.prefill, text)
    reply = Reply(text=text)
    for stop in turn.stop:
        cut = reply.text.find(stop) if stop else -1
        if cut >= 0:
            reply = Reply(text=reply.text[:cut], finish="stop_sequence", stop_sequence=stop)
    if turn.max_tokens is not None and count_tokens(reply.text) > turn.max_tokens:
        # A continuation's leading space is part of its first token, as in a real model's output.
        lead = reply.text[: len(reply.text) - len(reply.text.lstrip())]
        reply = Reply(text=lead + " ".join(words(reply.text)[: turn.max_tokens]), finish="length")
    return reply


def _chosen_tool(turn: Turn) -> Tool | None:
    if not turn.tools or turn.tools_disabled:
        return None
    by_name = {t.name: t for t in turn.tools}
    if turn.forced_tool in ("required", "any"):
        return turn.tools[0]
    if turn.forced_tool is not None:
        return by_name.get(turn.forced_tool)
    for match in _CALL.finditer(turn.last_user_text):
        if match.group(1) in by_name:
            return by_name[match.group(1)]
    return None


def _tool_arguments(turn: Turn, tool: Tool) -> dict[str, Any]:
    match = re.search(rf"\bcall\s+{re.escape(tool.name)}\s*(\{{.*\}})", turn.last_user_text, re.DOTALL)
    if match:
        try:
            args = json.loads(match.group(1))
        except ValueError:
            args = None
        if isinstance(args, dict):
            return args
    example = example_for_schema(tool.schema or {"type": "object"}, "example")
    return example if isinstance(example, dict) else {}


def example_for_schema(schema: dict[str, Any], text: str) -> Any:
    """A value valid for a (simple) JSON schema: objects get every property, strings `text`."""
    if schema.get("enum"):
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example_for_schema(schema[key][0], text)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    kind = str(kind).lower()  # Gemini's OpenAPI-style schemas say "OBJECT", "STRING"
    if kind == "object":
        props = schema.get("properties", {})
        return {name: example_for_schema(sub, text) for name, sub in props.items()}
    if kind == "array":
        return [example_for_schema(schema.get("items", {"type": "string"}), text)]
    if kind == "integer":
        return max(1, int(schema.get("minimum", 1)))
    if kind == "number":
        return max(1.0, float(schema.get("minimum", 1.0)))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return text


def embedding(text: str, dims: int) -> list[float]:
    """A deterministic unit vector: a bag of hashed words, so texts sharing words are similar."""
    vec = [0.0] * dims
    for word in words(text.lower()) or [""]:
        digest = hashlib.sha256(word.encode()).digest()
        for i in range(0, 16, 4):
            slot = int.from_bytes(digest[i : i + 3], "little") % dims
            vec[slot] += 1.0 if digest[i + 3] & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


@dataclass
class ReportedUsage:
    """The usage a fake reported for one response, in Weir's normalised terms.

    Field names match `gateway.usage.Usage`, so a test can compare what the gateway recorded with what
    the vendor said, independently of the gateway's own translation.
    """

    input_tokens: int = 0  # prompt tokens not read from or written to a cache
    cached_input_tokens: int = 0
    cache_write_5m_tokens: int = 0
    cache_write_1h_tokens: int = 0
    output_tokens: int = 0  # reasoning included
    reasoning_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return (
            self.input_tokens
            + self.cached_input_tokens
            + self.cache_write_5m_tokens
            + self.cache_write_1h_tokens
        )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens
