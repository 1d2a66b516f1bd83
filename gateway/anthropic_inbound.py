"""The Anthropic Messages API inbound: requests into the canonical shape, and canonical responses and
stream chunks back into Messages responses and the full event sequence (message_start, ping,
content_block_start/delta/stop, message_delta with usage, message_stop).

Reasoning: `thinking` becomes the canonical `reasoning_budget` (`enabled`) or `reasoning_adaptive`
(`adaptive`), and `output_config.effort` the canonical `reasoning_effort`; thinking blocks in earlier turns are
kept (only an Anthropic backend can use them: it checks their signatures). The model's reasoning is
shown as thinking blocks, first in the content, to a client that enabled thinking, as Anthropic does;
reasoning from another vendor has no signature and is shown with an empty one, which Weir's Anthropic
adapter never sends upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import msgspec

from gateway.errors import InvalidRequest, encode_anthropic_error, stream_failure, validation_error
from gateway.providers.base import (
    CANONICAL_BLOCKS,
    CANONICAL_RESULT_BLOCKS,
    claude_only,
    comma_list,
    new_id,
    parse_arguments,
)
from gateway.types import (
    AnthropicTool,
    AssistantMessage,
    Base,
    ChatChunk,
    ChatRequest,
    ChatResponse,
    ContentPart,
    Delta,
    FilePart,
    FunctionCall,
    FunctionDefinition,
    ImagePart,
    ImageURL,
    JSONSchemaFormat,
    Message,
    NamedToolChoice,
    Reasoning,
    ReasoningBlock,
    RedactedReasoning,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
    ToolChoiceFunction,
    continuable,
)
from gateway.usage import Usage, anthropic_usage

CacheControl = dict[str, Any] | None

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def _stop_reason(
    finish: str | None,
    stop_sequence: str | None,
    own: str | None,
    refused: bool = False,
    called: bool = False,
) -> str:
    """The Messages stop_reason for a canonical finish: Claude's own where a Claude backend sent one
    finish_reason cannot say (`pause_turn`, `model_context_window_exceeded`), else the nearest.
    `refused`: the answer is OpenAI's `refusal` (structured outputs), which ends with finish `stop`.
    `called`: the answer holds tool calls, which end with `stop` where OpenAI forced the tool (a named
    tool_choice) and on some OpenAI-compatible servers: Claude says `tool_use`, which agent loops
    wait for to run the tools."""
    if own is not None:
        return own
    if refused:
        return "refusal"
    if stop_sequence is not None:
        return "stop_sequence"  # a backend that says which sequence matched (Anthropic)
    if called and finish in (None, "stop"):
        return "tool_use"
    return STOP_REASONS.get(finish or "stop", "end_turn")


# --- the Messages request ------------------------------------------------------------------------


class ImageSource(Base):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class TextBlock(Base, tag="text", tag_field="type"):
    text: str
    cache_control: CacheControl = None


class ImageBlock(Base, tag="image", tag_field="type"):
    source: ImageSource
    cache_control: CacheControl = None


class DocumentSource(Base):
    type: str  # "base64" (a PDF) or "text"; "url" and "content" are Anthropic's alone
    media_type: str | None = None
    data: str | None = None


class DocumentBlock(Base, tag="document", tag_field="type"):
    source: DocumentSource
    title: str | None = None
    cache_control: CacheControl = None


class ToolUseBlock(Base, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(Base, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None  # typed by `_typed`
    is_error: bool | None = None
    cache_control: CacheControl = None


class ThinkingBlock(Base, tag="thinking", tag_field="type"):
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(Base, tag="redacted_thinking", tag_field="type"):
    data: str = ""


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class InboundMessage(Base):
    role: Literal["user", "assistant"]
    # Blocks as the client sent them: typed by `_typed` (an assistant turn's blocks of Claude's own,
    # server tools' and any Weir does not model, are kept as they are, for Claude).
    content: str | list[dict[str, Any]]


def _typed(
    content: list[dict[str, Any]], where: str, modelled: frozenset[str] | None
) -> list[Block | dict[str, Any]]:
    """A message's blocks as Weir models them, any of a type outside `modelled` as it is (None: every
    block typed, a user turn's). An assistant turn's are its text, reasoning and tool calls: a server
    tool's block, or one of a type Claude added after this gateway was written, is one Claude
    returned to the client, to be sent back unchanged (`claude_only`). A tool result's are text,
    images and documents: another (a client-side tool search's `tool_reference`) is Claude's to read."""
    blocks: list[Block | dict[str, Any]] = []
    for i, raw in enumerate(content):
        kind = raw.get("type")
        if modelled is not None and isinstance(kind, str) and kind not in modelled:
            blocks.append(raw)
            continue
        try:
            blocks.append(msgspec.convert(raw, Block))
        except msgspec.ValidationError as exc:
            raise validation_error(exc, f"{where}.content[{i}]") from None
    return blocks


class InboundTool(Base):
    """A client tool the client runs (`type` absent or `custom`)."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    cache_control: CacheControl = None


def _tools(tools: list[dict[str, Any]]) -> tuple[list[Tool] | None, list[AnthropicTool] | None]:
    """The client's tools: its own as function tools; those of Anthropic's API (any other `type`: a
    server tool, an Anthropic-defined client tool) and its own that Anthropic's tool search is to load
    (`defer_loading`) as they are, for an Anthropic backend."""
    functions: list[Tool] = []
    typed: list[AnthropicTool] = []
    for i, raw in enumerate(tools):
        kind = raw.get("type")
        if kind is not None and kind != "custom":
            if not isinstance(kind, str) or not isinstance(raw.get("name"), str):
                raise InvalidRequest(
                    f"tools[{i}]: a tool of type {kind!r} needs a string `type` and `name`",
                    param=f"tools[{i}]",
                )
            typed.append(AnthropicTool(position=i, definition=raw))
            continue
        try:
            tool = msgspec.convert(raw, InboundTool)
        except msgspec.ValidationError as exc:
            raise validation_error(exc, f"tools[{i}]") from None
        if raw.get("defer_loading"):
            # Loaded when Anthropic's tool search finds it (a `tool_reference`): Claude's alone, as is.
            typed.append(AnthropicTool(position=i, definition=raw))
            continue
        definition = FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        )
        functions.append(Tool(function=definition, cache_control=tool.cache_control))
    return functions or None, typed or None


