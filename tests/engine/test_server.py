"""The engine's OpenAI-compatible server, driven with the official `openai` SDK against a real server on
127.0.0.1 running the real `LLMEngine` with a tiny random-weight model (byte-level tokenizer)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError
from openai import AsyncOpenAI
from tokenizers import AddedToken, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.async_engine import AsyncLLMEngine
from engine.config import KNOWN_MODELS
from engine.llm_engine import LLMEngine
from engine.server import EngineServer
from engine.tokenizer import Tokenizer
from routing.load import parse_orca
from tests.engine.engine_server import NUM_BLOCKS, all_blocks_free, start

MODEL = "tiny"


@dataclass
class Served:
    engine: LLMEngine
    server: EngineServer
    base_url: str
    client: AsyncOpenAI

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")


async def wait_until(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    engine = LLMEngine.from_config(KNOWN_MODELS["tiny"], num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=256)
    server, runner, base_url = await start(engine, model_name=MODEL)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    yield Served(engine, server, base_url, client)
    await client.close()
    await runner.cleanup()  # type: ignore[attr-defined]
    assert all_blocks_free(engine), engine.stats()


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# --- chat ---------------------------------------------------------------------------------------------


async def test_chat_completion(served: Served) -> None:
    resp = await served.client.chat.completions.create(
        model=MODEL, messages=chat("hello there"), max_tokens=8, temperature=0
    )
    prompt = served.engine.tokenizer.apply_chat_template(chat("hello there"), add_generation_prompt=True)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(served.engine.tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


async def test_greedy_output_is_what_the_engine_generates(served: Served) -> None:
    messages = chat("tell me something")
    resp = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0
    )
    tok = served.engine.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    reference = LLMEngine.from_config(
        KNOWN_MODELS["tiny"], num_kv_blocks=NUM_BLOCKS
    )  # same seed, same weights
    from engine.sampling import SamplingParams

    [ids] = reference.generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0))
    assert resp.choices[0].message.content == tok.decode(ids)


async def test_repeated_prompt_reports_cached_tokens(served: Served) -> None:
    messages = chat("a long shared system prompt that spans several KV blocks " * 4)
    first = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0
    )
    second = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0
    )
    assert first.usage and second.usage
    assert first.usage.prompt_tokens_details and second.usage.prompt_tokens_details
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    prompt_tokens = second.usage.prompt_tokens
    assert cached > 0 and cached % 16 == 0  # whole blocks
    assert prompt_tokens - 16 < cached < prompt_tokens  # all full blocks but the last token's
    assert second.choices[0].message.content == first.choices[0].message.content


async def test_streaming_matches_non_streaming_and_ends_with_usage(served: Served) -> None:
    messages = chat("stream this")
    whole = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    stream = await served.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])
    assert len(chunks) > 3  # token by token, not one blob


async def test_chat_logprobs(served: Served) -> None:
    resp = await served.client.chat.completions.create(
        model=MODEL,
        messages=chat("logprobs please"),
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob
        assert bytes(entry.bytes or []) == bytes(entry.top_logprobs[0].bytes or [])


async def test_stop_string_trims_text_and_finishes_with_stop(served: Served) -> None:
    messages = chat("say something long")
    free = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    text = free.choices[0].message.content or ""
    assert len(text) >= 6
    stop = text[4:6]
    expected = text[: text.find(stop)]
    stopped = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage and stopped.usage.completion_tokens < 24
    # Which stop string ended it, as vLLM says it (`stop_reason`): an Anthropic client's stop_sequence.
    assert stopped.choices[0].model_extra == {"stop_reason": stop}
    assert free.choices[0].model_extra == {"stop_reason": None}  # no stop string or token ended it
    stream = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=["\0never", stop], stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra == {"stop_reason": stop}


async def test_include_stop_str_in_output_keeps_the_stop_string(served: Served) -> None:
    """vLLM's `include_stop_str_in_output`: the text ends with the stop string that ended it (it was
    ignored, the stop string cut off)."""
    kwargs = dict(model=MODEL, messages=chat("say something long"), max_tokens=24, temperature=0)
    free = (await served.client.chat.completions.create(**kwargs)).choices[0].message.content or ""  # type: ignore[call-overload]
    stop = free[4:6]
    expected = free[: free.find(stop) + len(stop)]
    extra = {"include_stop_str_in_output": True}
    whole = await served.client.chat.completions.create(**kwargs, stop=[stop], extra_body=extra)  # type: ignore[call-overload]
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "stop"
    stream = await served.client.chat.completions.create(**kwargs, stop=[stop], stream=True, extra_body=extra)  # type: ignore[call-overload]
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == expected
    completion = await served.client.completions.create(
        model=MODEL, prompt="say", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = completion.choices[0].text
    cut = await served.client.completions.create(
        model=MODEL,
        prompt="say",
        max_tokens=24,
        temperature=0,
        stop=text[3:5],
        extra_body={"ignore_eos": True, **extra},
    )
    assert cut.choices[0].text == text[: text.find(text[3:5]) + 2]


async def finished_choices(served: Served, endpoint: str, stream: bool, body: dict) -> list[dict]:
    """The choice as the server wrote it (JSON, so `stop_reason`'s type shows); streamed, each chunk's,
    those that end the choice last."""
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        resp = await http.post(endpoint, json={"model": MODEL, "temperature": 0, "stream": stream, **body})
    assert resp.status_code == 200, resp.text
    if not stream:
        return list(resp.json()["choices"])
    lines = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
    return [choice for line in lines if line != "[DONE]" for choice in json.loads(line)["choices"]]


STOP_TOKEN, EOS = 7, 0  # the tiny model's EOS is token 0; a logit bias of 100 makes a token the greedy one


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("endpoint", "prompt"),
    [("/completions", {"prompt": "once upon"}), ("/chat/completions", {"messages": chat("once upon")})],
)
@pytest.mark.parametrize(
    ("extra", "finish_reason", "stop_reason"),
    [
        ({"logit_bias": {str(STOP_TOKEN): 100}, "stop_token_ids": [STOP_TOKEN]}, "stop", STOP_TOKEN),
        # EOS is said as EOS (null) though listed in stop_token_ids, as vLLM checks it first ...
        ({"logit_bias": {str(EOS): 100}, "stop_token_ids": [EOS]}, "stop", None),
        # ... but not with ignore_eos, where it ends the answer as a stop token only.
        ({"logit_bias": {str(EOS): 100}, "stop_token_ids": [EOS], "ignore_eos": True}, "stop", EOS),
        ({"logit_bias": {str(EOS): 100}}, "stop", None),
        ({"ignore_eos": True}, "length", None),
    ],
)
async def test_stop_reason_says_which_stop_token_ended_a_choice(
    served: Served,
    endpoint: str,
    prompt: dict,
    stream: bool,
    extra: dict,
    finish_reason: str,
    stop_reason: int | None,
) -> None:
    """vLLM's `stop_reason` on every finished choice, both endpoints, streamed or not: the
    stop_token_ids token that ended it, null for EOS and the length limit (it was missing there, and
    on completions always)."""
    choices = await finished_choices(served, endpoint, stream, {**prompt, "max_tokens": 3, **extra})
    *before, last = choices
    assert last["finish_reason"] == finish_reason
    assert "stop_reason" in last and last["stop_reason"] == stop_reason
    assert all(c["finish_reason"] is None and "stop_reason" not in c for c in before)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completions_stop_reason_names_the_stop_string(served: Served, stream: bool) -> None:
    body = {"prompt": "once upon", "max_tokens": 24, "ignore_eos": True}
    (free,) = await finished_choices(served, "/completions", False, body)
    stop = free["text"][3:5]
    choices = await finished_choices(served, "/completions", stream, {**body, "stop": ["\0never", stop]})
    assert "".join(c["text"] for c in choices) == free["text"][: free["text"].find(stop)]
    assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == stop


async def test_a_stop_string_inside_a_speculative_step_bills_only_the_tokens_up_to_it() -> None:
    """A speculative step emits several tokens at once; when a stop string ends inside them, the
    answer and its usage stop at the token that completed it, as without speculation (usage counted
    the whole step's tokens, never shown)."""
    engine = LLMEngine.from_config(
        KNOWN_MODELS["tiny"], num_kv_blocks=NUM_BLOCKS, speculative="ngram", num_speculative_tokens=5
    )
    _, runner, base_url = await start(engine, model_name=MODEL)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    a = engine.tokenizer.encode("A")[-1]
    try:
        for n in range(2, 12):  # every answer is "AAAA...": the stop string ends at token n
            resp = await client.completions.create(
                model=MODEL,
                prompt="AAAAAAAA",
                max_tokens=30,
                temperature=0,
                stop=["A" * n],
                logit_bias={str(a): 100},
            )
            assert resp.choices[0].text == "" and resp.choices[0].finish_reason == "stop"
            assert resp.usage and resp.usage.completion_tokens == n
        assert engine.speculator and engine.speculator.metrics.mean_tokens_per_step > 1.5
    finally:
        await client.close()
        await runner.cleanup()  # type: ignore[attr-defined]
    assert await wait_until(lambda: all_blocks_free(engine)), engine.stats()


async def test_the_generation_token_metric_stops_at_a_stop_string_inside_a_speculative_step() -> None:
    """weir_engine_generation_tokens counts what usage bills: a speculative step's tokens past the one
    that completed a stop string were counted as generated although never shown nor billed."""
    engine = LLMEngine.from_config(
        KNOWN_MODELS["tiny"], num_kv_blocks=NUM_BLOCKS, speculative="ngram", num_speculative_tokens=5
    )
    _, runner, base_url = await start(engine, model_name=MODEL)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    a = engine.tokenizer.encode("A")[-1]
    billed = 0
    try:
        for n in (3, 5, 8):  # every answer is "AAAA...": the stop string ends inside a step
            resp = await client.completions.create(
                model=MODEL,
                prompt="AAAAAAAA",
                max_tokens=30,
                temperature=0,
                stop=["A" * n],
                logit_bias={str(a): 100},
            )
            assert resp.usage and resp.usage.completion_tokens == n
            billed += resp.usage.completion_tokens
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(base_url.removesuffix("/v1") + "/metrics")).text
    finally:
        await client.close()
        await runner.cleanup()  # type: ignore[attr-defined]
    assert engine.speculator and engine.speculator.metrics.num_emitted_tokens > billed  # cut inside steps
    assert f"weir_engine_generation_tokens_total {float(billed)}" in metrics.splitlines()


async def test_min_tokens_holds_off_eos_and_stop_strings(served: Served) -> None:
    """vLLM's `min_tokens` (ignored before, then refused): EOS cannot end the answer, nor a stop string
    that ends within the text of its first min_tokens tokens."""
    eos = min(served.engine.config.eos_token_ids)
    forced = dict(model=MODEL, messages=chat("hi"), max_tokens=12, temperature=0, logit_bias={str(eos): 100})
    ended = await served.client.chat.completions.create(**forced)  # type: ignore[call-overload]
    assert ended.usage and ended.usage.completion_tokens == 1  # EOS at once
    held = await served.client.chat.completions.create(**forced, extra_body={"min_tokens": 5})  # type: ignore[call-overload]
    assert held.usage and held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    kwargs = dict(model=MODEL, prompt="say", max_tokens=24, temperature=0)
    free = (await served.client.completions.create(**kwargs, extra_body={"ignore_eos": True})).choices[0].text  # type: ignore[call-overload]
    stop = free[:2]  # ends within the first two tokens' text, or three: a character may take two bytes
    cut = await served.client.completions.create(**kwargs, stop=stop, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert cut.choices[0].text == ""
    later = await served.client.completions.create(  # type: ignore[call-overload]
        **kwargs, stop=stop, stream=True, extra_body={"ignore_eos": True, "min_tokens": 8}
    )
    text = "".join([c.choices[0].text async for c in later if c.choices])
    assert text and free.startswith(text)
    with pytest.raises(openai.BadRequestError):
        await served.client.completions.create(**{**kwargs, "max_tokens": 3}, extra_body={"min_tokens": 4})  # type: ignore[call-overload]


async def test_min_tokens_past_a_complete_json_answer_ends_it_and_the_engine_lives() -> None:
    """Once the JSON is complete its grammar allows only EOS, which min_tokens bans: masking both left
    no token at all, and the token drawn anyway (id 0: argmax of a row of -inf) failed the grammar's
    check and stopped the engine. (EOS is not id 0 here, where it would be drawn by luck.)"""
    config = KNOWN_MODELS["tiny"].with_(eos_token_ids=(3,))
    engine = LLMEngine.from_config(config, num_kv_blocks=NUM_BLOCKS)
    _, runner, base_url = await start(engine, model_name=MODEL)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["a"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    try:
        for temperature in (0.0, 1.0):
            resp = await client.completions.create(
                model=MODEL,
                prompt="json:",
                max_tokens=32,
                temperature=temperature,
                extra_body={"guided_json": schema, "min_tokens": 20},
            )
            assert json.loads(resp.choices[0].text) == {"k": "a"}
            assert resp.choices[0].finish_reason == "stop"
        again = await client.completions.create(model=MODEL, prompt="still there?", max_tokens=2)
        assert again.choices[0].finish_reason in ("stop", "length")
    finally:
        await client.close()
        await runner.cleanup()  # type: ignore[attr-defined]
    assert all_blocks_free(engine)


async def test_sampling_parameters_are_accepted_and_seeded_runs_repeat(served: Served) -> None:
    kwargs = dict(
        model=MODEL,
        messages=chat("sample"),
        max_tokens=10,
        temperature=1.3,
        top_p=0.9,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    a = await served.client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    b = await served.client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage and a.usage.completion_tokens == 10


def tool_tokenizer() -> Tokenizer:
    """Byte-level, with a chat template that renders tools (so the server parses tool calls)."""
    template = (
        "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    )
    return Tokenizer(None, chat_template=template, eos_token_ids={0}, vocab_size=256)


async def test_tools_reach_a_template_that_renders_them() -> None:
    tokenizer = tool_tokenizer()
    engine = LLMEngine.from_config(KNOWN_MODELS["tiny"], tokenizer=tokenizer, num_kv_blocks=NUM_BLOCKS)
    _, runner, base_url = await start(engine, model_name=MODEL)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        plain = await client.chat.completions.create(model=MODEL, messages=chat("weather?"), max_tokens=1)
        with_tools = await client.chat.completions.create(
            model=MODEL,
            messages=chat("weather?"),
            max_tokens=1,
            tools=tools,  # type: ignore[arg-type]
        )
    await runner.cleanup()  # type: ignore[attr-defined]
    expected = tokenizer.apply_chat_template(chat("weather?"), tools=tools, add_generation_prompt=True)
    assert with_tools.usage and plain.usage
    assert with_tools.usage.prompt_tokens == len(tokenizer.encode(expected))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + len("get_weather")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


@pytest.fixture
async def tool_client() -> AsyncIterator[AsyncOpenAI]:
    """A tiny engine whose chat template renders tools, so tool calls are parsed from its replies."""
    tokenizer = tool_tokenizer()
    engine = LLMEngine.from_config(KNOWN_MODELS["tiny"], tokenizer=tokenizer, num_kv_blocks=NUM_BLOCKS)
    _, runner, base_url = await start(engine, model_name=MODEL)
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        yield client
    await runner.cleanup()  # type: ignore[attr-defined]
    assert all_blocks_free(engine)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_named_tool_choice_always_gets_a_valid_call(tool_client: AsyncOpenAI, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):  # a random model: only the grammar makes these calls
        kwargs = dict(model=MODEL, messages=chat("weather?"), max_tokens=80, seed=seed, tools=TOOLS)
        if not stream:
            resp = await tool_client.chat.completions.create(**kwargs, tool_choice=choice)  # type: ignore[call-overload]
            assert resp.choices[0].finish_reason == "tool_calls"
            calls = resp.choices[0].message.tool_calls or []
        else:
            chunks = await tool_client.chat.completions.create(**kwargs, tool_choice=choice, stream=True)  # type: ignore[call-overload]
            calls = [
                t for c in [c async for c in chunks] if c.choices for t in c.choices[0].delta.tool_calls or []
            ]
        assert len(calls) == 1 and calls[0].function and calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments or "")["city"] in ("Paris", "Oslo")


async def test_tool_choice_required_picks_one_of_the_tools(tool_client: AsyncOpenAI) -> None:
    names = set()
    for seed in range(4):
        resp = await tool_client.chat.completions.create(
            model=MODEL,
            messages=chat("?"),
            max_tokens=80,
            seed=seed,
            tools=TOOLS,
            tool_choice="required",  # type: ignore[arg-type]
        )
        [call] = resp.choices[0].message.tool_calls or []
        names.add(call.function.name)
        assert isinstance(json.loads(call.function.arguments), dict)
    assert names <= {"get_weather", "get_time"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
async def test_bad_tool_choices_are_400(tool_client: AsyncOpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await tool_client.chat.completions.create(
            model=MODEL,
            messages=chat("?"),
            max_tokens=8,
            tools=TOOLS,
            **extra,  # type: ignore[arg-type]
        )
    assert info.value.body["param"] == param  # type: ignore[index]


async def test_a_tool_calls_json_arguments_reach_the_template_as_an_object() -> None:
    """OpenAI sends an assistant's tool call `arguments` as JSON text; templates (Qwen2.5's, Hermes')
    write them with `tojson`, so the model was shown a quoted string instead of the call it wrote."""
    template = (
        "{% if tools %}tools\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>"
        "{% endfor %}\n{% endfor %}assistant: "
    )
    tokenizer = Tokenizer(None, chat_template=template, eos_token_ids={0}, vocab_size=256)
    engine = LLMEngine.from_config(KNOWN_MODELS["tiny"], tokenizer=tokenizer, num_kv_blocks=NUM_BLOCKS)
    _, runner, base_url = await start(engine, model_name=MODEL)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
    }
    messages = [
        *chat("time?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    try:
        async with httpx.AsyncClient() as http:
            resp = await http.post(
                base_url.removesuffix("/v1") + "/tokenize",
                json={"model": MODEL, "messages": messages, "tools": TOOLS},
            )
    finally:
        await runner.cleanup()  # type: ignore[attr-defined]
    assert '<tool_call>{"tz": "UTC"}</tool_call>' in tokenizer.decode(resp.json()["tokens"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": "get_time"}], "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": ["get_time"]}], "tool_choice": "auto"}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_time"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tools"),
        ({"tools": [], "tool_choice": "required"}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ],
)
async def test_malformed_tools_and_a_call_forced_without_tools_are_400(
    tool_client: AsyncOpenAI, extra: dict, param: str
) -> None:
    """A `function` that is not an object was a 500 (AttributeError), and a call forced with no tools
    to call was silently answered with text: both are the client's mistake, a 400 naming the parameter."""
    body = {"model": MODEL, "messages": chat("?"), "max_tokens": 4, **extra}
    for stream in (False, True):
        async with httpx.AsyncClient(base_url=str(tool_client.base_url)) as http:
            resp = await http.post("chat/completions", json={**body, "stream": stream})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


# --- legacy completions -------------------------------------------------------------------------------


async def test_completion_echo_with_prompt_logprobs(served: Served) -> None:
    prompt = "score this text"
    resp = await served.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    choice = resp.choices[0]
    assert choice.text == prompt
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs is not None
    assert "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == list(range(len(prompt)))
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])  # type: ignore[arg-type]
    assert resp.usage and resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(prompt)
    assert choice.finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_text_offsets_point_into_the_text(served: Served, stream: bool) -> None:
    """`text_offset` is where each token starts in the choice's text, past characters split over
    several tokens too (the tiny model's tokens are bytes: each piece counted as a character, so every
    offset after "café" ran ahead of its token)."""
    prompt = "café ☕ ok, naïve"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    if stream:
        chunks = [c async for c in await served.client.completions.create(**kwargs, stream=True)]  # type: ignore[call-overload]
        text = "".join(c.choices[0].text for c in chunks)
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        offsets = [o for lp in lps for o in lp.text_offset]
    else:
        choice = (await served.client.completions.create(**kwargs)).choices[0]  # type: ignore[call-overload]
        text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    assert text == prompt and len(tokens) == len(prompt.encode())
    whole = [(t, o) for t, o in zip(tokens, offsets, strict=True) if not t.startswith("bytes:")]
    assert [text[o : o + len(t)] for t, o in whole] == [t for t, _ in whole]
    assert offsets[-1] == len(prompt) - 1


async def test_completion_echo_and_generation_logprobs(served: Served) -> None:
    prompt_ids = served.engine.tokenizer.encode("abc")
    resp = await served.client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=4, echo=True, logprobs=1, temperature=0
    )
    choice = resp.choices[0]
    assert choice.text.startswith("abc")
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert len(choice.logprobs.tokens) == 3 + 4
    assert choice.logprobs.tokens[:3] == ["a", "b", "c"]
    assert choice.logprobs.text_offset[:4] == [0, 1, 2, 3]  # type: ignore[index]
    assert choice.logprobs.token_logprobs[0] is None  # type: ignore[index]
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])  # type: ignore[index]


async def test_completion_streaming_and_default_max_tokens(served: Served) -> None:
    whole = await served.client.completions.create(model=MODEL, prompt="once upon", temperature=0)
    assert whole.usage and whole.usage.completion_tokens == 16  # the legacy default
    stream = await served.client.completions.create(
        model=MODEL, prompt="once upon", temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


async def test_completion_batch_of_prompts(served: Served) -> None:
    resp = await served.client.completions.create(model=MODEL, prompt=["first", "second"], max_tokens=3)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage and resp.usage.completion_tokens == 6
    assert resp.usage.prompt_tokens == len("first") + len("second")


# --- several choices (n) and logit_bias ---------------------------------------------------------------


async def test_n_choices_are_seeded_apart_reproducible_and_billed_once_for_the_prompt(served: Served) -> None:
    kwargs = dict(model=MODEL, messages=chat("choices"), max_tokens=8, temperature=1.0, seed=7, n=3)
    a = await served.client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    b = await served.client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]  # each choice reproducible
    assert len(set(texts)) > 1  # choice i draws with seed + i, not copies of one draw
    one = await served.client.chat.completions.create(**{**kwargs, "n": 1})  # type: ignore[call-overload]
    assert one.choices[0].message.content == texts[0]  # choice 0 is the n=1 answer
    assert a.usage and one.usage
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is billed once
    assert 3 <= a.usage.completion_tokens <= 24


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
async def test_seeds_at_the_ends_of_the_range_serve_every_choice(served: Served, seed: int) -> None:
    """The last choice's seed + i still seeds a generator (2**64 - 1 with n=2 was a 400)."""
    kwargs = dict(model=MODEL, prompt="seeds", max_tokens=3, seed=seed, n=16)
    a = await served.client.completions.create(**kwargs)  # type: ignore[call-overload]
    b = await served.client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert len(a.choices) == 16
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


async def test_n_greedy_choices_are_equal(served: Served) -> None:
    resp = await served.client.chat.completions.create(
        model=MODEL, messages=chat("same"), max_tokens=6, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].message.content == resp.choices[1].message.content
    assert resp.usage and resp.usage.completion_tokens == 12


async def test_n_streamed_choices_match_the_non_streamed_ones(served: Served) -> None:
    kwargs = dict(
        model=MODEL,
        messages=chat("stream n"),
        max_tokens=10,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"ignore_eos": True},
    )
    whole = await served.client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    stream = await served.client.chat.completions.create(
        **kwargs,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[call-overload]
    )
    texts = ["", "", ""]
    finished: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert texts == [c.message.content for c in whole.choices]
    assert sorted(finished) == [0, 1, 2]
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 30)
    # the three choices of the first request computed the prompt together; this one's read its full
    # block from the prefix cache, every choice of it
    assert usage.prompt_tokens_details and usage.prompt_tokens_details.cached_tokens == 16


async def test_completions_number_choices_prompt_major(served: Served) -> None:
    resp = await served.client.completions.create(
        model=MODEL,
        prompt=["first", "second"],
        max_tokens=3,
        n=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    alone = [
        (await served.client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0))
        .choices[0]
        .text
        for p in ("first", "second")
    ]
    assert [c.text for c in resp.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert resp.usage and resp.usage.prompt_tokens == len("first") + len("second")
    assert resp.usage.completion_tokens == 12
    stream = await served.client.completions.create(
        model=MODEL, prompt=["first", "second"], max_tokens=3, n=2, temperature=0, stream=True
    )
    streamed = ["", "", "", ""]
    async for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in resp.choices]


async def test_a_disconnected_n_stream_frees_every_choice(served: Served) -> None:
    body = {
        "model": MODEL,
        "prompt": "z" * 100,
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
        "n": 3,
    }
    async with (
        httpx.AsyncClient(base_url=served.base_url, timeout=30) as http,
        http.stream("POST", "/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        while not (await anext(lines)).startswith("data: {"):
            pass
        assert served.engine.stats().num_running + served.engine.stats().num_waiting == 3
    assert await wait_until(lambda: all_blocks_free(served.engine), timeout=5)


async def test_an_engine_rejection_of_n_choices_is_a_400_and_leaves_nothing_running(served: Served) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            await served.client.chat.completions.create(
                model=MODEL, messages=chat("bad"), max_tokens=4, n=3, stream=stream, logit_bias={"99999": 5}
            )
        assert "vocabulary" in info.value.message
        assert await wait_until(lambda: all_blocks_free(served.engine), timeout=5)


async def test_logit_bias_steers_the_choice(served: Served) -> None:
    kwargs = dict(model=MODEL, prompt="bias", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = await served.client.completions.create(**kwargs)  # type: ignore[call-overload]
    forced = await served.client.completions.create(**kwargs, logit_bias={"65": 100})  # type: ignore[call-overload]
    assert forced.choices[0].text == "AAAA"  # byte-level tokenizer: id 65 is "A"
    first = plain.choices[0].text.encode()[0]
    banned = await served.client.completions.create(**kwargs, logit_bias={str(first): -100})  # type: ignore[call-overload]
    assert banned.choices[0].text.encode()[0] != first


# --- structured output ----------------------------------------------------------------------------------


async def test_response_format_json_schema_gives_parseable_json(served: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
        "required": ["ok", "kind"],
        "additionalProperties": False,
    }
    resp = await served.client.chat.completions.create(
        model=MODEL,
        messages=chat("json please"),
        max_tokens=64,
        seed=1,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
    )
    for choice in resp.choices:
        value = json.loads(choice.message.content or "")
        assert value["kind"] in ("cat", "dog") and isinstance(value["ok"], bool)
        assert choice.finish_reason == "stop"
    stream = await served.client.chat.completions.create(
        model=MODEL,
        messages=chat("json please"),
        max_tokens=64,
        seed=1,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert streamed == resp.choices[0].message.content


async def test_response_format_json_object_starts_an_object(served: Served) -> None:
    resp = await served.client.chat.completions.create(
        model=MODEL, messages=chat("json"), max_tokens=12, seed=2, response_format={"type": "json_object"}
    )
    assert (resp.choices[0].message.content or "").startswith("{")


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x"}},  # no schema
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
        {"type": "regex"},
    ],
)
async def test_a_bad_response_format_is_a_400(served: Served, response_format: dict) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await served.client.chat.completions.create(
            model=MODEL,
            messages=chat("x"),
            max_tokens=4,
            response_format=response_format,  # type: ignore[arg-type]
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    assert await wait_until(lambda: all_blocks_free(served.engine), timeout=5)


async def test_a_schema_the_grammar_cannot_use_is_a_400_naming_where_it_came_from(
    served: Served, tool_client: AsyncOpenAI
) -> None:
    """The grammar compiler's refusal named no parameter (param null), said `response_format` for a
    guided_json or a tool's parameters, and began with xgrammar's log time and C++ source position."""
    bad = {"type": "no-such-type"}
    asks = [
        (served.client, "chat/completions", {"messages": chat("x"), "guided_json": bad}, "guided_json"),
        (served.client, "completions", {"prompt": "x", "guided_json": bad}, "guided_json"),
        (
            tool_client,
            "chat/completions",
            {
                "messages": chat("x"),
                "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            served.client,
            "chat/completions",
            {
                "messages": chat("x"),
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
            },
            "response_format",
        ),
    ]
    for client, path, body, param in asks:
        async with httpx.AsyncClient(base_url=str(client.base_url)) as http:
            resp = await http.post(path, json={"model": MODEL, "max_tokens": 4, **body})
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == param, resp.text
        assert error["message"] == f'{param}: the JSON schema cannot be used: Unsupported type "no-such-type"'


async def test_a_legacy_completion_honours_response_format(served: Served) -> None:
    """vLLM takes `response_format` on /v1/completions too; the engine ignored it there, so a client
    asking for JSON got free text."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    resp = await served.client.completions.create(
        model=MODEL, prompt="json:", max_tokens=24, seed=3, extra_body={"response_format": fmt}
    )
    assert isinstance(json.loads(resp.choices[0].text)["ok"], bool)
    assert resp.choices[0].finish_reason == "stop"
    for extra, param in (
        ({"response_format": {"type": "regex"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_json": schema}, "guided_json"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            await served.client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
        assert info.value.body["param"] == param  # type: ignore[index]


async def test_guided_json_constrains_both_endpoints(served: Served) -> None:
    """vLLM's older structured-output parameter: ignored, a vLLM client asking for JSON got free text."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    chat_resp = await served.client.chat.completions.create(
        model=MODEL, messages=chat("json"), max_tokens=24, seed=3, extra_body={"guided_json": schema}
    )
    completion = await served.client.completions.create(
        model=MODEL, prompt="json:", max_tokens=24, seed=3, extra_body={"guided_json": json.dumps(schema)}
    )
    for text, finish in (
        (chat_resp.choices[0].message.content or "", chat_resp.choices[0].finish_reason),
        (completion.choices[0].text, completion.choices[0].finish_reason),
    ):
        assert isinstance(json.loads(text)["ok"], bool) and finish == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        await served.client.chat.completions.create(
            model=MODEL,
            messages=chat("json"),
            max_tokens=4,
            response_format={"type": "json_object"},
            extra_body={"guided_json": schema},
        )
    assert info.value.body["param"] == "guided_json"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "[a-z]+"}, "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, "guided_choice"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": 0}, "prompt_logprobs"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"bad_words": ["no"]}, "bad_words"),
    ],
)
async def test_vllm_extras_the_engine_cannot_honour_are_400_not_ignored(
    served: Served, extra: dict, param: str
) -> None:
    """Ignored, each of these gave a vLLM client an answer other than the one it asked for (text under
    its min_tokens, outside its regex or choices) with a 200."""
    for path, body in (
        ("/chat/completions", {"messages": chat("hi")}),
        ("/completions", {"prompt": "hi"}),
    ):
        async with httpx.AsyncClient(base_url=served.base_url) as http:
            resp = await http.post(path, json={"model": MODEL, "max_tokens": 2, **body, **extra})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == (param, "unsupported_parameter")
    # what a client sends for "off" is no reason to refuse it
    off = {"min_tokens": 0, "use_beam_search": False, "guided_regex": None}
    resp_ok = await served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=off)
    assert resp_ok.choices[0].finish_reason in ("stop", "length")
    chat_ok = await served.client.chat.completions.create(
        model=MODEL, messages=chat("hi"), max_tokens=2, extra_body={**off, "echo": False}
    )
    assert chat_ok.choices[0].finish_reason in ("stop", "length")


