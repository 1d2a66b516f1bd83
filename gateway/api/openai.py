"""The OpenAI-shaped API: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Stream

from gateway.api.chat import run_chat
from gateway.api.common import SSE_HEADERS, begin, json_response, parse_body
from gateway.api.routed import completion_op, embeddings_op, run_routed
from gateway.auth import Principal
from gateway.errors import GatewayError, InvalidRequest, ModelNotFound, encode_openai_error, stream_failure
from gateway.runtime import Gateway
from gateway.types import ChatChunk, ChatRequest, ChatResponse, CompletionRequest, EmbeddingRequest
from gateway.usage import Usage, openai_usage

_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"


# --- rendering -----------------------------------------------------------------------------------


# Canonical fields OpenAI's shape has no place for: signed reasoning is for the vendor that signed it
# (OpenAI clients get the text as `reasoning_content`, as from DeepSeek); Claude's own content blocks
# are for Anthropic clients.
_INTERNAL_MESSAGE_FIELDS = ("reasoning_blocks", "anthropic_content")
_INTERNAL_DELTA_FIELDS = ("reasoning_signature", "redacted_reasoning", "anthropic_block", "anthropic_delta")


def _unmodelled_back(data: dict[str, Any]) -> None:
    """The fields the backend sent that Weir does not model (`extra`) back beside the others."""
    for key, value in data.pop("extra", {}).items():
        data.setdefault(key, value)


def render_chat(response: ChatResponse) -> dict[str, Any]:
    data = msgspec.to_builtins(response)
    _unmodelled_back(data)
    data["object"] = "chat.completion"
    data["usage"] = openai_usage(response.usage)
    for choice in data["choices"]:
        _unmodelled_back(choice)
        _unmodelled_back(choice["message"])
        choice["message"].setdefault("content", None)
        for name in _INTERNAL_MESSAGE_FIELDS:
            choice["message"].pop(name, None)
        choice.pop("stop_sequence", None)  # internal: OpenAI's shape has no place for it
        choice.pop("anthropic_stop_reason", None)
        choice.pop("responses_output", None)
        choice.setdefault("finish_reason", None)
    return data


def render_chunk(chunk: ChatChunk, include_usage: bool = True) -> bytes:
    """One SSE frame; its usage only when the client asked for it (`include_usage`)."""
    if chunk.raw is not None and chunk.usage is None:
        return b"data: " + chunk.raw.encode() + b"\n\n"
    data = msgspec.to_builtins(chunk)
    data.pop("raw", None)
    data.pop("prompt_usage", None)  # internal, for Anthropic clients' message_start
    data.pop("responses_event", None)  # internal, for Responses clients
    _unmodelled_back(data)
    data["object"] = "chat.completion.chunk"
    if chunk.usage is not None:
        if include_usage:
            data["usage"] = openai_usage(chunk.usage)
        else:
            del data["usage"]
    for choice in data["choices"]:
        _unmodelled_back(choice)
        _unmodelled_back(choice["delta"])
        for name in _INTERNAL_DELTA_FIELDS:
            choice["delta"].pop(name, None)
        choice.pop("stop_sequence", None)
        choice.pop("anthropic_stop_reason", None)
        choice.setdefault("finish_reason", None)
    return b"data: " + _encode(data) + b"\n\n"


def _usage_alone(usage: Usage | None, choices: list[Any] | None) -> bool:
    """Whether a streamed chunk is a usage report and nothing else, which only a client that set
    `include_usage` gets: Weir asks every backend for usage (accounting). A chunk that holds more
    (Mistral's, Together's and llama.cpp's last one also carries the finish reason, at times the last
    text) goes to every client, rendered without its usage for one that did not ask."""
    return usage is not None and not choices


def _sse_error(error: GatewayError) -> bytes:
    # The OpenAI SDKs raise APIError when a stream event carries an `error` object.
    return b"data: " + encode_openai_error(error) + b"\n\n"


async def chat_sse(batches: AsyncIterator[list[ChatChunk]], include_usage: bool) -> AsyncIterator[bytes]:
    try:
        async for batch in batches:
            frames = [
                render_chunk(c, include_usage)
                for c in batch
                if include_usage or not _usage_alone(c.usage, c.choices)
            ]
            if frames:
                yield b"".join(frames)
    except Exception as exc:
        yield _sse_error(stream_failure(exc))
        return
    yield _DONE


def _check_stream_options(request: ChatRequest | CompletionRequest) -> None:
    """OpenAI and vLLM refuse options of a stream for an answer that is not streamed; passed on, the
    request got a 400 from one backend and an answer from another, by route."""
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )


def _validate_chat(request: ChatRequest) -> None:
    _check_stream_options(request)
    if not request.messages:
        raise InvalidRequest("'messages' must contain at least one message.", param="messages")
    if request.n is not None and request.n < 1:
        raise InvalidRequest("'n' must be at least 1.", param="n")
    limit = request.output_limit
    if limit is not None and limit < 1:
        name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        raise InvalidRequest(f"'{name}' must be at least 1.", param=name)
    for i, message in enumerate(request.messages):
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidRequest(
                "Messages with role 'tool' need a 'tool_call_id'.", param=f"messages[{i}].tool_call_id"
            )


# --- handlers ------------------------------------------------------------------------------------


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    gateway, call = await begin(request, "chat")
    chat = await parse_body(request, ChatRequest)
    _validate_chat(chat)
    result = await run_chat(gateway, call, chat)
    if isinstance(result, ChatResponse):
        return json_response(render_chat(result))
    include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
    return Stream(chat_sse(result, include_usage), media_type="text/event-stream", headers=SSE_HEADERS)


def _check_text_or_tokens(value: str | list[Any], param: str) -> None:
    """OpenAI's `prompt` and `input`: a string, strings, token ids, or lists of token ids. Anything
    else (`[null]`, `[]`, mixed lists) is refused here with a 400: passed on, it cost an upstream call
    and came back as whatever that backend made of it (the fake OpenAI, like some compatible servers,
    failed with a 500, which the client saw as a 502)."""
    if isinstance(value, str):
        return
    if value and (
        all(isinstance(x, str) for x in value)
        or all(type(x) is int for x in value)
        or all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in value)
    ):
        return
    raise InvalidRequest(
        f"'{param}' must be a string, a list of strings, a list of token ids, or a list of lists of token ids.",
        param=param,
    )


def _text_choices(choices: list[Any], delta: bool) -> list[dict[str, Any]]:
    result = []
    for choice in choices:
        text = (choice.delta.content if delta else choice.message.content) or ""
        result.append(
            {"index": choice.index, "text": text, "finish_reason": choice.finish_reason, "logprobs": None}
        )
    return result


def _completion_frame(chunk: Any, native: bool, include_usage: bool) -> bytes:
    if native:
        data = chunk.data
    else:
        data = {
            "id": chunk.id,
            "object": "text_completion",
            "created": chunk.created,
            "model": chunk.model,
            "choices": _text_choices(chunk.choices, delta=True),
        }
    if chunk.usage is not None:
        if include_usage:
            data["usage"] = openai_usage(chunk.usage)
        else:
            data.pop("usage", None)
    return b"data: " + _encode(data) + b"\n\n"


async def _completion_sse(
    batches: AsyncIterator[list[Any]], include_usage: bool, native: bool
) -> AsyncIterator[bytes]:
    try:
        async for batch in batches:
            frames = [
                _completion_frame(c, native, include_usage)
                for c in batch
                if include_usage or not _usage_alone(c.usage, c.data.get("choices") if native else c.choices)
            ]
            if frames:
                yield b"".join(frames)
    except Exception as exc:
        yield _sse_error(stream_failure(exc))
        return
    yield _DONE


def _validate_completion(request: CompletionRequest) -> None:
    """As a chat's limits (`_validate_chat`), and `best_of`: the candidates generated to return the
    best `n` of, so never fewer than `n` (OpenAI's rule)."""
    _check_text_or_tokens(request.prompt, "prompt")
    _check_stream_options(request)
    if request.max_tokens is not None and request.max_tokens < 1:
        raise InvalidRequest("'max_tokens' must be at least 1.", param="max_tokens")
    if request.n is not None and request.n < 1:
        raise InvalidRequest("'n' must be at least 1.", param="n")
    if request.best_of is not None and request.best_of < max(request.n or 1, 1):
        raise InvalidRequest("'best_of' must be at least 1 and at least 'n'.", param="best_of")


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    gateway, call = await begin(request, "completions")
    body = await parse_body(request, CompletionRequest)
    _validate_completion(body)
    # The tenant's output cap, as a chat's (`run_chat`): more is a 400, none asked is sent the cap.
    if (cap := gateway.limits.output_cap(call.principal, body.max_tokens, "max_tokens")) is not None:
        body = msgspec.structs.replace(body, max_tokens=cap)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    result, plan = await run_routed(
        gateway, call, body.model, body.prompt, completion_op(body), body.max_tokens, body.n, body.best_of
    )
    # Candidates of one route may differ: the native completions shape, or a chat to translate back.
    native = plan.chosen is not None and plan.chosen.target.provider.native_completions
    if body.stream:
        return Stream(
            _completion_sse(result, include_usage, native),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    if native:
        data = result.data
        if result.usage is not None:
            data["usage"] = openai_usage(result.usage)
        return json_response(data)
    return json_response(
        {
            "id": result.id,
            "object": "text_completion",
            "created": result.created,
            "model": result.model,
            "choices": _text_choices(result.choices, delta=False),
            "usage": openai_usage(result.usage),
        }
    )


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
    gateway, call = await begin(request, "embeddings")
    body = await parse_body(request, EmbeddingRequest)
    _check_text_or_tokens(body.input, "input")
    if body.dimensions is not None and body.dimensions < 1:
        raise InvalidRequest("'dimensions' must be at least 1.", param="dimensions")
    response, _ = await run_routed(gateway, call, body.model, body.input, embeddings_op(body))
    data = msgspec.to_builtins(response)
    data["object"] = "list"
    for item in data["data"]:
        item["object"] = "embedding"  # a default, which to_builtins leaves out; OpenAI always sends it
    usage = response.usage
    data["usage"] = {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens}
    return json_response(data)


ROUTE_OWNER = "weir"  # `owned_by` of a route's public name: Weir picks the backend per request


def _listing(gateway: Gateway, principal: Principal) -> list[tuple[str, str]]:
    """(name, owner) of every model name the caller may send: plain models, then routes (`auto`...),
    which an app's model picker must offer too."""
    models = [(t.model.name, t.backend.name) for t in gateway.models.visible_to(principal)]
    plain = {name for name, _ in models}
    routes = [(name, ROUTE_OWNER) for name in gateway.router.names() if name not in plain]
    # Only routes this caller can use: one limited to other tenants or keys answers it 404.
    return models + [(name, owner) for name, owner in routes if gateway.router.offers(name, principal)]


def _card(name: str, owner: str, anthropic: bool) -> dict[str, Any]:
    if anthropic:  # the Anthropic SDKs' ModelInfo
        return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
    return {"id": name, "object": "model", "created": 0, "owned_by": owner}


MODELS_PATH = "/v1/models"  # OpenAI's and Anthropic's alike: answered in the client's shape


def anthropic_client(request: Request[Any, Any, Any]) -> bool:
    # The Anthropic SDKs send anthropic-version on every call; OpenAI's never do.
    return "anthropic-version" in request.headers


@get(MODELS_PATH)
async def list_models(request: Request[Any, Any, Any]) -> Response[Any]:
    gateway, call = await begin(request, "models")
    anthropic = anthropic_client(request)
    names = _listing(gateway, call.principal)
    if anthropic:
        page, has_more = _anthropic_page([name for name, _ in names], request)
        data = [_card(name, "", True) for name in page]
        first, last = (page[0], page[-1]) if page else (None, None)
        return json_response({"data": data, "has_more": has_more, "first_id": first, "last_id": last})
    return json_response({"object": "list", "data": [_card(name, owner, False) for name, owner in names]})


ANTHROPIC_PAGE = 20  # Anthropic's default `limit`, from 1 to ANTHROPIC_MAX_PAGE
ANTHROPIC_MAX_PAGE = 1000


def _anthropic_page(names: list[str], request: Request[Any, Any, Any]) -> tuple[list[str], bool]:
    """The page of `names` an Anthropic client asked for, as Anthropic's `GET /v1/models` pages
    (https://docs.anthropic.com/en/api/models-list): `limit` names (20 by default, 1 to 1000) from the
    start, right after `after_id` or right before `before_id`; and whether more lie in that
    direction (`has_more`). A cursor that names no model of the list, both cursors at once, or a
    `limit` out of range is a 400 naming the parameter."""
    query = request.query_params
    raw_limit = query.get("limit")
    limit = ANTHROPIC_PAGE
    if raw_limit is not None:
        try:
            limit = int(raw_limit)
        except ValueError:
            limit = 0
        if not 1 <= limit <= ANTHROPIC_MAX_PAGE:
            raise InvalidRequest(
                f"limit: Input should be an integer from 1 to {ANTHROPIC_MAX_PAGE}.", param="limit"
            )
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise InvalidRequest("before_id: cannot be used with after_id.", param="before_id")
    for param, cursor in (("after_id", after), ("before_id", before)):
        if cursor is not None and cursor not in names:
            raise InvalidRequest(f"{param}: no model `{cursor}` in this list.", param=param)
    if before is not None:
        end = names.index(before)
        return names[max(0, end - limit) : end], end - limit > 0
    start = names.index(after) + 1 if after is not None else 0
    return names[start : start + limit], start + limit < len(names)


@get(MODELS_PATH + "/{model_id:path}")
async def get_model(request: Request[Any, Any, Any], model_id: str) -> Response[Any]:
    gateway, call = await begin(request, "models")
    name = model_id.lstrip("/")
    owner = dict(_listing(gateway, call.principal)).get(name)
    if owner is None:  # as for a plain model, one the tenant may not use reads as one that does not exist
        raise ModelNotFound(
            f"The model `{name}` does not exist or you do not have access to it.", param="model"
        )
    return json_response(_card(name, owner, anthropic_client(request)))


ROUTES = [chat_completions, completions, embeddings, list_models, get_model]
