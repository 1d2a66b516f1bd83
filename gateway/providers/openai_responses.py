"""OpenAI's Responses API outbound (`POST /responses`), for models OpenAI serves there alone (o1-pro,
o3-pro, codex-mini-latest, gpt-5-codex, ...: chat completions to them get 404 "This model is only
supported in v1/responses"). Chosen per model or backend with `api: responses`.

Stateless, as the rest of Weir: every request carries the whole conversation (`store: false`), never a
`previous_response_id`. The transport, the error shape, embeddings and the request rules shared with
chat (tool results' images, a failed tool's result in words, reasoning effort, the user id) are the
OpenAI adapter's (`error`: the same error shape); this module only translates canonical requests into Responses input items and
Responses output and events back into canonical responses and chunks."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from gateway.config import Backend
from gateway.errors import BadGateway, GatewayError, InvalidRequest
from gateway.providers import openai
from gateway.providers.base import (
    CONTEXT_LENGTH_EXCEEDED,
    NO_ARGUMENTS,
    Param,
    ParamTable,
    Unexpressible,
    UpstreamRequest,
    continued,
    custom_arguments,
    decode_json,
    json_encode,
    refuse_anthropic_tools,
    refuse_unexpressible,
    unexpressible,
    upstream_call_id,
    upstream_error,
)
from gateway.types import (
    AllowedToolsChoice,
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
    RefusalPart,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
)
from gateway.usage import normalise_usage

VENDOR = "openai_responses"  # its row of gateway.usage.USAGE_SHAPES
BACKEND_HINT = "the OpenAI Responses API"
# Chat finish reasons that leave a Response `incomplete`, and the reason the Responses API gives: one
# table for both directions (gateway.responses_inbound writes these reasons, this adapter reads them).
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}
_FINISH_REASONS = {reason: finish for finish, reason in INCOMPLETE_REASONS.items()}
# A failed response's error code (`response.failed`, an `error` event) as an HTTP status: a rate limit
# or an overloaded model fails over as its 429 or 503 would; a prompt OpenAI refuses is the request's
# fault; anything else is the upstream's (502).
_FAILURE_STATUS = {
    "rate_limit_exceeded": 429,
    "insufficient_quota": 429,
    "server_is_overloaded": 503,
    "slow_down": 503,
    "invalid_prompt": 400,
    CONTEXT_LENGTH_EXCEEDED: 400,
}


# --- the request ---------------------------------------------------------------------------------

# Chat parameters the Responses API has no field for (it refuses them: "Unsupported parameter"): a
# request that sets one cannot be expressed for it, and is not sent (a route passes the candidate
# over; a client of that model alone gets this 400). `top_k` and `seed` are dropped as on chat to
# OpenAI: another vendor's clients send them where their own models took them.
_NOT_IN_RESPONSES: Unexpressible = {
    "stop": (lambda request: bool(request.stop_list), "stop sequences"),
    "n": (lambda request: (request.n or 1) > 1, "several choices"),
    # A Responses client's come back in the output items passed through as they came (its `include` and
    # `top_logprobs` sent as is); a chat client's would need them read back into chat's, which is not done.
    "logprobs": (
        lambda request: request.responses is None and bool(request.logprobs or request.top_logprobs),
        "token log probabilities",
    ),
    # The Responses API answers in text alone, and searches the web with a `web_search` tool, which
    # Weir does not send for chat's `web_search_options`.
    **unexpressible(
        "logit_bias", "frequency_penalty", "presence_penalty", "modalities", "web_search_options"
    ),
}
# Chat parameters Weir does not model (`ChatRequest.extra`) that the Responses API takes under the same
# name (`verbosity` as `text.verbosity`): without them its prompt cache is routed, kept and its abuse
# checks keyed otherwise than the client asked, and gpt-5 answers at its default length.
_SAME_IN_RESPONSES = ("prompt_cache_key", "prompt_cache_retention", "safety_identifier")


def _tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Chat's nested function tools in the Responses API's flat shape."""
    return [{"type": "function", **msgspec.to_builtins(tool.function)} for tool in tools]


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "name": choice.function.name}
    if isinstance(choice, AllowedToolsChoice):  # resolved by ChatRequest; never reaches an adapter
        return choice.allowed_tools.mode
    return choice


