"""Fake OpenAI API (and OpenAI-compatible servers such as DeepSeek) on 127.0.0.1.

Endpoints under ``/v1``: ``POST chat/completions``, ``POST responses`` (`tests.fakes.openai_responses`,
which also serves the models OpenAI serves there alone), ``POST completions``, ``POST embeddings``,
``GET models``, ``GET models/{id}``; the same three POSTs in Azure OpenAI's form
(``/openai/deployments/{deployment}/...?api-version=...``, the deployment being the model). Auth: ``Authorization: Bearer <api_key>`` (Azure's ``api-key``
header also works); a missing or wrong key gets OpenAI's 401 body. Unknown models get 404
``model_not_found``; add models with ``fake.models.add(name)``. ``/v1/completions`` and
``/v1/embeddings`` accept every known model, as an OpenAI-compatible server (vLLM, Ollama) does.

Wire format as OpenAI sends it: ``chat.completion`` objects with ``choices[].message`` (content,
refusal, annotations, tool_calls), ``chat.completion.chunk`` SSE frames (``data: {...}\\n\\n``, one word
per chunk, tool-call arguments in pieces, a search model's annotations in a delta of their own after
the text, ``data: [DONE]``), ``stream_options.include_usage`` (every
chunk carries ``"usage": null`` and a last chunk with empty ``choices`` carries the usage),
``x-request-id`` and rate-limit headers, errors as ``{"error": {"message", "type", "param", "code"}}``.

``logprobs``/``top_logprobs`` give every reply token a fixed log-probability (-0.01) and the asked
number of alternatives, in whole replies and per chunk.

Usage: ``prompt_tokens`` counts every prompt token (see `behaviour` for the tokenizer),
``prompt_tokens_details.cached_tokens`` the part read from the automatic prompt cache (prompts of at
least 1024 tokens; the longest prefix seen before, in 128-token steps), and
``completion_tokens_details.reasoning_tokens`` hidden reasoning for o-series/gpt-5 models or when
``reasoning_effort`` is set (minimal 0, low 64, medium 192, high 512), counted inside
``completion_tokens``.

Reasoning models (ids starting ``o1``, ``o3``, ``o4``, ``gpt-5``) refuse on chat what OpenAI's refuse:
``max_tokens`` (400 ``unsupported_parameter``: they take ``max_completion_tokens``), and ``temperature``
or ``top_p`` other than 1 (``unsupported_value``), ``presence_penalty``/``frequency_penalty`` other than 0,
``logprobs``, ``top_logprobs`` and ``logit_bias`` (``unsupported_parameter``), except that gpt-5.1 on
take the sampling parameters when they do not reason (``reasoning_effort`` unset or ``none``, their
default).

Rejects with OpenAI's 400 what OpenAI rejects, so gateway translation bugs surface: ``max_tokens``
above the model's limit (`MAX_OUTPUT_TOKENS`), ``stream_options`` without ``stream``, ``temperature``
outside 0..2, ``n`` outside 1..128, empty ``messages``, a message whose ``content`` is an empty
array, unknown roles, an ``image_url`` part in a
message whose role is not ``user`` (a tool result's screenshot), a ``tool`` message with no matching
``tool_calls`` before it, a tool, tool call or named ``tool_choice`` without ``type``, a tool
call id over 40 characters, a ``user`` over 64, chat ``metadata`` without ``store: true`` ("The
'metadata' parameter is only allowed when 'store' is enabled."), a body that is not JSON.

``FakeOpenAI(flavour="deepseek")`` speaks DeepSeek's dialect instead: models ``deepseek-chat`` and
``deepseek-reasoner``, usage ``prompt_cache_hit_tokens``/``prompt_cache_miss_tokens`` (64-token cache
units, no ``prompt_tokens_details``), an output limit outside 1 to the model's refused as DeepSeek
refuses it ("Invalid max_tokens value, the valid range of max_tokens is [1, 8192]", no ``param``), and
``reasoning_content`` from ``deepseek-reasoner``, which, as DeepSeek's thinking mode does, refuses a
history whose assistant tool calls come without their ``reasoning_content``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
import secrets
import struct
import time
from typing import Any, ClassVar

from aiohttp import web

from tests.fakes import openai_responses
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
from tests.fakes.caches import AutomaticPrefixCache
from tests.fakes.openai_responses import ONLY_ON_RESPONSES, RESPONSES_ONLY
from tests.fakes.server import BODY, INVALID_JSON, FakeServer, current_request, sse
from tests.fakes.util import deep_merge, huge_text

IMAGE_TOKENS = 85
REASONING_TOKENS = {"minimal": 0, "low": 64, "medium": 192, "high": 512}
EMBEDDING_DIMS = {"text-embedding-3-large": 3072}
_REASONING_PREFIXES = ("o1", "o3", "o4", "gpt-5")

_STATUS_ERRORS: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", None, "Bad request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: (
        "invalid_request_error",
        "unsupported_country_region_territory",
        "Country, region, or territory not supported",
    ),
    404: ("invalid_request_error", None, "Not found."),
    409: ("invalid_request_error", None, "Conflict."),
    413: ("invalid_request_error", None, "Request too large."),
    422: ("invalid_request_error", None, "Unprocessable entity."),
    429: (
        "requests",
        "rate_limit_exceeded",
        "Rate limit reached for requests per min (RPM): Limit 3, Used 3, Requested 1. Please try again in 20s.",
    ),
    500: ("server_error", None, "The server had an error while processing your request. Sorry about that!"),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
    504: ("server_error", None, "Request timed out."),
}

# Errors OpenAI tells apart by `code` rather than status: (type, message).
_CODE_ERRORS: dict[str, tuple[str, str]] = {
    # A 429 that is not a rate limit: the account is out of credit, and waiting will not help.
    "insufficient_quota": (
        "insufficient_quota",
        "You exceeded your current quota, please check your plan and billing details. For more "
        "information on this error, read the docs: https://platform.openai.com/docs/guides/error-codes/api-errors.",
    ),
}


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class FakeOpenAI(FakeServer):
    vendor: ClassVar[str] = "openai"
    default_models: ClassVar[tuple[str, ...]] = (
        "gpt-4o",
        "gpt-4o-mini",
        "gpt-4.1",
        "gpt-4.1-mini",
        "gpt-4.1-nano",
        "gpt-5",
        "gpt-5-mini",
        "gpt-4o-search-preview",
        "gpt-4o-mini-search-preview",
        "o3-mini",
        "o4-mini",
        *RESPONSES_ONLY,
        "gpt-3.5-turbo-instruct",
        "text-embedding-3-small",
        "text-embedding-3-large",
        "text-embedding-ada-002",
    )

    def __init__(self, api_key: str | None = None, *, flavour: str = "openai", **kwargs: Any) -> None:
        if flavour not in ("openai", "deepseek"):
            raise ValueError(f"unknown flavour {flavour!r}")
        self.flavour = flavour
        if flavour == "deepseek":
            kwargs.setdefault("models", ("deepseek-chat", "deepseek-reasoner"))
        super().__init__(api_key, **kwargs)
        self.cache = (
            AutomaticPrefixCache(minimum=64, increment=64)
            if flavour == "deepseek"
            else AutomaticPrefixCache()
        )
        self.refusal: str | None = None
        self.max_model_len: dict[str, int] = {}  # `serve_windows`

    def serve_windows(self, windows: dict[str, int]) -> None:
        """Its `/v1/models` says each model's context window, `max_model_len`, to a caller with the
        key, as vLLM started with `--api-key` does (OpenAI's own list says no window), until
        `reset()`."""
        self.max_model_len = dict(windows)

    def refuse_with(self, refusal: str) -> None:
        """Chats are refused with `refusal`, as OpenAI refuses one under structured outputs (the
        message's `refusal` instead of its content, finish `stop`), until `reset()`."""
        self.refusal = refusal

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    def azure_base_url(self, deployment: str) -> str:
        """Base URL of an Azure OpenAI deployment (send ``api-version`` as a query parameter)."""
        return f"{self.origin}/openai/deployments/{deployment}"

    def reset_state(self) -> None:
        self.cache.clear()
        self.refusal = None
        self.max_model_len = {}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self._chat),
            web.post("/v1/responses", self._responses),
            web.post("/v1/completions", self._completions),
            web.post("/v1/embeddings", self._embeddings),
            web.get("/v1/models", self._list_models),
            web.get("/v1/models/{model}", self._get_model),
            # Azure OpenAI: the deployment names the model; `api-version` is required
            web.post("/openai/deployments/{deployment}/chat/completions", self._chat),
            web.post("/openai/deployments/{deployment}/completions", self._completions),
            web.post("/openai/deployments/{deployment}/embeddings", self._embeddings),
        ]

    # ---- vendor shapes ---------------------------------------------------------------------------

    def response_headers(self) -> dict[str, str]:
        return {
            "x-request-id": f"req_{secrets.token_hex(16)}",
            "openai-processing-ms": "7",
            "openai-version": "2020-10-01",
            "x-ratelimit-limit-requests": "10000",
            "x-ratelimit-remaining-requests": "9999",
            "x-ratelimit-reset-requests": "6ms",
            "x-ratelimit-limit-tokens": "30000000",
            "x-ratelimit-remaining-tokens": "29999000",
            "x-ratelimit-reset-tokens": "2ms",
        }

    def error_response(self, status: int, message: str | None = None, **extra: Any) -> web.Response:
        kind, code, default = _STATUS_ERRORS.get(
            status, ("server_error" if status >= 500 else "invalid_request_error", None, "Error.")
        )
        if extra.get("code") in _CODE_ERRORS:  # an error named by its code: its own type and message
            kind, default = _CODE_ERRORS[extra["code"]]
        error = {
            "message": message or default,
            "type": extra.get("type", kind),
            "param": extra.get("param"),
            "code": extra.get("code", code),
        }
        return web.json_response({"error": error}, status=status, headers=self.response_headers())

    def stream_error_frame(self, status: int, message: str | None) -> bytes:
        if current_request().path.endswith("/responses"):
            return openai_responses.stream_error_event(message)
        kind, code, default = _STATUS_ERRORS.get(status, ("server_error", None, "Error."))
        return sse({"error": {"message": message or default, "type": kind, "param": None, "code": code}})

    def auth_error(self, request: web.Request) -> web.StreamResponse | None:
        header = request.headers.get("authorization", "")
        key = header[7:] if header.lower().startswith("bearer ") else request.headers.get("api-key", "")
        if not key:
            return self.error_response(
                401,
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY). You can obtain an API key from "
                "https://platform.openai.com/account/api-keys.",
                code=None,
            )
        if key != self.api_key:
            masked = f"{key[:3]}{'*' * max(0, len(key) - 7)}{key[-4:]}" if len(key) > 7 else "****"
            return self.error_response(
                401,
                f"Incorrect API key provided: {masked}. You can find your API key at "
                "https://platform.openai.com/account/api-keys.",
                code="invalid_api_key",
            )
        return None

    # ---- request parsing -------------------------------------------------------------------------

    def _body(self, request: web.Request) -> dict[str, Any]:
        body = request[BODY]
        if body is INVALID_JSON or not isinstance(body, dict):
            raise BadRequest(
                400,
                "We could not parse the JSON body of your request. (HINT: This likely means you aren't using "
                "your HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent was not "
                "valid JSON.)",
            )
        deployment = request.match_info.get("deployment")
        if deployment is not None:
            if "api-version" not in request.query:
                raise BadRequest(404, "Resource not found")
            body["model"] = body.get("model") or deployment
        model = body.get("model")
        if not model:
            raise BadRequest(400, "you must provide a model parameter")
        if model not in self.models:
            raise BadRequest(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                code="model_not_found",
            )
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            limit = _max_output(model)
            in_range = isinstance(value, int) and 1 <= value <= (limit or value)
            if self.flavour == "deepseek" and value is not None and not in_range:
                # DeepSeek's words, for a limit below 1 and above the model's alike, with no param.
                raise BadRequest(
                    400,
                    f"Invalid {name} value, the valid range of {name} is [1, {limit}]",
                    code="invalid_request_error",
                )
            if value is not None and (not isinstance(value, int) or value < 1):
                raise BadRequest(
                    400,
                    f"Invalid '{name}': integer below minimum value. Expected a value >= 1, but got {value} instead.",
                    param=name,
                    code="integer_below_min_value",
                )
            if value is not None and limit is not None and value > limit:
                raise BadRequest(
                    400,
                    f"{name} is too large: {value}. This model supports at most {limit} completion tokens, "
                    f"whereas you provided {value}.",
                    param=name,
                    code="invalid_value",
                )
        if body.get("stream_options") is not None and not body.get("stream"):
            raise BadRequest(
                400,
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
                code="invalid_value",
            )
        temperature = body.get("temperature")
        if temperature is not None and not (isinstance(temperature, int | float) and 0 <= temperature <= 2):
            raise BadRequest(
                400,
                f"Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got {temperature} instead.",
                param="temperature",
                code="decimal_above_max_value",
            )
        user = body.get("user")
        if isinstance(user, str) and len(user) > MAX_USER:
            raise BadRequest(
                400,
                f"Invalid 'user': string too long. Expected a string with maximum length {MAX_USER}, "
                f"but got a string with length {len(user)} instead.",
                param="user",
                code="string_above_max_length",
            )
        n = body.get("n", 1)
        if not isinstance(n, int) or not 1 <= n <= 128:
            raise BadRequest(400, f"Invalid 'n': expected an integer between 1 and 128, got {n}.", param="n")
        return body

    @staticmethod
    def _stop(body: dict[str, Any]) -> list[str]:
        stop = body.get("stop")
        return [stop] if isinstance(stop, str) else list(stop or [])

    def _chat_turn(self, body: dict[str, Any]) -> tuple[Turn, list[str]]:
        messages = body.get("messages")
        if messages is None:
            raise BadRequest(
                400, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"
            )
        if not isinstance(messages, list) or not messages:
            raise BadRequest(
                400,
                "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
                "messages",
                "empty_array",
            )
        # OpenAI requires `type` on every tool, assistant tool call and named tool_choice.
        for i, tool in enumerate(body.get("tools") or []):
            if not isinstance(tool, dict) or "type" not in tool:
                raise BadRequest(
                    400,
                    f"Missing required parameter: 'tools[{i}].type'.",
                    f"tools[{i}].type",
                    "missing_required_parameter",
                )
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and "type" not in choice:
            raise BadRequest(
                400,
                "Missing required parameter: 'tool_choice.type'.",
                "tool_choice.type",
                "missing_required_parameter",
            )
        tools = [
            Tool(t["function"]["name"], t["function"].get("parameters") or {})
            for t in body.get("tools") or []
            if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]
        ]
        tokens: list[str] = words(json.dumps(body["tools"])) if body.get("tools") else []
        call_names: dict[str, str] = {}
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in (
                "system",
                "developer",
                "user",
                "assistant",
                "tool",
                "function",
            ):
                raise BadRequest(
                    400, f"Invalid value for 'messages[{i}].role'.", f"messages.[{i}].role", "invalid_value"
                )
            if message.get("content") == []:
                raise BadRequest(
                    400,
                    f"Invalid 'messages[{i}].content': empty array. Expected an array with minimum length 1, "
                    "but got an empty array instead.",
                    f"messages.[{i}].content",
                    "empty_array",
                )
            if message["role"] != "user" and _content_text(message.get("content"))[1]:
                raise BadRequest(
                    400,
                    f"Invalid 'messages[{i}]'. Image URLs are only allowed for messages with role 'user', "
                    f"but this message with role '{message['role']}' contains an image URL.",
                    f"messages.[{i}].content",
                    "invalid_value",
                )
            if message["role"] == "tool" and message.get("tool_call_id") not in call_names:
                raise BadRequest(
                    400,
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.",
                    f"messages.[{i}].role",
                )
            for j, call in enumerate(message.get("tool_calls") or []):
                if "type" not in call:
                    where = f"messages[{i}].tool_calls[{j}].type"
                    raise BadRequest(
                        400, f"Missing required parameter: '{where}'.", where, "missing_required_parameter"
                    )
                if len(call.get("id", "")) > MAX_CALL_ID:
                    where = f"messages[{i}].tool_calls[{j}].id"
                    raise BadRequest(
                        400,
                        f"Invalid '{where}': string too long. Expected a string with maximum length "
                        f"{MAX_CALL_ID}, but got a string with length {len(call['id'])} instead.",
                        where,
                        "string_above_max_length",
                    )
                call_names[call.get("id", "")] = call.get("function", {}).get("name", "")
            if (
                self.flavour == "deepseek"
                and body.get("model") == "deepseek-reasoner"
                and message.get("tool_calls")
                and "reasoning_content" not in message
            ):
                raise BadRequest(
                    400, "The reasoning_content in the thinking mode must be passed back to the API.", None
                )
                tokens += words(call.get("function", {}).get("name", ""))
                tokens += words(call.get("function", {}).get("arguments", ""))
            text, images = _content_text(message.get("content"))
            tokens += words(text)
            for digest in images:
                tokens += [f"<image:{digest}>"] * IMAGE_TOKENS

        last = messages[-1]
        # vLLM's flag: the final assistant message is continued, not closed (OpenAI itself has none).
        continuing = bool(body.get("continue_final_message"))
        instructed = False  # asked for the rest of its answer in a user turn
        if continuing and body.get("add_generation_prompt", True):
            raise BadRequest(
                400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", None
            )
        if (
            len(messages) > 1
            and last.get("role") == "user"
            and messages[-2].get("role") == "assistant"
            and asks_to_continue(_content_text(last.get("content"))[0])
        ):
            messages, last, continuing, instructed = messages[:-1], messages[-2], True, True
        turn = Turn(
            tools=tools,
            stop=self._stop(body),
            max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
        )
        if last.get("role") == "tool":
            turn.tool_result = (
                call_names.get(last.get("tool_call_id", ""), ""),
                _content_text(last.get("content"))[0],
            )
        elif last.get("role") in ("user", "system", "developer"):
            text, images = _content_text(last.get("content"))
            turn.last_user_text, turn.images = text, len(images)
        elif last.get("role") == "assistant" and not last.get("tool_calls"):
            # A trailing assistant message is a closed turn to OpenAI: the reply starts afresh.
            turn.prefill = _content_text(last.get("content"))[0] if continuing else None
            turn.rejoin = self.rejoin if instructed else None
            asked = next((m for m in reversed(messages) if m.get("role") == "user"), {})
            text, images = _content_text(asked.get("content"))
            turn.last_user_text, turn.images = text, len(images)
        if choice == "none":
            turn.tools_disabled = True
        elif choice == "required":
            turn.forced_tool = "required"
        elif isinstance(choice, dict):
            turn.forced_tool = (choice.get("function") or {}).get("name")
        fmt = body.get("response_format") or {}
        if fmt.get("type") == "json_object":
            turn.json_mode = True
        elif fmt.get("type") == "json_schema":
            turn.json_mode = True
            turn.json_schema = (fmt.get("json_schema") or {}).get("schema") or {"type": "object"}
            tokens += words(json.dumps(turn.json_schema))
        return turn, tokens

    def _reasoning_tokens(self, body: dict[str, Any], reply: Reply) -> int:
        model = body["model"]
        if self.flavour == "deepseek":
            return count_tokens(_deepseek_reasoning(reply)) if model == "deepseek-reasoner" else 0
        effort = body.get("reasoning_effort")
        if effort is None and not model.startswith(_REASONING_PREFIXES):
            return 0
        return REASONING_TOKENS.get(effort or "medium", REASONING_TOKENS["medium"])

    def _usage(self, computed: ReportedUsage, completion_details: bool = True) -> dict[str, Any]:
        usage, raw = self.take_usage(computed)
        prompt = usage.prompt_tokens
        rendered: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": usage.output_tokens,
            "total_tokens": prompt + usage.output_tokens,
        }
        if self.flavour == "deepseek":
            rendered["prompt_cache_hit_tokens"] = usage.cached_input_tokens
            rendered["prompt_cache_miss_tokens"] = prompt - usage.cached_input_tokens
            if usage.reasoning_tokens:
                rendered["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
        elif completion_details:
            rendered["prompt_tokens_details"] = {
                "cached_tokens": usage.cached_input_tokens,
                "audio_tokens": 0,
            }
            rendered["completion_tokens_details"] = {
                "reasoning_tokens": usage.reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            }
        if raw:
            deep_merge(rendered, raw)
        return rendered

    # ---- handlers --------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = self._body(request)
            if body["model"] in RESPONSES_ONLY:
                raise BadRequest(404, ONLY_ON_RESPONSES)
            if self.flavour == "openai":
                _refuse_unsupported_by_reasoning(body)
                if body.get("metadata") is not None and body.get("store") is not True:
                    raise BadRequest(
                        400, "The 'metadata' parameter is only allowed when 'store' is enabled.", "metadata"
                    )
            turn, prompt = self._chat_turn(body)
        except BadRequest as exc:
            return self.error_response(exc.status, exc.message, param=exc.param, code=exc.code)
        reply = self.reply_to(body.get("model"), turn)
        if self.flavour == "openai" and reply.tool_name and isinstance(body.get("tool_choice"), dict):
            # OpenAI ends a call to the tool that tool_choice names with finish `stop`, not
            # `tool_calls` (only `auto` and `required` say `tool_calls`), streamed or not.
            reply = dataclasses.replace(reply, finish="stop")
        big = huge_text(request)
        if big is not None:
            reply = Reply(text=big)
        n = body.get("n", 1)
        reasoning = self._reasoning_tokens(body, reply)
        cached = self.cache.lookup_and_store(prompt)
        usage = self._usage(
            ReportedUsage(
                input_tokens=len(prompt) - cached,
                cached_input_tokens=cached,
                output_tokens=n * (reply.output_tokens + reasoning),
                reasoning_tokens=n * reasoning,
            )
        )
        common: dict[str, Any] = {"id": f"chatcmpl-{secrets.token_urlsafe(21)}", "created": int(time.time())}
        common |= {"model": body["model"], "system_fingerprint": "fp_fake0001"}
        if self.flavour == "openai":
            common["service_tier"] = self._served_tier(body)
        call_ids = [f"call_{secrets.token_urlsafe(18)}" for _ in range(n)]
        top = body.get("top_logprobs") or 0
        want_logprobs = bool(body.get("logprobs")) and not reply.tool_name
        if not body.get("stream"):
            logprobs = _logprobs(chunk_words(reply.text), top) if want_logprobs else None
            choices = [
                {
                    "index": i,
                    "message": self._message(body["model"], reply, call_ids[i]),
                    "logprobs": logprobs,
                    "finish_reason": _FINISH[reply.finish],
                }
                for i in range(n)
            ]
            payload = {**common, "object": "chat.completion", "choices": choices, "usage": usage}
            return self.json_response(request, _ordered(payload))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        per_chunk = 4096 if big is not None else 1
        async with self.open_stream(request) as stream:
            for delta, finish in self._deltas(body["model"], reply, per_chunk):
                choices = []
                for index in range(n):
                    if "id" in delta.get("tool_calls", [{}])[0]:  # the tool call's head: each choice's own id
                        delta = {"tool_calls": [{**delta["tool_calls"][0], "id": call_ids[index]}]}
                    content = delta.get("content")
                    logprobs = _logprobs([content], top) if want_logprobs and content else None
                    choices.append(
                        {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                    )
                payload = {**common, "object": "chat.completion.chunk", "choices": choices}
                if include_usage:
                    payload["usage"] = None
                await stream.send(sse(_ordered(payload)))
            if include_usage:
                payload = {**common, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                await stream.send(sse(_ordered(payload)))
            await stream.send(b"data: [DONE]\n\n")
        return stream.response

    def _served_tier(self, body: dict[str, Any]) -> str:
        """The tier OpenAI reports serving a request at: the `flex` or `priority` it asks for, else
        `default` (or the project's capacity tier for `auto`), in every response and chunk."""
        asked = body.get("service_tier")
        if asked in ("flex", "priority", "default"):
            return str(asked)
        return self.capacity_tier or "default"

    def _message(self, model: str, reply: Reply, call_id: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": None if reply.tool_name else reply.text}
        if self.flavour == "openai":
            message |= {"refusal": None, "annotations": _url_citations(model, message["content"] or "")}
        if self.refusal is not None:
            return message | {"content": None, "refusal": self.refusal}
        elif model == "deepseek-reasoner":
            message["reasoning_content"] = _deepseek_reasoning(reply)
        if reply.tool_name:
            function = {"name": reply.tool_name, "arguments": reply.arguments_json}
            message["tool_calls"] = [{"id": call_id, "type": "function", "function": function}]
        return message

    def _deltas(self, model: str, reply: Reply, per_chunk: int) -> list[tuple[dict[str, Any], str | None]]:
        """(delta, finish_reason) per chunk: role, [reasoning], [tool call head], text or arguments, finish."""
        first: dict[str, Any] = {"role": "assistant", "content": None if reply.tool_name else ""}
        if self.flavour == "openai":
            first["refusal"] = None
        deltas: list[tuple[dict[str, Any], str | None]] = [(first, None)]
        if self.refusal is not None:
            deltas += [({"refusal": p}, None) for p in chunk_words(self.refusal, per_chunk)]
            return [*deltas, ({}, "stop")]
        if reply.tool_name:
            function = {"name": reply.tool_name, "arguments": ""}
            deltas.append(
                ({"tool_calls": [{"index": 0, "id": "", "type": "function", "function": function}]}, None)
            )
            for piece in chunk_words(reply.arguments_json, per_chunk):
                deltas.append(({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}, None))
        else:
            if self.flavour == "deepseek" and model == "deepseek-reasoner":
                deltas += [
                    ({"reasoning_content": p}, None) for p in chunk_words(_deepseek_reasoning(reply), 1)
                ]
            deltas += [({"content": p}, None) for p in chunk_words(reply.text, per_chunk)]
            if citations := _url_citations(model, reply.text):
                deltas.append(({"annotations": citations}, None))  # after the text, alone
        deltas.append(({}, _FINISH[reply.finish]))
        return deltas

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        try:
            body = self._body(request)
        except BadRequest as exc:
            return self.error_response(exc.status, exc.message, param=exc.param, code=exc.code)
        return await openai_responses.respond(self, request, body)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = self._body(request)
            prompt = body.get("prompt")
            if prompt is None:
                raise BadRequest(
                    400, "Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter"
                )
        except BadRequest as exc:
            return self.error_response(exc.status, exc.message, param=exc.param, code=exc.code)
        prompts = (
            [prompt]
            if isinstance(prompt, str)
            else [p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt]
        )
        # the legacy endpoint's default max_tokens is 16
        max_tokens = body.get("max_tokens") or 16
        n = body.get("n", 1)
        big = huge_text(request)
        replies = [
            Reply(text=big)
            if big is not None
            else plan_reply(Turn(last_user_text=p, stop=self._stop(body), max_tokens=max_tokens))
            for p in prompts
        ]
        prompt_tokens = [t for p in prompts for t in words(p)]
        cached = self.cache.lookup_and_store(prompt_tokens)
        rendered = self._usage(
            ReportedUsage(
                input_tokens=len(prompt_tokens) - cached,
                cached_input_tokens=cached,
                output_tokens=n * sum(r.output_tokens for r in replies),
            ),
            completion_details=False,
        )
        common = {
            "id": f"cmpl-{secrets.token_urlsafe(21)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body["model"],
        }
        indexed = [(p * n + j, r) for p, r in enumerate(replies) for j in range(n)]
        if not body.get("stream"):
            choices = [
                {"text": r.text, "index": i, "logprobs": None, "finish_reason": _FINISH[r.finish]}
                for i, r in indexed
            ]
            return self.json_response(
                request,
                {**common, "system_fingerprint": "fp_fake0001", "choices": choices, "usage": rendered},
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        async with self.open_stream(request) as stream:
            for i, r in indexed:
                for piece in chunk_words(r.text, 4096 if big is not None else 1):
                    await stream.send(
                        sse(
                            {
                                **common,
                                "choices": [
                                    {"text": piece, "index": i, "logprobs": None, "finish_reason": None}
                                ],
                            }
                        )
                    )
                await stream.send(
                    sse(
                        {
                            **common,
                            "choices": [
                                {"text": "", "index": i, "logprobs": None, "finish_reason": _FINISH[r.finish]}
                            ],
                        }
                    )
                )
            if include_usage:
                await stream.send(sse({**common, "choices": [], "usage": rendered}))
            await stream.send(b"data: [DONE]\n\n")
        return stream.response

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        try:
            body = self._body(request)
            inputs = body.get("input")
            if isinstance(inputs, str) or (
                isinstance(inputs, list) and inputs and isinstance(inputs[0], int)
            ):
                inputs = [inputs]
            if not isinstance(inputs, list) or not inputs or any(x in ("", []) for x in inputs):
                raise BadRequest(
                    400,
                    "'$.input' is invalid. Please check the API reference: https://platform.openai.com/docs/api-reference.",
                    "input",
                )
        except BadRequest as exc:
            return self.error_response(exc.status, exc.message, param=exc.param, code=exc.code)
        texts = [x if isinstance(x, str) else " ".join(map(str, x)) for x in inputs]
        dims = body.get("dimensions") or EMBEDDING_DIMS.get(body["model"], 1536)
        data = []
        for i, text in enumerate(texts):
            vector = embedding(text, dims)
            encoded: Any = vector
            if body.get("encoding_format") == "base64":
                encoded = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": encoded})
        tokens = sum(count_tokens(t) for t in texts)
        usage, _ = self.take_usage(ReportedUsage(input_tokens=tokens))
        payload = {
            "object": "list",
            "data": data,
            "model": body["model"],
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
        }
        return self.json_response(request, payload)

    async def _list_models(self, request: web.Request) -> web.StreamResponse:
        data = [self._with_window(_model_object(m, self.flavour)) for m in sorted(self.models)]
        return self.json_response(request, {"object": "list", "data": data})

    async def _get_model(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        if model not in self.models:
            return self.error_response(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            )
        return self.json_response(request, self._with_window(_model_object(model, self.flavour)))

    def _with_window(self, card: dict[str, Any]) -> dict[str, Any]:
        window = self.max_model_len.get(card["id"])
        return card if window is None else {**card, "max_model_len": window}


# the largest max_tokens each model family accepts (longest prefix wins); others: no limit
MAX_OUTPUT_TOKENS = {
    "gpt-4o": 16384,
    "gpt-4.1": 32768,
    "gpt-5": 128000,
    "o3": 100000,
    "o4": 100000,
    "gpt-3.5-turbo-instruct": 4096,
    "deepseek-chat": 8192,
    "deepseek-reasoner": 65536,
}


def _refuse_unsupported_by_reasoning(body: dict[str, Any]) -> None:
    """OpenAI's reasoning models refuse `max_tokens` and the sampling parameters, with these 400s."""
    model = body["model"]
    if not model.startswith(_REASONING_PREFIXES):
        return
    if body.get("max_tokens") is not None:
        raise BadRequest(
            400,
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
            "'max_completion_tokens' instead.",
            "max_tokens",
            "unsupported_parameter",
        )
    if _SAMPLING_MODELS.match(model) and body.get("reasoning_effort") in (None, "none"):
        return  # gpt-5.1 on: no reasoning by default, and then they sample as chat models do
    for name, default in (("temperature", 1), ("top_p", 1)):
        value = body.get(name)
        if value is not None and value != default:
            raise BadRequest(
                400,
                f"Unsupported value: '{name}' does not support {value} with this model. Only the default "
                f"({default}) value is supported.",
                name,
                "unsupported_value",
            )
    for name, absent in (
        ("presence_penalty", 0),
        ("frequency_penalty", 0),
        ("logprobs", False),
        ("top_logprobs", None),
        ("logit_bias", None),
    ):
        if body.get(name) not in (None, absent):
            raise BadRequest(
                400,
                f"Unsupported parameter: '{name}' is not supported with this model.",
                name,
                "unsupported_parameter",
            )


_SAMPLING_MODELS = re.compile(r"gpt-5\.\d")


def _url_citations(model: str, text: str) -> list[dict[str, Any]]:
    """A search model's (``*-search-preview``) annotations: a ``url_citation`` of each ``https://`` word
    of its reply, indexed by character, titled after its host."""
    if not model.endswith("-search-preview"):
        return []
    return [
        {
            "type": "url_citation",
            "url_citation": {
                "start_index": found.start(),
                "end_index": found.end(),
                "url": found.group(),
                "title": f"Page on {found.group().split('/')[2]}",
            },
        }
        for found in re.finditer(r"https://\S+", text)
    ]


def _max_output(model: str) -> int | None:
    matches = [p for p in MAX_OUTPUT_TOKENS if model.startswith(p)]
    return MAX_OUTPUT_TOKENS[max(matches, key=len)] if matches else None


MAX_CALL_ID = 40
MAX_USER = 64  # OpenAI's longest `user`
_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}
_KEY_ORDER = ("id", "object", "created", "model", "choices", "usage", "service_tier", "system_fingerprint")


def _ordered(payload: dict[str, Any]) -> dict[str, Any]:
    return {
        k: payload[k] for k in sorted(payload, key=lambda k: _KEY_ORDER.index(k) if k in _KEY_ORDER else 99)
    }


def _logprobs(tokens: list[str], top: int) -> dict[str, Any]:
    """Chat `logprobs` for these tokens: a fixed, plausible log-probability per token and `top`
    alternatives each (the chosen token first)."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = [
        {
            **entry(t, -0.01),
            "top_logprobs": [entry(t, -0.01), *(entry(f"{t}{k}", -5.0 - k) for k in range(1, top))][:top],
        }
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def _content_text(content: Any) -> tuple[str, list[str]]:
    """Text of a message's content (string or parts) and a digest per image part."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    images: list[str] = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "text":
            texts.append(str(part.get("text", "")))
        elif part.get("type") == "image_url":
            url = (part.get("image_url") or {}).get("url", "")
            images.append(hashlib.sha256(url.encode()).hexdigest()[:12])
    return " ".join(texts), images


def _deepseek_reasoning(reply: Reply) -> str:
    return f"The user wants: {reply.text or reply.tool_name or ''}".strip()


def _model_object(model: str, flavour: str) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": 1715367049,
        "owned_by": "deepseek" if flavour == "deepseek" else "system",
    }