class InboundToolChoice(Base):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Base):
    type: str  # "enabled", "adaptive" or "disabled"; others (newer than Weir) ask for no thinking
    budget_tokens: int | None = None

    def budget(self) -> int | None:
        if self.type != "enabled":
            return None
        if self.budget_tokens is None:
            raise InvalidRequest("thinking.enabled.budget_tokens: Field required", param="thinking")
        return self.budget_tokens


class OutputFormat(Base):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Base):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(Base):
    user_id: str | None = None

    def entries(self) -> dict[str, str]:
        """The metadata as route conditions read it (`when.metadata`), as a chat client's would be.
        Upstream it goes as the canonical `user`, not as `metadata`: OpenAI takes `metadata` only with
        `store`, and a chat client's is sent as that client sent it."""
        return {} if self.user_id is None else {"user_id": self.user_id}


class MessagesRequest(Base):
    model: str
    messages: list[InboundMessage]
    max_tokens: int
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None  # typed by `_tools`
    tool_choice: InboundToolChoice | None = None
    metadata: Metadata | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Automatic prompt caching: Claude puts this breakpoint on the last cacheable block itself.
    cache_control: CacheControl = None
    service_tier: Literal["auto", "standard_only"] | None = None

    @property
    def shows_thinking(self) -> bool:
        """Whether the reply shows the model's reasoning: Anthropic's only when thinking is on."""
        return self.thinking is not None and self.thinking.type in ("enabled", "adaptive")


class CountTokensRequest(Base):
    """The body of /v1/messages/count_tokens: what a Messages request would send, without sampling."""

    model: str
    messages: list[InboundMessage]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None  # typed by `_tools`
    tool_choice: InboundToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None

    def to_canonical(self, beta: list[str] | None = None) -> ChatRequest:
        as_messages = MessagesRequest(
            model=self.model,
            messages=self.messages,
            max_tokens=1,
            system=self.system,
            tools=self.tools,
            tool_choice=self.tool_choice,
            thinking=self.thinking,
            output_config=self.output_config,
            cache_control=self.cache_control,
        )
        return msgspec.structs.replace(to_canonical(as_messages, beta), max_tokens=None)


