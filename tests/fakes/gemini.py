"""Fake Gemini API (Google AI Studio, ``generativelanguage.googleapis.com``) on 127.0.0.1.

Endpoints under ``/v1beta`` (and ``/v1``): ``models/{model}:generateContent``,
``:streamGenerateContent`` (``?alt=sse`` gives SSE frames ``data: {...}\\r\\n\\r\\n``; without it, a
streamed JSON array), ``:countTokens``, ``:embedContent``, ``:batchEmbedContents``, ``GET models``,
``GET models/{model}``, and ``cachedContents`` (create, get, list, delete). Auth: ``x-goog-api-key``
header or ``?key=``. As the real API does, a wrong key gets 400 ``INVALID_ARGUMENT`` whose ``details``
hold an ``ErrorInfo`` of reason ``API_KEY_INVALID`` and a ``LocalizedMessage``, and a missing key 403
``PERMISSION_DENIED``; errors are ``{"error": {"code", "message", "status"}}``.

Responses carry ``candidates[].content.parts[]`` (``text``; ``functionCall`` with ``args`` for tool
calls, sent whole in one chunk as Gemini does; a ``thought: true`` part when
``thinkingConfig.includeThoughts``), ``finishReason`` (``STOP``, ``MAX_TOKENS``; any other through
``stop_next_with``), ``usageMetadata`` and ``modelVersion``/``responseId``; streamed with
``candidateCount`` > 1, the candidates come interleaved (each one event behind the one before), each
finishing in an event of its own; a blocked prompt
(``block_next``) gets ``promptFeedback.blockReason``, no candidates and the prompt's usage. Every
stream chunk carries the usage so far, the last one the total.
With ``generationConfig.responseLogprobs`` each candidate also carries ``logprobsResult`` for the text
it holds (a stream chunk, its own tokens; one token a word): ``chosenCandidates`` (``token``,
``tokenId``, ``logProbability``, left out when 0 as proto3 JSON leaves out zeros), ``topCandidates``
(``generationConfig.logprobs`` candidates a step, most likely first, only when that is set) and
``logProbabilitySum``, with ``avgLogprobs`` beside it.

Rejects with 400 ``INVALID_ARGUMENT`` empty ``contents``, ``maxOutputTokens`` outside 1 to the
model's output limit (`MAX_OUTPUT_TOKENS`: 8,192 on Gemini 2.0 Flash, 65,536 on 2.5 and 3), a
``systemInstruction`` to Gemma (``gemma-3-27b-it``: "Developer instruction is not enabled"), a
``presencePenalty`` or ``frequencyPenalty`` other than 0 to a model after Gemini 2.0 ("Penalty is not
enabled for models/gemini-2.5-flash"; 0 is not checked),
and on 3.5 Flash-Lite and 3.6 on (`NO_PREFILL`) contents ending with a model turn, which earlier
models continue (a prefill). A function's ``parameters`` or the ``responseSchema`` is parsed as Gemini's
``Schema`` message (`check_schema`): a keyword it has no field for (``additionalProperties``,
``const``, ``oneOf``...), a list for ``type``, an enum value that is not a string or an enum beside
a type other than STRING, ``properties``
empty or beside a type other than OBJECT, a ``required`` name no property defines, or an ARRAY
without ``items`` is a 400 in the real API's words, as is an image or audio of a type it does not read (``image/gif``:
"Unsupported MIME type").

Gemini 3 models (``gemini-3-*``) sign their function calls as the real ones do: the first
``functionCall`` part of a response carries a ``thoughtSignature``, and a request is refused (400)
when the first ``functionCall`` of a model step since the last user text lacks one ("missing a
thought_signature") or carries one this server never issued ("Corrupted thought signature"), the
documented stand-in ``skip_thought_signature_validator`` excepted. Gemini 2 models check nothing.
Gemini 3 models also give every ``functionCall`` an ``id`` of its own (parallel calls too), and a
``functionResponse`` whose ``id`` is none of the ids of the calls of the model turn before it is a 400
("functionResponse.id does not match functionCall.id"); one without an ``id`` is matched by name.
``thinkingConfig`` is checked per model: none at all on Gemini 2.0 Flash and Gemma (`NEVER_THINKS`:
"thinking_config is not supported."), ``thinkingLevel`` only on Gemini 3 and only the levels each
takes (`THINKING_LEVELS`), never beside ``thinkingBudget``, and a budget of 0 refused by 2.5 Pro and
3 Pro, which cannot stop thinking (`ALWAYS_THINKS`), as is a budget outside a 2.5 model's range
(`BUDGET_RANGES`).

Usage: ``promptTokenCount`` counts every prompt token including ``cachedContentTokenCount``, which is
reported when the request names a ``cachedContent`` created earlier (its whole size; creating one
needs at least ``fake.min_cache_tokens`` tokens, 1024 by default). ``thoughtsTokenCount`` is reported
when ``thinkingConfig.thinkingBudget`` > 0 (min(budget, 64) tokens; 64 for the dynamic -1 and
``thinkingLevel`` high, Gemini 3's default, 16 for lower levels) and is not part of
``candidatesTokenCount``; ``totalTokenCount`` = prompt + candidates + thoughts (+ a
``toolUsePromptTokenCount`` a test sets raw, beside the prompt as Gemini reports grounding's).
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

from aiohttp import web

from tests.fakes.behaviour import (
    Reply,
    ReportedUsage,
    Tool,
    Turn,
    asks_to_continue,
    chunk_words,
    count_tokens,
    embedding,
    plan_reply,
    words,
)
from tests.fakes.server import BODY, INVALID_JSON, FakeServer, Invalid, sse
from tests.fakes.util import deep_merge, huge_text

IMAGE_TOKENS = 258
THOUGHT_TOKENS = 64
# The most output tokens each model writes (`outputTokenLimit`), as Google documents them.
MAX_OUTPUT_TOKENS = {
    "gemini-2.5-flash": 65536,
    "gemini-2.5-pro": 65536,
    "gemini-2.5-flash-lite": 65536,
    "gemini-2.0-flash": 8192,
    "gemini-3-pro-preview": 65536,
    "gemini-3-flash-preview": 65536,
}
EMBEDDING_DIMS = {"gemini-embedding-001": 3072, "text-embedding-004": 768}
_STATUS = {
    400: ("INVALID_ARGUMENT", "Request contains an invalid argument."),
    401: ("UNAUTHENTICATED", "Request had invalid authentication credentials."),
    403: ("PERMISSION_DENIED", "The caller does not have permission."),
    404: ("NOT_FOUND", "Requested entity was not found."),
    409: ("ABORTED", "The operation was aborted."),
    429: ("RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota)."),
    500: (
        "INTERNAL",
        "An internal error has occurred. Please retry or report in https://developers.generativeai.google/guide/troubleshooting",
    ),
    503: ("UNAVAILABLE", "The model is overloaded. Please try again later."),
    504: ("DEADLINE_EXCEEDED", "Deadline expired before operation could complete."),
}
SKIP_SIGNATURE = "skip_thought_signature_validator"
# thinkingLevel by model, as Google documents them; Gemini 2 takes only thinkingBudget.
THINKING_LEVELS = {
    "gemini-3-pro-preview": ("low", "high"),
    "gemini-3-flash-preview": ("minimal", "low", "medium", "high"),
}


# Models that cannot stop thinking: a thinkingBudget of 0 is their 400.
ALWAYS_THINKS = frozenset({"gemini-2.5-pro", "gemini-3-pro-preview"})
# The thinkingBudget range of each Gemini 2.5 model, as Google documents it (-1, the dynamic budget,
# and 0, which stops thinking where the model can, aside).
BUDGET_RANGES = {
    "gemini-2.5-pro": (128, 32768),
    "gemini-2.5-flash": (0, 24576),
    "gemini-2.5-flash-lite": (512, 24576),
}


# Models that do not think: any thinkingConfig is their 400.
NEVER_THINKS = frozenset({"gemini-2.0-flash", "gemma-3-27b-it"})


def check_thinking(model: str, thinking: dict[str, Any]) -> None:
    if thinking and model in NEVER_THINKS:
        raise Invalid(400, "thinking_config is not supported.")
    level, budget = thinking.get("thinkingLevel"), thinking.get("thinkingBudget")
    if level is not None and budget is not None:
        raise Invalid(400, "You cannot use both thinking_level and the legacy thinking_budget parameter.")
    if level is not None and level not in THINKING_LEVELS.get(model, ()):
        raise Invalid(400, f"Thinking level {level} is not supported for this model.")
    if budget == 0 and model in ALWAYS_THINKS:
        raise Invalid(400, "Budget 0 is invalid. This model only works in thinking mode.")
    least, most = BUDGET_RANGES.get(model, (0, None))
    if budget not in (None, -1, 0) and (budget < least or (most is not None and budget > most)):
        raise Invalid(
            400, f"The thinking budget {budget} is invalid. Please choose a value between {least} and {most}."
        )


# The fields of Gemini's `Schema` (function `parameters`, `responseSchema`): a proto message, so any
# other keyword is an unknown field, and `type` one value, never a list (`parametersJsonSchema` and
# `responseJsonSchema` take JSON Schema instead, unchecked here).
SCHEMA_FIELDS = frozenset(
    {
        *("type", "format", "title", "description", "nullable", "enum", "default", "example"),
        *("properties", "required", "minProperties", "maxProperties", "propertyOrdering"),
        *("items", "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum"),
        "anyOf",
    }
)


def check_schema(schema: Any, where: str) -> None:
    """A `Schema` as Gemini parses one, refused with its words where it has a field the message has
    not, a list for `type`, an enum value that is not a string or an enum on a schema that is not a
    STRING, `properties` empty or on a schema that is not an OBJECT, a `required` name that no
    property defines, or an ARRAY without `items`."""
    if not isinstance(schema, dict):
        return
    for key in schema:
        if key not in SCHEMA_FIELDS:
            raise Invalid(
                400, f"Invalid JSON payload received. Unknown name \"{key}\" at '{where}': Cannot find field."
            )
    if isinstance(schema.get("type"), list):
        raise Invalid(
            400,
            f"Invalid JSON payload received. Unknown name \"type\" at '{where}': Proto field is not repeating, "
            "cannot start list.",
        )
    for i, value in enumerate(schema.get("enum") or ()):
        if not isinstance(value, str):
            raise Invalid(400, f"Invalid value at '{where}.enum[{i}]' (TYPE_STRING), {json.dumps(value)}")
    if "enum" in schema and str(schema.get("type", "")).upper() != "STRING":
        raise Invalid(400, f"* GenerateContentRequest.{where}.enum: only allowed for STRING type\n")
    if str(schema.get("type", "")).upper() == "ARRAY" and "items" not in schema:
        raise Invalid(400, f"* GenerateContentRequest.{where}.items: missing field.\n")
    properties = schema.get("properties")
    if properties is not None:
        # Its checks of what was parsed name properties by name ("properties[city]"); close enough here.
        if str(schema.get("type", "")).upper() != "OBJECT":
            raise Invalid(400, f"* GenerateContentRequest.{where}.properties: only allowed for OBJECT type\n")
        if not properties:
            raise Invalid(
                400, f"* GenerateContentRequest.{where}.properties: should be non-empty for OBJECT type\n"
            )
    for i, name in enumerate(schema.get("required") or ()):
        if name not in (properties or {}):
            raise Invalid(400, f"* GenerateContentRequest.{where}.required[{i}]: property is not defined\n")
    for i, sub in enumerate((properties or {}).values()):
        check_schema(sub, f"{where}.properties[{i}].value")
    check_schema(schema.get("items"), f"{where}.items")
    for i, sub in enumerate(schema.get("anyOf") or ()):
        check_schema(sub, f"{where}.any_of[{i}]")


# The image types Gemini reads; another (image/gif) is its 400.
IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/webp", "image/heic", "image/heif"})
# The audio types Google documents for audio understanding; another (audio/pcm) is its 400 too.
AUDIO_TYPES = frozenset({"audio/wav", "audio/mp3", "audio/aiff", "audio/aac", "audio/ogg", "audio/flac"})


def check_images(body: dict[str, Any]) -> None:
    """Every image or audio part of the contents (inline or by URI) of a type Gemini reads."""
    for content in body.get("contents") or ():
        for part in content.get("parts") or ():
            media = part.get("inlineData") or part.get("inline_data") or part.get("fileData") or {}
            kind = media.get("mimeType") or media.get("mime_type") or ""
            if (kind.startswith("image/") and kind not in IMAGE_TYPES) or (
                kind.startswith("audio/") and kind not in AUDIO_TYPES
            ):
                raise Invalid(400, f"Unsupported MIME type: {kind}")


def check_schemas(body: dict[str, Any]) -> None:
    """Every `Schema` of a generateContent request: its function declarations' and its response's."""
    for i, tool in enumerate(body.get("tools") or ()):
        for j, declaration in enumerate(tool.get("functionDeclarations") or ()):
            check_schema(declaration.get("parameters"), f"tools[{i}].function_declarations[{j}].parameters")
    check_schema(
        (body.get("generationConfig") or {}).get("responseSchema"), "generation_config.response_schema"
    )


_FINISH = {"stop": "STOP", "stop_sequence": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP"}


# Gemini 3.5 Flash-Lite and 3.6 on refuse contents ending with a model turn (earlier ones continue it).
NO_PREFILL = re.compile(r"gemini-(3\.5-flash-lite|3\.[6-9]|[4-9])")


class FakeGemini(FakeServer):
    vendor: ClassVar[str] = "gemini"
    default_models: ClassVar[tuple[str, ...]] = (
        "gemini-2.5-flash",
        "gemini-2.5-pro",
        "gemini-2.5-flash-lite",
        "gemini-2.0-flash",
        "gemini-3-pro-preview",
        "gemini-3-flash-preview",
        "gemma-3-27b-it",
        "gemini-embedding-001",
        "text-embedding-004",
    )

    def __init__(self, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(api_key, **kwargs)
        self.min_cache_tokens = 1024
        self.cached_contents: dict[str, dict[str, Any]] = {}
        self.signatures: set[str] = set()  # thought signatures issued, as base64
        self.call_ids: list[str] = []  # functionCall ids issued (Gemini 3), in order
        self.calls_per_reply = 1
        self._finish_reasons: list[tuple[str, bool]] = []
        self._block_reasons: list[str] = []

    def reset_state(self) -> None:
        self.min_cache_tokens = 1024
        self.cached_contents = {}
        self.signatures = set()
        self.call_ids = []
        self.calls_per_reply = 1
        self._finish_reasons = []
        self._block_reasons = []

    def stop_next_with(self, reason: str, *, empty: bool = False) -> None:
        """The next answer ends with Gemini's `finishReason` `reason` (`SAFETY`, `LANGUAGE`,
        `TOO_MANY_TOOL_CALLS`, `OTHER`...: ones the echo never gives), its content as usual; streamed,
        the reason comes on the last chunk, after the text before it. `empty`: stopped before any of
        the answer, its candidate has no parts (its thoughts aside) and only the thoughts are output."""
        with self._lock:
            self._finish_reasons.append((reason, empty))

    def block_next(self, reason: str) -> None:
        """The next generation's prompt is blocked as Gemini blocks one (`SAFETY`, `PROHIBITED_CONTENT`,
        `BLOCKLIST`...): a 200 with `promptFeedback.blockReason`, no candidates, and the usage of the
        prompt alone, which is billed; streamed, that one event."""
        with self._lock:
            self._block_reasons.append(reason)

    def _block_reason(self) -> str | None:
        with self._lock:
            return self._block_reasons.pop(0) if self._block_reasons else None

    def _finish_reason(self) -> tuple[str | None, bool]:
        """The finish `stop_next_with` queued, and whether the answer is empty; (None, False) if none."""
        with self._lock:
            return self._finish_reasons.pop(0) if self._finish_reasons else (None, False)

    def call_in_parallel(self, calls: int) -> None:
        """A function call reply holds the call `calls` times, as parallel calls (only the first
        signed, as Gemini signs them), in one part each, until `reset()`. Gemini has no switch that
        stops it, whatever the request."""
        self.calls_per_reply = calls

    def routes(self) -> list[web.RouteDef]:
        routes: list[web.RouteDef] = []
        for version in ("v1beta", "v1"):
            routes += [
                web.post(f"/{version}/models/{{call}}", self._model_call),
                web.get(f"/{version}/models", self._list_models),
                web.get(f"/{version}/models/{{model}}", self._get_model),
                web.post(f"/{version}/cachedContents", self._create_cache),
                web.get(f"/{version}/cachedContents", self._list_caches),
                web.get(f"/{version}/cachedContents/{{id}}", self._get_cache),
                web.delete(f"/{version}/cachedContents/{{id}}", self._delete_cache),
            ]
        return routes

    # ---- vendor shapes ---------------------------------------------------------------------------

    def error_response(self, status: int, message: str | None = None, **extra: Any) -> web.Response:
        return web.json_response(self._error_body(status, message, **extra), status=status)

    def _error_body(self, status: int, message: str | None, **extra: Any) -> dict[str, Any]:
        name, default = _STATUS.get(status, ("INTERNAL", "Internal error."))
        error: dict[str, Any] = {
            "code": status,
            "message": message or default,
            "status": extra.get("status") or extra.get("code") or name,  # a fault's `error_code`
        }
        if "details" in extra:
            error["details"] = extra["details"]
        elif extra.get("retry_delay") is not None:
            # How Google says when to retry: no header, a RetryInfo (google.protobuf.Duration in its
            # JSON form, seconds with an "s") beside the quota that was hit and a help link.
            error["details"] = [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [
                        {
                            "quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                            "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                            "quotaDimensions": {"location": "global", "model": "gemini-2.5-flash"},
                            "quotaValue": "10",
                        }
                    ],
                },
                {
                    "@type": "type.googleapis.com/google.rpc.Help",
                    "links": [
                        {
                            "description": "Learn more about Gemini API quotas",
                            "url": "https://ai.google.dev/gemini-api/docs/rate-limits",
                        }
                    ],
                },
                {
                    "@type": "type.googleapis.com/google.rpc.RetryInfo",
                    "retryDelay": f"{extra['retry_delay']:g}s",
                },
            ]
        return {"error": error}

    def stream_error_frame(self, status: int, message: str | None) -> bytes:
        return sse(self._error_body(status, message), sep=b"\r\n\r\n")

    def is_stream(self, request: web.Request, body: Any) -> bool:
        return request.path.endswith(":streamGenerateContent")

    def auth_error(self, request: web.Request) -> web.StreamResponse | None:
        key = request.headers.get("x-goog-api-key") or request.query.get("key")
        if not key:
            return self.error_response(
                403,
                "Method doesn't allow unregistered callers (callers without established identity). "
                "Please use API Key or other form of API consumer identity to call this API.",
            )
        if key != self.api_key:
            message = "API key not valid. Please pass a valid API key."
            return self.error_response(
                400,
                message,
                details=[
                    {
                        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                        "reason": "API_KEY_INVALID",
                        "domain": "googleapis.com",
                        "metadata": {"service": "generativelanguage.googleapis.com"},
                    },
                    {
                        "@type": "type.googleapis.com/google.rpc.LocalizedMessage",
                        "locale": "en-US",
                        "message": message,
                    },
                ],
            )
        return None

    # ---- request parsing -------------------------------------------------------------------------

    def _body(self, request: web.Request) -> dict[str, Any]:
        body = request[BODY]
        if body is INVALID_JSON or not isinstance(body, dict):
            raise Invalid(400, "Invalid JSON payload received. Unexpected token.")
        return body

    def _check_model(self, model: str, method: str) -> None:
        if model not in self.models:
            raise Invalid(
                404,
                f"models/{model} is not found for API version v1beta, or is not supported for {method}. "
                "Call ListModels to see the list of available models and their supported methods.",
            )

    @staticmethod
    def _content_tokens(body: dict[str, Any]) -> list[str]:
        tokens: list[str] = []
        if body.get("tools"):
            tokens += words(json.dumps(body["tools"]))
        system = body.get("systemInstruction") or body.get("system_instruction")
        contents = ([system] if system else []) + list(body.get("contents") or [])
        for content in contents:
            for part in content.get("parts") or []:
                if "text" in part:
                    tokens += words(part["text"])
                elif "inlineData" in part or "inline_data" in part or "fileData" in part:
                    data = part.get("inlineData") or part.get("inline_data") or part.get("fileData")
                    tokens += [f"<media:{json.dumps(data, sort_keys=True)[-48:]}>"] * IMAGE_TOKENS
                elif "functionCall" in part:
                    tokens += words(json.dumps(part["functionCall"]))
                elif "functionResponse" in part:
                    tokens += words(json.dumps(part["functionResponse"]))
        return tokens

    def _turn(self, body: dict[str, Any]) -> Turn:
        config = body.get("generationConfig") or {}
        tools = [
            Tool(d["name"], d.get("parametersJsonSchema") or d.get("parameters") or {})
            for t in body.get("tools") or []
            for d in t.get("functionDeclarations") or t.get("function_declarations") or []
        ]
        turn = Turn(
            tools=tools,
            stop=list(config.get("stopSequences") or []),
            max_tokens=config.get("maxOutputTokens"),
        )
        contents = body.get("contents") or []
        last = contents[-1] if contents else {}
        said = " ".join(p["text"] for p in last.get("parts") or [] if "text" in p)
        if len(contents) > 1 and last.get("role", "user") == "user" and asks_to_continue(said):
            contents, last = contents[:-1], contents[-2]  # the fake model obeys: it goes on with its reply
            turn.rejoin = self.rejoin
        asked = last
        if last.get("role") == "model" and not any("functionCall" in p for p in last.get("parts") or []):
            turn.prefill = " ".join(p["text"] for p in last.get("parts") or [] if "text" in p)
            asked = next((c for c in reversed(contents) if c.get("role", "user") == "user"), {})
        if asked.get("role", "user") == "user":
            parts = asked.get("parts") or []
            turn.last_user_text = " ".join(p["text"] for p in parts if "text" in p)
            turn.images = sum(1 for p in parts if "inlineData" in p or "inline_data" in p or "fileData" in p)
            responses = [p["functionResponse"] for p in parts if "functionResponse" in p]
            if responses:
                turn.tool_result = (
                    responses[-1].get("name", ""),
                    json.dumps(responses[-1].get("response", {})),
                )
        calling = (body.get("toolConfig") or {}).get("functionCallingConfig") or {}
        mode = calling.get("mode", "AUTO")
        if mode == "NONE":
            turn.tools_disabled = True
        elif mode == "ANY":
            allowed = calling.get("allowedFunctionNames") or []
            turn.forced_tool = allowed[0] if allowed else "any"
        if config.get("responseMimeType") == "application/json":
            turn.json_mode = True
            schema = config.get("responseJsonSchema") or config.get("responseSchema")
            turn.json_schema = _lower_types(schema) if schema else None
        return turn

    def _check_signatures(self, body: dict[str, Any]) -> None:
        contents = body.get("contents") or []
        for position, content in reversed(list(enumerate(contents))):
            parts = content.get("parts") or []
            if content.get("role", "user") == "user" and any("text" in p for p in parts):
                return
            calls = [p for p in parts if "functionCall" in p]
            if content.get("role") != "model" or not calls:
                continue
            signature = calls[0].get("thoughtSignature")
            if signature is None:
                raise Invalid(
                    400,
                    "Function call is missing a thought_signature in functionCall parts. This is required "
                    "for tools to work correctly, and missing thought_signature may lead to degraded model "
                    f"performance. Additional data, function call `default_api:{calls[0]['functionCall']['name']}` "
                    f", position {position + 1}. Please refer to "
                    "https://ai.google.dev/gemini-api/docs/thought-signatures for more details.",
                )
            if signature != SKIP_SIGNATURE and signature not in self.signatures:
                raise Invalid(400, "Corrupted thought signature.")

    @staticmethod
    def _check_response_ids(body: dict[str, Any]) -> None:
        """Every functionResponse `id` names a functionCall of the model turn before it."""
        issued: set[str] = set()
        for content in body.get("contents") or ():
            parts = content.get("parts") or []
            if content.get("role") == "model":
                issued = {p["functionCall"]["id"] for p in parts if "id" in p.get("functionCall", {})}
                continue
            for part in parts:
                answered = (part.get("functionResponse") or {}).get("id")
                if answered is not None and answered not in issued:
                    raise Invalid(400, "functionResponse.id does not match functionCall.id")

    def _sign(self) -> str:
        # 50 random bytes: standard base64 with padding, + and / likely, as Gemini's are
        signature = base64.b64encode(secrets.token_bytes(50)).decode()
        self.signatures.add(signature)
        return signature

    # ---- handlers --------------------------------------------------------------------------------

    async def _model_call(self, request: web.Request) -> web.StreamResponse:
        model, _, method = request.match_info["call"].partition(":")
        handlers = {
            "generateContent": self._generate,
            "streamGenerateContent": self._generate,
            "countTokens": self._count_tokens,
            "embedContent": self._embed,
            "batchEmbedContents": self._embed,
        }
        if method not in handlers:
            return self.error_response(404, f"Method not found: {method}")
        try:
            self._check_model(model, method)
            return await handlers[method](request, model, method, self._body(request))
        except Invalid as exc:
            return self.error_response(exc.status, exc.message)

    async def _generate(
        self, request: web.Request, model: str, method: str, body: dict[str, Any]
    ) -> web.StreamResponse:
        if not body.get("contents"):
            raise Invalid(400, "* GenerateContentRequest.contents: contents is not specified\n")
        limit = body.get("generationConfig", {}).get("maxOutputTokens")
        most = _max_output(model)
        if limit is not None and not 1 <= limit <= most:
            raise Invalid(
                400,
                f"Unable to submit request because it has a maxOutputTokens value of {limit} but the supported "
                f"range is from 1 (inclusive) to {most + 1} (exclusive). Update the value and try again.",
            )
        cached_tokens = 0
        if body.get("cachedContent"):
            cache = self.cached_contents.get(body["cachedContent"].removeprefix("cachedContents/"))
            if cache is None or cache["expires"] < time.time():
                raise Invalid(403, f"CachedContent not found (or permission denied): {body['cachedContent']}")
            if cache["model"] != f"models/{model}":
                raise Invalid(
                    400, "Model used by GenerateContent request and CachedContent has to be the same."
                )
            cached_tokens = cache["tokens"]
        if model.startswith("gemma-") and (body.get("systemInstruction") or body.get("system_instruction")):
            raise Invalid(400, f"Developer instruction is not enabled for models/{model}")
        signs = model.startswith("gemini-3")
        if signs:
            self._check_signatures(body)
            self._check_response_ids(body)
        last = (body.get("contents") or [{}])[-1]
        if (
            NO_PREFILL.search(model)
            and last.get("role") == "model"
            and not any("functionResponse" in p for p in last.get("parts") or [])
        ):
            raise Invalid(400, "Requests ending with a model turn are not supported.")
        check_schemas(body)
        check_images(body)
        config = body.get("generationConfig") or {}
        if not model.startswith("gemini-2.0") and (
            config.get("presencePenalty") or config.get("frequencyPenalty")
        ):
            raise Invalid(400, f"Penalty is not enabled for models/{model}")
        reply = plan_reply(self._turn(body))
        big = huge_text(request)
        if big is not None:
            reply = Reply(text=big)
        thinking = config.get("thinkingConfig") or {}
        check_thinking(model, thinking)
        budget = thinking.get("thinkingBudget") or 0
        thoughts = min(budget, THOUGHT_TOKENS) if budget > 0 else 0
        level = thinking.get("thinkingLevel") or ("high" if model.startswith("gemini-3") else None)
        if budget == -1 or level == "high":  # dynamic, or the most a level gives (Gemini 3's default)
            thoughts = THOUGHT_TOKENS
        elif level in ("minimal", "low", "medium"):
            thoughts = THOUGHT_TOKENS // 4
        n = config.get("candidateCount") or 1
        prompt = len(self._content_tokens(body)) + cached_tokens
        blocked = self._block_reason()
        if blocked is not None:
            return await self._blocked(request, model, method, blocked, prompt, cached_tokens)
        finish, empty = self._finish_reason()
        if empty:
            reply = Reply()
        finish = finish or _FINISH[reply.finish]
        usage, raw = self.take_usage(
            ReportedUsage(
                input_tokens=prompt - cached_tokens,
                cached_input_tokens=cached_tokens,
                output_tokens=n * reply.output_tokens + thoughts,
                reasoning_tokens=thoughts,
            )
        )

        def metadata(candidates_tokens: int, thoughts_tokens: int) -> dict[str, Any]:
            prompt_count = usage.prompt_tokens
            # A raw toolUsePromptTokenCount (grounding, code execution) counts in the total, as Gemini's
            # does: beside promptTokenCount, not in it.
            tool_use = int((raw or {}).get("toolUsePromptTokenCount", 0))
            meta: dict[str, Any] = {
                "promptTokenCount": prompt_count,
                "candidatesTokenCount": candidates_tokens,
                "totalTokenCount": prompt_count + candidates_tokens + thoughts_tokens + tool_use,
            }
            if usage.cached_input_tokens:
                meta["cachedContentTokenCount"] = usage.cached_input_tokens
            meta["promptTokensDetails"] = [{"modality": "TEXT", "tokenCount": prompt_count}]
            if usage.cached_input_tokens:
                meta["cacheTokensDetails"] = [{"modality": "TEXT", "tokenCount": usage.cached_input_tokens}]
            if thoughts_tokens:
                meta["thoughtsTokenCount"] = thoughts_tokens
            if raw:
                deep_merge(meta, raw)
            return meta

        response_id = secrets.token_urlsafe(16)
        thought_part = (
            {"text": f"Thinking about: {reply.text or reply.tool_name}", "thought": True}
            if thoughts and thinking.get("includeThoughts")
            else None
        )

        def response(
            pieces: list[tuple[int, list[dict[str, Any]], str | None]],
            candidates_tokens: int,
            thoughts_tokens: int,
        ) -> dict[str, Any]:
            """A response of these candidates: (index, parts, finishReason or None) each."""
            candidates = []
            for i, parts, ended in pieces:
                # proto3 JSON leaves out an empty list: a candidate stopped before any part has none
                content: dict[str, Any] = {"parts": parts, "role": "model"} if parts else {"role": "model"}
                candidate: dict[str, Any] = {"content": content}
                if ended:
                    candidate["finishReason"] = ended
                if config.get("responseLogprobs"):
                    text = "".join(p["text"] for p in parts if "text" in p and not p.get("thought"))
                    candidate |= _logprobs(chunk_words(text) if text else [], config.get("logprobs") or 0)
                candidate["index"] = i
                candidates.append(candidate)
            return {
                "candidates": candidates,
                "usageMetadata": metadata(candidates_tokens, thoughts_tokens),
                "modelVersion": model,
                "responseId": response_id,
            }

        final_parts: list[dict[str, Any]] = [thought_part] if thought_part else []
        if reply.tool_name:
            for k in range(self.calls_per_reply):  # parallel calls: only the first signed
                function_call: dict[str, Any] = {"name": reply.tool_name, "args": reply.tool_args or {}}
                call: dict[str, Any] = {"functionCall": function_call}
                if signs:
                    function_call["id"] = secrets.token_hex(4)  # Gemini 3 names each call
                    self.call_ids.append(function_call["id"])
                    if k == 0:
                        call["thoughtSignature"] = self._sign()
                final_parts.append(call)
        elif not empty:
            final_parts.append({"text": reply.text})
        candidates_total = usage.output_tokens - usage.reasoning_tokens
        if method == "generateContent":
            whole = [(i, final_parts, finish) for i in range(n)]
            return self.json_response(request, response(whole, candidates_total, usage.reasoning_tokens))

        # streaming: thoughts first, then one word per chunk (or the whole function call), with the
        # candidate's tokens so far
        chunks: list[tuple[list[dict[str, Any]], int]] = []
        if thought_part:
            chunks.append(([thought_part], 0))
        if reply.tool_name:
            chunks.append(([part for part in final_parts if "functionCall" in part], reply.output_tokens))
        elif empty:
            chunks.append(([], 0))
        else:
            pieces = chunk_words(reply.text, 4096 if big is not None else 1) or [""]
            so_far = 0
            for piece in pieces:
                so_far += count_tokens(piece)
                chunks.append(([{"text": piece}], so_far))
        # Several candidates stream interleaved, each finishing at its own time: candidate c is c
        # events behind the first, so event i carries chunk i - c of each one still going.
        events = len(chunks) + n - 1
        sse_mode = request.query.get("alt") == "sse"
        content_type = "text/event-stream" if sse_mode else "application/json; charset=UTF-8"
        async with self.open_stream(request, content_type) as stream:
            for i in range(events):
                last = i == events - 1
                steps = {c: i - c for c in range(n) if i >= c}  # each started candidate's chunk now
                going = [
                    (c, chunks[k][0], finish if k == len(chunks) - 1 else None)
                    for c, k in steps.items()
                    if k < len(chunks)
                ]
                counted = sum(chunks[min(k, len(chunks) - 1)][1] for k in steps.values())
                tokens = candidates_total if last else min(counted, candidates_total)
                payload = response(going, tokens, usage.reasoning_tokens)
                if sse_mode:
                    await stream.send(sse(payload, sep=b"\r\n\r\n"))
                else:
                    text = json.dumps(payload, indent=2)
                    await stream.send(f"[{text}".encode() if i == 0 else f",\r\n{text}".encode())
            if not sse_mode:
                await stream.send(b"]")
        return stream.response

    async def _blocked(
        self, request: web.Request, model: str, method: str, reason: str, prompt: int, cached: int
    ) -> web.StreamResponse:
        """A blocked prompt's answer: its feedback and the prompt's usage, no candidates."""
        usage, raw = self.take_usage(ReportedUsage(input_tokens=prompt - cached, cached_input_tokens=cached))
        meta: dict[str, Any] = {
            "promptTokenCount": usage.prompt_tokens,
            "totalTokenCount": usage.prompt_tokens,
        }
        if usage.cached_input_tokens:
            meta["cachedContentTokenCount"] = usage.cached_input_tokens
        meta["promptTokensDetails"] = [{"modality": "TEXT", "tokenCount": usage.prompt_tokens}]
        if raw:
            deep_merge(meta, raw)
        payload = {
            "promptFeedback": {"blockReason": reason},
            "usageMetadata": meta,
            "modelVersion": model,
            "responseId": secrets.token_urlsafe(16),
        }
        if method == "generateContent":
            return self.json_response(request, payload)
        async with self.open_stream(request) as stream:
            await stream.send(sse(payload, sep=b"\r\n\r\n"))
        return stream.response

    async def _count_tokens(
        self, request: web.Request, model: str, method: str, body: dict[str, Any]
    ) -> web.StreamResponse:
        inner = body.get("generateContentRequest") or body
        total = len(self._content_tokens(inner))
        return self.json_response(
            request,
            {"totalTokens": total, "promptTokensDetails": [{"modality": "TEXT", "tokenCount": total}]},
        )

    async def _embed(
        self, request: web.Request, model: str, method: str, body: dict[str, Any]
    ) -> web.StreamResponse:
        items = body.get("requests") if method == "batchEmbedContents" else [body]
        if not items:
            raise Invalid(400, "* BatchEmbedContentsRequest.requests: requests is not specified\n")
        vectors = []
        tokens = 0
        for item in items:
            parts = (item.get("content") or {}).get("parts") or []
            text = " ".join(p.get("text", "") for p in parts)
            if not text:
                raise Invalid(400, "* EmbedContentRequest.content: contents is not specified\n")
            tokens += count_tokens(text)
            dims = item.get("outputDimensionality") or EMBEDDING_DIMS.get(model, 768)
            vectors.append({"values": embedding(text, dims)})
        self.take_usage(ReportedUsage(input_tokens=tokens))
        if method == "embedContent":
            return self.json_response(request, {"embedding": vectors[0]})
        return self.json_response(request, {"embeddings": vectors})

    async def _list_models(self, request: web.Request) -> web.StreamResponse:
        return self.json_response(request, {"models": [_model_object(m) for m in sorted(self.models)]})

    async def _get_model(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        if model not in self.models:
            return self.error_response(404, f"models/{model} is not found for API version v1beta.")
        return self.json_response(request, _model_object(model))

    async def _create_cache(self, request: web.Request) -> web.StreamResponse:
        try:
            body = self._body(request)
            model = str(body.get("model", "")).removeprefix("models/")
            self._check_model(model, "createCachedContent")
        except Invalid as exc:
            return self.error_response(exc.status, exc.message)
        tokens = len(self._content_tokens(body))
        if tokens < self.min_cache_tokens:
            return self.error_response(
                400,
                f"Cached content is too small. total_token_count={tokens}, min_total_token_count={self.min_cache_tokens}",
            )
        ttl = float(str(body.get("ttl", "3600s")).rstrip("s"))
        ident = secrets.token_hex(8)
        now = datetime.now(UTC)
        self.cached_contents[ident] = {
            "name": f"cachedContents/{ident}",
            "model": f"models/{model}",
            "displayName": body.get("displayName", ""),
            "tokens": tokens,
            "expires": time.time() + ttl,
            "createTime": now.isoformat().replace("+00:00", "Z"),
            "expireTime": (now + timedelta(seconds=ttl)).isoformat().replace("+00:00", "Z"),
        }
        return self.json_response(request, _cache_object(self.cached_contents[ident]))

    async def _list_caches(self, request: web.Request) -> web.StreamResponse:
        return self.json_response(
            request, {"cachedContents": [_cache_object(c) for c in self.cached_contents.values()]}
        )

    async def _get_cache(self, request: web.Request) -> web.StreamResponse:
        cache = self.cached_contents.get(request.match_info["id"])
        if cache is None:
            return self.error_response(403, "CachedContent not found (or permission denied)")
        return self.json_response(request, _cache_object(cache))

    async def _delete_cache(self, request: web.Request) -> web.StreamResponse:
        if self.cached_contents.pop(request.match_info["id"], None) is None:
            return self.error_response(403, "CachedContent not found (or permission denied)")
        return self.json_response(request, {})


def _logprobs(tokens: list[str], top: int) -> dict[str, Any]:
    """A candidate's `logprobsResult` (and `avgLogprobs`) for these tokens: the first token certain
    (log-probability 0, so left out as proto3 JSON leaves out zeros), the others a fixed -0.25, and
    `top` alternatives a step, the chosen token first."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        item: dict[str, Any] = {"token": token, "tokenId": sum(token.encode()) % 256_000}
        if logprob:
            item["logProbability"] = logprob
        return item

    chosen = [0.0 if i == 0 else -0.25 for i in range(len(tokens))]
    result: dict[str, Any] = {
        "chosenCandidates": [entry(t, p) for t, p in zip(tokens, chosen, strict=True)],
        "logProbabilitySum": sum(chosen),
    }
    if top:
        result["topCandidates"] = [
            {"candidates": [entry(t, p), *(entry(f"{t}{k}", p - 4.0 - k) for k in range(1, top))]}
            for t, p in zip(tokens, chosen, strict=True)
        ]
    return {"logprobsResult": result, "avgLogprobs": sum(chosen) / len(chosen) if chosen else 0.0}


