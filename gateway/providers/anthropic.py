"""Anthropic Messages API as a backend: canonical (OpenAI-shaped) chat <-> Messages requests, responses
and the streaming event sequence. Structured output (`response_format`) is one forced tool whose input
schema is the requested schema, its input coming back as the message content (it works on every Claude
model); for a strict schema, beside the client's tools or with thinking, which a forced tool would not
hold or would rule out, it is Claude's own `output_config.format` where the model has it
(`strict_schema` fits the schema to its rules).

Reasoning depends on the model (`thinking_mode`): up to the 4.5 family Claude takes a thinking budget,
the 4.6 family a budget or adaptive thinking with an effort, and from Opus 4.7 on only adaptive
thinking. An Anthropic client's own `thinking` is sent as it is where the model takes it (not beside a
tool turn without signed thinking, see `_thinking`); otherwise
(an OpenAI client's `reasoning_effort`, adaptive thinking for a budget-only model, a budget for an
adaptive-only one) it is turned into what the model takes, fitted to Anthropic's rules. Thinking blocks
come back as `reasoning_content` plus the signed blocks, which go back upstream first in their turn."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from gateway.config import Backend
from gateway.errors import ANTHROPIC_ERROR_STATUSES, BadGateway, GatewayError, InvalidRequest
from gateway.estimate import with_thinking
from gateway.providers.base import (
    CANONICAL_BLOCKS,
    NO_ARGUMENTS,
    NO_THINKING,
    Continuation,
    Param,
    ParamTable,
    Provider,
    UpstreamRequest,
    VendorApi,
    as_list,
    claude_only,
    comma_list,
    continued,
    decode_json,
    effort_for_budget,
    error_text,
    json_encode,
    json_instruction,
    now,
    parse_arguments,
    parse_data_url,
    parse_image_data_url,
    refuse_builtin_tools,
    refuse_emptied_final_turn,
    refuse_unexpressible,
    token_count,
    unexpressible,
    upstream_call_id,
    upstream_error,
)
from gateway.types import (
    AssistantMessage,
    ChatChunk,
    ChatRequest,
    ChatResponse,
    Choice,
    ChunkChoice,
    ContentPart,
    Delta,
    FilePart,
    FunctionCall,
    FunctionCallDelta,
    ImagePart,
    Message,
    NamedToolChoice,
    Reasoning,
    ReasoningBlock,
    RedactedReasoning,
    TextPart,
    TokenCount,
    ToolCall,
    ToolCallDelta,
    block_breakpoints,
)
from gateway.usage import Usage, normalise_usage

VENDOR = "anthropic"
DEFAULT_MAX_TOKENS = 4096  # Anthropic requires max_tokens; OpenAI clients often leave it out
JSON_TOOL = "json_response"  # the forced tool that carries structured output
BETA = "anthropic-beta"  # the header that turns on Anthropic's beta features
MIN_THINKING_BUDGET = 1024  # Anthropic refuses smaller thinking budgets
# Anthropic refuses a request with more `cache_control` breakpoints than this: "A maximum of 4 blocks
# with cache_control may be provided. Found 5."
MAX_BREAKPOINTS = 4
# reasoning_effort -> thinking budget; other efforts ("minimal", "none") ask for no thinking. Above
# high, no more than high: a larger budget needs a max_tokens the client did not choose.
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 16384, "max": 16384}
EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort
_BUDGET_ONLY = re.compile(r"claude-(3|(opus|sonnet|haiku)-4(-[015])?(-\d{8}|-latest)?$)")
_BUDGET_OR_ADAPTIVE = re.compile(r"claude-(opus|sonnet)-4-6")
# The Claude models that take `temperature` and `top_p` together; from Sonnet 4.5, Haiku 4.5 and Opus
# 4.1 on: "`temperature` and `top_p` cannot both be specified for this model". Models this table does
# not know are taken to be newer.
_BOTH_SAMPLERS = re.compile(r"claude-(3|(opus|sonnet)-4(-0)?(-\d{8}|-latest)?$)")
# Claude 4.6 dropped the assistant prefill with budget-only thinking: "This model does not support
# assistant message prefill. The conversation must end with a user message." Models this table does
# not know are taken to be newer.
_PREFILL = _BUDGET_ONLY

STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
    "pause_turn": "stop",
    "model_context_window_exceeded": "length",
}
# The stop reasons an Anthropic client gets back from finish_reason as Claude sent them; the others
# (pause_turn, model_context_window_exceeded, any added later) travel as `anthropic_stop_reason`.
_FINISH_SAYS = {"end_turn", "stop_sequence", "max_tokens", "tool_use", "refusal"}


def _own_stop_reason(reason: str | None) -> str | None:
    """Claude's stop_reason where the OpenAI finish_reason cannot say it."""
    return reason if reason is not None and reason not in _FINISH_SAYS else None


# A canonical (OpenAI) service tier as Anthropic's request takes one: priority capacity where there is
# some (`auto`) for `auto` and `priority`; standard processing alone for `default` and `flex` (Claude
# has no flex tier: the cheapest it has short of the Batch API). Another tier is left out: `auto`.
_ANTHROPIC_TIERS = {"auto": "auto", "priority": "auto", "default": "standard_only", "flex": "standard_only"}

