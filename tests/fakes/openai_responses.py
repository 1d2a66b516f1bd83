"""The fake OpenAI's Responses API: ``POST /v1/responses``, stateless, in OpenAI's wire format.

Served for every model the fake knows; `RESPONSES_ONLY` models are served there alone, and their chat
completions get OpenAI's 404 ("This model is only supported in v1/responses and not in
v1/chat/completions."). Requests are checked as OpenAI checks them, so a gateway's translation bugs
surface: chat's fields (``messages``, ``max_tokens``, ``max_completion_tokens``, ``stop``,
``reasoning_effort``, ``response_format``, ``n``...) get 400 ``unsupported_parameter``; a tool in chat's
nested shape is missing its ``name``; a ``function_call_output`` needs a ``function_call`` with its
``call_id`` earlier in ``input`` (a ``custom_tool_call_output`` a ``custom_tool_call``);
``previous_response_id`` is refused, since the fake stores nothing; a ``reasoning`` item sent back is
refused unless it carries ``encrypted_content`` the fake issued (with nothing stored, its id alone names
nothing). Tools: ``function`` and ``custom`` (freeform: ``format`` text or a lark/regex ``grammar``)
tools, and built-in ones (``web_search``, ``local_shell``, ...), whose calls and outputs are taken back
as input items.

Custom tools: the model calls one as it calls a function of one string ``input`` (``call apply_patch
{"input": "..."}`` in the user's text), and answers a ``custom_tool_call`` item with that ``input``,
streamed as ``response.custom_tool_call_input.delta`` events. ``include: ["reasoning.encrypted_content"]``
adds ``encrypted_content`` to the reasoning item; ``reasoning.summary`` gives it a ``summary_text``
part, streamed as ``response.reasoning_summary_part.added``, ``response.reasoning_summary_text.delta``
and their ``.done`` events. Input that ends with an assistant message and Weir's user turn asking for
the rest of it (``CONTINUE_INSTRUCTION``) is answered with the rest, as the chat fake answers it
(``continue_loosely`` applies).

Answers: a Response object (``output``: a ``reasoning`` item for reasoning models, then a ``message``
with ``output_text`` or a ``function_call``; ``status`` ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when cut by ``max_output_tokens``); usage ``input_tokens`` (cache reads included),
``input_tokens_details.cached_tokens`` (the automatic prompt cache), ``output_tokens`` (reasoning
included), ``output_tokens_details.reasoning_tokens``. Streams: ``event:``/``data:`` SSE events with
``sequence_number``: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (a word each), response.function_call_arguments.delta,
their ``.done`` events, response.output_item.done, then response.completed or response.incomplete. A
``Fault.stream_error`` ends a stream with an ``error`` event."""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tests.fakes.behaviour import Reply, ReportedUsage, Tool, Turn, asks_to_continue, chunk_words, words
from tests.fakes.server import sse

if TYPE_CHECKING:
    from tests.fakes.openai import FakeOpenAI

# OpenAI's models served on the Responses API alone.
RESPONSES_ONLY = ("o1-pro", "o3-pro", "codex-mini-latest", "gpt-5-codex", "computer-use-preview")
ONLY_ON_RESPONSES = "This model is only supported in v1/responses and not in v1/chat/completions."
# The top-level fields the Responses API takes; any other gets 400 unsupported_parameter.
_FIELDS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "reasoning", "store", "stream", "stream_options", "user", "metadata",
    "service_tier", "include", "truncation", "previous_response_id", "background", "prompt_cache_key",
    "safety_identifier", "prompt_cache_retention", "max_tool_calls", "top_logprobs", "conversation", "prompt",
}  # fmt: skip
# Where chat's fields went, as OpenAI's 400 says it.
_MOVED = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}
_REASONING_TOKENS = {"minimal": 0, "low": 64, "medium": 192, "high": 512}
IMAGE_TOKENS = 85
# The prefix of the reasoning the fake encrypts (OpenAI's is a Fernet token, which starts so), and what
# it says when asked to summarise its reasoning.
ENCRYPTED = "gAAAAB"
SUMMARY = "**Planning the answer** I considered the request and chose what to do."
# Input items of built-in tools' calls and outputs, taken back as they are.
_BUILTIN_ITEMS = {"web_search_call", "local_shell_call", "local_shell_call_output", "file_search_call"}


