"""OpenAI's Responses API inbound (/v1/responses), stateless: requests into the canonical chat shape,
and canonical responses and stream chunks back into Response objects and the Responses event
sequence (response.created ... response.completed).

Weir stores nothing, so whatever needs OpenAI's server-side state (previous_response_id,
conversation, background, stored prompts, item references) is refused with a 400 that says to send
the whole input. Function tools, text and image input, structured output and streaming work on every
backend, as chat does; custom (freeform) tools too, as functions of one string on chat backends.

What only OpenAI's Responses API reads (built-in tools, custom tools' grammars, its encrypted
reasoning sent back with `store: false`, reasoning summaries, `include`) rides along the canonical
request (`ChatRequest.responses`, `Message.responses_items`) to OpenAI's models served there, and
their output items and events come back as they came (`Choice.responses_output`,
`ChatChunk.responses_event`): a Codex CLI session sees OpenAI's own. Other backends refuse built-in
tools (the route passes them over) and never see OpenAI's encrypted reasoning."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, TypeVar

import msgspec

from gateway.errors import GatewayError, InvalidRequest, stream_failure, validation_error
from gateway.estimate import Produced, input_tokens
from gateway.providers.base import CUSTOM_INPUT, custom_arguments, custom_input, new_id, now
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

# What a Responses client includes to get the answer's token log probabilities (with `top_logprobs`).
LOGPROBS = "message.output_text.logprobs"
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
# Input items of OpenAI's built-in tools (their calls and results): passed to OpenAI's Responses API as
# they came; no other backend runs these tools, so a request with them in its `tools` goes there alone.
BUILTIN_ITEMS = frozenset(
    {
        "web_search_call", "file_search_call", "computer_call", "computer_call_output",
        "image_generation_call", "code_interpreter_call", "local_shell_call", "local_shell_call_output",
        "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output",
        "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "mcp_call",
    }
)  # fmt: skip
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


class CustomToolCallItem(Base):
    call_id: str
    name: str
    input: str


class FunctionCallOutputItem(Base):  # a custom_tool_call_output too
    call_id: str
    output: str | list[Part]


class FunctionTool(Base):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomTool(Base):
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None  # {"type": "text"} or {"type": "grammar", "syntax", "definition"}


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
    verbosity: str | None = None  # chat's `verbosity` (`_SAME_IN_CHAT`); Claude and Gemini have none


class Reasoning(Base):
    effort: str | None = None
    summary: str | None = None  # for OpenAI's Responses API alone; no other vendor summarises


class ResponsesRequest(Base):
    """The body of POST /v1/responses. Top-level fields not modelled here (stream_options, ...) are
    accepted and ignored; the Responses-only ones modelled (include, the reasoning summary, custom and
    built-in tools) reach OpenAI's Responses API alone (`ChatRequest.responses`): a chat endpoint
    upstream would refuse them. The prompt cache settings, safety identifier and the text's verbosity
    reach both (`_SAME_IN_CHAT`)."""

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
    # Responses-only settings, for OpenAI's Responses API alone (`ChatRequest.responses`).
    include: list[str] | None = None
    top_logprobs: int | None = None  # with include's LOGPROBS: chat's `logprobs` and `top_logprobs`
    # Calls of built-in tools alone (OpenAI's own word), which OpenAI's Responses API alone runs: for it,
    # as sent; a chat backend runs no built-in tool, so there it holds as it stands.
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
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


def _foreign_reasoning(raw: dict[str, Any]) -> bool:
    """A reasoning item OpenAI encrypted (`include: reasoning.encrypted_content`): only OpenAI's
    Responses API can read it, and it needs it back in a tool loop that stores nothing."""
    encrypted = raw.get("encrypted_content")
    return isinstance(encrypted, str) and bool(encrypted) and not encrypted.startswith((SIGNED, REDACTED))


def _as_sent(raw: dict[str, Any]) -> dict[str, Any]:
    """An input item to send OpenAI's Responses API as the client sent it. Ids are left out but a
    reasoning item's: with nothing stored, OpenAI refuses ids it never kept (an item Weir minted when
    another vendor answered), and a reasoning item names its encrypted content by its own."""
    return raw if raw.get("type") == "reasoning" else {k: v for k, v in raw.items() if k != "id"}


class _Turn:
    """A canonical message being built, with the input items it stands for and whether any of them
    has no canonical form (`native`: the Responses API gets those items rather than the message)."""

    def __init__(self, message: Message, items: list[dict[str, Any]], native: bool) -> None:
        self.message, self.items, self.native = message, items, native

    def done(self) -> Message:
        if not self.native:
            return self.message
        return msgspec.structs.replace(self.message, responses_items=[_as_sent(item) for item in self.items])


def _messages(request: ResponsesRequest) -> list[Message]:
    turns: list[_Turn] = []
    if request.instructions:
        turns.append(_Turn(Message(role="system", content=request.instructions), [], False))
    if isinstance(request.input, str):
        return [turn.message for turn in turns] + [Message(role="user", content=request.input)]
    if not request.input:
        raise InvalidRequest("'input' must not be empty.", param="input")
    # The reasoning items before the next assistant turn: their text, and the thinking blocks they carry;
    # and the items only the Responses API reads (OpenAI's encrypted reasoning, built-in tools' calls)
    # that go before the next turn.
    reasoning, blocks = "", list[ThinkingBlock]()
    held: list[dict[str, Any]] = []

    def add(message: Message, raw: dict[str, Any], native: bool) -> None:
        nonlocal held
        turns.append(_Turn(message, [*held, raw], native or bool(held)))
        held = []

    def join(turn: _Turn, message: Message, raw: dict[str, Any], native: bool) -> None:
        nonlocal held
        turn.message, turn.items = message, [*turn.items, *held, raw]
        turn.native = turn.native or native or bool(held)
        held = []

    for i, raw in enumerate(request.input):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        last = turns[-1] if turns else None
        if kind == "message":
            message = _message(_convert(raw, InputMessage, where), where)
            if message.role == "assistant" and (reasoning or blocks):
                add(_with_reasoning(message, reasoning, blocks), raw, False)
            elif message.role == "assistant" and last is not None and _calls_alone(last.message):
                # Text written after the turn's calls (Gemini's parts, a server's trailing text) is
                # still that turn: OpenAI refuses anything between tool_calls and their tool messages.
                join(last, msgspec.structs.replace(last.message, content=message.content), raw, False)
            else:
                add(message, raw, False)
            reasoning, blocks = "", []
        elif kind in ("function_call", "custom_tool_call"):
            custom = kind == "custom_tool_call"
            if custom:
                item = _convert(raw, CustomToolCallItem, where)
                function = FunctionCall(name=item.name, arguments=custom_arguments(item.input))
            else:
                call_item = _convert(raw, FunctionCallItem, where)
                function = FunctionCall(name=call_item.name, arguments=call_item.arguments)
            call = ToolCall(id=raw["call_id"], function=function)
            if last is not None and last.message.role == "assistant" and not (reasoning or blocks):
                # One assistant turn: its text and every call it made (the Responses API lists them as
                # separate items; chat, Anthropic and Gemini all want them in one turn).
                calls = [*(last.message.tool_calls or ()), call]
                join(last, msgspec.structs.replace(last.message, tool_calls=calls), raw, custom)
            else:
                turn = Message(role="assistant", tool_calls=[call])
                add(_with_reasoning(turn, reasoning, blocks), raw, custom)
            reasoning, blocks = "", []
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = _convert(raw, FunctionCallOutputItem, where)
            content = _content(output.output, f"{where}.output")
            tool = Message(role="tool", tool_call_id=output.call_id, content=content)
            add(tool, raw, kind == "custom_tool_call_output")
        elif kind == "reasoning":
            # Its text (what Weir hands out: reasoning_text parts) goes back as the next assistant
            # turn's reasoning_content, which DeepSeek and Kimi need in a tool loop, and with the
            # signature Weir put in `encrypted_content` as a thinking block, which Anthropic needs to
            # go on thinking in one. OpenAI's encrypted reasoning goes back to OpenAI's Responses API
            # alone; summaries cannot be read by another vendor and are dropped.
            raw_parts = raw.get("content")
            parts: list[Any] = raw_parts if isinstance(raw_parts, list) else []
            text = "".join(
                p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"
            )
            reasoning += text
            block = _reasoning_block(raw, text)
            if block is not None:
                blocks.append(block)
            if _foreign_reasoning(raw):
                held.append(raw)
        elif kind == "item_reference":
            raise InvalidRequest(STATELESS, param=f"{where}.type")
        elif kind in BUILTIN_ITEMS:
            held.append(raw)  # a built-in tool's call or result: OpenAI's Responses API alone runs them
        else:
            raise InvalidRequest(
                f"Input items of type {kind!r} are not supported: only messages, function_call, "
                "function_call_output, custom_tool_call, custom_tool_call_output, reasoning items and "
                "built-in tools' calls are.",
                param=f"{where}.type",
            )
    if held and turns:
        # Items after the last turn (a built-in call's output the model is to read) close that turn.
        turns[-1].items += held
        turns[-1].native = True
    return [turn.done() for turn in turns]


def _custom_tool(raw: dict[str, Any], where: str) -> FunctionDefinition:
    """A custom (freeform) tool as a function of one string (`CUSTOM_INPUT`), for backends with
    function tools alone; its grammar, which they cannot enforce, is told in the description."""
    tool = _convert(raw, CustomTool, where)
    described = [tool.description] if tool.description else []
    form = tool.format or {}
    if form.get("type") == "grammar" and isinstance(form.get("definition"), str):
        syntax = form.get("syntax") or "lark"
        described.append(f"The `{CUSTOM_INPUT}` must match this {syntax} grammar:\n{form['definition']}")
    field = {"type": "string", "description": "The tool's freeform input, as plain text."}
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: field},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }
    return FunctionDefinition(
        name=tool.name, description="\n\n".join(described) or None, parameters=parameters
    )


def _tools(raw_tools: list[dict[str, Any]]) -> list[Tool] | None:
    """Function and custom tools, which every backend can serve (custom ones as functions); built-in
    tools stay in `ChatRequest.responses` alone, for OpenAI's Responses API."""
    tools = []
    for i, raw in enumerate(raw_tools):
        kind = raw.get("type")
        if kind == "custom":
            tools.append(Tool(function=_custom_tool(raw, f"tools[{i}]")))
        elif kind == "function":
            tool = _convert(raw, FunctionTool, f"tools[{i}]")
            function = FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            )
            tools.append(Tool(function=function))
        elif not isinstance(kind, str):
            raise InvalidRequest("Missing required parameter: 'type'.", param=f"tools[{i}].type")
    return tools or None