async def test_vllm_chat_echo_is_400_not_ignored(served: Served) -> None:
    """vLLM's chat `echo` (the reply starts with the final message) was ignored; a completion's is kept."""
    with pytest.raises(openai.BadRequestError) as info:
        await served.client.chat.completions.create(
            model=MODEL, messages=chat("hi"), max_tokens=2, extra_body={"echo": True}
        )
    assert info.value.body["param"] == "echo"  # type: ignore[index]
    assert info.value.code == "unsupported_parameter"


# --- concurrency and disconnects ----------------------------------------------------------------------


async def test_concurrent_streams_match_their_solo_outputs(served: Served) -> None:
    prompts = [f"request number {i} " * (i + 1) for i in range(8)]

    async def run(prompt: str) -> str:
        stream = await served.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    together = await asyncio.gather(*(run(p) for p in prompts))
    alone = [await run(p) for p in prompts]
    assert together == alone


async def test_an_unexpected_error_mid_stream_is_an_error_event_not_a_broken_stream(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the stream's headers are out, an error's 500 response was written into the chunked body:
    the SDK saw a connection error ("illegal chunk header"), not an OpenAI error."""
    from engine.generation import Generation

    deltas = Generation.deltas

    async def failing(self: Generation):  # type: ignore[no-untyped-def]
        async with contextlib.aclosing(deltas(self)) as inner:
            async for delta in inner:
                yield delta
                raise RuntimeError("a bug after the first token")

    monkeypatch.setattr(Generation, "deltas", failing)
    stream = await served.client.chat.completions.create(
        model=MODEL, messages=chat("x"), max_tokens=10, stream=True
    )
    with pytest.raises(openai.APIError) as info:
        async for _ in stream:
            pass
    assert not isinstance(info.value, openai.APIConnectionError)
    assert info.value.message == "internal server error"
    assert info.value.body == {
        "message": "internal server error",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    monkeypatch.undo()
    resp = await served.client.chat.completions.create(model=MODEL, messages=chat("x"), max_tokens=2)
    assert resp.choices[0].finish_reason in ("stop", "length")  # still serving
    assert await wait_until(lambda: all_blocks_free(served.engine), timeout=5)


async def test_disconnected_stream_frees_its_blocks_at_once(served: Served) -> None:
    body = {
        "model": MODEL,
        "prompt": "x" * 300,
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(base_url=served.base_url, timeout=30) as http,
        http.stream("POST", "/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        while not (await anext(lines)).startswith("data: {"):
            pass
        assert served.engine.stats().kv_blocks_free < served.engine.stats().kv_blocks_total
    # the client is gone: the request must be aborted and its blocks freed long before 600 tokens
    assert await wait_until(lambda: all_blocks_free(served.engine), timeout=5)
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{served.root}/metrics")).text
    assert 'weir_engine_requests_total{finish_reason="abort"} 1.0' in metrics


@pytest.mark.parametrize("lost_at", ["a chunk", "[DONE]"])
async def test_a_client_gone_during_a_write_ends_the_stream_quietly(
    served: Served, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, lost_at: str
) -> None:
    """A client that disconnects mid-stream often makes the server's next write fail before aiohttp
    cancels the handler (two of five SDK streams closed early did), and one that leaves once it has
    its finish_reason makes `[DONE]` fail: every choice still running is aborted and its blocks freed,
    and nothing is logged as a server error (it was: an "unhandled error" traceback per disconnect,
    and a 500 answered into the closed stream)."""
    write = web.StreamResponse.write
    writes = 0

    async def lose_the_client(self: web.StreamResponse, data: bytes) -> None:
        nonlocal writes
        writes += 1
        if (writes == 3) if lost_at == "a chunk" else data == b"data: [DONE]\n\n":
            raise ClientConnectionResetError("Cannot write to closing transport")  # as aiohttp says it
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", lose_the_client)
    max_tokens = 600 if lost_at == "a chunk" else 3
    body = {"model": MODEL, "prompt": "x" * 100, "max_tokens": max_tokens, "n": 2, "ignore_eos": True}
    lines: list[str] = []
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        with contextlib.suppress(httpx.HTTPError):
            async with http.stream("POST", "/completions", json=body | {"stream": True}) as resp:
                lines.extend([line async for line in resp.aiter_lines() if line])
    assert lines and "data: [DONE]" not in lines
    assert await wait_until(lambda: all_blocks_free(served.engine), timeout=5)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{served.root}/metrics")).text
    finish = "abort" if lost_at == "a chunk" else "length"
    assert f'weir_engine_requests_total{{finish_reason="{finish}"}} 2.0' in metrics


async def test_cancelled_non_streaming_request_is_aborted(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        task = asyncio.create_task(
            http.post(
                "/completions",
                json={"model": MODEL, "prompt": "y" * 200, "max_tokens": 700, "ignore_eos": True},
            )
        )
        assert await wait_until(lambda: served.engine.stats().num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await wait_until(lambda: all_blocks_free(served.engine), timeout=5)


# --- errors -------------------------------------------------------------------------------------------


async def test_unknown_model_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await served.client.chat.completions.create(model="gpt-nope", messages=chat("hi"))
    assert info.value.status_code == 404
    assert info.value.body["param"] == "model"  # type: ignore[index]
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": -0.5}, "top_p"),
        ({"n": 17}, "n"),  # MAX_CHOICES
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        # a chat completion writes at least one token (OpenAI, vLLM); only a legacy completion scores
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"logit_bias": {"five": 10}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
        ),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),  # was named max_tokens
        # seeds are 64-bit signed, as vLLM's: above, a 400 naming nothing for some n and not others
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63, "n": 2}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
        ),  # template has no tool prompt
    ],
)
async def test_bad_parameters_are_400_naming_the_parameter(served: Served, extra: dict, param: str) -> None:
    body = {"model": MODEL, "messages": chat("hi"), **extra}
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        resp = await http.post("/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] is not None and error["param"].split("[")[0] == param.split("[")[0]
    assert error["param"] == param or param == "logit_bias"  # a bad value is named by its key
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert all_blocks_free(served.engine)


async def test_content_parts_a_refusal_is_text_and_a_malformed_text_part_is_the_clients_mistake(
    served: Served,
) -> None:
    """An assistant's `refusal` part (OpenAI's SDK types it) was refused as unsupported, where vLLM
    reads it as text; a text part without a string `text` was called unsupported too
    (`unsupported_value`: a gateway tried its next candidate with the same malformed request)."""
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        tokens = []
        for content in (
            "I can't help with that.",
            [{"type": "refusal", "refusal": "I can't help with that."}],
        ):
            messages = [*chat("hi"), {"role": "assistant", "content": content}, *chat("why?")]
            resp = await http.post(served.root + "/tokenize", json={"model": MODEL, "messages": messages})
            assert resp.status_code == 200, resp.text
            tokens.append(resp.json()["tokens"])
        assert tokens[0] == tokens[1]
        for part in ({"type": "text"}, {"type": "text", "text": 5}, {"type": "refusal"}):
            messages = [*chat("hi"), {"role": "assistant", "content": [part]}]
            resp = await http.post("/chat/completions", json={"model": MODEL, "messages": messages})
            error = resp.json()["error"]
            assert resp.status_code == 400 and error["code"] is None, resp.text
            assert error["param"] == "messages[1].content[0]"


AUDIO = {"voice": "alloy", "format": "wav"}


@pytest.mark.parametrize(
    ("refused", "taken", "param", "code"),
    [
        (
            {"modalities": ["text", "audio"], "audio": AUDIO},
            {"modalities": ["text"]},
            "modalities",
            "unsupported_value",
        ),
        ({"web_search_options": {}}, {}, "web_search_options", "unsupported_parameter"),
        ({"n": 17}, {"n": 2}, "n", "unsupported_value"),  # MAX_CHOICES; OpenAI takes up to 128
    ],
    ids=["audio", "web_search", "n"],
)
async def test_what_the_engine_cannot_honour_is_refused_as_unsupported(
    served: Served, refused: dict, taken: dict, param: str, code: str
) -> None:
    """The engine answers in text, searches nothing and runs at most MAX_CHOICES choices a request.
    Ignored, audio and search gave another answer than the one asked for; and OpenAI's codes for a
    parameter or value a model does not take let a gateway pass the request on to one that does,
    where a plain 400 ended it."""
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2}
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        resp = await http.post("/chat/completions", json=body | refused)
        answer = await http.post("/chat/completions", json=body | taken)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert answer.status_code == 200, answer.text
    assert all_blocks_free(served.engine)


async def test_prompt_longer_than_the_context_is_400_context_length_exceeded(served: Served) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        await served.client.completions.create(model=MODEL, prompt="z" * 2000, max_tokens=1)
    assert info.value.status_code == 400
    assert info.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert info.value.body["param"] == "prompt"  # type: ignore[index]


async def test_malformed_json_and_unknown_routes(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.root) as http:
        bad = await http.post(
            "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        missing = await http.get("/v1/nothing-here")
        wrong_method = await http.get("/v1/chat/completions")
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


async def test_greedy_takes_top_p_0_and_sampling_refuses_it_naming_it(served: Served) -> None:
    """`temperature: 0, top_p: 0` is greedy, as vLLM answers it (it was a 400): greedy never reads
    top_p. Sampling with top_p 0 would keep no token: a 400 that names top_p (it named nothing)."""
    kwargs = dict(model=MODEL, prompt="determinism", max_tokens=8, temperature=0)
    greedy = await served.client.completions.create(**kwargs)  # type: ignore[call-overload]
    zero = await served.client.completions.create(**kwargs, top_p=0)  # type: ignore[call-overload]
    assert zero.choices[0].text == greedy.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        await served.client.completions.create(**{**kwargs, "temperature": 1}, top_p=0)  # type: ignore[call-overload]
    assert info.value.body["param"] == "top_p"  # type: ignore[index]
    assert "top_p" in info.value.message


async def test_engine_rejection_is_a_400_not_a_crash(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await served.client.completions.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=2, extra_body={"stop_token_ids": [999]}
        )
    assert "vocabulary" in info.value.message
    assert info.value.body["param"] == "stop_token_ids"  # type: ignore[index]
    ok = await served.client.completions.create(model=MODEL, prompt="still serving", max_tokens=2)
    assert ok.usage and ok.usage.completion_tokens == 2


# --- tokenize, detokenize -----------------------------------------------------------------------------


async def post(base: str, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base.rstrip("/").removesuffix("/v1")) as http:
        return await http.post(path, json=body)


async def test_tokenize_messages_counts_a_chat_completions_prompt_tokens(served: Served) -> None:
    messages = [{"role": "system", "content": "be brief"}, *chat("how many tokens is this?")]
    resp = await served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    tokenized = await post(served.root, "/tokenize", {"model": MODEL, "messages": messages})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert resp.usage and body["count"] == resp.usage.prompt_tokens == len(body["tokens"])
    tok = served.engine.tokenizer
    assert body["tokens"] == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    assert body["max_model_len"] == served.engine.max_model_len
    bare = await post(
        served.root, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False}
    )
    assert bare.json()["tokens"] == body["tokens"][: -len("assistant: ")]  # byte-level: one per byte
    # Tools with tool_choice "none" on a template without a tool prompt: served (the tools unused), and
    # counted the same.
    unused = {"tools": TOOLS, "tool_choice": "none"}
    reply = await served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, **unused
    )  # type: ignore[arg-type]
    counted = await post(served.root, "/tokenize", {"model": MODEL, "messages": messages, **unused})
    assert counted.status_code == 200 and reply.usage
    assert counted.json()["count"] == reply.usage.prompt_tokens


async def test_tokenize_messages_with_tools_counts_as_the_chat_completion(tool_client: AsyncOpenAI) -> None:
    resp = await tool_client.chat.completions.create(
        model=MODEL,
        messages=chat("weather?"),
        max_tokens=1,
        tools=TOOLS,  # type: ignore[arg-type]
    )
    body = {"model": MODEL, "messages": chat("weather?"), "tools": TOOLS}
    tokenized = await post(str(tool_client.base_url), "/tokenize", body)
    assert resp.usage and tokenized.json()["count"] == resp.usage.prompt_tokens
    plain = await post(str(tool_client.base_url), "/tokenize", {**body, "tools": None})
    assert plain.json()["count"] < resp.usage.prompt_tokens


async def test_tokenize_prompt_counts_a_completions_prompt_tokens(served: Served) -> None:
    prompt = "héllo wörld"  # byte-level: one token a byte, no special tokens to add
    resp = await served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    default = (await post(served.root, "/tokenize", {"model": MODEL, "prompt": prompt})).json()
    assert resp.usage and default["count"] == resp.usage.prompt_tokens == len(prompt.encode())
    assert default["tokens"] == list(prompt.encode())
    bare = await post(
        served.root, "/tokenize", {"model": MODEL, "prompt": prompt, "add_special_tokens": False}
    )
    assert bare.json()["tokens"] == default["tokens"]


@pytest.mark.parametrize("add_bos", [False, True], ids=["no-bos", "bos"])
async def test_completion_prompts_start_with_bos_where_the_model_wants_it(add_bos: bool) -> None:
    """A Llama-3-like tokenizer (its post-processor adds BOS): a completion prompt gets BOS once, as
    llama.cpp and vLLM give it, where the tokenizer says the model expects it; /tokenize counts the same,
    and without special tokens when asked. Echoed prompts read back as sent."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.add_special_tokens([AddedToken("<s>", special=True)])
    tokenizer = Tokenizer(backend, chat_template=None, eos_token_ids={2}, bos_token_id=1, add_bos=add_bos)
    bos = [1] if add_bos else []
    assert tokenizer.encode_prompt("hello world") == [*bos, 3, 4]
    assert tokenizer.encode_prompt("<s> hello") == [1, 3]  # already there: once
    engine = LLMEngine.from_config(KNOWN_MODELS["tiny"], tokenizer=tokenizer, num_kv_blocks=NUM_BLOCKS)
    _, runner, base_url = await start(engine, model_name=MODEL)
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        resp = await client.completions.create(model=MODEL, prompt="hello world", max_tokens=1)
        echoed = await client.completions.create(
            model=MODEL, prompt="hello world", max_tokens=0, echo=True, logprobs=0
        )
    counts = [
        (await post(base_url, "/tokenize", {"model": MODEL, "prompt": "hello world", **extra})).json()
        for extra in ({}, {"add_special_tokens": True}, {"add_special_tokens": False})
    ]
    await runner.cleanup()  # type: ignore[attr-defined]
    assert resp.usage and resp.usage.prompt_tokens == 2 + len(bos)
    assert echoed.choices[0].text == "hello world"
    assert [c["tokens"] for c in counts] == [[*bos, 3, 4], [*bos, 3, 4], [3, 4]]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "prompt": "x", "messages": chat("x")}, 400, "messages"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "prompt": 5}, 400, "prompt"),
        ({"model": MODEL, "messages": chat("x"), "tools": TOOLS}, 400, "tools"),  # no tool prompt
        ({"model": "gpt-nope", "prompt": "x"}, 404, "model"),
    ],
)
async def test_bad_tokenize_requests(served: Served, body: dict, status: int, param: str) -> None:
    resp = await post(served.root, "/tokenize", body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param
    if status == 404:
        assert resp.json()["error"]["code"] == "model_not_found"


async def test_detokenize_round_trips_tokenize(served: Served) -> None:
    for source in ({"prompt": "héllo wörld 🎉"}, {"messages": chat("round trip")}):
        tokens = (await post(served.root, "/tokenize", {"model": MODEL, **source})).json()["tokens"]
        resp = await post(served.root, "/detokenize", {"model": MODEL, "tokens": tokens})
        assert resp.status_code == 200, resp.text
        expected = source.get("prompt") or served.engine.tokenizer.apply_chat_template(chat("round trip"))
        assert resp.json() == {"prompt": expected}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "tokens": [104, 256]}, 400, "tokens"),  # the byte-level vocabulary is 256
        ({"model": MODEL, "tokens": [-1]}, 400, "tokens"),
        ({"model": MODEL, "tokens": "hi"}, 400, "tokens"),
        ({"model": "gpt-nope", "tokens": [104]}, 404, "model"),
    ],
)
async def test_bad_detokenize_requests(served: Served, body: dict, status: int, param: str) -> None:
    resp = await post(served.root, "/detokenize", body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


async def test_tokenize_is_503_until_the_model_is_attached() -> None:
    _, runner, base_url = await start(None, model_name=MODEL)
    tokenize = await post(base_url, "/tokenize", {"model": MODEL, "prompt": "hi"})
    detokenize = await post(base_url, "/detokenize", {"model": MODEL, "tokens": [104]})
    await runner.cleanup()  # type: ignore[attr-defined]
    for resp in (tokenize, detokenize):
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_not_ready"


# --- models, health, metrics --------------------------------------------------------------------------


async def test_models_health_and_metrics(served: Served) -> None:
    models = await served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await served.client.models.retrieve(MODEL)).id == MODEL
    messages = chat("metrics " * 10)
    for _ in range(2):
        await served.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0
        )
    async with httpx.AsyncClient(base_url=served.root) as http:
        health = await http.get("/health")
        metrics = (await http.get("/metrics")).text
    assert health.status_code == 200 and health.json()["status"] == "ok"
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line and line[0] != "#"
    }
    assert values["weir_engine_time_to_first_token_seconds_count"] == 2
    assert values["weir_engine_inter_token_latency_seconds_count"] == 2 * 5
    assert values["weir_engine_generation_tokens_total"] == 12
    assert values['weir_engine_requests_total{finish_reason="length"}'] == 2
    assert values["weir_engine_num_requests_running"] == 0
    assert values["weir_engine_num_requests_waiting"] == 0
    assert values["weir_engine_kv_cache_blocks_total"] == NUM_BLOCKS
    assert 0 <= values["weir_engine_kv_cache_usage_ratio"] <= 1
    assert values["weir_engine_prefix_cache_hits_total"] > 0
    assert 0 < values["weir_engine_prefix_cache_hit_rate"] < 1
    assert values["weir_engine_cached_prompt_tokens_total"] == values["weir_engine_prefix_cache_hits_total"]
    assert values["weir_engine_generation_tokens_per_second"] > 0


