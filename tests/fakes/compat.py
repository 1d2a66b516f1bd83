"""A scripted OpenAI-compatible server (a bare ASGI app) for the ways real servers' replies differ from
OpenAI's own (and so from `FakeOpenAI`), by upstream model:

- `mistral-small`: Mistral's (and Together's, llama.cpp's) streams, whose last chunk carries the finish
  reason and the usage together, on chat (text "Hello there") and legacy completions (" world");
  finish `length` under a `max_tokens` below 3, else `stop`;
- `vllm-reasoner`: vLLM 0.17+'s (and OpenRouter's) `reasoning` delta field, with OpenRouter's
  `reasoning_details` beside it, then the answer "4";
- `gpt-4o-audio-preview`: a whole answer with fields Weir does not model, the message's `audio` and
  the completion's `service_tier`, beside the message's `annotations` (a citation);
- `vllm-served`: vLLM's own fields beside OpenAI's, whole and streamed ("Hello there"): each choice's
  `stop_reason` (the stop string that ended it, "END"), and with `return_token_ids` the choices'
  `token_ids` and the prompt's `prompt_token_ids` (on a stream's first chunk); a stream asked for
  `stream_options.continuous_usage_stats` reports the usage so far on every chunk;
- `cut-short`: a stream that breaks after "Hello" (no finish reason, no `[DONE]`);
- `ollama-parallel`: Ollama's (and SGLang's, Dynamo's) parallel tool calls, streamed: each call whole in
  a chunk of its own, every one at `index: 0`, told apart only by its `id` (`OLLAMA_CALLS`);
- `sglang-parallel`: SGLang's parallel tool calls (`SGLANG_CALLS`), streamed all at `index: 0` too, each
  starting with a delta of its id, name and `arguments: ""`, its arguments in pieces after it without
  id or name; a call without arguments has only that `""`, streamed and whole.

Every stream ends with `data: [DONE]` unless cut; `GET` (a prober) gets an empty model list.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
AUDIO = {"id": "audio_1", "data": "UklGRg==", "expires_at": 1900000000, "transcript": "Hi there"}
CITATION = {
    "type": "url_citation",
    "url_citation": {"start_index": 0, "end_index": 4, "title": "T", "url": "https://example.com/"},
}


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": [choice],
    } | extra


def _finish(request: dict[str, Any]) -> str:
    limit = request.get("max_tokens") or request.get("max_completion_tokens")
    return "length" if limit is not None and limit < 3 else "stop"


PROMPT_IDS = [1, 15043]
# vLLM's answer: (delta, finish reason, the delta's token ids).
VLLM_ANSWER: list[tuple[dict[str, Any], str | None, list[int]]] = [
    ({"role": "assistant", "content": ""}, None, []),
    ({"content": "Hello"}, None, [9906]),
    ({"content": " there"}, None, [1070]),
    ({"content": ""}, "stop", []),
]


def _vllm_usage(completion_tokens: int) -> dict[str, int]:
    prompt = USAGE["prompt_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def _vllm_stream(request: dict[str, Any]) -> list[dict[str, Any]]:
    model, ids = request["model"], bool(request.get("return_token_ids"))
    options = request.get("stream_options") or {}
    chunks, generated = [], 0
    for delta, finish, tokens in VLLM_ANSWER:
        generated += len(tokens)
        chunk = _chunk(model, delta, finish)
        choice = chunk["choices"][0]
        if finish:
            choice["stop_reason"] = "END"
        if ids:
            choice["token_ids"] = tokens
            if not chunks:
                chunk["prompt_token_ids"] = PROMPT_IDS
        if options.get("continuous_usage_stats"):
            chunk["usage"] = _vllm_usage(generated)
        chunks.append(chunk)
    if options.get("include_usage"):
        chunks.append(_chunk(model, {}) | {"choices": [], "usage": _vllm_usage(generated)})
    return chunks


# Ollama's answer to a request for two calls at once: (id, name, arguments).
OLLAMA_CALLS = [
    ("call_lima01", "get_weather", '{"city": "Lima"}'),
    ("call_quito2", "get_time", '{"city": "Quito"}'),
]


def _ollama_stream(model: str) -> list[dict[str, Any]]:
    calls = [
        {"id": id_, "index": 0, "type": "function", "function": {"name": name, "arguments": arguments}}
        for id_, name, arguments in OLLAMA_CALLS
    ]
    return [
        _chunk(model, {"role": "assistant", "content": ""}),
        *(_chunk(model, {"role": "assistant", "content": "", "tool_calls": [call]}) for call in calls),
        _chunk(model, {"role": "assistant", "content": ""}, "tool_calls", usage=USAGE),
    ]


# SGLang's answer to a request for three calls at once: (id, name, pieces of its arguments); the
# first and last calls take no arguments.
SGLANG_CALLS: list[tuple[str, str, list[str]]] = [
    ("call_now0001", "now", []),
    ("call_lima002", "get_weather", ['{"city": ', '"Lima"}']),
    ("call_date003", "today", []),
]


def _sglang_stream(model: str) -> list[dict[str, Any]]:
    chunks = [_chunk(model, {"role": "assistant", "content": ""})]
    for id_, name, pieces in SGLANG_CALLS:
        start = {"id": id_, "index": 0, "type": "function", "function": {"name": name, "arguments": ""}}
        chunks.append(_chunk(model, {"tool_calls": [start]}))
        for piece in pieces:
            more = {
                "id": None,
                "index": 0,
                "type": "function",
                "function": {"name": None, "arguments": piece},
            }
            chunks.append(_chunk(model, {"tool_calls": [more]}))
    return [*chunks, _chunk(model, {}, "tool_calls", usage=USAGE)]


def _sglang_completion(model: str) -> dict[str, Any]:
    calls = [
        {"id": id_, "index": i, "type": "function", "function": {"name": name, "arguments": "".join(pieces)}}
        for i, (id_, name, pieces) in enumerate(SGLANG_CALLS)
    ]
    message = {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": calls}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}],
        "usage": USAGE,
    }


def _reasoning(text: str) -> dict[str, Any]:
    """A delta of reasoning as OpenRouter streams it: `reasoning`, and its own `reasoning_details`."""
    return {"reasoning": text, "reasoning_details": [{"type": "reasoning.text", "text": text, "index": 0}]}


def _chat_stream(request: dict[str, Any]) -> list[dict[str, Any]]:
    model = request["model"]
    if model == "vllm-served":
        return _vllm_stream(request)
    if model == "mistral-small":
        return [
            _chunk(model, {"role": "assistant", "content": ""}),
            _chunk(model, {"content": "Hello"}),
            _chunk(model, {"content": " there"}),
            # Mistral: the finish reason and the usage come in one last chunk.
            _chunk(model, {"content": ""}, _finish(request), usage=USAGE),
        ]
    if model == "ollama-parallel":
        return _ollama_stream(model)
    if model == "sglang-parallel":
        return _sglang_stream(model)
    if model == "cut-short":
        return [_chunk(model, {"role": "assistant", "content": ""}), _chunk(model, {"content": "Hello"})]
    assert model == "vllm-reasoner", model
    return [
        _chunk(model, {"role": "assistant", "content": ""}),
        _chunk(model, _reasoning("two plus two")),
        _chunk(model, _reasoning(" is four")),
        _chunk(model, {"content": "4"}),
        _chunk(model, {}, "stop"),
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": model,
            "choices": [],
            "usage": USAGE,
        },
    ]


def _completion_stream(request: dict[str, Any]) -> list[dict[str, Any]]:
    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": request["model"],
            "choices": [choice],
        }

    return [chunk(" wor"), chunk("ld"), chunk("", _finish(request)) | {"usage": USAGE}]


def _vllm_completion(request: dict[str, Any]) -> dict[str, Any]:
    message = {"role": "assistant", "content": "Hello there", "refusal": None, "tool_calls": []}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop", "stop_reason": "END"}
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": request["model"],
        "choices": [choice],
        "usage": _vllm_usage(2),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
    if request.get("return_token_ids"):
        choice["token_ids"] = [9906, 1070]
        completion["prompt_token_ids"] = PROMPT_IDS
    return completion


def _completion(model: str) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [CITATION],
        "audio": AUDIO,
    }
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE,
        "service_tier": "default",
    }


async def _body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def _respond(send: Send, content_type: bytes, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})


async def compat_server(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["method"] == "GET":
        await _respond(send, b"application/json", b'{"object": "list", "data": []}')
        return
    request = json.loads(await _body(receive))
    if not request.get("stream"):
        model = request["model"]
        if model == "vllm-served":
            completion = _vllm_completion(request)
        elif model == "sglang-parallel":
            completion = _sglang_completion(model)
        else:
            completion = _completion(model)
        await _respond(send, b"application/json", json.dumps(completion).encode())
        return
    chunks = _completion_stream(request) if scope["path"] == "/v1/completions" else _chat_stream(request)
    frames = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    if request["model"] != "cut-short":
        frames += b"data: [DONE]\n\n"
    await _respond(send, b"text/event-stream", frames)