class Refused(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def _unsupported(name: str) -> Refused:
    moved = f" In the Responses API, this parameter has moved to '{_MOVED[name]}'." if name in _MOVED else ""
    return Refused(f"Unsupported parameter: '{name}'.{moved}", name, "unsupported_parameter")


def _text_of(content: Any, where: str) -> tuple[str, int]:
    """A message's text and how many images it holds; parts of an unknown type are refused."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise Refused(f"Invalid type for '{where}'.", where, "invalid_type")
    texts, images = [], 0
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            texts.append(str(part.get("text", "")))
        elif kind == "input_image" and part.get("image_url"):
            images += 1
        elif kind != "input_file":
            raise Refused(f"Invalid value: '{kind}'.", f"{where}[{j}].type", "invalid_value")
    return " ".join(texts), images


def _turn(body: dict[str, Any]) -> tuple[Turn, list[str]]:
    for name in body:
        if name not in _FIELDS:
            raise _unsupported(name)
    if body.get("previous_response_id"):
        raise Refused(
            "Previous response with id not found.", "previous_response_id", "previous_response_not_found"
        )
    tools = []
    for i, tool in enumerate(body.get("tools") or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in ("function", "custom") and isinstance(tool, dict) and "name" not in tool:
            continue  # a built-in tool (web_search, local_shell, ...): the model never calls one here
        if not isinstance(tool, dict) or "name" not in tool:  # chat's nested shape has none at the top
            raise Refused(
                f"Missing required parameter: 'tools[{i}].name'.",
                f"tools[{i}].name",
                "missing_required_parameter",
            )
        if kind == "custom":
            form = tool.get("format") or {"type": "text"}
            if form.get("type") not in ("text", "grammar") or (
                form.get("type") == "grammar" and not isinstance(form.get("definition"), str)
            ):
                raise Refused("Invalid value for 'format'.", f"tools[{i}].format", "invalid_value")
            # Called as a function of one string would be (`_output` makes it a custom_tool_call).
            tools.append(Tool(tool["name"], {"type": "object", "properties": {"input": {"type": "string"}}}))
        else:
            tools.append(Tool(tool["name"], tool.get("parameters") or {}))
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise Refused("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    tokens = words(str(body.get("instructions") or "")) + (words(json.dumps(body["tools"])) if tools else [])
    calls: dict[str, tuple[str, str]] = {}  # call_id -> (its item's type, the tool's name)
    turn = Turn(tools=tools, max_tokens=body.get("max_output_tokens"))
    said: list[tuple[int, str, str, int]] = []  # the message items: where, role, text, images
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise Refused(f"Invalid value: '{item.get('role')}'.", f"input[{i}].role", "invalid_value")
            text, images = _text_of(item.get("content"), f"input[{i}].content")
            tokens += words(text) + ["<image>"] * (images * IMAGE_TOKENS)
            turn.tool_result = None
            turn.last_user_text, turn.images = (text, images) if item["role"] != "assistant" else ("", 0)
            said.append((i, item["role"], text, images))
        elif kind in ("function_call", "custom_tool_call"):
            argument = "arguments" if kind == "function_call" else "input"
            for key in ("call_id", "name", argument):
                if not isinstance(item.get(key), str):
                    where = f"input[{i}].{key}"
                    raise Refused(
                        f"Missing required parameter: '{where}'.", where, "missing_required_parameter"
                    )
            calls[item["call_id"]] = (kind, item["name"])
            tokens += words(item["name"]) + words(item[argument])
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            called = calls.get(call_id)
            if called is None or called[0] != kind.removesuffix("_output"):
                what = kind.removesuffix("_output").replace("_", " ")
                raise Refused(f"No {what} found for {kind} with call_id {call_id}.", "input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"input[{i}].output")[0]
            tokens += words(text)
            turn.tool_result, turn.last_user_text = (called[1], text), ""
        elif kind == "reasoning":
            encrypted = item.get("encrypted_content")
            if not (isinstance(encrypted, str) and encrypted.startswith(ENCRYPTED)):
                # OpenAI's, with nothing stored: the id alone names an item it never kept.
                raise Refused(
                    f"Item with id '{item.get('id')}' not found. Items are not persisted when `store` is "
                    "set to false. Try again with `store` set to true, or remove this item from your input.",
                    "input",
                )
        elif kind in _BUILTIN_ITEMS:
            pass
        else:
            raise Refused(f"Invalid value: '{kind}'.", f"input[{i}].type", "invalid_value")
    _continuation(turn, len(items), said)
    choice = body.get("tool_choice")
    if choice == "none":
        turn.tools_disabled = True
    elif choice == "required":
        turn.forced_tool = "required"
    elif isinstance(choice, dict):
        turn.forced_tool = choice.get("name")
    form = (body.get("text") or {}).get("format") or {}
    if form.get("type") in ("json_object", "json_schema"):
        turn.json_mode = True
        turn.json_schema = form.get("schema") if form.get("type") == "json_schema" else None
    return turn, tokens


def _continuation(turn: Turn, count: int, said: list[tuple[int, str, str, int]]) -> None:
    """Input that ends with an assistant message and Weir's user turn asking for the rest of it
    (`asks_to_continue`): the reply continues that message, as the chat fake's does."""
    if len(said) < 2:
        return
    (before, role, partial, _), (last, asker, asked, _) = said[-2], said[-1]
    if last != count - 1 or before != last - 1 or role != "assistant" or asker == "assistant":
        return
    if not asks_to_continue(asked):
        return
    turn.prefill = partial
    turn.last_user_text, turn.images = next(
        ((text, images) for _, who, text, images in reversed(said[:-2]) if who != "assistant"), ("", 0)
    )


def _reasoning_tokens(body: dict[str, Any]) -> int:
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is None and not body["model"].startswith(("o1", "o3", "o4", "gpt-5", "codex")):
        return 0
    return _REASONING_TOKENS.get(effort or "medium", _REASONING_TOKENS["medium"])


def _usage(usage: ReportedUsage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_input_tokens},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def _output(body: dict[str, Any], reply: Reply, reasoning: int) -> list[dict[str, Any]]:
    """The output items, whole: a reasoning item (its summary empty unless asked for, as OpenAI gives
    one; its encrypted content where `include` asks), then the call or the message."""
    output: list[dict[str, Any]] = []
    if reasoning:
        item: dict[str, Any] = {"type": "reasoning", "id": f"rs_{secrets.token_hex(24)}", "summary": []}
        if (body.get("reasoning") or {}).get("summary"):
            item["summary"] = [{"type": "summary_text", "text": SUMMARY}]
        if "reasoning.encrypted_content" in (body.get("include") or ()):
            item["encrypted_content"] = ENCRYPTED + secrets.token_urlsafe(48)
        output.append(item)
    custom = {tool.get("name") for tool in body.get("tools") or () if tool.get("type") == "custom"}
    if reply.tool_name in custom:
        call_id = f"call_{secrets.token_urlsafe(18)}"
        text = str((reply.tool_args or {}).get("input", ""))
        call = {"type": "custom_tool_call", "id": f"ctc_{secrets.token_hex(24)}", "status": "completed"}
        output.append(call | {"call_id": call_id, "name": reply.tool_name, "input": text})
    elif reply.tool_name:
        call = {
            "type": "function_call",
            "id": f"fc_{secrets.token_hex(24)}",
            "call_id": f"call_{secrets.token_urlsafe(18)}",
        }
        output.append(
            call | {"name": reply.tool_name, "arguments": reply.arguments_json, "status": "completed"}
        )
    else:
        text = {"type": "output_text", "annotations": [], "logprobs": [], "text": reply.text}
        message = {"type": "message", "id": f"msg_{secrets.token_hex(24)}", "status": "completed"}
        output.append(message | {"role": "assistant", "content": [text]})
    return output


def _response(
    body: dict[str, Any], status: str, output: list[Any], usage: dict[str, Any] | None
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": body["_id"], "object": "response", "created_at": body["_created"], "status": status,
        "background": False, "error": None, "incomplete_details": incomplete,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": body["model"], "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None, "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
        "service_tier": "default", "store": body.get("store", True), "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "top_p": body.get("top_p", 1.0), "truncation": "disabled",
        "usage": usage, "user": body.get("user"), "metadata": body.get("metadata") or {},
    }  # fmt: skip


async def respond(fake: FakeOpenAI, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    try:
        turn, prompt = _turn(body)
    except Refused as exc:
        return fake.error_response(400, exc.message, param=exc.param, code=exc.code)
    turn.rejoin = fake.rejoin if turn.prefill is not None else None
    reply = fake.reply_to(body["model"], turn)
    reasoning = _reasoning_tokens(body)
    cached = fake.cache.lookup_and_store(prompt)
    reported, raw = fake.take_usage(
        ReportedUsage(
            input_tokens=len(prompt) - cached,
            cached_input_tokens=cached,
            output_tokens=reply.output_tokens + reasoning,
            reasoning_tokens=reasoning,
        )
    )
    usage = _usage(reported) | (raw or {})
    body = body | {
        "_id": f"resp_{secrets.token_hex(24)}",
        "_created": int(time.time()),
    }  # not the recorded one
    status = "incomplete" if reply.finish == "length" else "completed"
    output = _output(body, reply, reasoning)
    if not body.get("stream"):
        return fake.json_response(request, _response(body, status, output, usage))
    async with fake.open_stream(request) as stream:
        for event in _events(body, reply, output, status, usage):
            await stream.send(sse(event, event=event["type"]))
    return stream.response


def _events(
    body: dict[str, Any], reply: Reply, output: list[dict[str, Any]], status: str, usage: dict[str, Any]
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    emit("response.created", response=_response(body, "in_progress", [], None))
    emit("response.in_progress", response=_response(body, "in_progress", [], None))
    for index, item in enumerate(output):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "custom_tool_call":
            emit("response.output_item.added", output_index=index, item=item | {"input": ""})
            for piece in chunk_words(item["input"]):
                emit("response.custom_tool_call_input.delta", **where, delta=piece)
            emit("response.custom_tool_call_input.done", **where, input=item["input"])
        elif item["type"] == "reasoning" and item["summary"]:
            emit("response.output_item.added", output_index=index, item=item | {"summary": []})
            empty = {"type": "summary_text", "text": ""}
            emit("response.reasoning_summary_part.added", **where, summary_index=0, part=empty)
            for piece in chunk_words(SUMMARY):
                emit("response.reasoning_summary_text.delta", **where, summary_index=0, delta=piece)
            emit("response.reasoning_summary_text.done", **where, summary_index=0, text=SUMMARY)
            emit("response.reasoning_summary_part.done", **where, summary_index=0, part=item["summary"][0])
        elif item["type"] == "function_call":
            emit(
                "response.output_item.added",
                output_index=index,
                item=item | {"arguments": "", "status": "in_progress"},
            )
            for piece in chunk_words(item["arguments"]):
                emit("response.function_call_arguments.delta", **where, delta=piece)
            emit("response.function_call_arguments.done", **where, arguments=item["arguments"])
        elif item["type"] == "message":
            emit(
                "response.output_item.added",
                output_index=index,
                item=item | {"status": "in_progress", "content": []},
            )
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
            emit("response.content_part.added", **where, content_index=0, part=part)
            for piece in chunk_words(reply.text):
                emit("response.output_text.delta", **where, content_index=0, delta=piece, logprobs=[])
            emit("response.output_text.done", **where, content_index=0, text=reply.text, logprobs=[])
            emit("response.content_part.done", **where, content_index=0, part=item["content"][0])
        else:
            emit("response.output_item.added", output_index=index, item=item)
        emit("response.output_item.done", output_index=index, item=item)
    emit(f"response.{status}", response=_response(body, status, output, usage))
    return events


def stream_error_event(message: str | None) -> bytes:
    """What a Responses stream that fails midway ends with: OpenAI's `error` event."""
    error = {"type": "error", "code": "server_error", "param": None, "sequence_number": 0}
    error["message"] = message or "The server had an error while processing your request. Sorry about that!"
    return sse(error, event="error")
