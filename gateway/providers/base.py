"""What every provider adapter is made of, and the helpers they share.

An adapter is data plus pure functions: a parameter table (canonical name -> vendor path and
transform), a request builder, a response parser, a stream decoder and an error parser. None of them
does I/O; `gateway.transport` sends what they build and feeds them what comes back.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlencode

import msgspec
import structlog

from gateway.config import Backend
from gateway.errors import (
    BackendUnavailable,
    BadGateway,
    GatewayError,
    GatewayTimeout,
    InvalidRequest,
    UpstreamError,
)
from gateway.ids import random_hex
from gateway.logging import redact_keys
from gateway.types import (
    ChatChunk,
    ChatRequest,
    ChatResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    Message,
    ResponseFormat,
    TokenCount,
    builtin_tools,
)

_json_decode = msgspec.json.decode
json_encode = msgspec.json.Encoder().encode

log = structlog.get_logger("weir.providers")
Continuation = Literal["prefill", "continue_final_message", "instruction"]
# The code of a 502 for an answer saying the backend refused the gateway's own credentials
# (`upstream_error`): a request's, or a health probe's (`routing.health`).
CREDENTIALS_REFUSED = "upstream_auth_failed"


@dataclass(slots=True)
class UpstreamRequest:
    url: str
    headers: dict[str, str]
    body: bytes
    method: str = "POST"
    stream: bool = False


def _no_headers(backend: Backend) -> Mapping[str, str]:
    return {}


@dataclass(frozen=True, slots=True)
class VendorApi:
    """How a vendor's HTTP API is reached, as data: where its paths start, how it takes the backend's
    key, what else every request carries. The URLs and headers every adapter sends (its health
    probes' included) are built from it here, once; an adapter declares only what differs."""

    key_header: str  # the header the backend's key goes in
    key_prefix: str = ""  # before the key in it ("Bearer ")
    root: str = ""  # the API's version prefix, before every path ("/v1")
    models_path: str = "/models"  # the model list, below `root`
    # Headers the vendor wants on every request besides the key (Anthropic's API version).
    fixed: Callable[[Backend], Mapping[str, str]] = _no_headers

    def url(self, backend: Backend, path: str, query: Mapping[str, str] | None = None) -> str:
        """`path` (below `root`) on `backend`, with its configured query and then `query`."""
        params = {**backend.query, **(query or {})}
        suffix = f"?{urlencode(params)}" if params else ""
        return f"{(backend.base_url or backend.url or '').rstrip('/')}{self.root}{path}{suffix}"

    def base_headers(self, backend: Backend) -> dict[str, str]:
        """What every request to `backend` carries, with a body or without (its health probes): the
        vendor's fixed headers, the backend's own key (never a client's), then its configured headers
        (Azure's `api-key`), which win."""
        result = dict(self.fixed(backend))
        if backend.api_key:
            result[self.key_header] = f"{self.key_prefix}{backend.api_key}"
        result.update(backend.headers)
        return result

    def headers(self, backend: Backend) -> dict[str, str]:
        """`base_headers` for a request with a JSON body."""
        return {"content-type": "application/json", **self.base_headers(backend)}

    def models_request(self, backend: Backend) -> UpstreamRequest:
        """The GET of `backend`'s model list, asked as every request is (`Provider.models_request`)."""
        return UpstreamRequest(
            self.url(backend, self.models_path), self.base_headers(backend), b"", method="GET"
        )


class StreamDecoder(Protocol):
    """Turns a vendor's SSE events into canonical chunks, keeping what state the vendor's format needs."""

    def feed(self, event: str | None, data: str) -> list[ChatChunk]: ...

    def close(self) -> list[ChatChunk]:
        """The upstream stream ended: the final chunks (usage), or BadGateway if it ended too early."""
        ...


@dataclass(frozen=True, slots=True)
class Provider:
    """One vendor wire format. `None` entries are capabilities the vendor does not have."""

    name: str
    chat_request: Callable[[Backend, ChatRequest, str], UpstreamRequest]
    chat_response: Callable[[bytes, str], ChatResponse]
    chat_stream: Callable[[ChatRequest, str], StreamDecoder]  # (request, upstream model)
    error: Callable[[int, bytes, Mapping[str, str]], GatewayError]
    # A whole chat answer from upstream model `model` with no text, in the smallest form the vendor's
    # API has (compact JSON, the fields every answer carries): what an answer holds besides its text,
    # which the estimate of an answer not read to its end takes off its size (`estimate.whole_answer`).
    empty_answer: Callable[[str], bytes]
    # The GET of the backend's model list with what every request to it carries (its own key, never a
    # client's): the health probes' question (`routing.health`).
    models_request: Callable[[Backend], UpstreamRequest]
    embeddings_request: Callable[[Backend, EmbeddingRequest, str], UpstreamRequest] | None = None
    embeddings_response: Callable[[bytes, str], EmbeddingResponse] | None = None
    # OpenAI-compatible servers serve /completions natively; others get it translated through chat.
    native_completions: bool = False
    # The input tokens a chat request would cost, counted by the backend (Anthropic's count_tokens,
    # Gemini's countTokens, the engine's /tokenize); None: the backend has no way to count.
    count_tokens_request: Callable[[Backend, ChatRequest, str], UpstreamRequest] | None = None
    count_tokens_response: Callable[[bytes, str], TokenCount] | None = None
    # How (backend, upstream model) is asked to go on writing an unfinished answer (`continued`).
    continuation: Callable[[Backend, str], Continuation] = lambda backend, model: (
        backend.continuation or "instruction"
    )
    # Whether the vendor can be told `parallel_tool_calls: false`; where it cannot (Gemini), a reply to
    # a client that asked for it keeps only its first call (`first_call_only`; its streams do it too).
    parallel_tool_calls_switch: bool = True
    # Where how a whole answer is read depends on the request it answers (Gemini: whether an empty
    # answer may be one), the reader for that request (`chat_response_reader`); None: `chat_response`.
    chat_response_to: Callable[[ChatRequest], Callable[[bytes, str], ChatResponse]] | None = None


def first_call_only(read: Callable[[bytes, str], ChatResponse]) -> Callable[[bytes, str], ChatResponse]:
    """`read`, with each choice's tool calls after the first left out (`parallel_tool_calls: false`
    to a vendor that has no such switch)."""

    def first(body: bytes, model: str) -> ChatResponse:
        response = read(body, model)
        for choice in response.choices:
            calls = choice.message.tool_calls
            if calls and len(calls) > 1:
                choice.message.tool_calls = calls[:1]
        return response

    return first


def chat_response_reader(provider: Provider, request: ChatRequest) -> Callable[[bytes, str], ChatResponse]:
    """How `provider`'s whole (not streamed) answer to `request` is read: a client's `parallel_tool_calls:
    false` that the vendor cannot be told is kept here (`first_call_only`). Every call that reads one
    answer (a routed request, a comparison's other answer) reads it so; streams keep it in their own
    decoders (`chat_stream`)."""
    read = provider.chat_response if provider.chat_response_to is None else provider.chat_response_to(request)
    if request.parallel_tool_calls is False and not provider.parallel_tool_calls_switch:
        return first_call_only(read)
    return read


# --- continuing an unfinished answer ------------------------------------------------------------

# The user turn after a partial answer, for vendors that do not continue a trailing assistant message
# (OpenAI answers it afresh; Claude 4.6 on refuses it: "This model does not support assistant message
# prefill"). Worded so that the reply is the rest of the answer and nothing else.
CONTINUE_INSTRUCTION = (
    "Your previous reply was cut off. Continue it from exactly where it stops, as if it had never been "
    "interrupted: do not repeat any of it and write nothing before the continuation."
)


# --- Claude's content blocks -----------------------------------------------------------------------

# The content blocks of a Claude turn that the canonical message says (its text, reasoning and tool
# calls). Any other, one Weir models or not (a server tool's, MCP's, `compaction`, a block type
# Claude adds later), is Claude's own: kept as Claude wrote it (`claude_only`).
CANONICAL_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use"})
# So, in a client's `tool_result`, the blocks the canonical tool message says (its content parts); any
# other (a client-side tool search's `tool_reference`, a type Weir does not model) is Claude's own.
CANONICAL_RESULT_BLOCKS = frozenset({"text", "image", "document"})


def server_block(kind: Any) -> bool:
    """Whether a block type is one of Claude's server tools' (`server_tool_use`, `web_search_tool_result`,
    `web_fetch_tool_result`, `code_execution_tool_result`, `tool_search_tool_result`, MCP's
    `mcp_tool_use` and `mcp_tool_result`, `container_upload`): a tool that ran on Anthropic's side,
    whose outcome the turn's text goes on to say, so another vendor can be sent the turn without it."""
    return isinstance(kind, str) and (
        kind in ("server_tool_use", "mcp_tool_use", "container_upload")
        or (kind.endswith("_tool_result") and kind != "tool_result")
    )


def left_out_safely(kind: Any) -> bool:
    """Whether another vendor may be sent a conversation without a block of this type: a server
    tool's (`server_block`), or a `tool_reference` in a tool result (a client-side tool search's
    answer), which loads a deferred tool into Claude's tools: a request with deferred tools is
    Claude's alone (`refuse_anthropic_tools`), so another vendor is sent every tool it has anyway."""
    return server_block(kind) or kind == "tool_reference"


def claude_only(content: Sequence[Any]) -> bool:
    """Whether a Claude turn (an answer, or an Anthropic client's assistant turn) holds what only Claude
    takes, and only an Anthropic client is shown, as it came: a block the canonical message does not
    say (`CANONICAL_BLOCKS`), or text with citations (a web search's sources)."""
    return any(
        isinstance(block, dict)
        and (
            block.get("type") not in CANONICAL_BLOCKS
            or (block.get("type") == "text" and bool(block.get("citations")))
        )
        for block in content
    )


def refuse_anthropic_tools(request: ChatRequest, vendor: str) -> None:
    """A request with a tool of Anthropic's own API (`ChatRequest.anthropic_tools`) refused by
    `vendor`'s adapter: a server tool runs on Anthropic's side, which no other vendor has; a client
    tool with Anthropic's fixed schema (bash, text editor, computer use) is one Claude is trained for,
    and its schema changes with each version, so it is not rewritten as a function tool either.
    Nothing is sent: the executor skips this candidate, and the client gets this 400 only when no
    candidate of the route could take the request. So, too, a conversation of Claude's blocks that
    another vendor cannot be sent (`refuse_claude_blocks`)."""
    for tool in request.anthropic_tools or ():
        raise InvalidRequest(
            f"tools[{tool.position}]: {tool.described} is a tool of Anthropic's API, which only Claude "
            f"models served by an Anthropic backend can take, not {vendor} models; route this request "
            "to a Claude model or leave the tool out.",
            param=f"tools[{tool.position}]",
            code="unsupported_tool",
        )
    refuse_claude_blocks(request, vendor)


def refuse_claude_blocks(request: ChatRequest, vendor: str) -> None:
    """An Anthropic client's assistant turn sent to `vendor` is its text, calls and reasoning, and its
    tool result the result's text, images and documents: what they hold besides is left out where
    that is safe (`left_out_safely`; citations), and refused otherwise: a block type Weir does not
    know (`compaction`, which stands for the conversation before it, or one Claude adds later) may
    carry what the rest of the conversation needs, so the candidate is skipped rather than sent a
    conversation missing it."""
    for message in request.messages:
        said = CANONICAL_RESULT_BLOCKS if message.role == "tool" else CANONICAL_BLOCKS
        for block in message.anthropic_content or ():
            kind = block.get("type")
            if kind in said or left_out_safely(kind):
                continue
            where = "a tool result" if message.role == "tool" else "an assistant turn"
            raise InvalidRequest(
                f"messages: {where} holds a `{kind}` block, which only Claude models served by an "
                f"Anthropic backend can be sent, not {vendor} models; route this request to a Claude model.",
                param="messages",
                code="unsupported_content",
            )


def continued(request: ChatRequest, how: Continuation) -> ChatRequest:
    """`request` as a vendor that continues an answer `how` takes it, when its final assistant message
    is an unfinished answer (`continue_final_message`): a bare trailing assistant message (`prefill`),
    the flag kept for a server that knows it (`continue_final_message`), or that message followed by a
    user turn asking for the rest (`instruction`)."""
    if not request.continue_final_message or how == "continue_final_message":
        return request
    messages = request.messages
    if how == "instruction":
        messages = [*messages, Message(role="user", content=CONTINUE_INSTRUCTION)]
    return msgspec.structs.replace(request, messages=messages, continue_final_message=None)


# --- declarative parameter tables ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Param:
    """Where a canonical request field goes in a vendor's body: a dotted path and an optional transform."""

    path: str
    transform: Callable[[Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class ParamTable:
    params: dict[str, Param] = field(default_factory=dict)

    def apply(self, request: Any, body: dict[str, Any]) -> dict[str, Any]:
        for name, param in self.params.items():
            value = getattr(request, name)
            if value is None:
                continue
            if param.transform is not None:
                value = param.transform(value)
                if value is None:
                    continue
            set_path(body, param.path, value)
        return body


def set_path(body: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = body
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def comma_list(values: Iterable[str]) -> list[str]:
    """Comma-separated header values (`anthropic-beta: a,b`, the header maybe repeated) as their
    items, each once, in order."""
    items = (item.strip() for value in values for item in value.split(","))
    return list(dict.fromkeys(item for item in items if item))


# --- shared translation helpers ------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}{random_hex(12)}"


def now() -> int:
    return int(time.time())


def parse_data_url(url: str) -> tuple[str, str] | None:
    """`data:image/png;base64,AAAA` -> ("image/png", "AAAA"); None for any other URL."""
    if not url.startswith("data:"):
        return None
    header, sep, data = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequest("image data URLs must be base64 encoded", param="messages")
    _decoded_head(data)  # refuses what is not base64
    return header.removesuffix(";base64") or "application/octet-stream", data


def _decoded_head(data: str) -> bytes:
    """The first bytes of base64 `data` (48: enough for any file signature)."""
    try:
        return base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4), validate=True)
    except binascii.Error:
        raise InvalidRequest("image data URL holds invalid base64", param="messages") from None


# The image formats every vendor takes, by the bytes they start with.
_IMAGE_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
# Names tools write for a type that vendors know by another (browsers' and pasteboards' `image/jpg`).
_IMAGE_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg", "image/x-png": "image/png"}


def parse_image_data_url(url: str) -> tuple[str, str] | None:
    """`parse_data_url` for an image, its type as its bytes say it where they are one of the formats
    every vendor takes, else as the URL says it under its standard name. OpenAI reads the bytes and
    takes any label; Anthropic refuses a label its bytes contradict ("Image does not match the
    provided media type") and any name but `image/jpeg`, `image/png`, `image/gif` and `image/webp`."""
    parsed = parse_data_url(url)
    if parsed is None:
        return None
    declared, data = parsed
    head = _decoded_head(data)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp", data
    sniffed = next((kind for signature, kind in _IMAGE_SIGNATURES if head.startswith(signature)), None)
    return sniffed or _IMAGE_ALIASES.get(declared.lower(), declared), data


def guess_media_type(url: str) -> str:
    lowered = url.lower().split("?", 1)[0]
    for ext, media_type in ((".png", "image/png"), (".gif", "image/gif"), (".webp", "image/webp")):
        if lowered.endswith(ext):
            return media_type
    return "image/jpeg"


NO_THINKING = ("none", "minimal")  # reasoning efforts that ask for no thinking


def refuse_emptied_final_turn(messages: list[Message], turns: list[dict[str, Any]], vendor: str) -> None:
    """A conversation the client ended with a user message whose content the adapter left out (text
    of whitespace alone, or empty, which `vendor` refuses) would reach it ending with the model's own
    turn, which it continues instead of answering, or with no turn at all: a 400 naming the message
    instead of a request that means something else. A blank turn before the end is left out, as the
    user turns around it say what the client asked. `turns` are the vendor's, each with its `role`."""
    if not messages or messages[-1].role != "user" or (turns and turns[-1]["role"] == "user"):
        return
    where = f"messages[{len(messages) - 1}].content"
    raise InvalidRequest(
        f"{where}: the final user message is empty (or whitespace alone), which {vendor} models "
        "refuse; left out, the conversation would end on another turn instead of asking",
        param=where,
    )


def check_stop_count(request: ChatRequest, most: int, vendor: str) -> None:
    """A vendor that takes at most `most` stop sequences refuses more with a 400 (OpenAI 4, Gemini 5;
    Anthropic any number): the request cannot be expressed for it, and is not sent (a route passes the
    candidate over; a client of that model alone gets this 400, `unsupported_value` as every refusal
    of a value the vendor lacks)."""
    count = len(request.stop_list)
    if count > most:
        raise InvalidRequest(
            f"{vendor} models take at most {most} stop sequences, not {count}",
            param="stop",
            code="unsupported_value",
        )


def asks_audio(request: ChatRequest) -> bool:
    """Whether the client asked for a spoken answer (OpenAI's `modalities: ["text", "audio"]`, which
    Weir does not model and forwards to OpenAI-compatible backends alone)."""
    modalities = request.extra.get("modalities")
    return isinstance(modalities, list) and "audio" in modalities


def asks_web_search(request: ChatRequest) -> bool:
    """Whether the client asked a search model to search the web (OpenAI's `web_search_options`)."""
    return request.extra.get("web_search_options") is not None


# A parameter whose meaning a vendor's API has no way to carry -> (whether the request sets it, what
# it asks for). Dropping one would answer another question than the one asked (no audio, no search,
# banned tokens that come back, repetition the client penalised), so the request is refused instead
# (`refuse_unexpressible`).
Unexpressible = Mapping[str, tuple[Callable[[ChatRequest], bool], str]]
ANSWER_CHANGING: Unexpressible = {
    "logprobs": (lambda request: bool(request.logprobs), "token log probabilities"),
    # OpenAI's token ids: another vendor's tokenizer numbers its tokens otherwise.
    "logit_bias": (lambda request: bool(request.logit_bias), "token biases (OpenAI token ids)"),
    # 0, what many clients send by default, asks for nothing.
    "frequency_penalty": (lambda request: bool(request.frequency_penalty), "repetition penalties"),
    "presence_penalty": (lambda request: bool(request.presence_penalty), "repetition penalties"),
    "modalities": (asks_audio, "audio output"),
    "web_search_options": (asks_web_search, "web search on the chat API"),
}


def unexpressible(*names: str) -> Unexpressible:
    """The rows of `ANSWER_CHANGING` a vendor's API cannot carry."""
    return {name: ANSWER_CHANGING[name] for name in names}


def refuse_unexpressible(request: ChatRequest, table: Unexpressible, where: str) -> None:
    """A 400 `unsupported_parameter` naming the first parameter of `table` the request sets, raised
    before anything is sent: a route passes the candidate over for the next one (`tried=model:
    unsupported`), and a client of that model alone gets this 400."""
    for name, (is_set, meaning) in table.items():
        if is_set(request):
            raise InvalidRequest(
                f"'{name}' is not supported by {where}: they have no {meaning}",
                param=name,
                code="unsupported_parameter",
            )


# A custom (freeform) tool of a Responses client on a backend with function tools alone: a function of
# one string argument, named so, whose value is the freeform input.
CUSTOM_INPUT = "input"


def custom_arguments(text: str) -> str:
    """A custom tool's freeform input as the arguments of the function tool it is elsewhere
    (`gateway.responses_inbound`): a JSON object of one string."""
    return json_encode({CUSTOM_INPUT: text}).decode()


def custom_input(arguments: str) -> str:
    """A custom tool's freeform input back from a function call's arguments (`custom_arguments`); a
    model that wrote something else gets it passed on as it wrote it."""
    try:
        value = msgspec.json.decode(arguments or "{}")
    except msgspec.DecodeError:
        return arguments
    text = value.get(CUSTOM_INPUT) if isinstance(value, dict) else None
    return text if isinstance(text, str) else arguments


def refuse_builtin_tools(request: ChatRequest, where: str) -> None:
    """A 400 `unsupported_parameter` for a Responses client's built-in tools on a backend that cannot
    run them, before anything is sent: a route passes the candidate over (`tried=model:unsupported`)
    for one on OpenAI's Responses API, and a client of that model alone gets this 400."""
    if builtin := builtin_tools(request):
        index, tool = builtin[0]
        kind = str(tool.get("type"))
        raise InvalidRequest(
            f"Tools of type {kind!r} are not supported by {where}: OpenAI's built-in tools run on "
            "OpenAI's models served on the Responses API (`api: responses`) alone.",
            param=f"tools[{index}].type",
            code="unsupported_parameter",
        )


def json_instruction(form: ResponseFormat) -> str:
    """Structured output asked for in words, where the vendor cannot take the schema beside the
    request's tools (a forced tool on Claude would take the client's tools away; Gemini before 3
    refuses a JSON response type beside function declarations)."""
    schema = (form.json_schema.schema if form.json_schema else None) or {"type": "object"}
    return f"Reply with only a JSON object matching this JSON schema: {json_encode(schema).decode()}"


def effort_for_budget(budget: int) -> str:
    """A reasoning budget in tokens (an Anthropic client's `thinking`) as a reasoning effort."""
    if budget <= 1024:
        return "low"
    return "medium" if budget <= 8192 else "high"


# --- tool call ids ---------------------------------------------------------------------------------
# Gemini 3 signs the first function call of each step (`thoughtSignature`) and refuses a history
# that comes back without it. Clients keep nothing but the id of a tool call, so the signature rides
# in the id Weir hands out (URL-safe base64 after this mark) and is taken out again on the way back.
_SIGNATURE_MARK = "__ts_"
_ANTHROPIC_ID = re.compile(r"[a-zA-Z0-9_-]+")


def call_id_with_signature(call_id: str, signature: str | None) -> str:
    if not signature:
        return call_id
    return call_id + _SIGNATURE_MARK + signature.replace("+", "-").replace("/", "_").rstrip("=")


def split_call_id(call_id: str) -> tuple[str, str | None]:
    """(the tool call's own id, the Gemini signature it carries in standard base64, or None)."""
    base, mark, signature = call_id.partition(_SIGNATURE_MARK)
    if not mark or not signature:
        return call_id, None
    signature = signature.replace("-", "+").replace("_", "/")
    return base, signature + "=" * (-len(signature) % 4)


def upstream_call_id(call_id: str, max_length: int | None = None, anthropic: bool = False) -> str:
    """A client's tool call id as a vendor that constrains ids accepts it.

    OpenAI refuses ids over 40 characters and Anthropic ids outside [a-zA-Z0-9_-]; a conversation that
    moves between vendors (a fallback, a client switching models) carries the previous vendor's ids.
    An id that does not fit is replaced by a digest of itself: the same for the assistant's call and
    the tool result that answers it, so the pair still matches, and no state is kept.
    """
    call_id = split_call_id(call_id)[0]
    too_long = max_length is not None and len(call_id) > max_length
    if too_long or (anthropic and not _ANTHROPIC_ID.fullmatch(call_id)):
        return "call_" + hashlib.blake2b(call_id.encode(), digest_size=16).hexdigest()
    return call_id


# A tool call's arguments where the backend gave none: an empty JSON object, as OpenAI sends it and as
# clients json.loads them ("" is no JSON).
NO_ARGUMENTS = "{}"


def parse_arguments(arguments: str, where: str) -> dict[str, Any]:
    """OpenAI tool-call arguments (JSON text) as the object Anthropic and Gemini want."""
    if not arguments.strip():
        return {}
    try:
        value = _json_decode(arguments)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nested thousands deep
        raise InvalidRequest(
            f"tool call arguments are not valid JSON: {arguments[:80]!r}", param=where
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest("tool call arguments must be a JSON object", param=where)
    return value


def decode_json(body: bytes | str, backend_hint: str) -> Any:
    try:
        return _json_decode(body)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nested thousands deep
        raise BadGateway(f"{backend_hint} returned a body that is not valid JSON") from None


def decode_typed(body: bytes | str, type_: Any, backend_hint: str) -> Any:
    try:
        return _json_decode(body, type=type_)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise BadGateway(f"{backend_hint} returned an unexpected response: {exc}") from None


def token_count(body: bytes, field: str, backend_hint: str) -> TokenCount:
    """A count endpoint's answer (`{field: N}`) as a TokenCount."""
    data = decode_json(body, backend_hint)
    count = data.get(field) if isinstance(data, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise BadGateway(f"{backend_hint} answered a token count without `{field}`")
    return TokenCount(input_tokens=count)


# How each vendor says a prompt does not fit the model's context window, as one code: OpenAI's own,
# `context_length_exceeded`, which OpenAI clients already handle, and which a route's `failover_on`
# can name (the next candidate may have a larger window).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
_CONTEXT_MESSAGES = re.compile(
    r"maximum context length"  # OpenAI, vLLM, SGLang: "This model's maximum context length is ..."
    r"|prompt is too long"  # Anthropic: "prompt is too long: 208656 tokens > 200000 maximum"
    r"|exceed context limit"  # Anthropic: "input length and `max_tokens` exceed context limit: ..."
    r"|input token count .* exceeds the maximum number of tokens"  # Gemini (INVALID_ARGUMENT)
    r"|exceeds the context window"  # OpenAI's Responses API: "Your input exceeds the context window ..."
    # Servers that never send OpenAI's code: llama.cpp's "request (N tokens) exceeds the available
    # context size (M tokens)", SGLang's and Together's "The input (N tokens) is longer than the
    # model's context length (M tokens).", xAI's "This model's maximum prompt length is M but the
    # request contains N tokens.", and TGI's 422 "Input validation error: `inputs` tokens +
    # `max_new_tokens` must be <= M" (or "`inputs` must have less than M tokens").
    r"|exceeds the available context size"
    r"|longer than the model's context length"
    r"|maximum prompt length is"
    r"|`inputs` tokens \+ `max_new_tokens` must be"
    r"|`inputs` must have less than \d+ tokens",
    re.IGNORECASE,
)
# The statuses a prompt too long comes with: 400 from nearly every vendor and server, 422 from TGI
# (and servers built on it), 413 from those that treat it as a request too large. Their words decide.
_CONTEXT_STATUSES = frozenset({400, 413, 422})

# A context-window 400 that says how large the window is and how many tokens the prompt has: the
# bundled engine's and OpenAI's words (vLLM's before 0.10 too), "This model's maximum context length
# is 8192 tokens. However, you requested 40000 tokens (8000 in the messages|prompt, 32000 ...)", and
# vLLM's since, "... maximum context length is 8192 tokens and your request has 8000 input tokens".
# Anthropic's, for models before Sonnet 4.5: "input length and `max_tokens` exceed context limit:
# 190000 + 32000 > 200000, decrease input length or `max_tokens` and try again". A prompt that fills
# the window alone is worded otherwise by each of them ("the prompt has N tokens", "prompt is too long").
_CONTEXT_REPORT = re.compile(
    r"maximum context length is (?P<window>\d+) tokens.*?"
    r"(?:\((?P<prompt>\d+) in the (?:prompt|messages)\b|your request has (?P<input>\d+) input tokens)",
    re.DOTALL,
)
_ANTHROPIC_CONTEXT_REPORT = re.compile(r"exceed context limit: (?P<prompt>\d+) \+ \d+ > (?P<window>\d+)")


def context_report(message: str) -> tuple[int, int] | None:
    """(context window, prompt tokens) of a context-window 400's message that says both, where the
    prompt fits and the output limit is what does not; None otherwise."""
    found = _CONTEXT_REPORT.search(message) or _ANTHROPIC_CONTEXT_REPORT.search(message)
    if found is None:
        return None
    named = found.groupdict()
    window, prompt = int(named["window"]), int(named["prompt"] or named.get("input") or 0)
    return (window, prompt) if prompt < window else None


# How each vendor says an output limit is above the most the model writes: a property of the model,
# not of the request (another model, or this one asked for less, takes it). The vendor's own error
# reaches the client unchanged when no other candidate takes the request (`routing.execute`).
OUTPUT_LIMIT_TOO_LARGE = re.compile(
    # OpenAI: "max_tokens is too large: 32000. This model supports at most 16384 completion tokens, ..."
    r"\b(max_tokens|max_completion_tokens) is too large"
    # Anthropic: "max_tokens: 32000 > 8192, which is the maximum allowed number of output tokens for ..."
    r"|maximum allowed number of output tokens"
    # Gemini: "... has a maxOutputTokens value of 70000 but the supported range is from 1 ..."
    r"|maxOutputTokens value of \d+ but the supported range"
    # DeepSeek: "Invalid max_tokens value, the valid range of max_tokens is [1, 8192]" (its words for a
    # limit below 1 too, which another candidate refuses as well: the last refusal reaches the client)
    r"|valid range of max_tokens is \[",
)

# OpenAI's words for a request larger on its own than the account's tokens-per-minute limit, in a
# 429: "Request too large for gpt-4o in organization ... on tokens per min (TPM): Limit 30000,
# Requested 50000. The input or output tokens must be reduced ...". No wait lifts it. (Groq says it
# with a 413, which `retries_in_place` does not retry either.)
TOO_LARGE_FOR_LIMIT = re.compile(r"\bRequest too large for\b", re.IGNORECASE)
INSUFFICIENT_QUOTA = "insufficient_quota"  # OpenAI's 429 for an account out of credit


def _never_lifts(status: int, message: str, code: str | None) -> bool:
    """A vendor's 429 that no wait lifts: its account out of credit, or a request larger than its rate
    limit itself. Routing asks that backend once (`routing.execute.retries_in_place`); the client is
    told not to retry either (`x-should-retry: false`, which the OpenAI and Anthropic SDKs obey)."""
    return status == 429 and (code == INSUFFICIENT_QUOTA or TOO_LARGE_FOR_LIMIT.search(message) is not None)


def upstream_error(
    status: int,
    message: str,
    headers: Mapping[str, str],
    *,
    vendor: str,
    param: str | None = None,
    code: str | None = None,
    type: str | None = None,
) -> GatewayError:
    """A vendor's error status and message as the error the client sees.

    4xx keep their status and the vendor's own message (the request is at fault, so the client must
    see why), except 401/402/403 (the gateway's credentials or account: a 502); 5xx become 502, 503 (overloaded,
    including Anthropic's 529) or 504, each with the vendor's `retry-after` if it sent one.
    """
    passed = {k: v for k, v in headers.items() if k.lower() in ("retry-after", "retry-after-ms")}
    if status in (401, 402, 403):
        # The backend refused the gateway's own credentials (a revoked or mistyped key, a project
        # without access to the model) or its account cannot pay (402): neither the request nor the
        # client's key is at fault. Passed on, it read as the client's key refused, and the vendor's
        # text is about the gateway's key or account; a 502 instead, which fails over and counts
        # against the backend's breaker. The vendor's words go to the operator's log, without the part
        # of the key they may quote.
        log.warning(
            "upstream_credentials_refused", vendor=vendor, status=status, message=redact_keys(message)
        )
        if status == 402:
            return BadGateway(
                f"The {vendor} backend refused the gateway's account for billing (402); an operator must "
                "check its credit.",
                code="upstream_billing_failed",
            )
        return BadGateway(
            f"The {vendor} backend refused the gateway's credentials ({status}); an operator must check "
            "the backend's API key.",
            code=CREDENTIALS_REFUSED,
        )
    if status in _CONTEXT_STATUSES and _CONTEXT_MESSAGES.search(message):
        code = CONTEXT_LENGTH_EXCEEDED
    if 400 <= status < 500:
        if _never_lifts(status, message, code):
            passed["x-should-retry"] = "false"
        return UpstreamError(
            message,
            status=status,
            param=param,
            code=code,
            type=type or ("rate_limit_error" if status == 429 else "invalid_request_error"),
            headers=passed,
        )
    text = f"{vendor} backend error ({status}): {message}"
    if status in (503, 529):
        return BackendUnavailable(text, headers=passed, upstream_code=code)
    # A vendor's `retry-after` on any 5xx is kept: the retry in place waits for it, and the client
    # is told it, as for a 503.
    if status == 504:
        return GatewayTimeout(text, headers=passed, upstream_code=code)
    return BadGateway(text, headers=passed, upstream_code=code)


def error_text(body: bytes, path: tuple[str, ...] = ("error", "message")) -> tuple[str, dict[str, Any]]:
    """The vendor's error message from its JSON body (or the body itself, shortened, if not JSON)."""
    try:
        value: Any = _json_decode(body)
    except (msgspec.DecodeError, RecursionError):
        return body[:300].decode("utf-8", "replace").strip() or "no error message", {}
    error = value.get("error") if isinstance(value, dict) else None
    node: Any = value
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, str):
        return node, error if isinstance(error, dict) else {}
    return msgspec.json.encode(value)[:300].decode(), error if isinstance(error, dict) else {}
