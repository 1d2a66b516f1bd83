"""OpenAI and every OpenAI-compatible server (vLLM, SGLang, Ollama, Together, Groq, DeepSeek, Mistral,
Azure OpenAI, Weir's own engine). The canonical shape is OpenAI's, so translation is mostly identity:
set the upstream model id, always ask for stream usage, and normalise the usage that comes back.
Reasoning comes back as `reasoning_content` (DeepSeek, older vLLM) or `reasoning` (vLLM 0.17 on,
OpenRouter), carried on as `reasoning_content`."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, cast
from urllib.parse import urlparse

import msgspec

from gateway.config import Backend
from gateway.errors import BadGateway, GatewayError
from gateway.providers.base import (
    NO_ARGUMENTS,
    Continuation,
    Provider,
    UpstreamRequest,
    VendorApi,
    check_stop_count,
    continued,
    decode_json,
    decode_typed,
    effort_for_budget,
    error_text,
    json_encode,
    refuse_anthropic_tools,
    refuse_builtin_tools,
    token_count,
    upstream_call_id,
    upstream_error,
)
from gateway.types import (
    AssistantMessage,
    Base,
    ChatChunk,
    ChatRequest,
    ChatResponse,
    Choice,
    ChunkChoice,
    CompletionRequest,
    ContentPart,
    Delta,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    FunctionCallDelta,
    Message,
    RawResult,
    ReasoningBlock,
    TextPart,
    TokenCount,
    ToolCallDelta,
    has_cache_control,
)
from gateway.usage import normalise_usage, reported_tier
from routing.load import report_request

VENDOR = "openai"
# Hosts whose thinking models want earlier turns' reasoning_content back (DeepSeek refuses a tool loop
# without it). Others are not sent it unless configured: OpenAI, Azure, Cerebras and Mistral refuse
# message fields they do not know.
REASONING_HOSTS = ("api.deepseek.com", "api.moonshot.ai", "api.moonshot.cn")
MAX_CALL_ID = 40  # OpenAI: "string too long. Expected a string with maximum length 40"
MAX_USER = 64  # OpenAI: "Invalid 'user': string too long. Expected ... maximum length 64" (OpenRouter: 128)
# The output limit's name. OpenAI's reasoning models (o1, o3, o4-mini, gpt-5 and on) refuse `max_tokens`
# with a 400 wherever they are served, and every current chat model of OpenAI's and Azure OpenAI's
# takes `max_completion_tokens`; DeepSeek's API documents only `max_tokens` and Mistral's refuses the
# other name (422); other servers (vLLM, SGLang, the engine) get the name the client used.
_REASONING_MODEL = re.compile(r"(o\d+|gpt-5)([-.]|$)")
MAX_TOKENS_HOSTS = ("api.deepseek.com", "api.mistral.ai")
# OpenAI's own model ids (not gpt-oss, served by vLLM and others under their own rules): wherever they
# are served (OpenAI, Azure, a proxy in front of them), OpenAI's limits apply to them.
_OPENAI_MODEL = re.compile(r"(gpt-\d|chatgpt-|o\d+([-.]|$))")
MAX_STOP_SEQUENCES = 4  # OpenAI: "'stop': array too long. Expected an array with maximum length 4"


# The backend's key as a bearer token; the bundled engine is asked for its load report on every
# request and probe. The model list (`/models`, free on OpenAI and Azure) is asked with the key: a vLLM
# or SGLang server started with `--api-key` answers it with each model's `max_model_len` only then.
API = VendorApi(key_header="authorization", key_prefix="Bearer ", fixed=report_request)


def request_body(request: Base, model: str) -> dict[str, Any]:
    """The request as OpenAI JSON: unset fields omitted, unmodelled parameters passed through."""
    body: dict[str, Any] = msgspec.to_builtins(request)
    body.pop("responses", None)  # a Responses client's own settings, for OpenAI's Responses API alone
    for message in body.get("messages") or ():
        message.pop("responses_items", None)
    extra = body.pop("extra", None)
    if extra:
        for key, value in extra.items():
            body.setdefault(key, value)
    body["model"] = model
    return body


def _strip_cache_control(body: dict[str, Any]) -> None:
    # Anthropic-style breakpoints (and automatic caching, the request's own `cache_control`) mean
    # nothing to OpenAI (its caching is automatic) and it would reject the unknown field.
    body.pop("cache_control", None)
    for item in (*body.get("messages", ()), *(body.get("tools") or ())):
        item.pop("cache_control", None)
        content = item.get("content")
        if isinstance(content, list):
            for part in content:
                part.pop("cache_control", None)


@functools.lru_cache(maxsize=256)
def _host_and_path(url: str) -> tuple[str, str]:
    """A backend URL's host and path, parsed once per URL: several checks of every request ask, and
    urlparse is the costly part of each. Keyed by the URL itself, so a reloaded backend with another
    URL is parsed afresh."""
    parsed = urlparse(url)
    return parsed.hostname or "", parsed.path


def sends_reasoning(backend: Backend) -> bool:
    if backend.send_reasoning is not None:
        return backend.send_reasoning
    return _host_and_path(backend.base_url or "")[0] in REASONING_HOSTS


def _openai_itself(backend: Backend) -> bool:
    """OpenAI's own API or Azure OpenAI (not another server that speaks the format)."""
    host, path = _host_and_path(backend.base_url or backend.url or "")
    azure = host.endswith(".openai.azure.com") or (
        host.endswith(".azure.com") and path.startswith("/openai/")
    )
    return host == "api.openai.com" or azure