def custom_tools(request: ResponsesRequest) -> frozenset[str]:
    """The names of the request's custom tools, whose calls are `custom_tool_call` items."""
    return frozenset(str(t.get("name")) for t in request.tools or () if t.get("type") == "custom")


def _tool_choice(choice: ToolChoice | ToolChoiceObject | None, built_in: bool) -> ToolChoice | None:
    """The canonical tool choice. `built_in`: the request has built-in tools, which OpenAI's Responses
    API alone runs (chat candidates are passed over), so a choice of one is for it to judge: it gets
    the choice as sent (`ChatRequest.responses`), the canonical request "required"."""
    if not isinstance(choice, ToolChoiceObject):
        return choice
    if built_in and choice.type not in ("allowed_tools", "function", "custom"):
        return "required"
    if choice.type == "allowed_tools":
        listed = choice.tools or []
        if built_in and any(t.get("type") not in ("function", "custom") for t in listed):
            # Built-in tools among those allowed: for OpenAI's Responses API to resolve, as sent; the
            # canonical request says only whether a call is a must.
            return "required" if choice.mode == "required" else "auto"
        # Responses names each tool flat ({"type": "function", "name"}); chat nests it under `function`.
        # Custom tools are functions there too; a built-in tool is no function (400 naming it).
        tools = [
            {
                "type": "function" if t.get("type") == "custom" else t.get("type"),
                "function": {"name": t.get("name")},
            }
            for t in listed
        ]
        allowed = _convert({"mode": choice.mode, "tools": tools}, AllowedTools, "tool_choice")
        return AllowedToolsChoice(allowed_tools=allowed)
    if choice.type not in ("function", "custom"):
        raise InvalidRequest(
            f"tool_choice of type {choice.type!r} is not supported: use 'auto', 'none', 'required', "
            "a function or a custom tool.",
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


def _responses_only(request: ResponsesRequest) -> dict[str, Any]:
    """The settings a Responses backend gets as the client sent them (`ChatRequest.responses`)."""
    settings: dict[str, Any] = {
        "tools": request.tools,
        "tool_choice": msgspec.to_builtins(request.tool_choice) if request.tool_choice else None,
        "include": request.include,
        "top_logprobs": request.top_logprobs,
        "max_tool_calls": request.max_tool_calls,
        "prompt_cache_key": request.prompt_cache_key,
        "prompt_cache_retention": request.prompt_cache_retention,
        "safety_identifier": request.safety_identifier,
        "reasoning_summary": request.reasoning.summary if request.reasoning else None,
    }
    return {name: value for name, value in settings.items() if value is not None}


# Responses settings that chat completions takes under the same name (the text's verbosity as
# `verbosity`): as a chat client's own unmodelled parameters (`ChatRequest.extra`) they reach an
# OpenAI-compatible chat backend too (and OpenAI's Responses API, as a chat client's do), and Claude's
# `metadata.user_id` the safety identifier. Kept to the Responses API alone, a Responses client's prompt
# cache was routed otherwise than it asked, and gpt-5 answered at its default length, whenever its
# model was served on chat completions.
_SAME_IN_CHAT = ("prompt_cache_key", "prompt_cache_retention", "safety_identifier")


def _chat_too(request: ResponsesRequest) -> dict[str, Any]:
    settings = {name: getattr(request, name) for name in _SAME_IN_CHAT}
    settings["verbosity"] = request.text.verbosity if request.text else None
    return {name: value for name, value in settings.items() if value is not None}


def _asks_state(value: object) -> bool:
    """Whether a stateful parameter asks for OpenAI's stored state: anything sent but null (and
    `background: false`). An empty `previous_response_id` names no response Weir could answer from;
    taken as absent, a client that meant one would get an answer without its conversation."""
    return value is not None and value is not False


def to_canonical(request: ResponsesRequest) -> ChatRequest:
    for param, reason in _STATEFUL.items():
        if _asks_state(getattr(request, param)):
            raise InvalidRequest(f"'{param}' is not supported: {reason}", param=param)
    if request.max_output_tokens is not None and request.max_output_tokens < 1:
        raise InvalidRequest("'max_output_tokens' must be at least 1.", param="max_output_tokens")
    messages, tools = _messages(request), _tools(request.tools or [])
    # Chat's logprobs: a backend that has none refuses them, and a route passes it over (as for chat).
    logprobs = LOGPROBS in (request.include or ())
    built_in = any(raw.get("type") not in ("function", "custom") for raw in request.tools or ())
    tool_choice, response_format = _tool_choice(request.tool_choice, built_in), _response_format(request.text)
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
            logprobs=logprobs or None,
            top_logprobs=request.top_logprobs if logprobs else None,
            max_completion_tokens=request.max_output_tokens,
            user=request.user,
            reasoning_effort=request.reasoning.effort if request.reasoning else None,
            service_tier=request.service_tier,
            responses=_responses_only(request),
            extra=_chat_too(request),
        )
    except ValueError as exc:  # ChatRequest's own check of allowed_tools against the tools
        raise InvalidRequest(f"{exc}.", param="tool_choice.tools") from None


