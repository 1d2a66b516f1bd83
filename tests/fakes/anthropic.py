"""Fake Anthropic Messages API on 127.0.0.1.

Endpoints: ``POST /v1/messages``, ``POST /v1/messages/count_tokens``, ``GET /v1/models``,
``GET /v1/models/{id}``. Auth: ``x-api-key`` (or ``Authorization: Bearer``) plus the required
``anthropic-version`` header; a missing or wrong key gets a 401 ``authentication_error``.

Wire format as Anthropic sends it: a ``message`` object with content blocks (``text``, ``thinking``
when ``thinking`` is enabled or adaptive, ``tool_use``; a tool call comes after a short text block, as Claude
usually does), ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``), the
streaming event sequence ``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``
(``text_delta``, ``thinking_delta``, ``signature_delta``, ``input_json_delta``), ``content_block_stop``,
``message_delta`` (stop reason and cumulative usage), ``message_stop``; errors as
``{"type": "error", "error": {"type", "message"}, "request_id"}`` (529 is ``overloaded_error``), the
same object as an ``event: error`` mid-stream; ``request-id`` and rate-limit headers.

Rejects with Anthropic's 400 what Anthropic rejects: a missing ``max_tokens``/``model``/``messages``,
``max_tokens`` above the model's limit (`MAX_OUTPUT_TOKENS`), ``temperature`` above 1, more than four
``cache_control`` breakpoints (a tool result's blocks' counted too), a thinking
budget under 1024 or not below ``max_tokens``, a ``tool_result`` without its ``tool_use`` in the
previous message, a ``tool_use`` id outside ``[a-zA-Z0-9_-]``, unknown block types; on ``count_tokens``, fields it does not take (``max_tokens``).
Thinking signatures are checked as Anthropic checks them: the fake signs each thinking block it
returns (an HMAC of its text), and a thinking block sent back with a missing, made-up or
mismatched signature is a 400; with thinking enabled, a tool loop's final assistant message must
start with a thinking (or redacted_thinking) block, or it is a 400 too, and so must a prefill (a
conversation ending with an assistant message) with thinking enabled or adaptive; from Claude 4.6 on
(`NO_PREFILL`) a prefill is refused outright. Thinking modes are checked
per model as Anthropic documents them: ``thinking: {"type": "adaptive"}`` only on the 4.6 family and
Opus 4.7 (`ADAPTIVE_MODELS`), ``enabled`` and ``disabled`` refused on Opus 4.7, and
``output_config.effort`` only on the models and levels in `EFFORT_LEVELS`. Structured outputs
(``output_config.format``) answer with the schema's JSON as text, only on the models that have them
(`STRUCTURED_OUTPUT_MODELS`), and refuse an object schema without ``additionalProperties: false`` or
numeric and length bounds, as Anthropic does.

Tools of Anthropic's own API (a ``type`` other than ``custom``: `SERVER_TOOL_TYPES`) are taken beside
client tools, which need an ``input_schema``. With a ``web_search_*`` tool, a user turn that asks to
"search" is answered as Claude answers with web search: a short text, a ``server_tool_use`` block
(``srvtoolu_`` id, the query as its input), its ``web_search_tool_result`` (results with their
``encrypted_content``), then text blocks, the answer's with ``citations``; streamed as Anthropic
streams them (the server tool's input as ``input_json_delta``, the result block whole in its
``content_block_start``, each citation as a ``citations_delta`` before its text), and
``usage.server_tool_use.web_search_requests`` counting the searches. Such blocks sent back in an
assistant turn are checked as Anthropic checks them: each result after its ``server_tool_use`` in the
same turn, results with their ``encrypted_content``, citations with their ``encrypted_index``; in a
user turn they are a 400. ``lead_next_with(block)`` starts the next answer with a block of a type the
fake does not otherwise model (a newer Claude's ``compaction``), which an assistant turn may send back
only as it was issued.

Usage: ``input_tokens`` is only the prompt tokens neither read from nor written to the cache;
``cache_read_input_tokens`` and ``cache_creation_input_tokens`` (split in
``cache_creation.ephemeral_5m_input_tokens``/``ephemeral_1h_input_tokens``) follow the
``cache_control`` breakpoints (see `caches.BreakpointCache`; the prefix order is tools, system,
messages; a top-level ``cache_control``, automatic caching, puts one on the last block; the minimum cacheable prefix is ``fake.min_cache_tokens``, 1024 by default). Thinking text
counts in ``output_tokens`` (Anthropic reports no separate reasoning count).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Callable
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
    words,
)
from tests.fakes.caches import Block, BreakpointCache
from tests.fakes.server import BODY, INVALID_JSON, FakeServer, Invalid, sse
from tests.fakes.util import deep_merge, huge_text

IMAGE_TOKENS = 1600
# Claude 4.6 on refuse an assistant prefill (a conversation ending with an assistant message).
NO_PREFILL = re.compile(r"claude-(opus|sonnet|haiku)-(4-[6-9]|[5-9])")
_ERROR_TYPES = {
    400: ("invalid_request_error", "Invalid request."),
    401: ("authentication_error", "invalid x-api-key"),
    403: ("permission_error", "Your API key does not have permission to use the specified resource."),
    404: ("not_found_error", "The requested resource could not be found."),
    413: ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
    429: ("rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit."),
    500: ("api_error", "Internal server error"),
    502: ("api_error", "Bad gateway"),
    503: ("api_error", "Service unavailable"),
    504: ("timeout_error", "Request timed out"),
    529: ("overloaded_error", "Overloaded"),
}
# The tool types of Anthropic's API the fake takes (by prefix: each has dated versions).
SERVER_TOOL_TYPES = (
    "web_search_",
    "web_fetch_",
    "code_execution_",
    "bash_",
    "text_editor_",
    "computer_",
    "memory_",
    "tool_search_tool_",
)
_COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers"}
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "stop_sequence": "stop_sequence",
    "tool_calls": "tool_use",
}


class FakeAnthropic(FakeServer):
    vendor: ClassVar[str] = "anthropic"
    default_models: ClassVar[tuple[str, ...]] = (
        "claude-sonnet-4-5",
        "claude-sonnet-4-5-20250929",
        "claude-opus-4-1",
        "claude-opus-4-5",
        "claude-haiku-4-5",
        "claude-sonnet-4-0",
        "claude-3-7-sonnet-latest",
        "claude-3-5-haiku-latest",
        "claude-opus-4-6",
        "claude-sonnet-4-6",
        "claude-opus-4-7",
    )

    def __init__(self, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(api_key, **kwargs)
        self._signing_key = secrets.token_bytes(32)  # signatures it issued verify for its whole life
        self.min_cache_tokens = 1024
        self.cache = BreakpointCache(min_tokens=self.min_cache_tokens)
        self._stop_reasons: list[str] = []
        self._leads: list[dict[str, Any]] = []
        self._issued: list[dict[str, Any]] = []  # the lead blocks it returned, which it takes back
        self.message_ids: list[str] = []  # the id of each message it answered, in order

    def reset_state(self) -> None:
        self.min_cache_tokens = 1024
        self.cache = BreakpointCache(min_tokens=self.min_cache_tokens)
        self._stop_reasons = []
        self._leads = []
        self._issued = []
        self.message_ids = []

    def lead_next_with(self, block: dict[str, Any]) -> None:
        """The next message starts with `block`, of a type this fake does not otherwise model (a newer
        Claude's: `compaction`, say), before its content as usual: streamed whole in its
        content_block_start. An assistant turn may send it back, unchanged (Anthropic checks what its
        blocks carry: a compaction's summary stands for the turns before it); changed, or in a user
        turn, it is a 400."""
        with self._lock:
            self._leads.append(block)

    def stop_next_with(self, reason: str) -> None:
        """The next message ends with Anthropic's `stop_reason` `reason` (`pause_turn`,
        `model_context_window_exceeded`: ones the echo never gives), its content as usual."""
        with self._lock:
            self._stop_reasons.append(reason)

    def _stop_reason(self, reply: Reply) -> str:
        with self._lock:
            return self._stop_reasons.pop(0) if self._stop_reasons else _STOP_REASONS[reply.finish]

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/messages", self._messages),
            web.post("/v1/messages/count_tokens", self._count_tokens),
            web.get("/v1/models", self._list_models),
            web.get("/v1/models/{model}", self._get_model),
        ]

    # ---- vendor shapes ---------------------------------------------------------------------------

    def response_headers(self) -> dict[str, str]:
        return {
            "request-id": f"req_011C{secrets.token_urlsafe(18)}",
            "anthropic-organization-id": "00000000-0000-4000-8000-000000000000",
            "anthropic-ratelimit-requests-limit": "4000",
            "anthropic-ratelimit-requests-remaining": "3999",
            "anthropic-ratelimit-input-tokens-limit": "2000000",
            "anthropic-ratelimit-input-tokens-remaining": "1999000",
            "anthropic-ratelimit-output-tokens-limit": "400000",
            "anthropic-ratelimit-output-tokens-remaining": "399000",
        }

    def _error_body(self, status: int, message: str | None) -> dict[str, Any]:
        kind, default = _ERROR_TYPES.get(status, ("api_error", "Internal server error"))
        return {
            "type": "error",
            "error": {"type": kind, "message": message or default},
            "request_id": f"req_011C{secrets.token_urlsafe(18)}",
        }

    def error_response(self, status: int, message: str | None = None, **extra: Any) -> web.Response:
        return web.json_response(
            self._error_body(status, message), status=status, headers=self.response_headers()
        )

    def stream_error_frame(self, status: int, message: str | None) -> bytes:
        body = self._error_body(status, message)
        return sse({"type": "error", "error": body["error"]}, event="error")

    def auth_error(self, request: web.Request) -> web.StreamResponse | None:
        key = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if key is None and auth.lower().startswith("bearer "):
            key = auth[7:]
        if not key:
            return self.error_response(401, "x-api-key header is required")
        if key != self.api_key:
            return self.error_response(401, "invalid x-api-key")
        if "anthropic-version" not in request.headers:
            return self.error_response(400, "anthropic-version: header is required")
        return None

    def sign(self, thinking: str) -> str:
        """The signature of a thinking block's text: only this fake can make one that verifies."""
        digest = hmac.new(self._signing_key, thinking.encode(), hashlib.sha256).digest()
        return base64.b64encode(digest).decode()

    # ---- request parsing -------------------------------------------------------------------------

    def _body(self, request: web.Request, *, need_max_tokens: bool = True) -> dict[str, Any]:
        body = request[BODY]
        if body is INVALID_JSON or not isinstance(body, dict):
            raise Invalid(400, "There was an issue with your request body: invalid JSON")
        for field in ("model", "messages", *(("max_tokens",) if need_max_tokens else ())):
            if field not in body:
                raise Invalid(400, f"{field}: Field required")
        if body["model"] not in self.models:
            raise Invalid(404, f"model: {body['model']}")
        if body.get("service_tier", "auto") not in ("auto", "standard_only"):
            raise Invalid(400, "service_tier: Input should be 'auto' or 'standard_only'")
        max_tokens = body.get("max_tokens", 1)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise Invalid(400, "max_tokens: Input should be greater than or equal to 1")
        limit = _max_output(body["model"])
        if max_tokens > limit:
            raise Invalid(
                400,
                f"max_tokens: {max_tokens} > {limit}, which is the maximum allowed number of output tokens "
                f"for {body['model']}",
            )
        thinking = body.get("thinking") or {}
        model = body["model"]
        if thinking.get("type") == "adaptive" and not model.startswith(ADAPTIVE_MODELS):
            raise Invalid(400, f"adaptive thinking is not supported on this model ({model})")
        if thinking.get("type") in ("enabled", "disabled") and model.startswith(ADAPTIVE_ONLY_MODELS):
            raise Invalid(
                400,
                f'thinking.type: "{thinking["type"]}" is not supported for this model. Use '
                '"thinking.type": "adaptive" and "output_config.effort" to control thinking behavior.',
            )
        output_format = (body.get("output_config") or {}).get("format")
        if output_format is not None:
            if not model.startswith(STRUCTURED_OUTPUT_MODELS):
                raise Invalid(400, f"'{model}' does not support output_config.format.")
            _check_output_schema(output_format.get("schema") or {}, "output_config.format.schema")
        effort = (body.get("output_config") or {}).get("effort")
        if effort is not None:
            levels = EFFORT_LEVELS.get(next((m for m in EFFORT_LEVELS if model.startswith(m)), ""), ())
            if not levels:
                raise Invalid(400, f"output_config.effort: the effort parameter is not supported on {model}")
            if effort not in levels:
                raise Invalid(
                    400, f"output_config.effort: Input should be {', '.join(repr(e) for e in levels)}"
                )
        if thinking.get("type") == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or budget < 1024:
                raise Invalid(
                    400, "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
                )
            if need_max_tokens and budget >= max_tokens:
                raise Invalid(400, "`max_tokens` must be greater than `thinking.budget_tokens`.")
        temperature = body.get("temperature")
        if temperature is not None and not (isinstance(temperature, int | float) and 0 <= temperature <= 1):
            raise Invalid(400, "temperature: Input should be less than or equal to 1")
        if not isinstance(body["messages"], list) or not body["messages"]:
            raise Invalid(400, "messages: at least one message is required")
        return body

    def _prompt_blocks(self, body: dict[str, Any]) -> tuple[list[Block], dict[str, str]]:
        """The prompt as cacheable blocks (tools, system, messages) and a tool_use id -> name map."""
        _check_breakpoint_count(body)
        blocks: list[Block] = []
        for i, tool in enumerate(body.get("tools") or []):
            kind = tool.get("type", "custom")
            if kind == "custom" and "input_schema" not in tool:
                raise Invalid(400, f"tools.{i}.custom.input_schema: Field required")
            if kind != "custom" and not str(kind).startswith(SERVER_TOOL_TYPES):
                raise Invalid(
                    400,
                    f"tools.{i}: Input tag '{kind}' found using 'type' does not match any of the expected tags",
                )
            plain = {k: v for k, v in tool.items() if k != "cache_control"}
            blocks.append(Block(words(json.dumps(plain)), _ttl(tool)))
        system = body.get("system")
        if isinstance(system, str):
            blocks.append(Block(words(system)))
        elif isinstance(system, list):
            blocks += [Block(words(b.get("text", "")), _ttl(b)) for b in system if isinstance(b, dict)]
        tool_names: dict[str, str] = {}
        previous_uses: set[str] = set()
        for i, message in enumerate(body["messages"]):
            if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
                raise Invalid(400, f"messages.{i}.role: Input should be 'user' or 'assistant'")
            content = message.get("content")
            if isinstance(content, str):
                if content and not content.strip():  # a string is one text block to Anthropic
                    raise Invalid(400, "messages: text content blocks must contain non-whitespace text")
                blocks.append(Block(words(content)))
                previous_uses = set()
                continue
            uses: set[str] = set()
            server_uses: set[str] = set()  # this turn's server_tool_use ids, which its results follow
            for j, block in enumerate(content if isinstance(content, list) else []):
                kind = block.get("type")
                if kind == "text":
                    _check_text(block.get("text", ""))
                    for k, citation in enumerate(block.get("citations") or []):
                        if not citation.get("encrypted_index"):
                            raise Invalid(
                                400, f"messages.{i}.content.{j}.citations.{k}.encrypted_index: Field required"
                            )
                    tokens = words(block.get("text", ""))
                elif kind in ("server_tool_use", "web_search_tool_result") and message["role"] != "assistant":
                    raise Invalid(
                        400,
                        f"messages.{i}.content.{j}: `{kind}` blocks are only allowed in assistant messages",
                    )
                elif kind == "server_tool_use":
                    if not re.fullmatch(r"srvtoolu_[a-zA-Z0-9_]+", str(block.get("id", ""))):
                        raise Invalid(
                            400,
                            f"messages.{i}.content.{j}.id: String should match pattern '^srvtoolu_[a-zA-Z0-9_]+$'",
                        )
                    server_uses.add(block["id"])
                    tokens = words(json.dumps(block.get("input", {})))
                elif kind == "web_search_tool_result":
                    if block.get("tool_use_id") not in server_uses:
                        raise Invalid(
                            400,
                            f"messages.{i}.content.{j}: `web_search_tool_result` block(s) provided when previous "
                            "message does not contain a corresponding `server_tool_use` block",
                        )
                    results = block.get("content")
                    for k, result in enumerate(results if isinstance(results, list) else []):
                        if not result.get("encrypted_content"):
                            raise Invalid(
                                400, f"messages.{i}.content.{j}.content.{k}.encrypted_content: Field required"
                            )
                    tokens = words(json.dumps(results))
                elif kind in ("image", "document"):
                    if kind == "image":
                        _check_image_source(
                            block.get("source") or {}, f"messages.{i}.content.{j}.image.source"
                        )
                    tokens = [
                        f"<{kind}:{json.dumps(block.get('source'), sort_keys=True)[:64]}>"
                    ] * IMAGE_TOKENS
                elif kind == "tool_use":
                    if not re.fullmatch(r"[a-zA-Z0-9_-]+", str(block.get("id", ""))):
                        raise Invalid(
                            400,
                            f"messages.{i}.content.{j}.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'",
                        )
                    tool_names[block.get("id", "")] = block.get("name", "")
                    uses.add(block.get("id", ""))
                    tokens = words(block.get("name", "")) + words(json.dumps(block.get("input", {})))
                elif kind == "tool_result":
                    if block.get("tool_use_id") not in previous_uses:
                        raise Invalid(
                            400,
                            f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                            f"{block.get('tool_use_id')}. Each `tool_result` block must have a corresponding "
                            "`tool_use` block in the previous message.",
                        )
                    _check_result_content(block.get("content"), body, f"messages.{i}.content.{j}")
                    tokens = words(_text_of(block.get("content")))
                elif kind == "thinking":
                    signature = block.get("signature")
                    if not isinstance(signature, str) or not hmac.compare_digest(
                        signature, self.sign(str(block.get("thinking", "")))
                    ):
                        raise Invalid(
                            400, f"messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
                        )
                    tokens = words(block.get("thinking", ""))
                elif kind == "redacted_thinking":
                    if not block.get("data"):
                        raise Invalid(400, f"messages.{i}.content.{j}.data: Field required")
                    tokens = []
                elif message["role"] == "assistant" and block in self._issued:
                    tokens = words(json.dumps(block))
                else:
                    raise Invalid(
                        400, f"messages.{i}.content.{j}.type: Input tag '{kind}' is not a valid block type"
                    )
                blocks.append(Block(tokens, _ttl(block)))
            previous_uses = uses
        _check_thinking_turn(body)
        automatic = _ttl(body)
        if automatic is not None and blocks and blocks[-1].ttl is None:
            # Automatic caching (the request's own cache_control): the breakpoint on the last block.
            blocks[-1] = Block(blocks[-1].tokens, automatic)
        return blocks, tool_names

    def _turn(self, body: dict[str, Any], tool_names: dict[str, str]) -> Turn:
        tools = [
            Tool(t["name"], t.get("input_schema") or {})
            for t in body.get("tools") or []
            if "name" in t and t.get("type", "custom") == "custom"
        ]
        turn = Turn(tools=tools, stop=list(body.get("stop_sequences") or []), max_tokens=body["max_tokens"])
        messages = body["messages"]
        last = messages[-1]
        content = last.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        if len(messages) > 1 and last.get("role") == "user" and asks_to_continue(_text_of(blocks)):
            messages, last = messages[:-1], messages[-2]
            content = last.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            if last.get("role") == "assistant":
                turn.prefill = _text_of(blocks)  # the fake model obeys: it goes on with its reply
                turn.rejoin = self.rejoin
        elif (
            last.get("role") == "assistant"
            and NO_PREFILL.search(body.get("model", ""))
            and not any(b.get("type") == "server_tool_use" for b in blocks)  # a paused turn, resumed
        ):
            raise Invalid(
                400,
                "This model does not support assistant message prefill. The conversation must end with a "
                "user message.",
            )
        if turn.prefill is not None:
            asked = next((m for m in reversed(messages) if m.get("role") == "user"), {})
            turn.last_user_text = _text_of(asked.get("content"))
        elif last.get("role") == "user":
            turn.last_user_text = _text_of(blocks)
            turn.images = sum(1 for b in blocks if b.get("type") == "image")
            results = [b for b in blocks if b.get("type") == "tool_result"]
            if results:
                name = tool_names.get(results[-1].get("tool_use_id", ""), "")
                turn.tool_result = (name, _text_of(results[-1].get("content")))
        elif not any(b.get("type") == "tool_use" for b in blocks):
            turn.prefill = _text_of(blocks)  # Anthropic continues a trailing assistant message
            if turn.prefill != turn.prefill.rstrip():
                raise Invalid(400, "messages: final assistant content cannot end with trailing whitespace")
            asked = next((m for m in reversed(messages) if m.get("role") == "user"), {})
            asked_blocks = asked.get("content")
            turn.last_user_text = _text_of(asked_blocks)
            if isinstance(asked_blocks, list):
                turn.images = sum(1 for b in asked_blocks if b.get("type") == "image")
        choice = body.get("tool_choice") or {}
        if choice.get("type") == "any":
            turn.forced_tool = "any"
        elif choice.get("type") == "tool":
            turn.forced_tool = choice.get("name")
        elif choice.get("type") == "none":
            turn.tools_disabled = True
        output_format = body.get("output_format") or (body.get("output_config") or {}).get("format") or {}
        if output_format.get("type") == "json_schema":
            turn.json_mode = True
            turn.json_schema = output_format.get("schema") or {"type": "object"}
        return turn

    # ---- handlers --------------------------------------------------------------------------------

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        try:
            body = self._body(request)
            blocks, tool_names = self._prompt_blocks(body)
            turn = self._turn(body, tool_names)
        except Invalid as exc:
            return self.error_response(exc.status, exc.message)
        reply = self.reply_to(body.get("model"), turn)
        big = huge_text(request)
        if big is not None:
            reply = Reply(text=big)
        thinking = body.get("thinking") or {}
        thought = (
            f"Let me think about: {reply.text or reply.tool_name}"
            if thinking.get("type") in ("enabled", "adaptive")
            else None
        )
        search = _web_search(body, turn)
        content = (
            _searched(search, turn.last_user_text, reply)
            if search
            else _content_blocks(reply, thought, self.sign)
        )
        with self._lock:
            if self._leads:
                lead = self._leads.pop(0)
                self._issued.append(lead)
                content = [lead, *content]
        output = sum(_block_tokens(b) for b in content)
        self.cache.min_tokens = self.min_cache_tokens
        cached = self.cache.process(blocks)
        usage, raw = self.take_usage(
            ReportedUsage(
                input_tokens=cached.uncached,
                cached_input_tokens=cached.read,
                cache_write_5m_tokens=cached.write_5m,
                cache_write_1h_tokens=cached.write_1h,
                output_tokens=output,
            )
        )
        rendered = {
            "input_tokens": usage.input_tokens,
            "cache_creation_input_tokens": usage.cache_write_5m_tokens + usage.cache_write_1h_tokens,
            "cache_read_input_tokens": usage.cached_input_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": usage.cache_write_5m_tokens,
                "ephemeral_1h_input_tokens": usage.cache_write_1h_tokens,
            },
            "output_tokens": usage.output_tokens,
            **({"server_tool_use": {"web_search_requests": 1, "web_fetch_requests": 0}} if search else {}),
            # As Anthropic reports it: `standard_only` is always standard; `auto` (the default) takes
            # the workspace's Priority Tier capacity where it has some.
            "service_tier": "standard"
            if body.get("service_tier") == "standard_only"
            else self.capacity_tier or "standard",
        }
        if usage.reasoning_tokens:
            # Newer models' breakdown (the SDKs' `OutputTokensDetails`): the thinking's share of
            # `output_tokens`, counted in full even where the text returned is a summary. A set
            # `reasoning_tokens` reports it; by default the fake is a model that reports none.
            rendered["output_tokens_details"] = {"thinking_tokens": usage.reasoning_tokens}
        if raw:
            deep_merge(rendered, raw)
        message = {
            "id": f"msg_01{secrets.token_urlsafe(18)}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": self._stop_reason(reply),
            "stop_sequence": reply.stop_sequence,
            "usage": rendered,
        }
        self.message_ids.append(message["id"])
        if not body.get("stream"):
            return self.json_response(request, message)

        # The output's breakdown comes with its count, in message_delta.
        start_usage = {
            k: v for k, v in rendered.items() if k not in ("output_tokens", "output_tokens_details")
        } | {"output_tokens": 1}
        head = {**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}
        per_chunk = 4096 if big is not None else 1
        async with self.open_stream(request, "text/event-stream; charset=utf-8") as stream:
            await stream.send(sse({"type": "message_start", "message": head}, "message_start"))
            for index, block in enumerate(content):
                await stream.send(
                    sse(
                        {"type": "content_block_start", "index": index, "content_block": _empty(block)},
                        "content_block_start",
                    )
                )
                if index == 0:
                    await stream.send(sse({"type": "ping"}, "ping"))
                for delta in _deltas(block, per_chunk):
                    await stream.send(
                        sse(
                            {"type": "content_block_delta", "index": index, "delta": delta},
                            "content_block_delta",
                        )
                    )
                await stream.send(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
            final_usage = {k: v for k, v in rendered.items() if k not in ("cache_creation", "service_tier")}
            await stream.send(
                sse(
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": message["stop_reason"],
                            "stop_sequence": message["stop_sequence"],
                        },
                        "usage": final_usage,
                    },
                    "message_delta",
                )
            )
            await stream.send(sse({"type": "message_stop"}, "message_stop"))
        return stream.response

    async def _count_tokens(self, request: web.Request) -> web.StreamResponse:
        try:
            body = self._body(request, need_max_tokens=False)
            # As Anthropic: the count endpoint takes no sampling fields.
            for field in body:
                if field not in _COUNT_FIELDS:
                    raise Invalid(400, f"{field}: Extra inputs are not permitted")
            blocks, _ = self._prompt_blocks(body)
        except Invalid as exc:
            return self.error_response(exc.status, exc.message)
        return self.json_response(request, {"input_tokens": sum(len(b.tokens) for b in blocks)})

    async def _list_models(self, request: web.Request) -> web.StreamResponse:
        data = [_model_object(m) for m in sorted(self.models)]
        return self.json_response(
            request,
            {
                "data": data,
                "has_more": False,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            },
        )

    async def _get_model(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        if model not in self.models:
            return self.error_response(404, f"model: {model}")
        return self.json_response(request, _model_object(model))


# Thinking by model, as Anthropic documents it: adaptive thinking from the 4.6 family on, only
# adaptive from Opus 4.7 on; output_config.effort from Opus 4.5 on, its levels by model.
ADAPTIVE_MODELS = ("claude-opus-4-6", "claude-sonnet-4-6", "claude-opus-4-7")
ADAPTIVE_ONLY_MODELS = ("claude-opus-4-7",)
EFFORT_LEVELS = {
    "claude-opus-4-5": ("low", "medium", "high"),
    "claude-opus-4-6": ("low", "medium", "high", "max"),
    "claude-sonnet-4-6": ("low", "medium", "high", "max"),
    "claude-opus-4-7": ("low", "medium", "high", "xhigh", "max"),
}

# Structured outputs (output_config.format) by model, and what their schemas may not hold.
STRUCTURED_OUTPUT_MODELS = (
    "claude-sonnet-4-5",
    "claude-opus-4-1",
    "claude-opus-4-5",
    "claude-haiku-4-5",
    *ADAPTIVE_MODELS,
)
_UNSUPPORTED_SCHEMA = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
)