def openai_rules(backend: Backend, model: str) -> bool:
    """Whether OpenAI's own API rules apply: its API or Azure's, or one of its models served elsewhere.
    Other OpenAI-compatible servers (vLLM, SGLang, the engine) take more (any number of stop sequences)."""
    return _openai_itself(backend) or bool(_OPENAI_MODEL.match(model))


def output_limit_field(backend: Backend, model: str) -> str | None:
    """The field that carries the output limit to this backend's `model`; None: the client's name."""
    if backend.max_tokens_field is not None:
        return backend.max_tokens_field
    if _openai_itself(backend) or _REASONING_MODEL.match(model):
        return "max_completion_tokens"
    host = _host_and_path(backend.base_url or backend.url or "")[0]
    return "max_tokens" if host in MAX_TOKENS_HOSTS else None


def media_after_tool_results(messages: list[Message]) -> list[Message]:
    """A tool message takes text only ("Image URLs are only allowed for messages with role 'user'"):
    a tool result's images (a screenshot tool's, an Anthropic client's image in a tool_result) go in
    a user message after the turn's tool results, which must follow their assistant message unbroken,
    joined to the user's own words of that turn where there are some; each result keeps its text."""
    out: list[Message] = []
    media: list[ContentPart] = []
    for message in messages:
        if message.role == "tool":  # a result of text alone too: the media wait after the turn's last
            if isinstance(message.content, list):
                text = [part for part in message.content if isinstance(part, TextPart)]
                if len(text) < len(message.content):
                    media.extend(part for part in message.content if not isinstance(part, TextPart))
                    message = msgspec.structs.replace(message, content=text or "")
        elif media and message.role == "user":
            own = message.content or []
            own = [TextPart(text=own)] if isinstance(own, str) else own
            message = msgspec.structs.replace(message, content=[*media, *own])
            media = []
        elif media:
            out.append(Message(role="user", content=media))
            media = []
        out.append(message)
    if media:
        out.append(Message(role="user", content=media))
    return out