MAX_TEMPERATURE = 1.0  # Claude's range is 0..1, OpenAI's 0..2
MIN_THINKING_TOP_P = 0.95  # beside thinking: "top_p may be set between 0.95 and 1"


def _stop_sequences(stop: str | list[str]) -> list[str] | None:
    # Anthropic refuses a whitespace-only stop sequence ("each stop sequence must contain
    # non-whitespace"): such a sequence (OpenAI's common `"\n"`) is left out, and with it the field
    # when nothing else is left.
    return [sequence for sequence in as_list(stop) if sequence.strip()] or None


PARAMS = ParamTable(
    {
        # Above Claude's range (an OpenAI client's, whose range is wider): its top, not a 400 that
        # would end a failover to Claude over a value the client's own model takes.
        "temperature": Param("temperature", lambda temperature: min(temperature, MAX_TEMPERATURE)),
        "top_p": Param("top_p"),
        "top_k": Param("top_k"),
        "cache_control": Param("cache_control"),  # automatic caching, as the client asked it
        "stop": Param("stop_sequences", _stop_sequences),
        "stream": Param("stream", lambda stream: True if stream else None),
        "service_tier": Param("service_tier", lambda tier: _ANTHROPIC_TIERS.get(tier)),
    }
)


def _version(backend: Backend) -> dict[str, str]:
    return {"anthropic-version": backend.anthropic_version}


# The backend's key in `x-api-key`, beside the API version every request needs, the model list's too
# (`/v1/models`, which Anthropic answers only with both).
API = VendorApi(key_header="x-api-key", root="/v1", fixed=_version)


def _headers(backend: Backend, request: ChatRequest) -> dict[str, str]:
    result = API.headers(backend)
    if request.anthropic_beta:
        # The client's beta flags beside any the backend's config sends, each once.
        configured = [result.pop(name) for name in list(result) if name.lower() == BETA]
        result[BETA] = ",".join(comma_list([*configured, *request.anthropic_beta]))
    return result


def _cache(block: dict[str, Any], cache_control: dict[str, Any] | None) -> dict[str, Any]:
    if cache_control is not None:
        block["cache_control"] = cache_control
    return block


def _image_block(part: ImagePart) -> dict[str, Any]:
    data = parse_image_data_url(part.image_url.url)
    if data is not None:
        source = {"type": "base64", "media_type": data[0], "data": data[1]}
    else:
        source = {"type": "url", "url": part.image_url.url}
    return _cache({"type": "image", "source": source}, part.cache_control)


def _document_block(part: FilePart) -> dict[str, Any] | None:
    """A file sent inline (a PDF as a data: URL) as Anthropic's document; None for a file id, which
    names a file in OpenAI's store."""
    data = parse_data_url(str(part.file.get("file_data", "")))
    if data is None:
        return None
    source = {"type": "base64", "media_type": data[0], "data": data[1]}
    return _cache({"type": "document", "source": source}, part.cache_control)


def _blank(text: str) -> bool:
    """Whether Anthropic refuses `text` as a text block ("text content blocks must be non-empty",
    "... must contain non-whitespace text"), which OpenAI takes (a stored reply of a newline alone)."""
    return not text.strip()


def _blocks(content: str | list[ContentPart] | None, where: str) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [] if _blank(content) else [{"type": "text", "text": content}]
    blocks = []
    for i, part in enumerate(content):
        if isinstance(part, TextPart):
            if _blank(part.text):
                continue  # an OpenAI client may send one; it says nothing Claude could read
            blocks.append(_cache({"type": "text", "text": part.text}, part.cache_control))
        elif isinstance(part, ImagePart):
            blocks.append(_image_block(part))
        elif isinstance(part, FilePart) and (document := _document_block(part)) is not None:
            blocks.append(document)
        else:
            raise InvalidRequest(
                f"content parts of type '{type(part).__struct_config__.tag}' are not supported by Anthropic models",
                param=f"{where}.content[{i}]",
            )
    return blocks


def _signed(block: Reasoning) -> bool:
    # Unsigned reasoning (another vendor's, shown to an Anthropic client) can never pass Anthropic's
    # signature check: it is left out rather than have the whole request refused.
    return isinstance(block, RedactedReasoning) or bool(block.signature)


def _reasoning_blocks(message: Message) -> list[dict[str, Any]]:
    """The turn's signed thinking, which Anthropic wants back unchanged and before the turn's text."""
    return [
        {"type": "thinking", "thinking": block.text, "signature": block.signature}
        if isinstance(block, ReasoningBlock)
        else {"type": "redacted_thinking", "data": block.data}
        for block in message.reasoning_blocks or ()
        if _signed(block)
    ]