def _image(block: ImageBlock, where: str) -> ImagePart:
    """An image as a URL part: its base64 data as a data URL, or its URL. A source without the field its
    type needs is refused, as Anthropic refuses it, not sent as an empty image."""
    source = block.source
    field, value = ("data", source.data) if source.type == "base64" else ("url", source.url)
    if not value:
        raise InvalidRequest(f"{where}.source.{field}: Field required", param=f"{where}.source.{field}")
    url = f"data:{source.media_type or 'image/png'};base64,{value}" if source.type == "base64" else value
    return ImagePart(image_url=ImageURL(url=url), cache_control=block.cache_control)


def _document(block: DocumentBlock, where: str) -> ContentPart:
    """A document as every vendor takes one: a PDF as a file (OpenAI's `file` part, which Weir's
    Anthropic and Gemini adapters send as a document / inline data), plain text as text."""
    source = block.source
    if source.type == "base64" and source.data:
        media_type = source.media_type or "application/pdf"
        file = {
            "file_data": f"data:{media_type};base64,{source.data}",
            "filename": block.title or "document.pdf",
        }
        return FilePart(file=file, cache_control=block.cache_control)
    if source.type == "text" and source.data is not None:
        return TextPart(text=source.data, cache_control=block.cache_control)
    raise InvalidRequest(
        f"document sources of type '{source.type}' are not supported: send the document as base64 or text",
        param=f"{where}.source",
    )


def _part(block: TextBlock | ImageBlock | DocumentBlock, where: str) -> ContentPart:
    if isinstance(block, TextBlock):
        return TextPart(text=block.text, cache_control=block.cache_control)
    if isinstance(block, ImageBlock):
        return _image(block, where)
    return _document(block, where)


def _parts(blocks: Sequence[TextBlock | ImageBlock | DocumentBlock], where: str) -> list[ContentPart]:
    return [_part(block, f"{where}[{i}]") for i, block in enumerate(blocks)]


def _tool_result(block: ToolResultBlock, where: str) -> Message:
    """A tool result as a tool message: its content as parts; as the client sent it besides, where it
    holds a block only Claude reads (a `tool_reference`), for an Anthropic backend. The failure in
    the flag: each vendor says it its own way (Claude the flag, Gemini an `error` response, OpenAI,
    which has neither, in words)."""
    verbatim = None
    if block.content is None or isinstance(block.content, str):
        content: str | list[ContentPart] = block.content or ""
    else:
        typed = _typed(block.content, where, CANONICAL_RESULT_BLOCKS)
        parts = [
            _part(part, f"{where}.content[{i}]")
            for i, part in enumerate(typed)
            if isinstance(part, TextBlock | ImageBlock | DocumentBlock)
        ]
        if len(parts) < len(typed):
            verbatim = block.content
        # An empty list (an MCP tool that returned nothing, a tool search's references alone) as the
        # empty string: OpenAI refuses an empty content array ("Expected an array with minimum length 1").
        content = parts or ""
    return Message(
        role="tool",
        tool_call_id=block.tool_use_id,
        content=content,
        cache_control=block.cache_control,
        is_error=block.is_error or None,
        anthropic_content=verbatim,
    )


def _user_messages(content: list[dict[str, Any]], where: str) -> list[Message]:
    # Tool results become OpenAI tool messages, which must follow the assistant turn directly: they
    # come first, then whatever else the user said in the same turn.
    results: list[Message] = []
    parts: list[ContentPart] = []
    for i, block in enumerate(_typed(content, where, None)):
        if isinstance(block, ToolResultBlock):
            results.append(_tool_result(block, f"{where}.content[{i}]"))
        elif isinstance(block, TextBlock | ImageBlock | DocumentBlock):
            parts.append(_part(block, f"{where}.content[{i}]"))
        else:
            raise InvalidRequest(
                f"a user message cannot hold a {type(block).__name__}", param=f"{where}.content[{i}]"
            )
    if parts:
        results.append(Message(role="user", content=parts))
    return results