def _check_output_schema(schema: Any, where: str) -> None:
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _check_output_schema(item, f"{where}.{i}")
        return
    if not isinstance(schema, dict):
        return
    if (schema.get("type") == "object" or "properties" in schema) and schema.get(
        "additionalProperties"
    ) is not False:
        raise Invalid(
            400, f"{where}: For 'object' type, 'additionalProperties' must be explicitly set to false"
        )
    for key in _UNSUPPORTED_SCHEMA:
        if key in schema:
            raise Invalid(400, f"{where}: property '{key}' is not supported")
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                _check_output_schema(sub, f"{where}.{key}.{name}")
        elif key in ("items", "anyOf", "allOf"):
            _check_output_schema(value, f"{where}.{key}")


# the largest max_tokens each model accepts (longest prefix wins)
MAX_OUTPUT_TOKENS = {
    "claude-sonnet-4": 64000,
    "claude-opus-4-5": 64000,
    "claude-opus-4": 32000,
    "claude-haiku-4-5": 64000,
    "claude-3-7-sonnet": 64000,
    "claude-3-5-haiku": 8192,
}


def _max_output(model: str) -> int:
    matches = [p for p in MAX_OUTPUT_TOKENS if model.startswith(p)]
    return MAX_OUTPUT_TOKENS[max(matches, key=len)] if matches else 64000