def _messages(messages: list[Message]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    system: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []

    def append(role: str, blocks: list[dict[str, Any]], cache_control: dict[str, Any] | None) -> None:
        if not blocks:
            # Anthropic refuses a turn with no content (an OpenAI client's stored empty reply): it is
            # left out, and its neighbours merged below.
            return
        if cache_control is not None:
            blocks[-1]["cache_control"] = cache_control
        # Anthropic wants user and assistant turns to alternate: merge neighbours of one role
        # (consecutive tool results become one user turn, as Anthropic expects).
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role in ("system", "developer"):
            blocks = _blocks(message.content, where)
            if message.cache_control is not None and blocks:
                blocks[-1]["cache_control"] = message.cache_control
            system.extend(blocks)
        elif message.role == "user":
            append("user", _blocks(message.content, where), message.cache_control)
        elif message.role == "assistant" and message.anthropic_content is not None:
            # A turn with Claude's server tool blocks (or cited text), as Claude wrote it and the
            # client sent it back: Anthropic wants those blocks unchanged. Copies: `append` may set a
            # breakpoint on the last one.
            append("assistant", [dict(block) for block in message.anthropic_content], None)
        elif message.role == "assistant":
            blocks = _reasoning_blocks(message) + _blocks(message.content, where)
            for j, call in enumerate(message.tool_calls or ()):
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": upstream_call_id(call.id, anthropic=True),
                        "name": call.function.name,
                        "input": parse_arguments(
                            call.function.arguments, f"{where}.tool_calls[{j}].function.arguments"
                        ),
                    }
                )
            append("assistant", blocks, message.cache_control)
        else:  # tool
            if not message.tool_call_id:
                raise InvalidRequest("tool messages need a tool_call_id", param=f"{where}.tool_call_id")
            result: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": upstream_call_id(message.tool_call_id, anthropic=True),
            }
            if message.anthropic_content is not None:
                # The client's own content, with what only Claude takes (a `tool_reference`), as sent.
                result["content"] = [dict(block) for block in message.anthropic_content]
            elif isinstance(message.content, str):
                result["content"] = message.content
            else:
                result["content"] = _blocks(message.content, where)
            if message.is_error:
                result["is_error"] = True
            append("user", [result], message.cache_control)
    refuse_emptied_final_turn(messages, out, "Anthropic")
    _trim_prefill(out)
    return system, out


def _trim_prefill(turns: list[dict[str, Any]]) -> None:
    """A conversation ending with an assistant turn asks Claude to go on from it (a prefill), and
    Anthropic refuses one whose text ends in whitespace ("final assistant content cannot end with
    trailing whitespace"), which OpenAI-compatible servers take: that whitespace is left out."""
    if not turns or turns[-1]["role"] != "assistant":
        return
    last = turns[-1]["content"][-1]
    if last.get("type") == "text":
        turns[-1]["content"][-1] = {**last, "text": last["text"].rstrip()}


def _tool_choice(request: ChatRequest) -> dict[str, Any] | None:
    choice = request.tool_choice
    result: dict[str, Any] | None
    if choice is None:
        result = None
    elif choice == "auto":
        result = {"type": "auto"}
    elif choice == "required":
        result = {"type": "any"}
    elif choice == "none":
        result = {"type": "none"}
    elif isinstance(choice, NamedToolChoice):
        result = {"type": "tool", "name": choice.function.name}
    else:  # allowed_tools never gets here: ChatRequest resolves it into tools and a mode
        result = None
    if request.parallel_tool_calls is False and (result is None or result["type"] != "none"):
        result = {**(result or {"type": "auto"}), "disable_parallel_tool_use": True}
    return result


# Claude's structured outputs (`output_config.format`): Sonnet 4.5, Opus 4.1 and 4.5, Haiku 4.5, and
# every model from the 4.6 family on.
_STRUCTURED_OUTPUTS = re.compile(r"claude-(sonnet-4-5|opus-4-1|opus-4-5|haiku-4-5)")
# What its JSON schemas may hold; other keywords (numeric and length bounds...) go into the
# description, where the model can still read them.
_SCHEMA_KEYS = frozenset(
    {"type", "description", "title", "enum", "const", "required", "$ref", "default", "properties", "items"}
)
_SCHEMA_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "uri", "ipv4", "ipv6", "uuid"}
)