def worded_error(message: Message) -> Message:
    """A failed tool's result (an Anthropic client's `is_error`) as OpenAI takes it: its tool message
    has no error flag (and OpenAI refuses fields it does not know), so the content says it in words."""
    if not message.is_error:
        return message
    content = message.content
    worded: str | list[ContentPart] = (
        [TextPart(text="Error:"), *content] if isinstance(content, list) else f"Error: {content or ''}"
    )
    return msgspec.structs.replace(message, content=worded, is_error=None)


def _chat_body(
    request: ChatRequest,
    model: str,
    send_reasoning: bool = False,
    limit_field: str | None = None,
    openai_rules: bool = False,
) -> dict[str, Any]:
    if openai_rules:
        check_stop_count(request, MAX_STOP_SEQUENCES, "OpenAI")
    messages = media_after_tool_results([worded_error(message) for message in request.messages])
    request = msgspec.structs.replace(request, messages=messages)
    body = request_body(request, model)
    # One limit, the one that applies (`output_limit`, also for a client that sent both), under the
    # name this backend takes: a reasoning model refuses `max_tokens`, Mistral `max_completion_tokens`.
    body.pop("max_tokens", None)
    body.pop("max_completion_tokens", None)
    if (limit := request.output_limit) is not None:
        named = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        body[limit_field or named] = limit
    for name in ("reasoning_budget", "reasoning_adaptive", "reasoning_effort_translated", "reasoning_effort"):
        body.pop(name, None)  # adaptive: the model's own default, nothing to send
    body.pop("anthropic_beta", None)  # an Anthropic client's, for Anthropic backends only
    body.pop("anthropic_tools", None)
    if (effort := reasoning_effort(request, model, openai_rules)) is not None:
        body["reasoning_effort"] = effort
    for message, source in zip(body["messages"], request.messages, strict=True):
        # Signed reasoning is for the vendor that signed it; OpenAI-compatible servers take its text.
        message.pop("reasoning_blocks", None)
        message.pop("anthropic_content", None)  # Claude's own blocks: the turn's text and calls go
        if not send_reasoning:
            message.pop("reasoning_content", None)
        elif source.reasoning_content is None and source.role == "assistant":
            blocks = source.reasoning_blocks or ()
            text = "".join(b.text for b in blocks if isinstance(b, ReasoningBlock))
            if text or source.tool_calls:
                # A tool call's turn always carries the field, empty when the reasoning is unknown (a
                # client that hid it, another vendor's turn): DeepSeek refuses the turn without it.
                message["reasoning_content"] = text
        for call in message.get("tool_calls") or ():
            call["id"] = upstream_call_id(call["id"], MAX_CALL_ID)
        if "tool_call_id" in message:
            message["tool_call_id"] = upstream_call_id(message["tool_call_id"], MAX_CALL_ID)
    if has_cache_control(request):
        _strip_cache_control(body)
    return body


def reasoning_effort(request: ChatRequest, model: str, rules: bool) -> str | None:
    """The reasoning effort to send `model` (`rules`: OpenAI's own rules apply), if any. An Anthropic client's thinking budget or effort:
    OpenAI's models other than its reasoning ones refuse `reasoning_effort` (400 unsupported_parameter),
    so they are sent none. An OpenAI client's own effort goes as it is: the client asked that model
    for it."""
    reasons = not rules or bool(_REASONING_MODEL.match(model))
    if request.reasoning_effort_translated and not reasons:
        return None
    if request.reasoning_budget is not None and request.reasoning_effort is None and reasons:
        return effort_for_budget(request.reasoning_budget)
    if request.reasoning_effort == "max":  # Anthropic's top effort; OpenAI's top is not on every model
        return "high"
    return request.reasoning_effort


def short_user(user: str) -> str:
    """An end-user id as OpenAI takes it. An Anthropic client's metadata.user_id runs longer (Claude
    Code's, about 150 characters) and OpenAI refuses the whole request for it: a digest of it still
    names one user."""
    if len(user) <= MAX_USER:
        return user
    return "user_" + hashlib.blake2b(user.encode(), digest_size=16).hexdigest()