def _ttl(block: dict[str, Any]) -> str | None:
    control = block.get("cache_control") if isinstance(block, dict) else None
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        return None
    return "1h" if control.get("ttl") == "1h" else "5m"


MAX_BREAKPOINTS = 4


def _check_breakpoint_count(body: dict[str, Any]) -> None:
    """At most `MAX_BREAKPOINTS` blocks with `cache_control`, as Anthropic counts them: tools, system
    blocks, message blocks and the blocks of a tool result, and automatic caching (a top-level
    `cache_control`), which takes one of the slots."""

    def marked(blocks: Any) -> int:
        blocks = blocks if isinstance(blocks, list) else []
        return sum(
            (block.get("cache_control") is not None)
            + (marked(block.get("content")) if block.get("type") == "tool_result" else 0)
            for block in blocks
            if isinstance(block, dict)
        )

    found = (
        (body.get("cache_control") is not None)
        + marked(body.get("tools"))
        + marked(body.get("system"))
        + sum(marked(m.get("content")) for m in body.get("messages") or [] if isinstance(m, dict))
    )
    if found > MAX_BREAKPOINTS:
        raise Invalid(
            400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {found}."
        )


_RESULT_BLOCKS = ("text", "image", "document", "search_result", "tool_reference")


def _check_result_content(content: Any, body: dict[str, Any], where: str) -> None:
    """A tool result's blocks, as Anthropic checks them: its types only, and a `tool_reference` (a
    client-side tool search's answer) naming a tool of the request that `defer_loading` holds back."""
    deferred = {t.get("name") for t in body.get("tools") or [] if t.get("defer_loading")}
    for k, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type")
        if kind not in _RESULT_BLOCKS:
            raise Invalid(400, f"{where}.content.{k}.type: Input tag '{kind}' is not a valid block type")
        if kind == "tool_reference" and part.get("tool_name") not in deferred:
            raise Invalid(
                400,
                f"{where}.content.{k}: `tool_reference` names `{part.get('tool_name')}`, which is not a "
                "tool of the request with `defer_loading`",
            )


