"""OpenAI's Responses API inbound (/v1/responses), stateless: requests into the canonical chat shape,
and canonical responses and stream chunks back into Response objects and the Responses event
sequence (response.created ... response.completed).

Weir stores nothing, so whatever needs OpenAI's server-side state (previous_response_id,
conversation, background, stored prompts, item references) is refused with a 400 that says to send
the whole input; built-in tools (web search, file search, computer use, ...) are refused too, since
no backend-independent way serves them. Function tools, text and image input, structured output
and streaming work on every backend, as chat does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, TypeVar

import msgspec

from gateway.errors import GatewayError, InvalidRequest, stream_failure, validation_error
from gateway.providers.base import new_id, now
from gateway.providers.openai_responses import INCOMPLETE_REASONS
from gateway.types import (
    AllowedTools,
    AllowedToolsChoice,
    AssistantMessage,
    Base,
    ChatChunk,
    ChatRequest,
    ChatResponse,
    ContentPart,
    FilePart,
    FunctionCall,
    FunctionDefinition,
    ImagePart,
    ImageURL,
    JSONSchemaFormat,
    Message,
    NamedToolChoice,
    ReasoningBlock,
    RedactedReasoning,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceFunction,
)
from gateway.types import Reasoning as ThinkingBlock
from gateway.usage import Usage

S = TypeVar("S", bound=msgspec.Struct)

_encode = msgspec.json.Encoder().encode

STATELESS = "Weir does not store responses: send the whole conversation in `input` instead."
# Request parameters that only make sense against OpenAI's stored state, and why each is refused.
_STATEFUL = {
    "previous_response_id": STATELESS,
    "conversation": "Weir does not store conversations: send the whole conversation in `input` instead.",
    "background": "Weir does not store responses, so they cannot run in the background to be polled later.",
    "prompt": "Stored prompt templates live at OpenAI; send the prompt's text in `instructions` and `input`.",
}
# A reasoning item's `encrypted_content`, where Weir keeps what Anthropic needs back to go on thinking in
# a tool loop (the thinking block's signature, or a redacted block's data): the opaque field clients
# already send back as is. Other vendors' encrypted content (OpenAI's) is not Weir's and is dropped.
SIGNED = "weir.thinking.signature:"
REDACTED = "weir.redacted_thinking:"
# Claude's stop reasons that leave a response incomplete though its output is whole (finish_reason
# `stop`), and the reason given. `pause_turn`: Claude paused a long turn of its server tools (web
# search...), to be resumed by sending the answer back as input. OpenAI's reasons have none that says
# so, and `completed` told the client the answer was whole, so Claude's word, as an Anthropic client
# gets it (OpenAI's SDKs take reasons outside their list as they come).
_PAUSED = {"pause_turn": "pause_turn"}


def _incomplete(finish: str | None, own_stop_reason: str | None) -> tuple[str | None, bool]:
    """Why a response ended incomplete (None: it is complete), and whether its last item was cut off
    (a length or content filter cut) rather than whole (a paused turn)."""
    if (paused := _PAUSED.get(own_stop_reason or "")) is not None:
        return paused, False
    reason = INCOMPLETE_REASONS.get(finish or "")
    return reason, reason is not None


# --- the Responses request -----------------------------------------------------------------------


class InputText(Base, tag="input_text", tag_field="type"):
    text: str


class OutputText(Base, tag="output_text", tag_field="type"):
    # An earlier assistant turn sent back (often `response.output` appended to the input as is).
    text: str


class Refusal(Base, tag="refusal", tag_field="type"):
    refusal: str


class InputImage(Base, tag="input_image", tag_field="type"):
    image_url: str | None = None  # https URL or data: URL
    file_id: str | None = None
    detail: str | None = None


class InputFile(Base, tag="input_file", tag_field="type"):
    file_data: str | None = None  # data: URL
    file_id: str | None = None
    file_url: str | None = None
    filename: str | None = None


Part = InputText | OutputText | Refusal | InputImage | InputFile


class InputMessage(Base):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class FunctionCallItem(Base):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Base):
    call_id: str
    output: str | list[Part]


class FunctionTool(Base):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(Base):
    type: str
    name: str | None = None
    mode: str | None = None  # allowed_tools
    tools: list[dict[str, Any]] | None = None  # allowed_tools


class TextFormat(Base):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Base):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; no backend-independent equivalent


class Reasoning(Base):
    effort: str | None = None
    summary: str | None = None  # accepted; reasoning summaries are not carried across vendors


class ResponsesRequest(Base):
    """The body of POST /v1/responses. Top-level fields not modelled here (include, store,
    prompt_cache_key, stream_options, ...) are accepted and ignored: they are Responses-only, so
    unlike on chat they are not forwarded (a chat endpoint upstream would refuse them)."""

    model: str
    # Items stay dicts until converted one by one: a message item may omit its `type`, which a
    # tagged union cannot express.
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None  # dicts: built-in tools get a 400 of their own
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceObject | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None  # accepted; Weir never truncates input
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    stream: bool | None = None
    store: bool | None = None  # accepted; nothing is ever stored (the response says "store": false)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None


def _convert(raw: dict[str, Any], type_: type[S], where: str) -> S:
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc, prefix=where) from None


def _parts(parts: list[Part], where: str) -> list[ContentPart]:
    result: list[ContentPart] = []
    for i, part in enumerate(parts):
        if isinstance(part, InputText | OutputText):
            result.append(TextPart(text=part.text))
        elif isinstance(part, Refusal):
            result.append(TextPart(text=part.refusal))
        elif isinstance(part, InputImage):
            if part.image_url is None:
                raise InvalidRequest(
                    "Weir stores no files: send the image as `image_url` (a URL or a data URL).",
                    param=f"{where}[{i}].image_url",
                )
            result.append(ImagePart(image_url=ImageURL(url=part.image_url, detail=part.detail)))
        else:
            if part.file_data is None and part.file_url is not None:
                # Not a stored file: a URL for the model to read, which neither OpenAI's chat API nor
                # every other backend takes, and Weir does not fetch it on the client's behalf.
                raise InvalidRequest(
                    "'file_url' is not supported: Weir routes to any backend, and not every backend "
                    "can read a file from a URL. Send the file's content as `file_data` (a data URL).",
                    param=f"{where}[{i}].file_url",
                )
            if part.file_data is None:
                raise InvalidRequest(
                    "Weir stores no files: send the file's content as `file_data` (a data URL).",
                    param=f"{where}[{i}].file_data",
                )
            file = {"file_data": part.file_data}
            if part.filename is not None:
                file["filename"] = part.filename
            result.append(FilePart(file=file))
    return result


def _content(content: str | list[Part], where: str) -> str | list[ContentPart]:
    return content if isinstance(content, str) else _parts(content, where)


def _message(item: InputMessage, where: str) -> Message:
    role: Literal["user", "system", "assistant"] = "system" if item.role == "developer" else item.role
    content = _content(item.content, f"{where}.content")
    if role == "assistant" and not isinstance(content, str):
        # Earlier assistant turns as plain text: what every backend takes (and OpenAI's chat API
        # refuses anything but text in assistant content).
        for i, part in enumerate(content):
            if not isinstance(part, TextPart):
                raise InvalidRequest(
                    "assistant messages can only hold text", param=f"{where}.content[{i}].type"
                )
        content = Message(role=role, content=content).text()
    return Message(role=role, content=content)


def _reasoning_block(raw: dict[str, Any], text: str) -> ThinkingBlock | None:
    """The signed or redacted thinking block a reasoning item Weir handed out stands for, if any."""
    encrypted = raw.get("encrypted_content")
    if not isinstance(encrypted, str):
        return None
    if encrypted.startswith(SIGNED):
        return ReasoningBlock(text=text, signature=encrypted.removeprefix(SIGNED))
    if encrypted.startswith(REDACTED):
        return RedactedReasoning(data=encrypted.removeprefix(REDACTED))
    return None


def _with_reasoning(message: Message, text: str, blocks: list[ThinkingBlock]) -> Message:
    return msgspec.structs.replace(message, reasoning_content=text or None, reasoning_blocks=blocks or None)


def _calls_alone(message: Message) -> bool:
    """An assistant turn of tool calls and no text yet (its results not sent yet)."""
    return message.role == "assistant" and bool(message.tool_calls) and not message.content


def _messages(request: ResponsesRequest) -> list[Message]:
    messages: list[Message] = []
    if request.instructions:
        messages.append(Message(role="system", content=request.instructions))
    if isinstance(request.input, str):
        messages.append(Message(role="user", content=request.input))
        return messages
    if not request.input:
        raise InvalidRequest("'input' must not be empty.", param="input")
    # The reasoning items before the next assistant turn: their text, and the thinking blocks they carry.
    reasoning, blocks = "", list[ThinkingBlock]()
    for i, raw in enumerate(request.input):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        if kind == "message":
            message = _message(_convert(raw, InputMessage, where), where)
            last = messages[-1] if messages else None
            if message.role == "assistant" and (reasoning or blocks):
                message = _with_reasoning(message, reasoning, blocks)
            elif message.role == "assistant" and last is not None and _calls_alone(last):
                # Text written after the turn's calls (Gemini's parts, a server's trailing text) is
                # still that turn: OpenAI refuses anything between tool_calls and their tool messages.
                message = msgspec.structs.replace(last, content=message.content)
                messages.pop()
            reasoning, blocks = "", []
            messages.append(message)
        elif kind == "function_call":
            item = _convert(raw, FunctionCallItem, where)
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and not (reasoning or blocks):
                # One assistant turn: its text and every call it made (the Responses API lists them as
                # separate items; chat, Anthropic and Gemini all want them in one turn).
                messages[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or ()), call])
            else:
                turn = Message(role="assistant", tool_calls=[call])
                messages.append(_with_reasoning(turn, reasoning, blocks))
            reasoning, blocks = "", []
        elif kind == "function_call_output":
            output = _convert(raw, FunctionCallOutputItem, where)
            content = _content(output.output, f"{where}.output")
            messages.append(Message(role="tool", tool_call_id=output.call_id, content=content))
        elif kind == "reasoning":
            # Its text (what Weir hands out: reasoning_text parts) goes back as the next assistant
            # turn's reasoning_content, which DeepSeek and Kimi need in a tool loop, and with the
            # signature Weir put in `encrypted_content` as a thinking block, which Anthropic needs to
            # go on thinking in one. Summaries and OpenAI's encrypted reasoning cannot be read by
            # another vendor and are dropped.
            raw_parts = raw.get("content")
            parts: list[Any] = raw_parts if isinstance(raw_parts, list) else []
            text = "".join(
                p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"
            )
            reasoning += text
            block = _reasoning_block(raw, text)
            if block is not None:
                blocks.append(block)
        elif kind == "item_reference":
            raise InvalidRequest(STATELESS, param=f"{where}.type")
        else:
            raise InvalidRequest(
                f"Input items of type {kind!r} are not supported: only messages, function_call, "
                "function_call_output and reasoning items are.",
                param=f"{where}.type",
            )
    return messages


def _tools(raw_tools: list[dict[str, Any]]) -> list[Tool] | None:
    tools = []
    for i, raw in enumerate(raw_tools):
        kind = raw.get("type")
        if kind != "function":
            raise InvalidRequest(
                f"Tools of type {kind!r} are not supported: Weir routes to any backend, and only "
                "function tools can be served by all of them.",
                param=f"tools[{i}].type",
            )
        tool = _convert(raw, FunctionTool, f"tools[{i}]")
        function = FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
        )
        tools.append(Tool(function=function))
    return tools or None


def _tool_choice(choice: ToolChoice | ToolChoiceObject | None) -> ToolChoice | None:
    if not isinstance(choice, ToolChoiceObject):
        return choice
    if choice.type == "allowed_tools":
        # Responses names each tool flat ({"type": "function", "name"}); chat nests it under `function`.
        tools = [{"type": t.get("type"), "function": {"name": t.get("name")}} for t in choice.tools or ()]
        allowed = _convert({"mode": choice.mode, "tools": tools}, AllowedTools, "tool_choice")
        return AllowedToolsChoice(allowed_tools=allowed)
    if choice.type != "function":
        raise InvalidRequest(
            f"tool_choice of type {choice.type!r} is not supported: use 'auto', 'none', 'required' or "
            "a function tool.",
            param="tool_choice.type",
        )
    if not choice.name:
        raise InvalidRequest("Missing required parameter: 'tool_choice.name'.", param="tool_choice.name")
    return NamedToolChoice(function=ToolChoiceFunction(name=choice.name))


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if not fmt.name:
        raise InvalidRequest("Missing required parameter: 'text.format.name'.", param="text.format.name")
    if fmt.schema is None:
        raise InvalidRequest("Missing required parameter: 'text.format.schema'.", param="text.format.schema")
    schema = JSONSchemaFormat(
        name=fmt.name, schema=fmt.schema, description=fmt.description, strict=fmt.strict
    )
    return ResponseFormat(type="json_schema", json_schema=schema)


def to_canonical(request: ResponsesRequest) -> ChatRequest:
    for param, reason in _STATEFUL.items():
        if getattr(request, param):
            raise InvalidRequest(f"'{param}' is not supported: {reason}", param=param)
    if request.max_output_tokens is not None and request.max_output_tokens < 1:
        raise InvalidRequest("'max_output_tokens' must be at least 1.", param="max_output_tokens")
    messages, tools = _messages(request), _tools(request.tools or [])
    tool_choice, response_format = _tool_choice(request.tool_choice), _response_format(request.text)
    try:
        return ChatRequest(
            model=request.model,
            messages=messages,
            stream=request.stream,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=request.parallel_tool_calls,
            response_format=response_format,
            temperature=request.temperature,
            top_p=request.top_p,
            max_completion_tokens=request.max_output_tokens,
            user=request.user,
            reasoning_effort=request.reasoning.effort if request.reasoning else None,
            service_tier=request.service_tier,
        )
    except ValueError as exc:  # ChatRequest's own check of allowed_tools against the tools
        raise InvalidRequest(f"{exc}.", param="tool_choice.tools") from None


# --- responses -----------------------------------------------------------------------------------


def responses_usage(usage: Usage) -> dict[str, Any]:
    """`Usage` in the Responses shape: `input_tokens` counts every prompt token, cache reads and
    writes included (`Usage.prompt_tokens`, as chat's `prompt_tokens`); the details say how many of
    them were read from or written to a cache."""
    details = {"cached_tokens": usage.cached_input_tokens, "cache_write_tokens": usage.cache_write_tokens}
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": details,
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def new_response(request: ResponsesRequest, created_at: int) -> dict[str, Any]:
    """A Response object before any output: the request's settings echoed back, as OpenAI does."""
    text_format = request.text.format if request.text is not None else None
    return {
        "id": new_id("resp_"),
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "model": request.model,
        "output": [],
        "usage": None,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tool_choice": msgspec.to_builtins(request.tool_choice) if request.tool_choice else "auto",
        "tools": request.tools or [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "text": {"format": msgspec.to_builtins(text_format) if text_format else {"type": "text"}},
        "reasoning": {
            "effort": request.reasoning.effort if request.reasoning else None,
            "summary": request.reasoning.summary if request.reasoning else None,
        },
        "truncation": request.truncation or "disabled",
        "user": request.user,
        "metadata": request.metadata or {},
        "service_tier": request.service_tier,
        "previous_response_id": None,
        "store": False,
        "background": False,
    }


def _text_part(text: str, annotations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": annotations or [], "logprobs": []}


def _url_citations(annotations: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat annotations (`{"type": "url_citation", "url_citation": {...}}`, a search model's) in the
    Responses shape, flat (`{"type": "url_citation", "url", "title", "start_index", "end_index"}`);
    the indices still count characters of the one text part the answer's text makes. Other kinds,
    and citations without a URL or indices, have no Responses form and are left out."""
    out = []
    for annotation in annotations or ():
        cited = annotation.get("url_citation") if annotation.get("type") == "url_citation" else None
        if not isinstance(cited, dict) or not isinstance(cited.get("url"), str):
            continue
        start, end = cited.get("start_index"), cited.get("end_index")
        if not (isinstance(start, int) and isinstance(end, int)):
            continue
        title = cited.get("title")
        out.append(
            {
                "type": "url_citation",
                "start_index": start,
                "end_index": end,
                "url": cited["url"],
                "title": title if isinstance(title, str) else "",
            }
        )
    return out


def _reasoning_item(content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    # The reasoning as text (what DeepSeek, vLLM, Gemini thoughts and Anthropic thinking give); no
    # summary: Weir has none. `encrypted_content` is added where Anthropic signed it (`SIGNED`).
    return {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": content, "status": status}


def _reasoning_items(message: AssistantMessage) -> list[dict[str, Any]]:
    """The answer's reasoning: one item per Anthropic block, with what Anthropic needs back in
    `encrypted_content`; other vendors' reasoning as one item of text."""
    if not message.reasoning_blocks:
        text = message.reasoning_content
        return [_reasoning_item([{"type": "reasoning_text", "text": text}], "completed")] if text else []
    items = []
    for block in message.reasoning_blocks:
        if isinstance(block, RedactedReasoning):
            item = _reasoning_item([], "completed")
            item["encrypted_content"] = REDACTED + block.data
        else:
            item = _reasoning_item([{"type": "reasoning_text", "text": block.text}], "completed")
            if block.signature:
                item["encrypted_content"] = SIGNED + block.signature
        items.append(item)
    return items


def _message_item(content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    item_id = new_id("msg_")
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call_id: str | None, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": new_id("fc_"),
        "call_id": call_id or new_id("call_"),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _finished(
    response: dict[str, Any],
    output: list[dict[str, Any]],
    finish: str | None,
    own_stop_reason: str | None,
    usage: Usage,
) -> dict[str, Any]:
    """The response once its output is complete; a cut-off one is `incomplete`, and so is its last
    item; a paused one is `incomplete`, its items whole."""
    reason, cut_off = _incomplete(finish, own_stop_reason)
    if cut_off and output:
        output[-1]["status"] = "incomplete"
    return {
        **response,
        "status": "incomplete" if reason else "completed",
        "incomplete_details": {"reason": reason} if reason else None,
        "output": output,
        "usage": responses_usage(usage),
        "service_tier": _served_tier(usage, response["service_tier"]),
    }


# The tiers a Response may name (the SDK refuses others, as Anthropic's `standard` or `batch`).
_RESPONSE_TIERS = frozenset({"default", "flex", "scale", "priority"})


def _served_tier(usage: Usage, asked: str | None) -> str | None:
    """The tier the vendor served the response at, as OpenAI's Responses report it, where it is one
    a Response may name; else the one asked for."""
    return usage.service_tier if usage.service_tier in _RESPONSE_TIERS else asked


def from_canonical(response: ChatResponse, request: ResponsesRequest) -> dict[str, Any]:
    choice = response.choices[0] if response.choices else None
    message = choice.message if choice is not None else AssistantMessage(role="assistant")
    parts = [_text_part(message.content, _url_citations(message.annotations))] if message.content else []
    if message.refusal:
        parts.append({"type": "refusal", "refusal": message.refusal})
    output = _reasoning_items(message)  # first, as the model produced it
    if parts or not message.tool_calls:
        # An empty answer is still a message, so `output[0].content[0]` is there to read.
        output.append(_message_item(parts or [_text_part("")], "completed"))
    for call in message.tool_calls or ():
        output.append(_call_item(call.id, call.function.name, call.function.arguments, "completed"))
    finish = choice.finish_reason if choice is not None else None
    own = choice.anthropic_stop_reason if choice is not None else None
    return _finished(new_response(request, response.created), output, finish, own, response.usage)


# Content parts as they stream: the output item that holds them, the field their text grows in, and
# the prefix of their delta and done events.
_PARTS = {
    "output_text": ("message", "text", "response.output_text"),
    "refusal": ("message", "refusal", "response.refusal"),
    "reasoning_text": ("reasoning", "text", "response.reasoning_text"),
}


class _StreamWriter:
    """Canonical chunks -> Responses events. As OpenAI streams them, one output item at a time: an
    item's closing events are written when the next item starts or the stream ends."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: int | None = None  # output index of the item still streaming
        self.part: dict[str, Any] | None = None  # the open message's content part still streaming
        self.calls: dict[int, int] = {}  # canonical tool call index -> output index of its call
        self.finish: str | None = None
        self.own_stop_reason: str | None = None  # Claude's, where finish_reason cannot say it
        self.usage = Usage()
        self.out: list[bytes] = []

    def emit(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        self.out.append(b"event: " + kind.encode() + b"\ndata: " + _encode(event) + b"\n\n")

    def flush(self) -> bytes:
        data, self.out = b"".join(self.out), []
        return data

    def _add(self, item: dict[str, Any]) -> int:
        self._close("completed")
        self.open = len(self.output)
        self.output.append(item)
        self.emit("response.output_item.added", output_index=self.open, item=item)
        return self.open

    def _where(self) -> dict[str, Any]:
        """Where the open item's last content part is, as every content event says."""
        assert self.open is not None
        item = self.output[self.open]
        return {"item_id": item["id"], "output_index": self.open, "content_index": len(item["content"]) - 1}

    def _close_part(self) -> None:
        part, self.part = self.part, None
        if part is None:
            return
        where = self._where()
        _, field, event = _PARTS[part["type"]]
        logprobs: dict[str, list[Any]] = {"logprobs": []} if part["type"] == "output_text" else {}
        self.emit(f"{event}.done", **where, **{field: part[field]}, **logprobs)
        self.emit("response.content_part.done", **where, part=part)

    def _close(self, status: str) -> None:
        if self.open is None:
            return
        index, item = self.open, self.output[self.open]
        if item["type"] == "function_call":
            self.emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
        else:
            self._close_part()
        item["status"] = status
        self.emit("response.output_item.done", output_index=index, item=item)
        self.open = None

    def _open_part(self, kind: str) -> dict[str, Any]:
        """The open item's content part of `kind`, starting the item (a message, or reasoning) or the
        part as needed."""
        holder, field, _ = _PARTS[kind]
        if self.open is None or self.output[self.open]["type"] != holder:
            item = _reasoning_item if holder == "reasoning" else _message_item
            self._add(item([], "in_progress"))
        assert self.open is not None
        if self.part is None or self.part["type"] != kind:
            self._close_part()
            self.part = _text_part("") if kind == "output_text" else {"type": kind, field: ""}
            self.output[self.open]["content"].append(self.part)
            self.emit("response.content_part.added", **self._where(), part=self.part)
        return self.part

    def _text(self, kind: str, delta: str) -> None:
        part = self._open_part(kind)
        _, field, event = _PARTS[kind]
        part[field] += delta
        logprobs: dict[str, list[Any]] = {"logprobs": []} if kind == "output_text" else {}
        self.emit(f"{event}.delta", **self._where(), delta=delta, **logprobs)

    def _annotate(self, annotations: list[dict[str, Any]]) -> None:
        """Citations of the answer's text (a search model sends them with its text or after it,
        alone): onto the text part, each told in an `annotation.added` event, as OpenAI streams them."""
        cited = _url_citations(annotations)
        if not cited:
            return
        part = self._open_part("output_text")
        for annotation in cited:
            part["annotations"].append(annotation)
            index = len(part["annotations"]) - 1
            self.emit(
                "response.output_text.annotation.added",
                **self._where(),
                annotation_index=index,
                annotation=annotation,
            )

    def _redacted(self, data: str) -> None:
        """A redacted thinking block: an item with no text, whole at once."""
        item = _reasoning_item([], "in_progress")
        self._add(item)
        item["encrypted_content"] = REDACTED + data  # on its done event, as a signature comes
        self._close("completed")

    def _tool_call(self, delta: ToolCallDelta) -> None:
        function = delta.function
        index = self.calls.get(delta.index)
        if index is None:
            name = (function.name if function else None) or ""
            index = self.calls[delta.index] = self._add(_call_item(delta.id, name, "", "in_progress"))
        item = self.output[index]
        if function is not None and function.arguments:
            # A backend that interleaves parallel calls can send more of a call already closed; the
            # delta still goes out, and the final response holds the whole arguments.
            item["arguments"] += function.arguments
            self.emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=function.arguments,
            )

    def chunk(self, chunk: ChatChunk) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices[:1]:
            delta = choice.delta
            if delta.reasoning_content:
                self._text("reasoning_text", delta.reasoning_content)
            if (
                delta.reasoning_signature is not None
                and self.open is not None
                and self.output[self.open]["type"] == "reasoning"
            ):
                # The end of one reasoning block: the next reasoning is an item of its own. Unsigned,
                # it is a stream's reasoning cut short and resumed on another candidate.
                if delta.reasoning_signature:
                    self.output[self.open]["encrypted_content"] = SIGNED + delta.reasoning_signature
                self._close("completed" if delta.reasoning_signature else "incomplete")
            if delta.redacted_reasoning is not None:
                self._redacted(delta.redacted_reasoning)
            if delta.content:
                self._text("output_text", delta.content)
            if delta.annotations:
                self._annotate(delta.annotations)
            if delta.refusal:
                self._text("refusal", delta.refusal)
            for call in delta.tool_calls or ():
                self._tool_call(call)
            if choice.finish_reason:
                self.finish = choice.finish_reason
                self.own_stop_reason = choice.anthropic_stop_reason

    def end(self) -> None:
        if not any(item["type"] != "reasoning" for item in self.output):
            self._open_part("output_text")  # an empty answer is still a message, as unstreamed
        reason, cut_off = _incomplete(self.finish, self.own_stop_reason)
        self._close("incomplete" if cut_off else "completed")
        final = _finished(self.response, self.output, self.finish, self.own_stop_reason, self.usage)
        self.emit("response.incomplete" if reason else "response.completed", response=final)

    def fail(self, error: GatewayError) -> None:
        if self.open is not None:
            self.output[self.open]["status"] = "incomplete"
        self.emit("error", code=error.code or error.type, message=error.message, param=error.param)
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        failed = {
            **self.response,
            "status": "failed",
            "output": self.output,
            "error": {"code": code, "message": error.message},
        }
        self.emit("response.failed", response=failed)


async def stream_events(
    batches: AsyncIterator[list[ChatChunk]], request: ResponsesRequest
) -> AsyncIterator[bytes]:
    """Batches of canonical chunks as the Responses event sequence, one write per batch. A failure
    after the stream started ends it with an `error` event and `response.failed`, never silently."""
    writer = _StreamWriter(new_response(request, now()))
    writer.emit("response.created", response=writer.response)
    writer.emit("response.in_progress", response=writer.response)
    try:
        async for batch in batches:
            for chunk in batch:
                writer.chunk(chunk)
            if writer.out:
                yield writer.flush()
    except Exception as exc:
        writer.fail(stream_failure(exc))
        yield writer.flush()
        return
    writer.end()
    yield writer.flush()