def _lower_types(schema: Any) -> Any:
    """Gemini's OpenAPI-style schemas spell types in capitals ("OBJECT"); JSON Schema in lower case."""
    if isinstance(schema, dict):
        return {
            k: (v.lower() if k == "type" and isinstance(v, str) else _lower_types(v))
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_lower_types(v) for v in schema]
    return schema


def _max_output(model: str) -> int:
    """The model's output limit: 1 for an embedding model, which writes none; a model a test adds to
    the fake's list writes what 2.5 and 3 do."""
    return 1 if "embedding" in model else MAX_OUTPUT_TOKENS.get(model, 65536)


def _model_object(model: str) -> dict[str, Any]:
    embed = "embedding" in model
    return {
        "name": f"models/{model}",
        "version": "001",
        "displayName": model.replace("-", " ").title(),
        "inputTokenLimit": 2048 if embed else 1048576,
        "outputTokenLimit": _max_output(model),
        "supportedGenerationMethods": ["embedContent", "batchEmbedContents"]
        if embed
        else ["generateContent", "countTokens", "createCachedContent", "batchGenerateContent"],
    }


def _cache_object(cache: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": cache["name"],
        "model": cache["model"],
        "displayName": cache["displayName"],
        "createTime": cache["createTime"],
        "updateTime": cache["createTime"],
        "expireTime": cache["expireTime"],
        "usageMetadata": {"totalTokenCount": cache["tokens"]},
    }