_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_IMAGE_MAGIC = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF8": "image/gif"}


def _check_image_source(source: dict[str, Any], where: str) -> None:
    """A base64 image, as Anthropic checks it: one of its four types, and the one its bytes are."""
    if source.get("type") != "base64":
        return
    media_type = source.get("media_type")
    if media_type not in _IMAGE_TYPES:
        raise Invalid(
            400,
            f"{where}.base64.media_type: Input should be 'image/jpeg', 'image/png', 'image/gif' or 'image/webp'",
        )
    data = str(source.get("data", ""))[:16]
    try:
        head = base64.b64decode(data + "=" * (-len(data) % 4))
    except ValueError:  # not base64: no type to compare
        return
    actual = next((kind for magic, kind in _IMAGE_MAGIC.items() if head.startswith(magic)), media_type)
    if actual != media_type:
        raise Invalid(400, f"{where}.base64.data: Image does not match the provided media type {media_type}")


def _check_text(text: str) -> None:
    """A text block of a message, as Anthropic checks it: never empty, never whitespace alone."""
    if not text:
        raise Invalid(400, "messages: text content blocks must be non-empty")
    if not text.strip():
        raise Invalid(400, "messages: text content blocks must contain non-whitespace text")


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _check_thinking_turn(body: dict[str, Any]) -> None:
    """With thinking on, a tool loop (the last user turn answers tools) needs the final assistant
    message to start with its thinking, as Anthropic refuses otherwise; so does a prefill (the
    conversation ending with an assistant message), which text alone cannot be."""
    kind = (body.get("thinking") or {}).get("type")
    messages = body["messages"]
    prefill = messages[-1].get("role") == "assistant"
    if kind != "enabled" and not (prefill and kind == "adaptive"):
        return
    last = messages[-1].get("content")
    if not prefill and (not isinstance(last, list) or not any(b.get("type") == "tool_result" for b in last)):
        return
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") != "assistant":
            continue
        content = messages[i].get("content")
        first = content[0].get("type") if isinstance(content, list) and content else "text"
        if first not in ("thinking", "redacted_thinking"):
            raise Invalid(
                400,
                f"messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
                f"`{first}`. When `thinking` is enabled, a final `assistant` message must start with a "
                "thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). "
                "We recommend you include thinking blocks from previous turns. To avoid this requirement, "
                "disable `thinking`.",
            )
        return