async def test_health_is_503_until_the_model_is_attached() -> None:
    server, runner, base_url = await start(None, model_name=MODEL)
    async with httpx.AsyncClient(base_url=base_url.removesuffix("/v1")) as http:
        loading = await http.get("/health")
        early = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("hi")})
        engine = AsyncLLMEngine(LLMEngine.from_config(KNOWN_MODELS["tiny"], num_kv_blocks=NUM_BLOCKS))
        server.attach(engine, MODEL)
        ready = await http.get("/health")
        served = await http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": chat("hi"), "max_tokens": 2}
        )
    await runner.cleanup()  # type: ignore[attr-defined]
    assert loading.status_code == 503 and loading.json()["status"] == "loading"
    assert early.status_code == 503 and early.json()["error"]["code"] == "model_not_ready"
    assert ready.status_code == 200
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2


# --- load reports ----------------------------------------------------------------------------------


async def test_a_request_that_asks_gets_the_engines_load_in_orca_format(served: Served) -> None:
    # Long enough to be running still when the first chunk's headers go out: with 4 tokens the engine
    # thread could finish it first on a loaded machine (num_requests_running 0, a flaky failure).
    body = {
        "model": MODEL,
        "messages": chat("hello there"),
        "max_tokens": 128,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        streamed = await http.post(
            "/chat/completions", json=body, headers={"endpoint-load-metrics-format": "TEXT"}
        )
        report = streamed.headers["endpoint-load-metrics"]
        assert report.startswith("TEXT named_metrics.")
        # Read as the gateway reads it: sent once the stream's first token is out, so it is running.
        named = parse_orca(report)
        assert named["num_requests_running"] >= 1 and named["num_requests_waiting"] >= 0
        assert 0 < named["kv_cache_usage_perc"] <= 1
        json_body = {**body, "stream": False}
        answered = await http.post(
            "/chat/completions", json=json_body, headers={"endpoint-load-metrics-format": "json"}
        )
        assert answered.headers["endpoint-load-metrics"].startswith("JSON {")
        assert set(parse_orca(answered.headers["endpoint-load-metrics"])) == set(named)
        plain = await http.post("/chat/completions", json=json_body)
        assert plain.status_code == 200 and "endpoint-load-metrics" not in plain.headers


async def test_continue_final_message_leaves_the_assistant_turn_open(served: Served) -> None:
    """vLLM's `continue_final_message`: the prompt ends where the final assistant message's text does
    (no end of its turn, no new turn), so the model goes on writing that answer, as a gateway
    resuming a broken stream needs; without it a trailing assistant message is a closed turn."""
    messages = [*chat("count to ten"), {"role": "assistant", "content": "one two three"}]
    tok = served.engine.tokenizer
    full = tok.apply_chat_template(messages, add_generation_prompt=False)
    open_turn = full[: full.rfind("one two three") + len("one two three")]
    assert open_turn != full  # the template closes the turn: the cut is what the test is about
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    tokenized = await post(served.root, "/tokenize", {"model": MODEL, "messages": messages, **flags})
    assert tokenized.json()["tokens"] == tok.encode(open_turn)
    resp = await served.client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        extra_body=flags,
    )
    assert resp.usage is not None and resp.usage.prompt_tokens == len(tok.encode(open_turn))
    closed = await served.client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
    )
    assert closed.usage is not None and closed.usage.prompt_tokens > resp.usage.prompt_tokens

    for body, param in (
        ({"continue_final_message": True}, "continue_final_message"),  # a new turn opened as well
        ({**flags, "messages": chat("no answer to continue")}, "messages"),
    ):
        refused = await post(
            served.root, "/v1/chat/completions", {"model": MODEL, "messages": messages, **body}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


# Llama 3's: each message `| trim`med, each turn closed with <|eot_id|>
TRIMMING_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.parametrize("answered", ["Steps:\n\n", "one two ", "one two"])
async def test_a_trimming_template_still_leaves_the_final_answer_open_as_written(answered: str) -> None:
    """A stream cut after "Steps:\\n\\n" resumed on the engine: a template that trims each message
    (Llama 3's) wrote the answer without its trailing whitespace, so the text was not found, the
    prompt was not cut, and the model was asked to go on after the answer's <|eot_id|>. The prompt
    now ends with the answer exactly as written, whitespace and all."""
    tokenizer = Tokenizer(None, chat_template=TRIMMING_TEMPLATE, eos_token_ids={0}, vocab_size=256)
    engine = LLMEngine.from_config(KNOWN_MODELS["tiny"], tokenizer=tokenizer, num_kv_blocks=NUM_BLOCKS)
    _, runner, base_url = await start(engine, model_name=MODEL)
    messages = [*chat("how?"), {"role": "assistant", "content": answered}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    body = {"model": MODEL, "messages": messages, **flags}
    try:
        tokenized = (await post(base_url, "/tokenize", body)).json()
        prompt = tokenizer.decode(tokenized["tokens"])
        assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n" + answered), prompt
        reply = await post(base_url, "/v1/chat/completions", {**body, "max_tokens": 2})
        assert reply.json()["usage"]["prompt_tokens"] == tokenized["count"]
    finally:
        await runner.cleanup()  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
async def test_stream_options_without_stream_is_a_400(served: Served, path: str) -> None:
    """OpenAI and vLLM refuse `stream_options` on an answer that is not streamed; the engine
    answered it, so a client tested against Weir's engine met the 400 only on another backend."""
    prompt = {"messages": chat("hi")} if path == "/chat/completions" else {"prompt": "hi"}
    body = {"model": MODEL, "max_tokens": 2, "stream_options": {"include_usage": True}, **prompt}
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        refused = [await http.post(path, json=body), await http.post(path, json=body | {"stream": False})]
        streamed = await http.post(path, json=body | {"stream": True})
        plain = await http.post(path, json=body | {"stream_options": None})
    for resp in refused:
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] == {
            "message": "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "type": "invalid_request_error",
            "param": "stream_options",
            "code": None,
        }
    assert streamed.status_code == 200 and '"usage"' in streamed.text, streamed.text
    assert plain.status_code == 200, plain.text
    assert all_blocks_free(served.engine)