def continuation(backend: Backend, model: str) -> Continuation:
    # OpenAI answers a trailing assistant message afresh; vLLM and the engine continue it when asked.
    return backend.continuation or ("continue_final_message" if backend.type == "engine" else "instruction")


def _refuse_anthropic_tools(backend: Backend, request: ChatRequest) -> None:
    refuse_anthropic_tools(request, "Weir's engine" if backend.type == "engine" else "OpenAI-compatible")


def chat_request(backend: Backend, request: ChatRequest, model: str) -> UpstreamRequest:
    _refuse_anthropic_tools(backend, request)
    refuse_builtin_tools(request, "models served on chat completions")
    request = continued(request, continuation(backend, model))
    rules = openai_rules(backend, model)
    body = _chat_body(request, model, sends_reasoning(backend), output_limit_field(backend, model), rules)
    if isinstance(user := body.get("user"), str):
        body["user"] = short_user(user)
    if rules and body.get("store") is not True:
        # It tags a stored completion, and OpenAI refuses it on one it does not store ("The 'metadata'
        # parameter is only allowed when 'store' is enabled."), a 400 no route fails over from: left
        # out, it still reaches Weir's route conditions and logs, which read the client's request.
        body.pop("metadata", None)
    if request.continue_final_message:
        body["add_generation_prompt"] = False  # vLLM refuses both at once; its default opens a new turn
    if _openai_itself(backend):
        # OpenAI refuses what it does not know ("Unrecognized request argument supplied: top_k"), which
        # would end a failover from Claude or Gemini, whose clients' top_k their own models took, or
        # from a vLLM server whose client asked for its usage on every chunk.
        body.pop("top_k", None)
        (body.get("stream_options") or {}).pop("continuous_usage_stats", None)
    if request.stream:
        # Always ask for the usage chunk: accounting needs it even when the client did not.
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return UpstreamRequest(
        API.url(backend, "/chat/completions"),
        API.headers(backend),
        json_encode(body),
        stream=bool(request.stream),
    )


# vLLM (0.17 on) and OpenRouter name the reasoning `reasoning`, DeepSeek and older vLLM
# `reasoning_content`: both are read, and carried on as `reasoning_content`.
class _Message(AssistantMessage):
    reasoning: str | None = None


class _Choice(Choice):
    message: _Message


class _Delta(Delta):
    reasoning: str | None = None


class _ChunkChoice(ChunkChoice):
    delta: _Delta


def _note_matched_stop(choice: _Choice | _ChunkChoice) -> None:
    """The stop string that ended the answer, where the server says it (vLLM's `stop_reason`, SGLang's
    `matched_stop`; an int there is a stop token, not a string): an Anthropic client is told
    `stop_sequence` and which one, as Claude tells it. OpenAI's own API does not say."""
    if choice.finish_reason != "stop":
        return
    for key in ("stop_reason", "matched_stop"):
        matched = choice.extra.get(key)
        if isinstance(matched, str) and matched:
            choice.stop_sequence = matched
            return


def _reasoning_as_content(part: _Message | _Delta) -> bool:
    """Whether `part` said `reasoning`, which it now carries as `reasoning_content`."""
    if part.reasoning is None:
        return False
    part.reasoning_content = part.reasoning_content or part.reasoning
    part.reasoning = None  # omitted when rendered: one name for clients
    return True


class _Completion(Base):
    id: str = ""
    created: int = 0
    model: str = ""
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: dict[str, Any] | None = None
    system_fingerprint: str | None = None
    error: dict[str, Any] | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