def _assistant_message(
    content: list[Block | dict[str, Any]], verbatim: list[dict[str, Any]] | None
) -> Message:
    """The turn's text, calls and reasoning; `verbatim`: the turn as the client sent it, where it holds
    what only Claude takes back (`claude_only`), for an Anthropic backend."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[Reasoning] = []
    cache_control = None
    for block in content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
            cache_control = block.cache_control or cache_control
        elif isinstance(block, ToolUseBlock):
            arguments = msgspec.json.encode(block.input).decode()
            calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=arguments)))
            cache_control = block.cache_control or cache_control
        elif isinstance(block, ThinkingBlock):
            reasoning.append(ReasoningBlock(text=block.thinking, signature=block.signature))
        elif isinstance(block, RedactedThinkingBlock):
            reasoning.append(RedactedReasoning(data=block.data))
    return Message(
        role="assistant",
        content="".join(texts) if texts else None,
        tool_calls=calls or None,
        cache_control=cache_control,
        reasoning_blocks=reasoning or None,
        anthropic_content=verbatim,
    )


def beta_flags(header_values: list[str]) -> list[str] | None:
    """The `anthropic-beta` header's flags (comma-separated, the header maybe repeated), each once."""
    return comma_list(header_values) or None


def to_canonical(request: MessagesRequest, beta: list[str] | None = None) -> ChatRequest:
    """`beta`: the client's `anthropic-beta` flags (`beta_flags`), for Anthropic backends."""
    messages: list[Message] = []
    if isinstance(request.system, str):
        messages.append(Message(role="system", content=request.system))
    elif request.system:
        messages.append(Message(role="system", content=_parts(request.system, "system")))
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        if isinstance(message.content, str):
            messages.append(Message(role=message.role, content=message.content))
        elif message.role == "user":
            messages.extend(_user_messages(message.content, where))
        else:
            blocks = _typed(message.content, where, CANONICAL_BLOCKS)
            verbatim = message.content if claude_only(message.content) else None
            messages.append(_assistant_message(blocks, verbatim))
    tools, anthropic_tools = _tools(request.tools) if request.tools else (None, None)
    tool_choice: Any = None
    parallel = None
    if request.tool_choice is not None:
        kind = request.tool_choice.type
        if kind == "tool":
            if not request.tool_choice.name:
                raise InvalidRequest("tool_choice of type 'tool' needs a name", param="tool_choice.name")
            tool_choice = NamedToolChoice(function=ToolChoiceFunction(name=request.tool_choice.name))
        else:
            tool_choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        if request.tool_choice.disable_parallel_tool_use:
            parallel = False
    output = request.output_config or OutputConfig()
    response_format = None
    if output.format is not None:
        schema = JSONSchemaFormat(name="output", schema=output.format.schema, strict=True)
        response_format = ResponseFormat(type="json_schema", json_schema=schema)
    return ChatRequest(
        model=request.model,
        messages=messages,
        max_tokens=request.max_tokens,
        stop=request.stop_sequences,
        temperature=request.temperature,
        top_p=request.top_p,
        stream=request.stream,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        user=request.metadata.user_id if request.metadata else None,
        reasoning_budget=request.thinking.budget() if request.thinking else None,
        reasoning_adaptive=True if request.thinking and request.thinking.type == "adaptive" else None,
        reasoning_effort=output.effort,
        reasoning_effort_translated=True if output.effort is not None else None,
        response_format=response_format,
        top_k=request.top_k,
        # Anthropic's prefill: the answer goes on from the final assistant message, on any vendor. Not
        # a turn with server tool blocks: Claude paused it (`pause_turn`) and goes on with it itself.
        continue_final_message=True if continuable(messages) and not _paused(messages) else None,
        anthropic_beta=beta,
        anthropic_tools=anthropic_tools,
        cache_control=request.cache_control,
        service_tier=_CANONICAL_TIERS[request.service_tier] if request.service_tier else None,
    )


def _paused(messages: list[Message]) -> bool:
    """Whether the conversation ends with a turn of Claude's with its server tools' blocks: one it
    paused (`pause_turn`, a long search), sent back as it was for Claude to go on with."""
    return bool(messages) and messages[-1].role == "assistant" and messages[-1].anthropic_content is not None


# An Anthropic client's service tier in the canonical (OpenAI) words: `standard_only` is OpenAI's
# standard processing, `default`; `auto` is `auto` to both (priority capacity where there is some).
_CANONICAL_TIERS = {"auto": "auto", "standard_only": "default"}


# --- responses -----------------------------------------------------------------------------------


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        return parse_arguments(arguments, "tool_calls")
    except InvalidRequest:
        return {"_raw": arguments}  # the backend produced arguments that are not a JSON object