# What the chat pipeline names a parameter (Weir's own checks on the canonical request, an
# OpenAI-compatible backend's 400), as a Responses request names it: the client never sent
# `max_completion_tokens` or `messages`. Messages do not map one to one onto input items (instructions
# are one, a turn's calls several items), so a message's fault names `input`, which holds it.
_CHAT_PARAMS = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
    ("logprobs", "include"),
    ("messages", "input"),
)


def responses_param(param: str | None) -> str | None:
    """A chat request's parameter, as the Responses request it was translated from names it."""
    for chat, ours in _CHAT_PARAMS:
        if param is not None and (param == chat or param.startswith((f"{chat}.", f"{chat}["))):
            return ours if chat == "messages" else ours + param.removeprefix(chat)
    return param


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
        "top_logprobs": request.top_logprobs,
        "max_tool_calls": request.max_tool_calls,
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


def _text_part(
    text: str, annotations: list[dict[str, Any]] | None = None, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": annotations or [], "logprobs": logprobs or []}


def _token(entry: dict[str, Any]) -> dict[str, Any]:
    raw = entry.get("bytes")
    return {"token": entry.get("token", ""), "logprob": entry.get("logprob", 0.0), "bytes": raw or []}


def _logprobs(chat: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Chat's choice `logprobs` (`{"content": [...]}`) as an output_text part's: the same entries, a
    token's `bytes` a list (chat's may be null) and its alternatives in `top_logprobs`."""
    entries = (chat or {}).get("content") or []
    return [
        _token(entry) | {"top_logprobs": [_token(top) for top in entry.get("top_logprobs") or ()]}
        for entry in entries
        if isinstance(entry, dict)
    ]


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


def _call_item(call_id: str | None, name: str, arguments: str, status: str, custom: bool) -> dict[str, Any]:
    """A function call, or a custom tool's (`custom`) with its freeform input (`custom_input`)."""
    if custom:
        item_id, fields = new_id("ctc_"), {"input": custom_input(arguments)}
    else:
        item_id, fields = new_id("fc_"), {"arguments": arguments}
    kind = "custom_tool_call" if custom else "function_call"
    call = {"type": kind, "id": item_id, "call_id": call_id or new_id("call_"), "name": name}
    return call | fields | {"status": status}


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
    finish = choice.finish_reason if choice is not None else None
    own = choice.anthropic_stop_reason if choice is not None else None
    if choice is not None and choice.responses_output is not None:
        # OpenAI's Responses API's own items (custom tool calls, encrypted reasoning, summaries,
        # built-in tools' calls), as it returned them.
        output = [dict(item) for item in choice.responses_output]
        return _finished(new_response(request, response.created), output, finish, own, response.usage)
    message = choice.message if choice is not None else AssistantMessage(role="assistant")
    custom = custom_tools(request)
    logprobs = _logprobs(choice.logprobs if choice is not None else None)
    parts = (
        [_text_part(message.content, _url_citations(message.annotations), logprobs)]
        if message.content
        else []
    )
    if message.refusal:
        parts.append({"type": "refusal", "refusal": message.refusal})
    output = _reasoning_items(message)  # first, as the model produced it
    if parts or not message.tool_calls:
        # An empty answer is still a message, so `output[0].content[0]` is there to read.
        output.append(_message_item(parts or [_text_part("")], "completed"))
    for call in message.tool_calls or ():
        name = call.function.name
        output.append(_call_item(call.id, name, call.function.arguments, "completed", name in custom))
    return _finished(new_response(request, response.created), output, finish, own, response.usage)


# Content parts as they stream: the output item that holds them, the field their text grows in, and
# the prefix of their delta and done events.
_PARTS = {
    "output_text": ("message", "text", "response.output_text"),
    "refusal": ("message", "refusal", "response.refusal"),
    "reasoning_text": ("reasoning", "text", "response.reasoning_text"),
    "summary_text": ("reasoning", "text", "response.reasoning_summary_text"),
}
# The lists of parts a passed item holds: the event that adds one, the field that numbers it, and the
# event that says it is done. A reasoning item's summary is parts of its own, apart from its content.
_PART_LISTS = {
    "content": ("response.content_part.added", "content_index", "response.content_part.done"),
    "summary": (
        "response.reasoning_summary_part.added",
        "summary_index",
        "response.reasoning_summary_part.done",
    ),
}
_TEXT_EVENTS = {event for _, _, event in _PARTS.values()}


class _StreamWriter:
    """Canonical chunks -> Responses events. As OpenAI streams them, one output item at a time: an
    item's closing events are written when the next item starts or the stream ends."""

    def __init__(
        self, response: dict[str, Any], custom: frozenset[str] = frozenset(), sent: ChatRequest | None = None
    ) -> None:
        self.response = response
        self.custom = custom  # the names of custom tools, whose calls are `custom_tool_call` items
        self.inputs: dict[int, str] = {}  # output index of a custom tool's call -> its arguments so far
        # Items of OpenAI's Responses API passed through as they came: its output index -> theirs, and
        # those of theirs not done yet.
        self.passed: dict[int, int] = {}
        self.passing: set[int] = set()
        # Their parts not done yet: (output index, the list holding it, its index) -> whether its text's
        # done event came (the part's did not yet).
        self.parts: dict[tuple[int, str, int], bool] = {}
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: int | None = None  # output index of the item still streaming
        self.part: dict[str, Any] | None = None  # the open message's content part still streaming
        self.calls: dict[int, int] = {}  # canonical tool call index -> output index of its call
        # Logprobs of tokens whose text has not come yet (bytes of a character not whole, which a
        # backend holds back): told with the next text, or on the part's done event.
        self.held_logprobs: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.own_stop_reason: str | None = None  # Claude's, where finish_reason cannot say it
        self.usage = Usage()
        self.reported = False  # whether a chunk reported the usage (else it is estimated on failure)
        self.produced = Produced()
        self.sent = sent  # the canonical request, whose prompt a stream failed before usage estimates
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
        self._cut_passing()
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
        if part["type"] == "output_text":
            part.setdefault("logprobs", []).extend(self.held_logprobs)
            self.held_logprobs = []
        self._end_part(self._where(), "content", part)

    def _end_part(self, where: dict[str, Any], holder: str, part: dict[str, Any], told: bool = False) -> None:
        """A content or summary part's done events, saying its text whole: its text's (unless `told`,
        already sent), then the part's."""
        _, field, event = _PARTS[part["type"]]
        if not told:
            logprobs = {"logprobs": part.get("logprobs") or []} if part["type"] == "output_text" else {}
            self.emit(f"{event}.done", **where, **{field: part[field]}, **logprobs)
        self.emit(_PART_LISTS[holder][2], **where, part=part)

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
        elif item["type"] == "custom_tool_call":
            # Its input whole at once: the arguments are JSON around it until the call is complete.
            item["input"] = custom_input(self.inputs.get(index, ""))
            where = {"item_id": item["id"], "output_index": index}
            if item["input"]:
                self.emit("response.custom_tool_call_input.delta", **where, delta=item["input"])
            self.emit("response.custom_tool_call_input.done", **where, input=item["input"])
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

    def _text(self, kind: str, delta: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        """More of a part's text; an output_text delta says its tokens' logprobs (where the backend gave
        them), which the part gathers, as OpenAI's final response has them."""
        part = self._open_part(kind)
        _, field, event = _PARTS[kind]
        part[field] += delta
        if kind == "output_text":
            part.setdefault("logprobs", []).extend(logprobs or ())
            self.emit(f"{event}.delta", **self._where(), delta=delta, logprobs=logprobs or [])
        else:
            self.emit(f"{event}.delta", **self._where(), delta=delta)

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
            item = _call_item(delta.id, name, "", "in_progress", name in self.custom)
            index = self.calls[delta.index] = self._add(item)
        item = self.output[index]
        if item["type"] == "custom_tool_call":
            if function is not None and function.arguments:
                self.inputs[index] = self.inputs.get(index, "") + function.arguments
                if self.open != index:  # more of a call already closed: the final response has it all
                    item["input"] = custom_input(self.inputs[index])
            return
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

    def _pass(self, event: dict[str, Any]) -> None:
        """An event of OpenAI's Responses API as it came, renumbered, and its item at its place in this
        response's output. The response's own events are this stream's (its id, its final output)."""
        kind = str(event.get("type"))
        if kind == "response.created" and self.output:
            # Another candidate answering afresh after a break (`routing.execute`): what the broken
            # stream left unfinished ends before its items, whose output indices are its own.
            self._cut_passing()
            self.passed = {}
        if "response" in event or kind == "error":
            return
        theirs = event.get("output_index")
        item = event.get("item")
        fields = {key: value for key, value in event.items() if key not in ("type", "sequence_number")}
        if kind == "response.output_item.added" and isinstance(theirs, int) and isinstance(item, dict):
            self._close("completed")
            self.passed[theirs] = len(self.output)
            self.passing.add(len(self.output))
            self.output.append(dict(item))
        ours = self.passed.get(theirs) if isinstance(theirs, int) else None
        if ours is None and theirs is not None:
            return  # of an item this stream never showed
        if ours is not None:
            fields["output_index"] = ours
            if kind == "response.output_item.done" and isinstance(item, dict):
                self.output[ours] = dict(item)
                self.passing.discard(ours)
                self.parts = {key: told for key, told in self.parts.items() if key[0] != ours}
            else:
                self._grow(ours, kind, event)
        self.emit(kind, **fields)

    def _grow(self, index: int, kind: str, event: dict[str, Any]) -> None:
        """A passed item's parts (a message's text, a reasoning item's summary or text) as far as they
        streamed, which its `output_item.done` would have said whole: a stream cut before it goes on
        in this item (`_adopt`), or ends with it, its open parts closed (`_cut_passing`)."""
        item = self.output[index]
        for holder, (added, numbered, done) in _PART_LISTS.items():
            at = event.get(numbered)
            if not isinstance(at, int):
                continue
            parts = item.get(holder)
            part = event.get("part")
            if kind == added and isinstance(part, dict) and part.get("type") in _PARTS:
                item[holder] = parts = parts if isinstance(parts, list) else []
                parts.append(dict(part))
                self.parts[index, holder, at] = False
            elif kind == done:
                self.parts.pop((index, holder, at), None)
            elif (
                not isinstance(parts, list)
                or not 0 <= at < len(parts)
                or (index, holder, at) not in self.parts
            ):
                return
            elif kind.endswith(".delta") and kind.removesuffix(".delta") in _TEXT_EVENTS:
                field = _PARTS[parts[at]["type"]][1]
                parts[at][field] = str(parts[at].get(field) or "") + str(event.get("delta") or "")
            elif kind.endswith(".done") and kind.removesuffix(".done") in _TEXT_EVENTS:
                self.parts[index, holder, at] = True
            elif kind == "response.output_text.annotation.added" and isinstance(
                event.get("annotation"), dict
            ):
                parts[at].setdefault("annotations", []).append(event["annotation"])
            return

    def _adopt(self) -> None:
        """A passed stream broke and another candidate's canonical chunks go on: a message it left
        unfinished in its text, the last item, is this writer's open item, so the continuation's text
        goes on in it (one message, as a resumed stream is elsewhere); any other unfinished item is
        incomplete."""
        last = len(self.output) - 1
        item = self.output[last] if last in self.passing else None
        content = item.get("content") if item is not None else None
        part = content[-1] if isinstance(content, list) and content else None
        key = (last, "content", len(content) - 1 if isinstance(content, list) else -1)
        if (
            item is None
            or item.get("type") != "message"
            or part is None
            or part.get("type") != "output_text"
            or self.parts.get(key) is not False  # its text said done already: nothing goes on in it
        ):
            self._cut_passing()
            return
        self.passing.discard(last)
        del self.parts[key]  # the writer's own part now, which it closes
        self._cut_passing()
        self.open, self.part = last, part
        part.setdefault("annotations", [])
        part.setdefault("text", "")

    def _cut_passing(self) -> None:
        """Items passed through that their stream never finished (it broke, and another candidate
        goes on): incomplete."""
        for index in sorted(self.passing):
            item = self.output[index]
            for (of, holder, at), told in sorted(self.parts.items()):
                if of == index:
                    where = {"item_id": item.get("id"), "output_index": index, _PART_LISTS[holder][1]: at}
                    self._end_part(where, holder, item[holder][at], told)
            item["status"] = "incomplete"
            self.emit("response.output_item.done", output_index=index, item=item)
        self.passing.clear()
        self.parts.clear()

    def chunk(self, chunk: ChatChunk) -> None:
        self.produced.add(chunk)
        if chunk.usage is not None:
            self.usage, self.reported = chunk.usage, True
        if chunk.responses_event is not None:
            self._pass(chunk.responses_event)
            for choice in chunk.choices[:1]:
                if choice.finish_reason:
                    self.finish = choice.finish_reason
            return
        if self.passing:
            self._adopt()
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
            logprobs = _logprobs(choice.logprobs)
            if delta.content:
                self._text("output_text", delta.content, [*self.held_logprobs, *logprobs])
                self.held_logprobs = []
            else:
                self.held_logprobs += logprobs
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
        self._cut_passing()
        if not any(item["type"] != "reasoning" for item in self.output):
            self._open_part("output_text")  # an empty answer is still a message, as unstreamed
        reason, cut_off = _incomplete(self.finish, self.own_stop_reason)
        self._close("incomplete" if cut_off else "completed")
        final = _finished(self.response, self.output, self.finish, self.own_stop_reason, self.usage)
        self.emit("response.incomplete" if reason else "response.completed", response=final)

    def _prompt_tokens(self) -> int:
        """The prompt's tokens, estimated as routing does (only when a stream fails unreported)."""
        return input_tokens(self.sent) if self.sent is not None else 0

    def fail(self, error: GatewayError) -> None:
        for index in (*self.passing, *(() if self.open is None else (self.open,))):
            self.output[index]["status"] = "incomplete"  # as far as it got, a passed item's too
        self.emit(
            "error", code=error.code or error.type, message=error.message, param=responses_param(error.param)
        )
        # What was streamed is billed (`routing.execute`): the client is told it, as the vendor
        # reported it or estimated as the ledger's is when the stream broke before any report.
        usage = (
            self.usage
            if self.reported
            else self.produced.with_output(Usage(input_tokens=self._prompt_tokens()))
        )
        failed = {
            **self.response,
            "status": "failed",
            "output": self.output,
            "error": {"code": _failure_code(error), "message": error.message},
            "usage": responses_usage(usage),
        }
        self.emit("response.failed", response=failed)


def _failure_code(error: GatewayError) -> str:
    """A failed response's `error.code`, in OpenAI's list (the SDK's `ResponseError.code`): a request's
    fault (a 400 after the stream started, met on the candidate a broken stream failed over to) is
    `invalid_prompt`, a rate limit `rate_limit_exceeded`, anything else `server_error`. The `error`
    event before it has the error's own code (`context_length_exceeded`...)."""
    if error.status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if 400 <= error.status < 500 else "server_error"


async def stream_events(
    batches: AsyncIterator[list[ChatChunk]], request: ResponsesRequest, sent: ChatRequest | None = None
) -> AsyncIterator[bytes]:
    """Batches of canonical chunks as the Responses event sequence, one write per batch. A failure
    after the stream started ends it with an `error` event and `response.failed`, never silently, with
    the usage of what was streamed (the prompt of `sent`, the canonical request, estimated where no
    usage was reported)."""
    writer = _StreamWriter(new_response(request, now()), custom_tools(request), sent)
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