def _content_blocks(reply: Reply, thought: str | None, sign: Callable[[str], str]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if thought is not None:
        blocks.append({"type": "thinking", "thinking": thought, "signature": sign(thought)})
    if reply.tool_name:
        blocks.append({"type": "text", "text": f"I'll call {reply.tool_name}."})
        blocks.append(
            {
                "type": "tool_use",
                "id": f"toolu_01{secrets.token_urlsafe(16)}",
                "name": reply.tool_name,
                "input": reply.tool_args or {},
            }
        )
    else:
        # Empty only when a prefill already holds the whole answer: nothing is left to say (plan_reply
        # gives a greeting to a prompt without text).
        blocks.append({"type": "text", "text": reply.text})
    return blocks


def _web_search(body: dict[str, Any], turn: Turn) -> str | None:
    """The web search tool's name where Claude would search: the tool is there, tools are not turned
    off, and the user's own turn (not a tool result) asks to search."""
    tool = next(
        (t for t in body.get("tools") or [] if str(t.get("type", "")).startswith("web_search_")), None
    )
    last = body["messages"][-1]
    asks = last.get("role") == "user" and turn.tool_result is None and "search" in turn.last_user_text.lower()
    return (
        str(tool.get("name", "web_search")) if tool is not None and asks and not turn.tools_disabled else None
    )


def _searched(tool: str, query: str, reply: Reply) -> list[dict[str, Any]]:
    """Claude's answer after one web search, as Anthropic returns it."""
    use_id = f"srvtoolu_01{secrets.token_hex(11)}"
    url = "https://example.com/" + "-".join(words(query))[:40]
    title = f"About {query}"[:60]
    result = {
        "type": "web_search_result",
        "url": url,
        "title": title,
        "encrypted_content": base64.b64encode(query.encode()).decode(),
        "page_age": "April 30, 2025",
    }
    citation = {
        "type": "web_search_result_location",
        "url": url,
        "title": title,
        "encrypted_index": base64.b64encode(url.encode()).decode(),
        "cited_text": reply.text[:150],
    }
    return [
        {"type": "text", "text": "I'll search the web."},
        {"type": "server_tool_use", "id": use_id, "name": tool, "input": {"query": query}},
        {"type": "web_search_tool_result", "tool_use_id": use_id, "content": [result]},
        {"type": "text", "text": "According to the web, "},
        {"type": "text", "text": reply.text, "citations": [citation]},
    ]


def _block_tokens(block: dict[str, Any]) -> int:
    if block["type"] == "text":
        return count_tokens(block["text"])
    if block["type"] == "thinking":
        return count_tokens(block["thinking"])
    if block["type"] == "tool_use" or block["type"] == "server_tool_use":
        return count_tokens(json.dumps(block["input"]))
    return 0  # a search's results (the next sampling's input), a lead block (`lead_next_with`)


def _empty(block: dict[str, Any]) -> dict[str, Any]:
    if block["type"] == "text":
        return {"type": "text", "text": ""}  # its citations come as citations_delta
    if block["type"] == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if block["type"] in ("tool_use", "server_tool_use"):
        return {"type": block["type"], "id": block["id"], "name": block["name"], "input": {}}
    return block  # whole in its start: a search's result, a lead block (`lead_next_with`)


def _deltas(block: dict[str, Any], per_chunk: int) -> list[dict[str, Any]]:
    if block["type"] == "text":
        citations = [{"type": "citations_delta", "citation": c} for c in block.get("citations") or ()]
        return citations + [{"type": "text_delta", "text": p} for p in chunk_words(block["text"], per_chunk)]
    if block["type"] not in ("thinking", "tool_use", "server_tool_use"):
        return []  # whole in its content_block_start
    if block["type"] == "thinking":
        return [
            {"type": "thinking_delta", "thinking": p} for p in chunk_words(block["thinking"], per_chunk)
        ] + [{"type": "signature_delta", "signature": block["signature"]}]
    # As Claude streams it: an empty fragment first, then the input's JSON; a tool called with no
    # input (one without parameters) gets the empty fragment alone, never "{}".
    arguments = json.dumps(block["input"]) if block["input"] else ""
    return [{"type": "input_json_delta", "partial_json": ""}] + [
        {"type": "input_json_delta", "partial_json": p} for p in chunk_words(arguments, 1)
    ]


def _model_object(model: str) -> dict[str, Any]:
    return {
        "type": "model",
        "id": model,
        "display_name": model.replace("-", " ").title(),
        "created_at": "2025-09-29T00:00:00Z",
    }
