"""A stand-in for `weir engine serve` in supervisor tests: /health and an OpenAI-shaped chat reply.

python tests/gateway/fake_engine.py PORT [LOADED_FILE]

With LOADED_FILE, /health says 503 "loading" (as the engine's own does while its model loads) until that
file exists: a test decides when the engine is up.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from aiohttp import web

LOADED_FILE = Path(sys.argv[2]) if len(sys.argv) > 2 else None


async def health(request: web.Request) -> web.Response:
    if LOADED_FILE is not None and not LOADED_FILE.exists():
        return web.json_response({"status": "loading", "detail": None}, status=503)
    return web.json_response({"status": "ok"})


async def chat(request: web.Request) -> web.Response:
    body = await request.json()
    text = f"engine pid {os.getpid()} says: {body['messages'][-1]['content']}"
    return web.json_response(
        {
            "id": "chatcmpl-engine",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
        },
        dumps=json.dumps,
    )


def main() -> None:
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
