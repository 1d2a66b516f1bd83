"""A near-zero-cost OpenAI-shaped upstream for gateway benchmarks.

Every chat completion gets the same precomputed body (or, for ``"stream": true``, the same
precomputed SSE chunks), so the time measured through a gateway is the gateway's, not the upstream's.

    python benchmarks/mock_upstream.py --port 9000 [--stream-chunks 16]

Endpoints: ``POST /v1/chat/completions``, ``GET /v1/models``. Any API key is accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

MODEL = "gpt-4o-mini"

COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello from the mock upstream.", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 6,
            "total_tokens": 18,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        },
        "system_fingerprint": "fp_bench",
    }
).encode()

MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}
).encode()


def stream_body(chunks: int) -> bytes:
    """The whole SSE body of a streamed reply: role chunk, `chunks` one-word chunks, finish, usage, [DONE]."""

    def frame(choices: list[dict], usage: dict | None = None) -> bytes:
        payload = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": choices,
            "usage": usage,
        }
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    def delta(d: dict, finish: str | None = None) -> dict:
        return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}

    parts = [frame([delta({"role": "assistant", "content": ""})])]
    parts += [frame([delta({"content": f" word{i}"})]) for i in range(chunks)]
    parts.append(frame([delta({}, "stop")]))
    parts.append(frame([], {"prompt_tokens": 12, "completion_tokens": chunks, "total_tokens": 12 + chunks}))
    parts.append(b"data: [DONE]\n\n")
    return b"".join(parts)


def make_app(stream_chunks: int = 16) -> web.Application:
    streamed = stream_body(stream_chunks)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        # a byte search instead of json.loads keeps the upstream's cost near zero
        if b'"stream":true' in body or b'"stream": true' in body:
            return web.Response(body=streamed, content_type="text/event-stream")
        return web.Response(body=COMPLETION, content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=MODELS, content_type="application/json")

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", chat), web.get("/v1/models", models)])
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--stream-chunks", type=int, default=16)
    args = parser.parse_args()
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    web.run_app(make_app(args.stream_chunks), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
