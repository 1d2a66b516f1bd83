"""The real SmolLM2-135M-Instruct behind the server, chatted with through the openai SDK (slow: loads
and dequantises the GGUF; pulls it into the model directory first if it is missing)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from openai import AsyncOpenAI

from engine import registry
from engine.async_engine import AsyncLLMEngine
from engine.llm_engine import LLMEngine
from engine.server import EngineServer, start_server
from tests.fixtures.net import free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def smollm2() -> LLMEngine:
    registry.pull(MODEL, quiet=True)  # no-op when already pulled
    return LLMEngine(MODEL, num_kv_blocks=256, max_num_batched_tokens=512, progress=False)


@pytest.fixture
async def client(smollm2: LLMEngine) -> AsyncIterator[AsyncOpenAI]:
    server = EngineServer(AsyncLLMEngine(smollm2), model_name=MODEL)
    port = free_port()
    runner = await start_server(server, "127.0.0.1", port)
    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as c:
        yield c
    await runner.cleanup()
    stats = smollm2.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_chat_with_smollm2(client: AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)  # type: ignore[arg-type]
    assert "Paris" in (resp.choices[0].message.content or "")
    assert resp.choices[0].finish_reason == "stop"  # the model ends its turn with <|im_end|>
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=30,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == resp.choices[0].message.content
    )
    usage = chunks[-1].usage
    assert usage and usage.prompt_tokens_details
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its full blocks are cached
    assert usage.completion_tokens == resp.usage.completion_tokens  # type: ignore[union-attr]


async def test_prompt_logprobs_prefer_the_true_continuation(client: AsyncOpenAI) -> None:
    async def score(text: str) -> float:
        resp = await client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=0)
        lps = resp.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
        assert lps is not None and lps[0] is None
        return lps[-1]  # type: ignore[return-value]

    assert await score("The capital of France is Paris") > await score("The capital of France is Tokyo")