def _text_format(form: ResponseFormat) -> dict[str, Any] | None:
    if form.type == "json_object":
        return {"type": "json_object"}
    schema = form.json_schema
    if form.type != "json_schema" or schema is None:
        return None
    fields = {"description": schema.description, "strict": schema.strict}
    out = {"type": "json_schema", "name": schema.name, "schema": schema.schema or {"type": "object"}}
    return out | {key: value for key, value in fields.items() if value is not None}


# Canonical request fields -> their place in a Responses body (the messages, the reasoning effort and
# what cannot be expressed are translated apart, below).
_PARAMS = ParamTable(
    {
        "output_limit": Param("max_output_tokens"),
        "temperature": Param("temperature"),
        "top_p": Param("top_p"),
        "tools": Param("tools", _tools),
        "tool_choice": Param("tool_choice", _tool_choice),
        "parallel_tool_calls": Param("parallel_tool_calls"),
        "response_format": Param("text.format", _text_format),
        "user": Param("user", openai.short_user),
        "metadata": Param("metadata"),
        "service_tier": Param("service_tier"),
    }
)


def _part(part: ContentPart) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "input_text", "text": part.text}
    if isinstance(part, RefusalPart):
        return {"type": "input_text", "text": part.refusal}
    if isinstance(part, ImagePart):
        return {
            "type": "input_image",
            "image_url": part.image_url.url,
            "detail": part.image_url.detail or "auto",
        }
    if isinstance(part, FilePart):
        return {"type": "input_file", **part.file}
    raise InvalidRequest(
        "audio input is not supported by models served on the Responses API", param="messages"
    )


def _content(content: str | list[ContentPart] | None) -> str | list[dict[str, Any]]:
    if content is None or isinstance(content, str):
        return content or ""
    return [_part(part) for part in content]


def _items(messages: list[Message]) -> tuple[str | None, list[dict[str, Any]]]:
    """(instructions, input items): the leading system and developer messages are the instructions;
    later ones stay in place as developer messages. An assistant turn is its text, then one
    `function_call` item per call; a tool message is a `function_call_output` item."""
    leading = 0
    while leading < len(messages) and messages[leading].role in ("system", "developer"):
        leading += 1
    instructions = "\n\n".join(message.text() for message in messages[:leading]) or None
    items: list[dict[str, Any]] = []
    for message in messages[leading:]:
        if message.responses_items is not None:
            # A Responses client's own items, some of which only this API reads (encrypted reasoning,
            # custom tool calls and their outputs, built-in tools' calls): as the client sent them.
            items.extend(message.responses_items)
        elif message.role in ("system", "developer"):
            items.append({"role": "developer", "content": _content(message.content)})
        elif message.role == "user":
            items.append({"role": "user", "content": _content(message.content)})
        elif message.role == "assistant":
            # Earlier reasoning is not sent back: OpenAI's is encrypted and not kept (`store: false`),
            # and another vendor's cannot be given to OpenAI's models.
            if text := message.text():
                items.append({"role": "assistant", "content": text})
            for call in message.tool_calls or ():
                function = call.function
                items.append(
                    {
                        "type": "function_call",
                        "call_id": upstream_call_id(call.id, openai.MAX_CALL_ID),
                        "name": function.name,
                        "arguments": function.arguments or NO_ARGUMENTS,
                    }
                )
        else:  # tool: its text (its images went to a user message after the turn's results)
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": upstream_call_id(message.tool_call_id or "", openai.MAX_CALL_ID),
                    "output": message.text(),
                }
            )
    return instructions, items


def _as_its_items(message: Message) -> Message:
    """A tool result a Responses client's items stand for (`responses_items`) without content of its
    own: the items are sent in its place (`_items`), its images inside them, which moved to a user
    message after the turn's results as well (`openai.media_after_tool_results`) were sent twice."""
    if message.responses_items is None or message.role != "tool":
        return message
    return msgspec.structs.replace(message, content=None)