def _thinking_blocks(message: AssistantMessage) -> list[dict[str, Any]]:
    if not message.reasoning_blocks:
        # Another vendor's reasoning: unsigned, so shown with an empty signature (see the module doc).
        text = message.reasoning_content
        return [{"type": "thinking", "thinking": text, "signature": ""}] if text else []
    return [
        {"type": "thinking", "thinking": block.text, "signature": block.signature or ""}
        if isinstance(block, ReasoningBlock)
        else {"type": "redacted_thinking", "data": block.data}
        for block in message.reasoning_blocks
    ]


def from_canonical(response: ChatResponse, model: str, thinking: bool = False) -> dict[str, Any]:
    """The Messages response; `thinking`: whether the client enabled thinking, and so sees reasoning."""
    choice = response.choices[0] if response.choices else None
    content: list[dict[str, Any]] = []
    stop_reason = "end_turn"
    stop_sequence = choice.stop_sequence if choice is not None else None
    if choice is not None and choice.message.anthropic_content is not None:
        # Claude's answer with its server tools' blocks: as it came, in its order (thinking only where
        # the client enabled it, as below).
        content = [
            block
            for block in choice.message.anthropic_content
            if thinking or block.get("type") not in ("thinking", "redacted_thinking")
        ]
    elif choice is not None:
        if thinking:
            content.extend(_thinking_blocks(choice.message))
        if choice.message.content:
            content.append({"type": "text", "text": choice.message.content})
        refusal = choice.message.refusal
        if refusal:  # OpenAI's words for what it refused, which Claude says as text
            content.append({"type": "text", "text": refusal})
        for call in choice.message.tool_calls or ():
            content.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.function.name,
                    "input": _tool_input(call.function.arguments),
                }
            )
    if choice is not None:
        stop_reason = _stop_reason(
            choice.finish_reason,
            stop_sequence,
            choice.anthropic_stop_reason,
            refused=bool(choice.message.refusal),
            called=bool(choice.message.tool_calls),
        )
    return {
        "id": message_id(response.id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": anthropic_usage(response.usage),
    }


def message_id(upstream_id: str) -> str:
    """A message's id: Claude's own (`msg_...`) where Claude answered, the one Anthropic's console and
    its support know the message by, streamed or not; else one of Weir's, in Anthropic's form (another
    vendor's id, `chatcmpl-...`, is no message id to an Anthropic client)."""
    return upstream_id if upstream_id.startswith("msg_") else new_id("msg_")


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


class _EventWriter:
    """Canonical chunks -> Anthropic events; keeps which content block is open."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking  # whether reasoning is shown (the client enabled thinking)
        self.index = -1
        self.open_kind: str | None = None  # "thinking", "text", "tool" or "claude" (a server tool's)
        self.tool_blocks: dict[int, int] = {}  # OpenAI tool call index -> content block index
        self.finish: str | None = None
        self.stop_sequence: str | None = None
        self.own_stop_reason: str | None = None  # Claude's, where finish_reason cannot say it
        self.refused = False  # the answer streamed OpenAI's `refusal`
        self.usage = Usage()

    def close_block(self, out: list[bytes]) -> None:
        if self.open_kind is not None:
            self.open_kind = None
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))

    def open_block(self, kind: str, block: dict[str, Any], out: list[bytes]) -> None:
        self.close_block(out)
        self.index += 1
        self.open_kind = kind
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        )

    def delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        out.append(_event("content_block_delta", event))

    def reasoning(self, delta: Delta, out: list[bytes]) -> None:
        """Reasoning as thinking blocks: the text streams into the open one, which its signature ends."""
        if delta.redacted_reasoning is not None:
            self.open_block("redacted", {"type": "redacted_thinking", "data": delta.redacted_reasoning}, out)
            self.close_block(out)
        if (delta.reasoning_content or delta.reasoning_signature) and self.open_kind != "thinking":
            self.open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}, out)
        if delta.reasoning_content:
            self.delta({"type": "thinking_delta", "thinking": delta.reasoning_content}, out)
        if delta.reasoning_signature:
            self.delta({"type": "signature_delta", "signature": delta.reasoning_signature}, out)
            self.close_block(out)
        elif delta.reasoning_signature is not None and self.open_kind == "thinking":
            # An empty signature ends the block unsigned (a stream cut mid-reasoning and resumed on
            # another candidate): the continuation's thinking is a block of its own.
            self.close_block(out)

    def chunk(self, chunk: ChatChunk, out: list[bytes]) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices[:1]:
            delta = choice.delta
            if delta.anthropic_block is not None:
                # A block of Claude's the canonical delta cannot say (a server tool's), or a text block
                # of an answer that holds them: a block of its own, as Claude sent it.
                kind = "text" if delta.anthropic_block.get("type") == "text" else "claude"
                self.open_block(kind, delta.anthropic_block, out)
            if self.thinking:
                self.reasoning(delta, out)
            for text in (delta.content, delta.refusal):  # a refusal is said as text (see from_canonical)
                if text:
                    if self.open_kind != "text":
                        self.open_block("text", {"type": "text", "text": ""}, out)
                    self.delta({"type": "text_delta", "text": text}, out)
            self.refused = self.refused or bool(delta.refusal)
            if delta.anthropic_delta is not None and self.open_kind in ("text", "claude"):
                self.delta(delta.anthropic_delta, out)  # a server tool's input, a text's citation
            for call in delta.tool_calls or ():
                if call.index not in self.tool_blocks:
                    name = (call.function.name if call.function else None) or ""
                    block = {"type": "tool_use", "id": call.id or new_id("toolu_"), "name": name, "input": {}}
                    self.open_block("tool", block, out)
                    self.tool_blocks[call.index] = self.index
                arguments = call.function.arguments if call.function else None
                if arguments:
                    json_delta = {"type": "input_json_delta", "partial_json": arguments}
                    event = {
                        "type": "content_block_delta",
                        "index": self.tool_blocks[call.index],
                        "delta": json_delta,
                    }
                    out.append(_event("content_block_delta", event))
            if choice.finish_reason:
                self.finish = choice.finish_reason
                self.stop_sequence = choice.stop_sequence
                self.own_stop_reason = choice.anthropic_stop_reason

    def end(self, out: list[bytes]) -> None:
        self.close_block(out)
        stop_reason = _stop_reason(
            self.finish,
            self.stop_sequence,
            self.own_stop_reason,
            refused=self.refused,
            called=bool(self.tool_blocks),
        )
        stop = {"stop_reason": stop_reason, "stop_sequence": self.stop_sequence}
        delta = {"type": "message_delta", "delta": stop}
        out.append(_event("message_delta", {**delta, "usage": anthropic_usage(self.usage)}))
        out.append(_event("message_stop", {"type": "message_stop"}))


def _message_start(model: str, usage: Usage, upstream_id: str = "") -> list[bytes]:
    start: dict[str, Any] = {
        "id": message_id(upstream_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": anthropic_usage(usage),
    }
    return [
        _event("message_start", {"type": "message_start", "message": start}),
        _event("ping", {"type": "ping"}),
    ]


async def stream_events(
    batches: AsyncIterator[list[ChatChunk]], model: str, thinking: bool = False, request_id: str | None = None
) -> AsyncIterator[bytes]:
    """Batches of canonical chunks as Anthropic's event sequence, one write per batch. message_start
    reports the prompt's tokens where the backend counted them before answering (Anthropic, Gemini:
    the first chunk's `prompt_usage`), else zeros (OpenAI-compatible backends report usage only at
    the end); message_delta carries the whole usage. `thinking`: whether the client enabled thinking,
    and so sees reasoning; `request_id`: the request's, in an `error` event as in any error body."""
    writer = _EventWriter(thinking)
    out: list[bytes] = []
    started = False  # message_start written (with the first batch, which may say the prompt's count)
    try:
        async for batch in batches:
            if not started:
                counted = next((c.prompt_usage for c in batch if c.prompt_usage is not None), None)
                # Also what message_delta says if the stream ends without a usage report: never less
                # than message_start (the anthropic SDK takes message_delta's input count as final).
                writer.usage = counted or Usage()
                # The first chunk's id is the backend's (Claude's `msg_` id from its message_start).
                upstream_id = batch[0].id if batch else ""
                out, started = _message_start(model, writer.usage, upstream_id), True
            for chunk in batch:
                writer.chunk(chunk, out)
            if out:
                yield b"".join(out)
                out = []
    except Exception as exc:
        out = out if started else _message_start(model, Usage())
        yield b"".join(
            [*out, b"event: error\ndata: ", encode_anthropic_error(stream_failure(exc), request_id), b"\n\n"]
        )
        return
    out = out if started else _message_start(model, Usage())
    writer.end(out)
    yield b"".join(out)