def _error_in_200(error: dict[str, Any]) -> GatewayError:
    """A failure reported after a 200: in its body, or as an event of its stream. OpenRouter commits
    its 200 before the provider behind it answers, and then reports that provider's failure as
    `{"error": {"code": 429, ...}}`: that status when it is an HTTP error status (a 429 or 5xx fails
    over), else 502, streamed or not."""
    code = error.get("code")
    numeric = isinstance(code, int) and not isinstance(code, bool)
    status = code if isinstance(code, int) and numeric and 400 <= code <= 599 else 502
    message = str(error.get("message") or "error in a 200 response")
    named = None if numeric or code is None else str(code)  # OpenAI's own codes are names
    return upstream_error(status, message, {}, vendor="OpenAI-compatible", code=named)


def empty_answer(model: str) -> bytes:
    """A chat completion with no text, in the fields every OpenAI-compatible server sends (OpenAI's
    own adds more: `refusal`, `annotations`, usage details, `system_fingerprint`...)."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": "stop",
    }
    return json_encode(
        {
            "id": "chatcmpl-" + "0" * 29,
            "object": "chat.completion",
            "created": 1700000000,
            "model": model,
            "choices": [choice],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }
    )


def _modelled(struct: type[msgspec.Struct], *own: str) -> frozenset[str]:
    """The fields `struct` models, and `own`: fields of the shape's own that each client's rendering
    sets (`object`)."""
    return frozenset(struct.__struct_fields__) - {"extra"} | frozenset(own)


class _Modelled(NamedTuple):
    """What a completion or chunk (`top`), its choices, and their `part` (the message, the delta)
    model; the rest of what the backend sends is kept in their `extra` for OpenAI clients (`audio`,
    `annotations`, `service_tier`, vLLM's `stop_reason`...)."""

    top: frozenset[str]
    choice: frozenset[str]
    part: str
    part_fields: frozenset[str]


_COMPLETION_FIELDS = _Modelled(
    _modelled(_Completion, "object"), _modelled(_Choice), "message", _modelled(_Message)
)


def _keep_unmodelled(data: Any, modelled: frozenset[str]) -> None:
    if isinstance(data, dict):
        extra = {key: value for key, value in data.items() if key not in modelled}
        if extra:
            data["extra"] = extra


def _with_unmodelled(data: Any, modelled: _Modelled) -> Any:
    """A completion or chunk decoded to JSON values, with what it, its choices and their part do not
    model in their `extra`, as requests keep theirs (`gateway.errors.decode_body`)."""
    _keep_unmodelled(data, modelled.top)
    for choice in (data.get("choices") if isinstance(data, dict) else None) or ():
        if isinstance(choice, dict):
            _keep_unmodelled(choice.get(modelled.part), modelled.part_fields)
            _keep_unmodelled(choice, modelled.choice)
    return data


def _completion(body: bytes) -> _Completion:
    """The completion, with what it, its choices and their messages do not model in their `extra`:
    decoded to JSON values first, then typed."""
    try:
        return msgspec.convert(_with_unmodelled(msgspec.json.decode(body), _COMPLETION_FIELDS), _Completion)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise BadGateway(f"the OpenAI-compatible backend returned an unexpected response: {exc}") from None


def chat_response(body: bytes, model: str) -> ChatResponse:
    wire = _completion(body)
    if wire.error is not None:
        raise _error_in_200(wire.error)
    if not wire.choices:
        # Not an answer (a completion always has a choice): the backend's failure, not an empty reply.
        # A server that reports usage beside it bills that usage: the attempt is recorded at it.
        raise BadGateway(
            "the OpenAI-compatible backend returned a response without choices",
            billed=normalise_usage(VENDOR, wire.usage) if wire.usage else None,
        )
    for choice in wire.choices:
        _reasoning_as_content(choice.message)
        _note_matched_stop(choice)
        for call in choice.message.tool_calls or ():
            if not call.function.arguments.strip():  # "" from some servers for a call without arguments
                call.function.arguments = NO_ARGUMENTS
    return ChatResponse(
        id=wire.id,
        created=wire.created,
        model=wire.model or model,
        choices=cast(list[Choice], wire.choices),  # subclasses, read-only here
        usage=normalise_usage(VENDOR, wire.usage, wire.extra.get("service_tier")),
        system_fingerprint=wire.system_fingerprint,
        extra=wire.extra,
    )


class _Chunk(Base):
    id: str = ""
    created: int = 0
    model: str = ""
    choices: list[_ChunkChoice] = msgspec.field(default_factory=list)
    usage: dict[str, Any] | None = None
    system_fingerprint: str | None = None
    error: dict[str, Any] | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


_CHUNK_FIELDS = _Modelled(_modelled(_Chunk, "object"), _modelled(_ChunkChoice), "delta", _modelled(_Delta))


def _chunk(data: str) -> _Chunk:
    """A stream chunk, with what it, its choices and their deltas do not model in their `extra`, for a
    chunk that is re-encoded (its usage normalised, its reasoning renamed, its calls renumbered, joined
    onto a resumed stream's text...) rather than passed on as the upstream's JSON (`ChatChunk.raw`)."""
    try:
        return msgspec.convert(_with_unmodelled(msgspec.json.decode(data), _CHUNK_FIELDS), _Chunk)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadGateway(f"the OpenAI-compatible backend sent an invalid stream chunk: {exc}") from None


# A stream is an answer once it carries a finish reason or some of the answer. `[DONE]` after
# nothing else (or after only the role, or a usage report) is none: the backend's failure, as a
# completion without choices is, never an empty reply. An empty answer with a finish reason
# (`stop`, or `length` under a tiny max_tokens) is the model's own, and is passed on.
NO_ANSWER = "the OpenAI-compatible backend ended the stream without an answer"


@dataclasses.dataclass(slots=True)
class _Call:
    index: int  # the call's own index among its choice's calls, as clients are told it
    id: str | None  # the id its first delta gave
    argued: bool = False  # some of its arguments came


class _CallNumbering:
    """Streamed tool calls as OpenAI numbers them: each call at an index of its own, and with JSON
    arguments once it ends. Every inbound API groups a stream's call deltas by index, and then:

    - Ollama, SGLang and Dynamo stream every parallel call at `index: 0`, each starting with a delta
      that gives its own id and name: a new id with a name at an index already taken is another call.
      A new id alone is not: some servers change the id on every delta of one call, naming it once.
    - some servers send `arguments: ""` for a call without arguments, which is no JSON: a call whose
      arguments stayed empty gets "{}" where it ends (another call takes its index, or its choice
      finishes), what OpenAI sends and what an Anthropic client's `input` must be."""

    def __init__(self) -> None:
        self.latest: dict[tuple[int, int], _Call] = {}  # (choice, server's index) -> its latest call
        self.calls: dict[int, list[_Call]] = {}  # choice -> its calls, by their own index

    def number(self, choice: int, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for delta in deltas:
            call = self.latest.get((choice, delta.index))
            if call is not None and _starts_another(call, delta):
                out.extend(_no_arguments([call]))
                call = None
            if call is None:
                calls = self.calls.setdefault(choice, [])
                call = self.latest[choice, delta.index] = _Call(len(calls), delta.id)
                calls.append(call)
            if delta.function is not None and delta.function.arguments:
                call.argued = True
            out.append(
                delta if delta.index == call.index else msgspec.structs.replace(delta, index=call.index)
            )
        return out

    def finish(self, choice: int) -> list[ToolCallDelta]:
        """The ends of a finished choice's calls that had no arguments."""
        return _no_arguments(self.calls.get(choice, ()))


def _starts_another(call: _Call, delta: ToolCallDelta) -> bool:
    named = delta.function is not None and bool(delta.function.name)
    return named and call.id is not None and bool(delta.id) and delta.id != call.id


def _no_arguments(calls: Iterable[_Call]) -> list[ToolCallDelta]:
    """`NO_ARGUMENTS` for each of `calls` that has had none, as it ends."""
    ended = []
    for call in calls:
        if not call.argued:
            call.argued = True
            ended.append(ToolCallDelta(index=call.index, function=FunctionCallDelta(arguments=NO_ARGUMENTS)))
    return ended


class ChatStream:
    def __init__(self, request: ChatRequest, model: str) -> None:
        self.model = model
        self.done = False
        self.finished = False
        self.answered = False  # some of the answer came: text, a tool call, a refusal, reasoning
        self.calls = _CallNumbering()
        # The tier OpenAI says it serves the stream at, in every chunk: what a stream cut before its
        # usage chunk is billed at (`pipeline._cut_usage`), which `auto` does not tell.
        self.served_tier: str | None = None

    def feed(self, event: str | None, data: str) -> list[ChatChunk]:
        if data == "[DONE]":
            self.done = True
            return []
        wire = _chunk(data)
        if wire.error is not None:  # read as in a whole 200: OpenRouter's provider status, if any
            raise _error_in_200(wire.error)
        changed = False  # the chunk says other than the upstream's JSON
        for choice in wire.choices:
            changed = _reasoning_as_content(choice.delta) or changed
            changed = self._number_calls(choice) or changed
            if choice.finish_reason:
                self.finished = True
                _note_matched_stop(choice)
            self.answered = self.answered or choice.delta.carries_output()
        tier = wire.extra.get("service_tier")
        if (served := reported_tier(tier)) is not None:
            self.served_tier = served
        usage = normalise_usage(VENDOR, wire.usage, tier) if wire.usage else None
        return [
            ChatChunk(
                id=wire.id,
                created=wire.created,
                model=wire.model or self.model,
                choices=cast(list[ChunkChoice], wire.choices),  # subclasses, read-only here
                usage=usage,
                system_fingerprint=wire.system_fingerprint,
                extra=wire.extra,
                # The upstream's JSON only where it says what the chunk does: not where the model
                # was filled in, the usage is to be normalised, the reasoning was renamed or the tool
                # calls renumbered.
                raw=data if usage is None and wire.model and not changed else None,
            )
        ]

    def _number_calls(self, choice: _ChunkChoice) -> bool:
        """Gives `choice`'s tool call deltas their calls' own indices (`_CallNumbering`); whether that
        changed them."""
        given = choice.delta.tool_calls or []
        calls = self.calls.number(choice.index, given)
        if choice.finish_reason:
            calls.extend(self.calls.finish(choice.index))
        if calls == given:
            return False
        choice.delta.tool_calls = calls
        return True

    def close(self) -> list[ChatChunk]:
        if not (self.done or self.finished):
            raise BadGateway("the OpenAI-compatible backend ended the stream before it was complete")
        if not (self.finished or self.answered):
            raise BadGateway(NO_ANSWER)
        return []


def served_on_responses_only(exc: GatewayError) -> bool:
    """OpenAI's answer to a chat completion for a model it serves on the Responses API alone (o1-pro,
    o3-pro, codex-mini-latest, gpt-5-codex...): "This model is only supported in v1/responses and not
    in v1/chat/completions." (404)."""
    return exc.status == 404 and "only supported in v1/responses" in exc.message


def error(status: int, body: bytes, response_headers: Mapping[str, str]) -> GatewayError:
    message, detail = error_text(body)
    code = detail.get("code")
    return upstream_error(
        status,
        message,
        response_headers,
        vendor="OpenAI-compatible",
        param=detail.get("param") if isinstance(detail.get("param"), str) else None,
        code=str(code) if code is not None else None,
        type=detail.get("type") if isinstance(detail.get("type"), str) else None,
    )


def embeddings_request(backend: Backend, request: EmbeddingRequest, model: str) -> UpstreamRequest:
    return UpstreamRequest(
        API.url(backend, "/embeddings"), API.headers(backend), json_encode(request_body(request, model))
    )


class _Embeddings(Base):
    data: list[Embedding]
    model: str = ""
    usage: dict[str, Any] | None = None


def embeddings_response(body: bytes, model: str) -> EmbeddingResponse:
    wire = decode_typed(body, _Embeddings, "the OpenAI-compatible backend")
    return EmbeddingResponse(
        data=wire.data, model=wire.model or model, usage=normalise_usage(VENDOR, wire.usage)
    )


def completions_request(backend: Backend, request: CompletionRequest, model: str) -> UpstreamRequest:
    body = request_body(request, model)
    if request.stream:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return UpstreamRequest(
        API.url(backend, "/completions"), API.headers(backend), json_encode(body), stream=bool(request.stream)
    )


def completions_response(body: bytes, model: str) -> RawResult:
    data = decode_json(body, "the OpenAI-compatible backend")
    if not isinstance(data, dict):
        raise BadGateway("the OpenAI-compatible backend returned an unexpected response")
    return RawResult(data=data, usage=normalise_usage(VENDOR, data.get("usage"), data.get("service_tier")))


class CompletionStream:
    def __init__(self, model: str) -> None:
        self.model = model
        self.done = False
        self.finished = False
        self.answered = False  # some text came (see NO_ANSWER)

    def feed(self, event: str | None, data: str) -> list[RawResult]:
        if data == "[DONE]":
            self.done = True
            return []
        payload = decode_json(data, "the OpenAI-compatible backend")
        if not isinstance(payload, dict):
            raise BadGateway("the OpenAI-compatible backend sent an invalid stream chunk")
        if isinstance(payload.get("error"), dict):
            raise _error_in_200(payload["error"])
        choices = payload.get("choices") or ()
        if any(choice.get("finish_reason") for choice in choices):
            self.finished = True
        self.answered = self.answered or any(choice.get("text") for choice in choices)
        usage = payload.get("usage")
        return [
            RawResult(
                data=payload,
                usage=normalise_usage(VENDOR, usage, payload.get("service_tier")) if usage else None,
            )
        ]

    def close(self) -> list[RawResult]:
        if not (self.done or self.finished):
            raise BadGateway("the OpenAI-compatible backend ended the stream before it was complete")
        if not (self.finished or self.answered):
            raise BadGateway(NO_ANSWER)
        return []


PROVIDER = Provider(
    name=VENDOR,
    chat_request=chat_request,
    chat_response=chat_response,
    chat_stream=ChatStream,
    error=error,
    empty_answer=empty_answer,
    models_request=API.models_request,
    embeddings_request=embeddings_request,
    embeddings_response=embeddings_response,
    native_completions=True,
    continuation=continuation,
)


def tokenize_request(backend: Backend, request: ChatRequest, model: str) -> UpstreamRequest:
    """Weir's engine counts a chat with `POST /tokenize` (vLLM's endpoint), at its server root; a chat
    it would refuse (`chat_request`) is not counted without what it refuses."""
    _refuse_anthropic_tools(backend, request)
    chat = _chat_body(request, model)
    body = {"model": model, "messages": chat["messages"]}
    for key in ("tools", "tool_choice"):
        if chat.get(key):
            body[key] = chat[key]
    root = (backend.base_url or backend.url or "").rstrip("/").removesuffix("/v1")
    return UpstreamRequest(f"{root}/tokenize", API.headers(backend), json_encode(body))


def tokenize_response(body: bytes, model: str) -> TokenCount:
    return token_count(body, "count", "the engine")


# The bundled engine: the OpenAI API with a token counter (other OpenAI-compatible servers may have
# none: OpenAI itself does not, so only the engine's is relied on) and without embeddings (it serves
# generative models only: an embeddings request gets a clear 400 instead of the engine's 404).
ENGINE_PROVIDER = dataclasses.replace(
    PROVIDER,
    name="engine",
    embeddings_request=None,
    embeddings_response=None,
    count_tokens_request=tokenize_request,
    count_tokens_response=tokenize_response,
)