def _kept_bound(key: str, value: Any) -> bool:
    return (key == "format" and value in _SCHEMA_FORMATS) or (key == "minItems" and value in (0, 1))


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema as Claude's structured outputs take it: every object closed (additionalProperties
    false, which they require), oneOf as anyOf, and unsupported keywords described instead."""
    out: dict[str, Any] = {}
    described: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {
                name: strict_schema(sub) if isinstance(sub, dict) else sub for name, sub in value.items()
            }
        elif key == "items" and isinstance(value, dict):
            out[key] = strict_schema(value)
        elif key in ("anyOf", "oneOf", "allOf") and isinstance(value, list):
            variants = [strict_schema(v) if isinstance(v, dict) else v for v in value]
            out["allOf" if key == "allOf" else "anyOf"] = variants
        elif key in _SCHEMA_KEYS or _kept_bound(key, value):
            out[key] = value
        elif key not in ("additionalProperties", "$schema", "strict"):
            described[key] = value
    if out.get("type") == "object" or "properties" in out:
        out["additionalProperties"] = False
    if described:
        note = "{" + ", ".join(f"{k}: {json_encode(v).decode()}" for k, v in described.items()) + "}"
        out["description"] = f"{out['description']}\n\n{note}" if out.get("description") else note
    return out


def _native_format(request: ChatRequest, model: str) -> bool:
    """Whether a JSON schema goes as `output_config.format` rather than the forced JSON tool, on a
    model that has structured outputs: where the client asked for the schema to be kept strictly
    (`strict: true`, which also marks an Anthropic client's own `output_config.format`: the forced
    tool's input is not checked against it), or its tools (a forced tool would take them away) or
    thinking (Anthropic refuses it beside a forced tool) are in play."""
    form = request.response_format
    if form is None or form.type != "json_schema" or form.json_schema is None or not form.json_schema.schema:
        return False
    effort = request.reasoning_effort
    thinks = bool(request.reasoning_budget or request.reasoning_adaptive) or (
        effort is not None and effort not in NO_THINKING
    )
    supported = thinking_mode(model) != "budget" or _STRUCTURED_OUTPUTS.search(model)
    # Claude's structured outputs take no recursive schemas, which the forced tool does: a strict one
    # with references keeps the tool unless tools or thinking rule it out.
    strict = bool(form.json_schema.strict) and not _refers(form.json_schema.schema)
    return bool(supported and (strict or _has_tools(request) or thinks))


def _refers(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_refers(value) for value in schema.values())
    return isinstance(schema, list) and any(_refers(item) for item in schema)


def _uses_json_tool(request: ChatRequest, model: str) -> bool:
    form = request.response_format
    return (
        form is not None
        and form.type != "text"
        and not _has_tools(request)
        and not _native_format(request, model)
    )


def _continues_unsigned_tool_turn(messages: list[Message]) -> bool:
    """Whether the last assistant turn called tools without signed thinking to send back. Anthropic
    refuses thinking then: a tool loop's assistant turn must start with its own signed thinking."""
    for message in reversed(messages):
        if message.role == "assistant":
            return bool(message.tool_calls) and not any(map(_signed, message.reasoning_blocks or ()))
    return False


def _forces_tool(request: ChatRequest) -> bool:
    """Whether the client's tool_choice forces a tool (`any` or `tool` to Anthropic), which Anthropic
    refuses beside thinking: "Tool use with extended thinking only supports tool_choice auto or none"."""
    choice = request.tool_choice
    return _has_tools(request) and (choice == "required" or isinstance(choice, NamedToolChoice))


def _has_tools(request: ChatRequest) -> bool:
    """Whether the request has tools: function tools, or tools of Anthropic's API (a web search)."""
    return bool(request.tools or request.anthropic_tools)


def thinking_mode(model: str) -> Literal["budget", "both", "adaptive"]:
    """How a Claude model takes thinking: a budget (`enabled`) up to the 4.5 family; a budget or
    adaptive thinking on the 4.6 family; only adaptive thinking from Opus 4.7 on (a budget or
    `disabled` is a 400 there), which is assumed for models this table does not know."""
    if _BUDGET_ONLY.search(model):
        return "budget"
    return "both" if _BUDGET_OR_ADAPTIVE.search(model) else "adaptive"


def _vendor_effort(effort: str | None, mode: str) -> str | None:
    """A reasoning effort as `output_config.effort`, for the models that take one."""
    if effort is None or mode == "budget":
        return None
    if effort in NO_THINKING:
        return "low"
    if effort == "xhigh" and mode == "both":
        return "max"  # the 4.6 family has no xhigh
    return effort if effort in EFFORTS else None


def _thinking(request: ChatRequest, model: str) -> tuple[dict[str, Any] | None, str | None, int]:
    """(`thinking`, `output_config.effort`, `max_tokens`) for the request to `model`.

    Thinking the client set in Anthropic's own terms (a budget, adaptive) is passed as it is where the
    model takes it: the client chose it, and Anthropic's own 400 is the answer to an invalid one. What
    needs translating (an OpenAI client's effort, which has no way to meet Anthropic's rules itself;
    adaptive thinking for a model that takes only budgets) is fitted to the rules instead: left out
    where Anthropic would refuse any thinking (a forced tool, a tool loop without the signed thinking
    OpenAI clients cannot send back) and a budget kept below max_tokens, which thinking counts toward.
    A budget for a model that takes only adaptive thinking becomes adaptive thinking at the nearest
    effort.

    A tool loop whose last tool turn has no signed thinking goes without thinking whoever asked for
    it: an Anthropic client's too. That turn is most often another candidate's (a failover in a Claude
    Code session), which Claude did not think for and the client cannot sign; Anthropic refuses
    thinking then ("To avoid this requirement, disable `thinking`"), on every retry, so the session
    could not go on past it."""
    mode = thinking_mode(model)
    limit = request.output_limit
    budget, effort = request.reasoning_budget, request.reasoning_effort
    adaptive = bool(request.reasoning_adaptive)
    wants = budget is not None or adaptive or (effort is not None and effort not in NO_THINKING)
    as_asked = (budget is not None and mode != "adaptive") or (
        adaptive and budget is None and mode != "budget"
    )
    if mode == "adaptive" and budget is not None:
        adaptive, effort, budget = True, effort or effort_for_budget(budget), None
    if wants and (
        _continues_unsigned_tool_turn(request.messages)
        or (not as_asked and (_uses_json_tool(request, model) or _forces_tool(request)))
    ):
        wants = False
    thinking: dict[str, Any] | None = None
    room = 0  # what thinking may take on top of the answer when the client set no limit
    if wants and mode != "budget" and budget is None:
        thinking = {"type": "adaptive"}
        room = EFFORT_BUDGETS.get(effort or "high", EFFORT_BUDGETS["high"])
    elif wants:
        if budget is None:  # an effort, or adaptive thinking, for a model that takes only budgets
            budget = EFFORT_BUDGETS.get(effort or "high")
            if budget is not None and limit is not None and budget >= limit:
                # Clamped under the client's limit, or no thinking when not even the minimum fits.
                budget = limit - 1 if limit - 1 >= MIN_THINKING_BUDGET else None
        if budget is not None:
            thinking = {"type": "enabled", "budget_tokens": budget}
            room = budget
    if limit is None:
        # The default limit is for the answer: thinking comes on top of it.
        limit = DEFAULT_MAX_TOKENS + room
    return thinking, _vendor_effort(effort, mode), limit


def continuation(backend: Backend, model: str) -> Continuation:
    return backend.continuation or ("prefill" if _PREFILL.search(model) else "instruction")


def chat_request(backend: Backend, request: ChatRequest, model: str) -> UpstreamRequest:
    request = continued(request, continuation(backend, model))
    body = json_encode(_chat_body(request, model))
    return UpstreamRequest(
        API.url(backend, "/messages"), _headers(backend, request), body, stream=bool(request.stream)
    )


# What /v1/messages/count_tokens takes of a Messages body; it refuses the rest (max_tokens, stream...).
_COUNTED = ("model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control")


def count_tokens_request(backend: Backend, request: ChatRequest, model: str) -> UpstreamRequest:
    body = {k: v for k, v in _chat_body(request, model).items() if k in _COUNTED}
    return UpstreamRequest(
        API.url(backend, "/messages/count_tokens"), _headers(backend, request), json_encode(body)
    )


def count_tokens_response(body: bytes, model: str) -> TokenCount:
    return token_count(body, "input_tokens", "the Anthropic backend")


# What Claude's Messages API cannot carry, which left out would change the answer: token log
# probabilities (the answer would read as having none), biased or banned tokens (OpenAI's token ids
# mean nothing to Claude's tokenizer), repetition penalties other than none, a spoken answer, a web
# search (not translated into Claude's web search tool). `seed`, `store`, `metadata`, `prediction`, `verbosity` and the
# prompt-cache hints are left out instead: they ask for no other answer.
UNEXPRESSIBLE = unexpressible(
    "logprobs", "logit_bias", "frequency_penalty", "presence_penalty", "modalities", "web_search_options"
)


def _end_user(request: ChatRequest) -> str | None:
    """The end user's id for `metadata.user_id`: OpenAI's `safety_identifier`, which replaces its
    deprecated `user` (an Anthropic client's own `metadata.user_id` arrives as `user`)."""
    safety = request.extra.get("safety_identifier")
    return safety if isinstance(safety, str) and safety else request.user


def _tools(request: ChatRequest) -> list[dict[str, Any]]:
    """The function tools as Claude's, and the tools of Anthropic's API as the client sent them, each
    in its place among the client's tools (an order a prompt-cache breakpoint on a tool depends on)."""
    tools = [
        _cache(
            {
                "name": tool.function.name,
                "description": tool.function.description or "",
                "input_schema": tool.function.parameters or {"type": "object", "properties": {}},
            },
            tool.cache_control,
        )
        for tool in request.tools or ()
    ]
    for typed in sorted(request.anthropic_tools or (), key=lambda tool: tool.position):
        tools.insert(typed.position, typed.definition)
    return tools


def _chat_body(request: ChatRequest, model: str) -> dict[str, Any]:
    # Tools first, then parameters, as every adapter refuses them (the first candidate's reason is
    # the one a client of no able candidate reads).
    refuse_builtin_tools(request, "Anthropic models")
    if request.n is not None and request.n > 1:
        raise InvalidRequest("Anthropic models do not support n > 1", param="n", code="unsupported_value")
    refuse_unexpressible(request, UNEXPRESSIBLE, "Anthropic models")
    system, messages = _messages(request.messages)
    thinking, effort, max_tokens = _thinking(request, model)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": messages}
    if thinking is not None:
        body["thinking"] = thinking
    if effort is not None:
        body["output_config"] = {"effort": effort}
    if system:
        body["system"] = system
    PARAMS.apply(request, body)
    if (end_user := _end_user(request)) is not None:
        body["metadata"] = {"user_id": end_user}
    _fit_sampling(body, model)
    if _has_tools(request):
        body["tools"] = _tools(request)
    tool_choice = _tool_choice(request)
    if tool_choice is not None and _has_tools(request):  # Anthropic refuses a tool_choice without tools
        body["tool_choice"] = tool_choice
    form = request.response_format
    if form is not None and form.json_schema is not None and _native_format(request, model):
        schema = strict_schema(form.json_schema.schema or {})
        body.setdefault("output_config", {})["format"] = {"type": "json_schema", "schema": schema}
    elif form is not None and form.type != "text":
        schema = (form.json_schema.schema if form.json_schema else None) or {"type": "object"}
        if not _uses_json_tool(request, model):
            # A forced tool would take the user's tools away: ask in words instead.
            body.setdefault("system", []).append({"type": "text", "text": json_instruction(form)})
        else:
            body["tools"] = [
                {"name": JSON_TOOL, "description": "Reply with the answer.", "input_schema": schema}
            ]
            body["tool_choice"] = {"type": "tool", "name": JSON_TOOL}
    _fit_breakpoints(body)
    return body


def _breakpoints(body: dict[str, Any]) -> list[tuple[list[Any], int]]:
    """Where the body's `cache_control` breakpoints are, in the order of Anthropic's prompt prefix
    (tools, system, messages), each as (the list holding its block, the block's index): every one the
    body carries, a tool result's own blocks' (kept as the client sent them) included."""
    found = [*block_breakpoints(body.get("tools")), *block_breakpoints(body.get("system"))]
    for message in body["messages"]:
        found.extend(block_breakpoints(message["content"]))
    return found


def _fit_breakpoints(body: dict[str, Any]) -> None:
    """Breakpoints beyond Anthropic's `MAX_BREAKPOINTS` left out, where Anthropic would refuse the whole
    request: they ask for no other answer, only for what is cached. Automatic caching (the body's own
    `cache_control`) takes one of the slots. Kept: the first ones, the prefixes other conversations
    share (tools, system), and the last, the longest prefix, which the next turn reads; those between
    are what another kept breakpoint's prefix holds too. Each block dropped from is replaced by a
    copy, never changed: it may be the client's own (a tool's definition)."""
    room = MAX_BREAKPOINTS - (body.get("cache_control") is not None)
    for blocks, i in _breakpoints(body)[room - 1 : -1]:
        blocks[i] = {key: value for key, value in blocks[i].items() if key != "cache_control"}


def _fit_sampling(body: dict[str, Any], model: str) -> None:
    """Sampling parameters as Claude takes them together. With thinking Anthropic takes only a
    temperature of 1, its default, no `top_k`, and a `top_p` from 0.95 to 1: another temperature and
    any top_k are left out, a lower top_p raised to 0.95 (the nearest it takes, still narrowing the
    sampling as the client asked). Newer models refuse `temperature` beside `top_p`: the temperature,
    the one every vendor has, is kept."""
    if "thinking" in body:
        body.pop("temperature", None)
        body.pop("top_k", None)
        if "top_p" in body:
            body["top_p"] = max(body["top_p"], MIN_THINKING_TOP_P)
    elif "temperature" in body and not _BOTH_SAMPLERS.search(model):
        body.pop("top_p", None)


def empty_answer(model: str) -> bytes:
    """A Messages answer with no text, in the fields every one carries (Anthropic's adds cache and
    service-tier usage fields)."""
    return json_encode(
        {
            "id": "msg_01" + "0" * 22,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": ""}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
    )


def chat_response(body: bytes, model: str) -> ChatResponse:
    data = decode_json(body, "the Anthropic backend")
    if not isinstance(data, dict) or not isinstance(data.get("content"), list):
        raise BadGateway("the Anthropic backend returned an unexpected response")
    text: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[Reasoning] = []
    structured: str | None = None  # the structured-output tool's input, which is then the whole reply
    own = claude_only(data["content"])
    for block in data["content"]:
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "thinking":
            reasoning.append(ReasoningBlock(text=block.get("thinking", ""), signature=block.get("signature")))
        elif kind == "redacted_thinking":
            reasoning.append(RedactedReasoning(data=block.get("data", "")))
        elif kind == "tool_use":
            arguments = msgspec.json.encode(block.get("input") or {}).decode()
            if block.get("name") == JSON_TOOL:
                structured = arguments
            else:
                calls.append(
                    ToolCall(id=block["id"], function=FunctionCall(name=block["name"], arguments=arguments))
                )
    finish = STOP_REASONS.get(data.get("stop_reason") or "end_turn", "stop")
    if structured is not None:
        text = [structured]
        if not calls:
            finish = "stop"
    thoughts = [block.text for block in reasoning if isinstance(block, ReasoningBlock)]
    message = AssistantMessage(
        role="assistant",
        content="".join(text) if text or not calls else None,
        tool_calls=calls or None,
        reasoning_content="".join(thoughts) if thoughts else None,
        reasoning_blocks=reasoning or None,
        anthropic_content=data["content"] if own and structured is None else None,
    )
    return ChatResponse(
        id=data.get("id", ""),
        created=now(),
        model=data.get("model") or model,
        choices=[
            Choice(
                index=0,
                message=message,
                finish_reason=finish,
                stop_sequence=_matched(data),
                anthropic_stop_reason=_own_stop_reason(data.get("stop_reason")),
            )
        ],
        usage=with_thinking(normalise_usage(VENDOR, data.get("usage")), _thought_bytes(reasoning)),
    )


def _thought_bytes(reasoning: list[Reasoning]) -> int:
    """The size of the thinking an answer returned: its text, or a redacted block's encrypted data."""
    return sum(
        len(block.text.encode()) if isinstance(block, ReasoningBlock) else len(block.data.encode())
        for block in reasoning
    )


def _matched(message: dict[str, Any]) -> str | None:
    """The stop sequence that ended a message (or a message_delta's delta), when one did."""
    sequence = message.get("stop_sequence")
    return sequence if message.get("stop_reason") == "stop_sequence" and isinstance(sequence, str) else None


class ChatStream:
    """Anthropic's event sequence (message_start, content_block_*, message_delta, message_stop) as chunks."""

    def __init__(self, request: ChatRequest, model: str) -> None:
        self.model = model
        # With the structured-output tool forced, its input is the whole reply: any text is dropped.
        self.structured = _uses_json_tool(request, model)
        self.id = ""
        self.created = now()
        self.usage: dict[str, Any] = {}
        self.blocks: dict[int, tuple[str, int]] = {}  # content block index -> (kind, tool call index)
        self.tool_calls = 0
        # Tool blocks whose input has not started: Claude streams an empty input as one empty fragment,
        # and "" is no JSON (clients json.loads a call's arguments, or the structured-output tool's
        # reply), so at the block's end such a call, or reply, gets "{}", what the unstreamed one has.
        self.no_input: set[int] = set()
        self.done = False
        self.thought_bytes = 0  # the thinking streamed, to estimate its tokens (`with_thinking`)
        # A content block (even an empty text block) or a stop_reason came: the model answered, if
        # only with nothing. message_start then message_stop alone is no answer (failed at message_stop).
        self.answered = False
        # A server tool's block came: from then on each text block is a block of its own for an
        # Anthropic client (`Delta.anthropic_block`), as Claude's answer with its sources is, each
        # text with its own citations.
        self.server_tools = False

    def _chunk(self, delta: Delta, finish: str | None = None, stop_sequence: str | None = None) -> ChatChunk:
        choice = ChunkChoice(index=0, delta=delta, finish_reason=finish, stop_sequence=stop_sequence)
        return ChatChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def feed(self, event: str | None, data: str) -> list[ChatChunk]:
        try:
            payload = msgspec.json.decode(data)
        except msgspec.DecodeError:
            raise BadGateway("the Anthropic backend sent an invalid stream event") from None
        kind = payload.get("type", event)
        if kind == "message_start":
            message = payload.get("message", {})
            self.id = message.get("id", "")
            self.model = message.get("model") or self.model
            self.usage = dict(message.get("usage") or {})
            start = self._chunk(Delta(role="assistant", content=""))
            # The prompt's count, known before the answer: an Anthropic client's message_start shows it.
            counted = self.partial_usage()
            start.prompt_usage = counted.prompt_only() if counted is not None else None
            return [start]
        if kind == "content_block_start":
            self.answered = True
            block = payload.get("content_block", {})
            index = payload.get("index", 0)
            if block.get("type") == "tool_use":
                if block.get("name") == JSON_TOOL:
                    self.blocks[index] = ("json", -1)
                    self.no_input.add(index)
                    return []
                call = self.tool_calls
                self.tool_calls += 1
                self.blocks[index] = ("tool", call)
                self.no_input.add(index)
                delta = ToolCallDelta(
                    index=call,
                    id=block.get("id"),
                    type="function",
                    function=FunctionCallDelta(name=block.get("name"), arguments=""),
                )
                return [self._chunk(Delta(tool_calls=[delta]))]
            block_type = block.get("type", "text")
            self.blocks[index] = (block_type, -1)
            if block_type not in CANONICAL_BLOCKS:  # a server tool's block, or newer, for Anthropic clients
                self.server_tools = True
                self.blocks[index] = ("claude", -1)
                return [self._chunk(Delta(anthropic_block=block))]
            if block_type == "text" and (self.server_tools or "citations" in block) and not self.structured:
                text = block.get("text")
                return [self._chunk(Delta(anthropic_block={**block, "text": ""}, content=text or None))]
            if block_type == "redacted_thinking":
                data = block.get("data", "")
                self.thought_bytes += len(data.encode())
                return [self._chunk(Delta(redacted_reasoning=data))]
            if block_type == "thinking":
                thought = block.get("thinking")
                self.thought_bytes += len((thought or "").encode())
                return [self._chunk(Delta(reasoning_content=thought))] if thought else []
            text = block.get("text")
            return [self._chunk(Delta(content=text))] if text and not self.structured else []
        if kind == "content_block_delta":
            delta = payload.get("delta", {})
            block_kind, call = self.blocks.get(payload.get("index", 0), ("text", -1))
            if delta.get("type") == "text_delta":
                return [] if self.structured else [self._chunk(Delta(content=delta.get("text", "")))]
            if block_kind == "claude" or delta.get("type") == "citations_delta":
                # A server tool's input, a text's citation: only an Anthropic client has a place for them.
                return [self._chunk(Delta(anthropic_delta=delta))]
            if delta.get("type") == "input_json_delta":
                partial = delta.get("partial_json", "")
                if partial:
                    self.no_input.discard(payload.get("index", 0))
                if block_kind == "json":
                    return [self._chunk(Delta(content=partial))] if partial else []
                tool_delta = ToolCallDelta(index=call, function=FunctionCallDelta(arguments=partial))
                return [self._chunk(Delta(tool_calls=[tool_delta]))]
            if delta.get("type") == "thinking_delta":
                thought = delta.get("thinking", "")
                self.thought_bytes += len(thought.encode())
                return [self._chunk(Delta(reasoning_content=thought))]
            if delta.get("type") == "signature_delta":
                return [self._chunk(Delta(reasoning_signature=delta.get("signature", "")))]
            return []  # delta types added later
        if kind == "content_block_stop":
            index = payload.get("index", 0)
            if index not in self.no_input:
                return []
            self.no_input.discard(index)
            block_kind, call = self.blocks[index]
            if block_kind == "json":  # the structured-output tool: its input is the reply
                return [self._chunk(Delta(content="{}"))]
            empty = ToolCallDelta(index=call, function=FunctionCallDelta(arguments=NO_ARGUMENTS))
            return [self._chunk(Delta(tool_calls=[empty]))]
        if kind == "message_delta":
            usage = payload.get("usage") or {}
            self.usage.update({k: v for k, v in usage.items() if v is not None})
            reason = (payload.get("delta") or {}).get("stop_reason")
            if reason is None:
                return []
            self.answered = True
            finish = STOP_REASONS.get(reason, "stop")
            if finish == "tool_calls" and self.tool_calls == 0:
                finish = "stop"  # only the structured-output tool was called
            chunk = self._chunk(Delta(), finish, _matched(payload.get("delta") or {}))
            chunk.choices[0].anthropic_stop_reason = _own_stop_reason(reason)
            return [chunk]
        if kind == "message_stop":
            if not self.answered:
                # The backend's failure, as OpenAI's `[DONE]` after nothing is: never an empty reply.
                # Raised here, before the usage chunk that would read as the answer's first output.
                raise BadGateway("the Anthropic backend ended the stream without an answer")
            self.done = True
            return [
                ChatChunk(
                    id=self.id,
                    created=self.created,
                    model=self.model,
                    choices=[],
                    usage=with_thinking(normalise_usage(VENDOR, self.usage), self.thought_bytes),
                )
            ]
        if kind == "error":
            # Any error Anthropic has may come after its 200 (a rate limit, an overload): read as
            # the status its type has in a status line, not as a generic 500.
            detail = payload.get("error") if isinstance(payload.get("error"), dict) else {}
            named = detail.get("type")
            status = ANTHROPIC_ERROR_STATUSES.get(named, 500) if isinstance(named, str) else 500
            raise _error(status, str(detail.get("message", "stream error")), detail, {})
        return []  # ping and event types added later

    def close(self) -> list[ChatChunk]:
        if not self.done:
            raise BadGateway("the Anthropic backend ended the stream before message_stop")
        return []

    def partial_usage(self) -> Usage | None:
        """What message_start (and any message_delta) reported before a break: the prompt's tokens,
        cache reads and writes counted exactly (see `gateway.pipeline._cut_usage`)."""
        return normalise_usage(VENDOR, self.usage) if self.usage else None


# Anthropic says an account is out of credit with a 400, as if the request were at fault.
_NO_CREDIT = "credit balance is too low"


def error(status: int, body: bytes, response_headers: Mapping[str, str]) -> GatewayError:
    message, detail = error_text(body)
    return _error(status, message, detail, response_headers)


def _error(
    status: int, message: str, detail: Mapping[str, Any], response_headers: Mapping[str, str]
) -> GatewayError:
    """Anthropic's error (`detail`: its `error` object) as the client sees it, said in the status
    line or inside a 200 stream."""
    kind = detail.get("type")
    if status == 400 and _NO_CREDIT in message:
        status = 402  # the gateway's account, not the request: fails over like a billing refusal
    return upstream_error(
        status,
        message,
        response_headers,
        vendor="Anthropic",
        type=kind if isinstance(kind, str) else None,
    )


PROVIDER = Provider(
    name=VENDOR,
    chat_request=chat_request,
    chat_response=chat_response,
    chat_stream=ChatStream,
    error=error,
    empty_answer=empty_answer,
    models_request=API.models_request,
    count_tokens_request=count_tokens_request,
    count_tokens_response=count_tokens_response,
    continuation=continuation,
)
