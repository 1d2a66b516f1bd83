"""The engine's OpenAI-compatible server on a free loopback port, and the check a test makes once its
requests are done: the engine idle with every KV block free."""

from __future__ import annotations

from engine.async_engine import AsyncLLMEngine
from engine.llm_engine import LLMEngine
from engine.server import EngineServer, start_server
from tests.fixtures.net import free_port

NUM_BLOCKS = 64  # 64 blocks of 16 tokens: a 1024-token context


async def start(engine: LLMEngine | None, **server_kwargs: object) -> tuple[EngineServer, object, str]:
    """The server on `engine` (None: one still loading its model), started; it, its runner (for
    `cleanup()`) and its base URL (`.../v1`)."""
    server = EngineServer(AsyncLLMEngine(engine) if engine else None, **server_kwargs)  # type: ignore[arg-type]
    port = free_port()
    runner = await start_server(server, "127.0.0.1", port)
    return server, runner, f"http://127.0.0.1:{port}/v1"


def all_blocks_free(engine: LLMEngine) -> bool:
    s = engine.stats()
    idle = s.num_running == 0 and s.num_waiting == 0 and not engine.has_unfinished_requests()
    return idle and s.kv_blocks_free == s.kv_blocks_total