def _client_settings(settings: dict[str, Any] | None, body: dict[str, Any]) -> None:
    """A Responses client's own settings (`ChatRequest.responses`), as it sent them: its tools as they
    are (custom tools with their grammar, built-in tools, which the canonical request holds as
    functions or not at all), what to include (encrypted reasoning, which a tool loop that stores
    nothing needs back), the reasoning summary, the verbosity and the prompt cache key."""
    if not settings:
        return
    for name in ("tools", "tool_choice", "include", "top_logprobs", "max_tool_calls", *_SAME_IN_RESPONSES):
        if name in settings:
            body[name] = settings[name]
    if "reasoning_summary" in settings:
        body.setdefault("reasoning", {})["summary"] = settings["reasoning_summary"]
    if "verbosity" in settings:
        body.setdefault("text", {})["verbosity"] = settings["verbosity"]


def chat_request(backend: Backend, request: ChatRequest, model: str) -> UpstreamRequest:
    refuse_anthropic_tools(request, "OpenAI")
    refuse_unexpressible(request, _NOT_IN_RESPONSES, "models served on the Responses API")
    request = continued(request, openai.continuation(backend, model))
    own = [_as_its_items(openai.worded_error(message)) for message in request.messages]
    instructions, items = _items(openai.media_after_tool_results(own))
    body: dict[str, Any] = {"model": model, "input": items, "store": False}
    if instructions is not None:
        body["instructions"] = instructions
    _PARAMS.apply(request, body)
    for name in _SAME_IN_RESPONSES:
        if (value := request.extra.get(name)) is not None:
            body[name] = value
    if (verbosity := request.extra.get("verbosity")) is not None:
        body.setdefault("text", {})["verbosity"] = verbosity
    effort = openai.reasoning_effort(request, model, openai.openai_rules(backend, model))
    if effort is not None:
        body["reasoning"] = {"effort": effort}
    _client_settings(request.responses, body)
    if request.stream:
        body["stream"] = True
    return UpstreamRequest(
        openai.API.url(backend, "/responses"),
        openai.API.headers(backend),
        json_encode(body),
        stream=bool(request.stream),
    )


# --- the answer ----------------------------------------------------------------------------------


def _failure(error: Any) -> GatewayError:
    """A response that failed after its 200 (`response.failed`, an `error` event, a whole response
    whose status is `failed`) as the error it stands for (`_FAILURE_STATUS`)."""
    error = error if isinstance(error, dict) else {}
    code = error.get("code")
    code = str(code) if code is not None else None
    message = str(error.get("message") or "the response failed")
    status = _FAILURE_STATUS.get(code or "", 502)
    return upstream_error(status, message, {}, vendor="OpenAI", code=code)


def _finish(response: dict[str, Any], called: bool) -> str:
    if response.get("status") == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return _FINISH_REASONS.get(str(reason), "length")
    return "tool_calls" if called else "stop"


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's readable text: its reasoning text where the model gives it, else its summary."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if not isinstance(parts, list):
            continue
        text = "".join(p.get("text") or "" for p in parts if isinstance(p, dict) and p.get("type") == kind)
        if text:
            return text
    return ""


def _annotation(annotation: Any) -> dict[str, Any] | None:
    """A Responses citation (flat) in chat's shape (nested under `url_citation`)."""
    if not isinstance(annotation, dict) or annotation.get("type") != "url_citation":
        return None
    cited = {
        key: annotation[key] for key in ("url", "title", "start_index", "end_index") if key in annotation
    }
    return {"type": "url_citation", "url_citation": cited}


def _message(output: list[Any]) -> AssistantMessage:
    text: list[str] = []
    refusal: list[str] = []
    reasoning: list[str] = []
    annotations: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    for item in output:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or ():
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "output_text":
                    text.append(part.get("text") or "")
                    annotations += filter(None, map(_annotation, part.get("annotations") or ()))
                elif part.get("type") == "refusal":
                    refusal.append(part.get("refusal") or "")
        elif kind == "function_call":
            arguments = item.get("arguments") or NO_ARGUMENTS
            function = FunctionCall(name=str(item.get("name") or ""), arguments=arguments)
            calls.append(ToolCall(id=str(item.get("call_id") or item.get("id") or ""), function=function))
        elif kind == "custom_tool_call":
            # As a function of one string, as other backends serve custom tools; a Responses client
            # gets the item itself (`Choice.responses_output`).
            function = FunctionCall(
                name=str(item.get("name") or ""), arguments=custom_arguments(str(item.get("input") or ""))
            )
            calls.append(ToolCall(id=str(item.get("call_id") or item.get("id") or ""), function=function))
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item))
    return AssistantMessage(
        role="assistant",
        content="".join(text) if text or not calls else None,
        tool_calls=calls or None,
        refusal="".join(refusal) or None,
        reasoning_content="".join(reasoning) or None,
        annotations=annotations or None,
    )


