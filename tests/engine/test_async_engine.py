"""The engine loop off the event loop: fan-out to concurrent consumers, aborts when a consumer leaves,
rejections, idling, shutdown and engine failure. Real `LLMEngine`, tiny random model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.config import KNOWN_MODELS
from engine.grammar import Grammars
from engine.llm_engine import LLMEngine
from engine.sampling import JsonFormat, SamplingParams
from tests.engine.engine_server import all_blocks_free

GREEDY = SamplingParams(max_tokens=10, temperature=0)


def new_engine() -> LLMEngine:
    return LLMEngine.from_config(KNOWN_MODELS["tiny"], num_kv_blocks=64, max_num_batched_tokens=128)


async def eventually(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


@pytest.fixture
async def engines() -> AsyncIterator[tuple[LLMEngine, AsyncLLMEngine]]:
    engine = new_engine()
    wrapper = AsyncLLMEngine(engine)
    wrapper.start()
    yield engine, wrapper
    await wrapper.shutdown()
    assert all_blocks_free(engine), engine.stats()


async def collect(wrapper: AsyncLLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    ids: list[int] = []
    async for out in wrapper.generate(prompt, params):
        ids.extend(out.new_token_ids)
    assert out.finished
    return ids


async def test_concurrent_requests_get_their_own_outputs(engines: tuple[LLMEngine, AsyncLLMEngine]) -> None:
    _, wrapper = engines
    prompts = [list(f"prompt {i} ".encode() * (i + 1)) for i in range(12)]
    together = await asyncio.gather(*(collect(wrapper, p) for p in prompts))
    expected = new_engine().generate(prompts, GREEDY)
    assert together == expected
    assert all(len(ids) == 10 for ids in together)


async def test_outputs_arrive_token_by_token_with_usage_counters(
    engines: tuple[LLMEngine, AsyncLLMEngine],
) -> None:
    _, wrapper = engines
    outputs = [out async for out in wrapper.generate(list(b"count me"), GREEDY)]
    assert [o.num_output_tokens for o in outputs if o.new_token_ids] == list(range(1, 11))
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert all(o.num_prompt_tokens == len(b"count me") for o in outputs)


async def test_leaving_the_iteration_aborts_and_frees_blocks(
    engines: tuple[LLMEngine, AsyncLLMEngine],
) -> None:
    engine, wrapper = engines
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    async for out in wrapper.generate(list(b"z" * 100), long):
        if out.num_output_tokens >= 3:
            break
    assert await eventually(lambda: all_blocks_free(engine))


async def test_cancelling_the_consumer_aborts_the_request(engines: tuple[LLMEngine, AsyncLLMEngine]) -> None:
    engine, wrapper = engines
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    task = asyncio.create_task(collect(wrapper, list(b"w" * 100), long))
    assert await eventually(lambda: engine.stats().num_running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await eventually(lambda: all_blocks_free(engine))
    assert await collect(wrapper, list(b"after")) == new_engine().generate([list(b"after")], GREEDY)[0]


async def test_rejected_request_raises_and_the_engine_keeps_serving(
    engines: tuple[LLMEngine, AsyncLLMEngine],
) -> None:
    engine, wrapper = engines
    with pytest.raises(ValueError, match="context"):
        await collect(wrapper, [65] * (engine.max_model_len + 1))
    with pytest.raises(ValueError, match="top_p"):
        await collect(wrapper, [65], SamplingParams(top_p=0))
    assert len(await collect(wrapper, list(b"fine"))) == 10


def _held_compilation(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Grammar compilation that sets the first event on entering, then waits for the second."""
    entered, released = threading.Event(), threading.Event()
    compiled = Grammars._compiled

    def slow(self: Grammars, fmt: JsonFormat) -> object:
        entered.set()
        released.wait(timeout=30)
        return compiled(self, fmt)

    monkeypatch.setattr(Grammars, "_compiled", slow)
    return entered, released


async def test_a_grammar_compiles_off_the_engine_thread_while_others_generate(
    engines: tuple[LLMEngine, AsyncLLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large JSON Schema compiles for seconds (an enum of 20,000 values: 13 s here); compiled in
    add_request, on the engine's thread, it stalled every running request's generation meanwhile. Here
    a compilation that waits for a signal: the other request must finish before it is given."""
    _, wrapper = engines
    entered, released = _held_compilation(monkeypatch)
    structured = asyncio.ensure_future(
        collect(wrapper, [5, 6, 7], SamplingParams(max_tokens=8, seed=1, json_format=JsonFormat()))
    )
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        other = await asyncio.wait_for(collect(wrapper, [9, 10, 11]), timeout=10)
        assert len(other) == 10
    finally:
        released.set()
    assert len(await structured) >= 1


async def test_a_request_whose_grammar_compiled_through_shutdown_is_told_not_left_waiting(
    engines: tuple[LLMEngine, AsyncLLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine stopping while a request's grammar compiles (off its thread): the request is then
    submitted to no engine, and must be told so rather than wait forever."""
    _, wrapper = engines
    entered, released = _held_compilation(monkeypatch)
    structured = asyncio.ensure_future(
        collect(wrapper, [5, 6, 7], SamplingParams(max_tokens=8, json_format=JsonFormat('{"type": "array"}')))
    )
    assert await asyncio.to_thread(entered.wait, 10)
    await wrapper.shutdown()
    released.set()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(structured, timeout=10)


async def test_the_thread_sleeps_when_idle(engines: tuple[LLMEngine, AsyncLLMEngine]) -> None:
    _, wrapper = engines
    await collect(wrapper, list(b"one"))
    steps = wrapper.timing.steps
    await asyncio.sleep(0.3)
    assert wrapper.timing.steps == steps
    assert wrapper.is_running
    await collect(wrapper, list(b"two"))  # and wakes up for the next request
    assert wrapper.timing.steps > steps


async def test_shutdown_aborts_requests_in_flight() -> None:
    engine = new_engine()
    wrapper = AsyncLLMEngine(engine)
    wrapper.start()
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    task = asyncio.create_task(collect(wrapper, list(b"q" * 50), long))
    assert await eventually(lambda: engine.stats().num_running == 1)
    await wrapper.shutdown()
    with pytest.raises(EngineDeadError):
        await task
    assert all_blocks_free(engine)


async def test_an_engine_failure_reaches_every_consumer() -> None:
    engine = new_engine()
    wrapper = AsyncLLMEngine(engine)
    wrapper.start()

    def broken_step() -> list:  # type: ignore[type-arg]
        raise RuntimeError("device lost")

    engine.step = broken_step  # type: ignore[method-assign]
    results = await asyncio.gather(
        *(collect(wrapper, list(b"x" * (i + 1))) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results)
    assert not wrapper.is_running and isinstance(wrapper.error, RuntimeError)
    with pytest.raises(EngineDeadError):
        await collect(wrapper, list(b"later"))
    await wrapper.shutdown()
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total  # aborted on the way down
    del engine.step  # the "device" is back: the aborts are reported and the engine is empty again
    while engine.has_unfinished_requests():
        engine.step()