def chat_response(body: bytes, model: str) -> ChatResponse:
    response = decode_json(body, BACKEND_HINT)
    if not isinstance(response, dict) or not isinstance(response.get("output"), list):
        raise BadGateway(f"{BACKEND_HINT} returned a response without output")
    if response.get("status") == "failed" or response.get("error"):
        raise _failure(response.get("error"))
    message = _message(response["output"])
    finish = _finish(response, bool(message.tool_calls))
    choice = Choice(index=0, message=message, finish_reason=finish, responses_output=response["output"])
    return ChatResponse(
        id=str(response.get("id") or ""),
        created=int(response.get("created_at") or 0),
        model=str(response.get("model") or model),
        choices=[choice],
        usage=normalise_usage(VENDOR, response.get("usage")),
    )


def empty_answer(model: str) -> bytes:
    """A Response with no text, in the fields every one carries."""
    message = {
        "type": "message",
        "id": "msg_" + "0" * 48,
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "", "annotations": []}],
    }
    return json_encode(
        {
            "id": "resp_" + "0" * 48,
            "object": "response",
            "created_at": 1700000000,
            "status": "completed",
            "model": model,
            "output": [message],
            "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
        }
    )


class ChatStream:
    """Responses events -> canonical chunks: the role first (at `response.created`), then text,
    reasoning, refusals and tool calls as their deltas come, then the finish and the usage at
    `response.completed` or `response.incomplete`. A `response.failed` or `error` event raises the
    error it stands for, which fails the stream over like a broken one."""

    def __init__(self, request: ChatRequest, model: str) -> None:
        self.model = model
        self.id = ""
        self.created = 0
        self.calls: dict[str, int] = {}  # function_call item id -> its canonical tool call index
        self.argued: set[int] = set()  # calls some of whose arguments came
        self.custom: set[int] = set()  # the calls of custom tools, as functions of one string
        # A Responses client gets each event as it came (`ChatChunk.responses_event`).
        self.passes = request.responses is not None
        self.finished = False

    def _chunk(self, delta: Delta | None = None, finish: str | None = None, **fields: Any) -> ChatChunk:
        choices = (
            [ChunkChoice(index=0, delta=delta or Delta(), finish_reason=finish)] if delta or finish else []
        )
        return ChatChunk(id=self.id, created=self.created, model=self.model, choices=choices, **fields)

    def _call(self, index: int, **fields: Any) -> ChatChunk:
        return self._chunk(Delta(tool_calls=[ToolCallDelta(index=index, **fields)]))

    def feed(self, event: str | None, data: str) -> list[ChatChunk]:
        payload = decode_json(data, BACKEND_HINT)
        if not isinstance(payload, dict):
            raise BadGateway(f"{BACKEND_HINT} sent an invalid stream event")
        chunks = self._read(event, payload)
        if not self.passes:
            return chunks
        first = chunks[0] if chunks else self._chunk()
        return [msgspec.structs.replace(first, responses_event=payload), *chunks[1:]]

    def _custom_call(self, kind: Any, item: Any, payload: dict[str, Any]) -> list[ChatChunk] | None:
        """A custom tool's call as a function's of one string (`custom_arguments`), its JSON written
        around the input as it streams; None: the event is not one of a custom tool's call."""
        if kind == "response.custom_tool_call_input.delta":
            index = self.calls.get(str(payload.get("item_id")), -1)
            delta = str(payload.get("delta") or "")
            if index not in self.custom or not delta:
                return []
            # The JSON string's inside: the encoded piece without its quotes.
            piece = json_encode(delta).decode()[1:-1]
            opening = "" if index in self.argued else custom_arguments("")[:-2]
            self.argued.add(index)
            return [self._call(index, function=FunctionCallDelta(arguments=opening + piece))]
        if not isinstance(item, dict) or item.get("type") != "custom_tool_call":
            return None
        if kind == "response.output_item.added":
            index = self.calls[str(item.get("id"))] = len(self.calls)
            self.custom.add(index)
            head = FunctionCallDelta(name=str(item.get("name") or ""), arguments="")
            call_id = str(item.get("call_id") or item.get("id") or "")
            return [self._call(index, id=call_id, type="function", function=head)]
        if kind == "response.output_item.done":
            index = self.calls.get(str(item.get("id")), -1)
            if index < 0:
                return []
            whole = index not in self.argued
            self.argued.add(index)
            closing = custom_arguments(str(item.get("input") or "")) if whole else custom_arguments("")[-2:]
            return [self._call(index, function=FunctionCallDelta(arguments=closing))]
        return []

    def _read(self, event: str | None, payload: dict[str, Any]) -> list[ChatChunk]:
        kind = payload.get("type", event)
        if kind == "error":
            raise _failure(payload)
        response = payload.get("response")
        if isinstance(response, dict):
            return self._response_event(kind, response)
        item = payload.get("item")
        if (custom := self._custom_call(kind, item, payload)) is not None:
            return custom
        if (
            kind == "response.output_item.added"
            and isinstance(item, dict)
            and item.get("type") == "function_call"
        ):
            index = self.calls[str(item.get("id"))] = len(self.calls)
            head = FunctionCallDelta(name=str(item.get("name") or ""), arguments="")
            call_id = str(item.get("call_id") or item.get("id") or "")
            return [self._call(index, id=call_id, type="function", function=head)]
        if (
            kind == "response.output_item.done"
            and isinstance(item, dict)
            and item.get("type") == "function_call"
        ):
            # Arguments that came whole, or none: a client's JSON parser wants "{}" for none.
            index = self.calls.get(str(item.get("id")), -1)
            if index < 0 or index in self.argued:
                return []
            self.argued.add(index)
            whole = FunctionCallDelta(arguments=item.get("arguments") or NO_ARGUMENTS)
            return [self._call(index, function=whole)]
        delta = payload.get("delta")
        if kind == "response.function_call_arguments.delta" and delta:
            index = self.calls.get(str(payload.get("item_id")), -1)
            if index < 0:
                raise BadGateway(f"{BACKEND_HINT} streamed arguments of a call it never started")
            self.argued.add(index)
            return [self._call(index, function=FunctionCallDelta(arguments=str(delta)))]
        if not isinstance(delta, str) or not delta:
            return self._annotated(kind, payload)
        if kind == "response.output_text.delta":
            return [self._chunk(Delta(content=delta))]
        if kind == "response.refusal.delta":
            return [self._chunk(Delta(refusal=delta))]
        if kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            return [self._chunk(Delta(reasoning_content=delta))]
        return []

    def _annotated(self, kind: Any, payload: dict[str, Any]) -> list[ChatChunk]:
        if kind != "response.output_text.annotation.added":
            return []  # the rest (content parts opening and closing, `.done` events) says nothing new
        annotation = _annotation(payload.get("annotation"))
        return [self._chunk(Delta(annotations=[annotation]))] if annotation else []

    def _response_event(self, kind: Any, response: dict[str, Any]) -> list[ChatChunk]:
        if kind == "response.created":
            self.id = str(response.get("id") or "")
            self.created = int(response.get("created_at") or 0)
            self.model = str(response.get("model") or self.model)
            return [self._chunk(Delta(role="assistant", content=""))]
        if kind == "response.failed":
            raise _failure(response.get("error"))
        if kind not in ("response.completed", "response.incomplete"):
            return []  # response.in_progress, response.queued
        self.finished = True
        finish = _finish(response, bool(self.calls))
        usage = normalise_usage(VENDOR, response.get("usage"))
        return [self._chunk(finish=finish), self._chunk(usage=usage)]

    def close(self) -> list[ChatChunk]:
        if not self.finished:
            raise BadGateway(f"{BACKEND_HINT} ended the stream before the response was complete")
        return []


PROVIDER = dataclasses.replace(
    openai.PROVIDER,
    name="openai-responses",
    chat_request=chat_request,
    chat_response=chat_response,
    chat_stream=ChatStream,
    empty_answer=empty_answer,
    # Legacy /completions to such a model is translated through chat, as for non-OpenAI vendors.
    native_completions=False,
)
