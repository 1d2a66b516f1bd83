"""The fake OpenAI server, driven by the official `openai` SDK exactly as an application would."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from gateway.providers.base import CONTINUE_INSTRUCTION
from tests.fakes import FakeOpenAI, Fault

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["location"],
        },
    },
}


@pytest.fixture
def client(fake_openai: FakeOpenAI) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_openai.base_url, api_key=fake_openai.api_key, max_retries=0, timeout=5)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_echoes_last_user_message_with_usage(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    reply = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "system", "content": "be brief"}, *user("the quick brown fox")],
    )
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.content == "the quick brown fox"
    assert reply.choices[0].finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (6, 4, 10)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    recorded = fake_openai.last_request
    assert (recorded.method, recorded.path) == ("POST", "/v1/chat/completions")
    assert recorded.headers["authorization"] == f"Bearer {fake_openai.api_key}"
    assert recorded.json["messages"][1]["content"] == "the quick brown fox"
    assert fake_openai.last_usage.input_tokens == 6


def test_stream_one_word_per_chunk_with_final_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="gpt-4o-mini",
            messages=user("one two three"),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert text == ["one", " two", " three"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_framing_ends_with_done(fake_openai: FakeOpenAI) -> None:
    with httpx.stream(
        "POST",
        f"{fake_openai.base_url}/chat/completions",
        headers={"authorization": f"Bearer {fake_openai.api_key}"},
        json={"model": "gpt-4o-mini", "messages": user("hi you"), "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"].startswith("req_")
        body = response.read().decode()
    frames = body.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert all(f.startswith("data: ") for f in frames[:-1])
    assert json.loads(frames[0][6:])["object"] == "chat.completion.chunk"
    assert "usage" not in json.loads(frames[0][6:])  # only with stream_options.include_usage


def test_tool_call_with_arguments_from_prompt_and_from_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gpt-4o", messages=user('please call get_weather {"location": "Paris"}'), tools=[WEATHER_TOOL]
    )
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"location": "Paris"})

    forced = client.chat.completions.create(
        model="gpt-4o",
        messages=user("what is the weather?"),
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    args = json.loads(forced.choices[0].message.tool_calls[0].function.arguments)
    assert args == {"location": "example", "unit": "c"}


def test_streamed_tool_call_reassembles(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="gpt-4o",
        messages=user("call get_weather"),
        tools=[WEATHER_TOOL],
        tool_choice="required",
        stream=True,
    )
    name, arguments, finish = "", "", None
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(arguments), finish) == (
        "get_weather",
        {"location": "example", "unit": "c"},
        "tool_calls",
    )


def test_tool_result_round_trip(client: openai.OpenAI) -> None:
    messages = [
        *user("call get_weather"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    reply = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[WEATHER_TOOL])
    assert reply.choices[0].message.content == "Tool get_weather returned: sunny, 21C"


def test_tool_message_without_matching_call_is_rejected(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="gpt-4o", messages=[*user("x"), {"role": "tool", "tool_call_id": "nope", "content": "1"}]
        )
    assert err.value.body["param"] == "messages.[1].role"


def test_images_outside_user_messages_are_rejected(client: openai.OpenAI) -> None:
    """As OpenAI: "Image URLs are only allowed for messages with role 'user'" (a tool's screenshot)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    call = {"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    messages = [
        *user("call screenshot"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "here"}, image]},
    ]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert err.value.body["param"] == "messages.[2].content"
    assert "only allowed for messages with role 'user'" in err.value.message
    messages[2]["content"] = "here"
    messages.append({"role": "user", "content": [image]})
    reply = client.chat.completions.create(model="gpt-4o", messages=messages)
    assert reply.choices[0].message.content == "[image]"


def test_max_tokens_stop_n_and_json_mode(client: openai.OpenAI) -> None:
    cut = client.chat.completions.create(model="gpt-4o-mini", messages=user("a b c d e"), max_tokens=2)
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("a b", "length")
    stopped = client.chat.completions.create(
        model="gpt-4o-mini", messages=user("alpha beta END gamma"), stop=["END"]
    )
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == ("alpha beta ", "stop")
    many = client.chat.completions.create(model="gpt-4o-mini", messages=user("x y"), n=3)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.usage.completion_tokens == 6
    as_json = client.chat.completions.create(
        model="gpt-4o-mini", messages=user("hello"), response_format={"type": "json_object"}
    )
    assert json.loads(as_json.choices[0].message.content) == {"echo": "hello"}
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}}
    structured = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=user("Paris"),
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert json.loads(structured.choices[0].message.content) == {"city": "Paris", "n": 1}


def test_images_count_fixed_tokens(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gpt-4o",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                ],
            }
        ],
    )
    assert reply.choices[0].message.content == "what is this [image]"
    assert reply.usage.prompt_tokens == 3 + 85


def test_automatic_prompt_cache_in_128_token_steps(client: openai.OpenAI) -> None:
    document = " ".join(f"w{i}" for i in range(1500))
    first = client.chat.completions.create(model="gpt-4o-mini", messages=user(document + " question one"))
    second = client.chat.completions.create(model="gpt-4o-mini", messages=user(document + " question two"))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the shared prefix is 1501 tokens ("question" included): 1024 + 3*128 = 1408 are reported cached
    assert second.usage.prompt_tokens == 1502
    assert second.usage.prompt_tokens_details.cached_tokens == 1408
    short = client.chat.completions.create(model="gpt-4o-mini", messages=user("short prompt"))
    client.chat.completions.create(model="gpt-4o-mini", messages=user("short prompt"))
    assert short.usage.prompt_tokens_details.cached_tokens == 0


def test_reasoning_models_report_reasoning_tokens(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="o4-mini", messages=user("think"), reasoning_effort="high")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 512
    assert reply.usage.completion_tokens == 513


def test_set_next_usage_overrides_one_response(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.set_next_usage(
        input_tokens=900, cached_input_tokens=1100, output_tokens=70, reasoning_tokens=20
    )
    reply = client.chat.completions.create(
        model="gpt-4o-mini", messages=user("x"), stream=True, stream_options={"include_usage": True}
    )
    usage = list(reply)[-1].usage
    assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens) == (
        2000,
        1100,
        70,
    )
    assert usage.completion_tokens_details.reasoning_tokens == 20
    after = client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    assert after.usage.prompt_tokens == 1


def test_auth_and_validation_errors_use_openai_shape(fake_openai: FakeOpenAI) -> None:
    bad = openai.OpenAI(base_url=fake_openai.base_url, api_key="sk-wrong-key-123", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    assert err.value.body["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=fake_openai.base_url, api_key=fake_openai.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        good.chat.completions.create(model="gpt-9", messages=user("x"))
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        good.chat.completions.create(model="gpt-4o-mini", messages=[])
    assert err.value.body["param"] == "messages"
    raw = httpx.post(
        f"{fake_openai.base_url}/chat/completions",
        headers={"authorization": f"Bearer {fake_openai.api_key}", "content-type": "application/json"},
        content=b"{not json",
    )
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_status_faults_carry_vendor_body_and_retry_after(
    client: openai.OpenAI, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.status(429, retry_after=3), times=2)
    for _ in range(2):
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
        assert err.value.response.headers["retry-after"] == "3"
        assert err.value.body["code"] == "rate_limit_exceeded"
    fake_openai.fail_next(500)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    assert (
        client.chat.completions.create(model="gpt-4o-mini", messages=user("ok")).choices[0].message.content
        == "ok"
    )


def test_faults_do_not_touch_get_requests(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(503)
    assert any(m.id == "gpt-4o-mini" for m in client.models.list().data)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))


def test_connection_faults(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.reset())
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    fake_openai.fail_next(Fault.garbage())
    with pytest.raises(json.JSONDecodeError):  # the SDK itself does not survive a garbage body
        client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    fake_openai.fail_next(Fault.wrong_content_type())
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=user("x"))
    assert raw.headers["content-type"].startswith("text/html")
    fake_openai.fail_next(Fault.cut_stream(after=0))
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))


def test_stream_cut_after_n_chunks_has_no_terminator(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    seen: list[str | None] = []
    with pytest.raises(openai.APIConnectionError):
        for chunk in client.chat.completions.create(
            model="gpt-4o-mini", messages=user("a b c d e"), stream=True
        ):
            seen.append(chunk.choices[0].delta.content)
    assert seen == ["", "a", " b"]


def test_a_stall_sends_part_of_the_reply_then_nothing_until_reset(
    client: openai.OpenAI, fake_openai: FakeOpenAI
) -> None:
    impatient = client.with_options(timeout=0.5)
    fake_openai.fail_next(Fault.stall(), times=2)
    with pytest.raises(openai.APITimeoutError):  # the headers came, the rest of the body never does
        impatient.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    seen: list[str | None] = []
    with pytest.raises(openai.APITimeoutError):
        for chunk in impatient.chat.completions.create(
            model="gpt-4o-mini", messages=user("a b c d e"), stream=True
        ):
            seen.append(chunk.choices[0].delta.content)
    assert seen == [""]  # one chunk (the role), then silence
    fake_openai.reset()
    assert (
        client.chat.completions.create(model="gpt-4o-mini", messages=user("ok")).choices[0].message.content
        == "ok"
    )


def test_in_stream_error_event(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.stream_error(after=2, code=500))
    with pytest.raises(openai.APIError, match="server had an error"):
        for _ in client.chat.completions.create(model="gpt-4o-mini", messages=user("a b c"), stream=True):
            pass


def test_delay_and_hang(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.delay(0.2))
    started = time.monotonic()
    client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    assert time.monotonic() - started >= 0.2
    impatient = client.with_options(timeout=0.5)
    fake_openai.fail_next(Fault.hang())
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    assert (
        client.chat.completions.create(model="gpt-4o-mini", messages=user("next")).choices[0].message.content
        == "next"
    )


def test_huge_response(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.huge(3_000_000))
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    assert len(reply.choices[0].message.content) >= 2_900_000


def test_completions_embeddings_and_models(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="say this", max_tokens=5)
    assert completion.object == "text_completion" and completion.choices[0].text == "say this"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="gpt-3.5-turbo-instruct", prompt="a b", stream=True)
        if c.choices
    )
    assert streamed == "a b"
    # the SDK asks for base64 by default and decodes it
    vectors = client.embeddings.create(
        model="text-embedding-3-small", input=["red apple", "red apple", "blue sky"]
    )
    assert len(vectors.data) == 3 and len(vectors.data[0].embedding) == 1536
    assert vectors.data[0].embedding == vectors.data[1].embedding != vectors.data[2].embedding
    assert vectors.usage.prompt_tokens == 6
    small = client.embeddings.create(
        model="text-embedding-3-large", input="x", dimensions=256, encoding_format="float"
    )
    assert len(small.data[0].embedding) == 256
    assert client.models.retrieve("gpt-4o").id == "gpt-4o"


def test_stop_and_start_keep_the_port(fake_openai: FakeOpenAI, client: openai.OpenAI) -> None:
    port = fake_openai.port
    fake_openai.stop()
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    fake_openai.start()
    assert fake_openai.port == port
    assert (
        client.chat.completions.create(model="gpt-4o-mini", messages=user("back")).choices[0].message.content
        == "back"
    )


def test_deepseek_flavour_reports_hit_and_miss_tokens(fake_deepseek: FakeOpenAI) -> None:
    client = openai.OpenAI(base_url=fake_deepseek.base_url, api_key=fake_deepseek.api_key, max_retries=0)
    prefix = " ".join(f"t{i}" for i in range(200))
    client.chat.completions.create(model="deepseek-chat", messages=user(prefix + " one"))
    reply = client.chat.completions.create(model="deepseek-chat", messages=user(prefix + " two"))
    usage = reply.usage.model_dump()
    assert (usage["prompt_cache_hit_tokens"], usage["prompt_cache_miss_tokens"]) == (192, 9)
    assert usage["prompt_tokens"] == 201 and usage.get("prompt_tokens_details") is None
    thinker = client.chat.completions.create(model="deepseek-reasoner", messages=user("why"))
    assert thinker.choices[0].message.model_extra["reasoning_content"] == "The user wants: why"
    assert thinker.usage.completion_tokens_details.reasoning_tokens == 4


@pytest.mark.parametrize("asked", [8193, 0])
def test_deepseek_flavour_refuses_an_output_limit_in_deepseeks_words(
    fake_deepseek: FakeOpenAI, asked: int
) -> None:
    client = openai.OpenAI(base_url=fake_deepseek.base_url, api_key=fake_deepseek.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="deepseek-chat", messages=user("hi"), max_tokens=asked)
    assert info.value.body == {
        "message": "Invalid max_tokens value, the valid range of max_tokens is [1, 8192]",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_request_error",
    }
    assert client.chat.completions.create(model="deepseek-chat", messages=user("hi"), max_tokens=8192).choices


def test_usable_as_context_manager_outside_pytest() -> None:
    with FakeOpenAI(api_key="k") as fake:
        client = openai.OpenAI(base_url=fake.base_url, api_key="k", max_retries=0)
        assert (
            client.chat.completions.create(model="gpt-4o", messages=user("hi")).choices[0].message.content
            == "hi"
        )
    assert not fake.running


def test_fault_for_a_path_hits_health_probes(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(503, path="/v1/models")
    assert (
        client.chat.completions.create(model="gpt-4o-mini", messages=user("x")).choices[0].message.content
        == "x"
    )
    with pytest.raises(openai.InternalServerError):
        client.models.list()
    assert client.models.list().data


def test_azure_deployment_routes(fake_openai: FakeOpenAI) -> None:
    azure = openai.AzureOpenAI(
        azure_endpoint=fake_openai.origin,
        api_key=fake_openai.api_key,
        api_version="2024-10-21",
        max_retries=0,
    )
    reply = azure.chat.completions.create(model="gpt-4o", messages=user("from azure"))
    assert reply.choices[0].message.content == "from azure"
    assert fake_openai.last_request.path == "/openai/deployments/gpt-4o/chat/completions"
    assert fake_openai.last_request.headers["api-key"] == fake_openai.api_key
    assert fake_openai.last_request.query["api-version"] == "2024-10-21"


async def test_async_client_from_an_async_test(fake_openai: FakeOpenAI) -> None:
    client = openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key=fake_openai.api_key, max_retries=0)
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=user("async works"), stream=True
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == "async works"
    await client.close()


def test_slow_stream_spaces_chunks_and_huge_stream_arrives_whole(
    client: openai.OpenAI, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.slow_stream(0.1))
    started = time.monotonic()
    chunks = list(client.chat.completions.create(model="gpt-4o-mini", messages=user("a b c"), stream=True))
    assert time.monotonic() - started >= 0.4  # 5 chunks and [DONE], 0.1 s apart
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "a b c"
    fake_openai.fail_next(Fault.huge(1_000_000))
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="gpt-4o-mini", messages=user("x"), stream=True)
    )
    assert len(text) >= 990_000


def test_recorded_history_is_bounded() -> None:
    with FakeOpenAI(max_recorded=3) as fake:
        client = openai.OpenAI(base_url=fake.base_url, api_key=fake.api_key, max_retries=0)
        for i in range(5):
            client.chat.completions.create(model="gpt-4o-mini", messages=user(f"m{i}"))
        assert [r.json["messages"][0]["content"] for r in fake.requests] == ["m2", "m3", "m4"]
        assert len(fake.usages) == 3


def test_control_endpoint_queues_faults_without_auth(client: openai.OpenAI, fake_openai: FakeOpenAI) -> None:
    queued = httpx.post(
        f"{fake_openai.origin}/__fake__/fail_next", json={"kind": "status", "status_code": 429, "times": 2}
    )
    assert queued.json() == {"ok": True, "queued": 2}
    for _ in range(2):
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="gpt-4o-mini", messages=user("x"))
    assert httpx.post(f"{fake_openai.origin}/__fake__/fail_next", json={"kind": "nope"}).status_code == 400
    assert all(not r.path.startswith("/__fake__") for r in fake_openai.requests)
    assert (
        client.chat.completions.create(model="gpt-4o-mini", messages=user("ok")).choices[0].message.content
        == "ok"
    )


def test_standalone_command_serves_until_interrupted(unused_port: int) -> None:
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes", "openai", "--port", str(unused_port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert f"base_url=http://127.0.0.1:{unused_port}/v1" in line
        key = line.split("api_key=")[1].strip()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{unused_port}/v1", api_key=key, max_retries=0)
        assert (
            client.chat.completions.create(model="gpt-4o", messages=user("hi")).choices[0].message.content
            == "hi"
        )
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0


def test_rejects_what_openai_rejects(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="gpt-4o-mini", messages=user("x"), max_tokens=100_000)
    assert (err.value.body["param"], err.value.body["code"]) == ("max_tokens", "invalid_value")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="gpt-4o-mini", messages=user("x"), stream_options={"include_usage": True}
        )
    assert err.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="gpt-4o-mini", messages=user("x"), temperature=3)
    assert err.value.body["param"] == "temperature"


def test_trailing_assistant_message_is_answered_afresh_unless_asked_to_continue(
    client: openai.OpenAI,
) -> None:
    # OpenAI closes a trailing assistant message's turn and answers anew; vLLM continues it with its
    # `continue_final_message` flag; any model continues it when a user turn asks for the rest.
    messages = [*user("one two three four"), {"role": "assistant", "content": "one two"}]
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
    assert reply.choices[0].message.content == "one two three four"
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, extra_body=flags)
    assert reply.choices[0].message.content == " three four"
    assert reply.usage.completion_tokens == 2
    asked = [*messages, {"role": "user", "content": CONTINUE_INSTRUCTION}]
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=asked)
    assert reply.choices[0].message.content == " three four"
    with pytest.raises(openai.BadRequestError):  # vLLM refuses both a continued and a new turn
        client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, extra_body={"continue_final_message": True}
        )


def test_continue_loosely_joins_only_continuations_asked_for_in_a_user_turn(
    client: openai.OpenAI, fake_openai: FakeOpenAI
) -> None:
    messages = [*user("one two three four"), {"role": "assistant", "content": "one two"}]
    asked = [*messages, {"role": "user", "content": CONTINUE_INSTRUCTION}]
    for how, expected in [
        ({}, "three four"),  # no leading space: a new message starts without one
        ({"restate": 1}, "two three four"),
        ({"restate": 2}, "one two three four"),
        ({"restart": True}, "one two three four"),
    ]:
        fake_openai.continue_loosely(**how)
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=asked)
        assert reply.choices[0].message.content == expected, how
        assert reply.usage.completion_tokens == len(expected.split())
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, extra_body=flags)
    assert reply.choices[0].message.content == " three four"  # a literal continuation stays exact
    fake_openai.reset()
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=asked)
    assert reply.choices[0].message.content == " three four"


def test_set_latency_slows_every_generation_until_reset(
    client: openai.OpenAI, fake_openai: FakeOpenAI
) -> None:
    fake_openai.set_latency(first_token=0.2, per_token=0.05)
    started = time.monotonic()
    client.chat.completions.create(model="gpt-4o-mini", messages=user("a b c"))
    assert time.monotonic() - started >= 0.2 + 2 * 0.05
    started = time.monotonic()
    stream = client.chat.completions.create(model="gpt-4o-mini", messages=user("a b c"), stream=True)
    next(iter(stream))
    first = time.monotonic() - started
    list(stream)
    assert first >= 0.2 and time.monotonic() - started >= 0.2 + 4 * 0.05
    fake_openai.reset()
    assert fake_openai.first_token_delay == fake_openai.token_delay == 0.0


async def test_serves_many_concurrent_streams(fake_openai: FakeOpenAI) -> None:
    import asyncio

    client = openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key=fake_openai.api_key, max_retries=0)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=user(f"req {i}"), stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    replies = await asyncio.gather(*(one(i) for i in range(64)))
    assert replies == [f"req {i}" for i in range(64)]
    assert len(fake_openai.requests) == len(fake_openai.usages) == 64
    await client.close()


def test_logprobs_per_token(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gpt-4o-mini", messages=user("sky is blue"), logprobs=True, top_logprobs=2
    )
    tokens = reply.choices[0].logprobs.content
    assert [t.token for t in tokens] == ["sky", " is", " blue"]
    assert [len(t.top_logprobs) for t in tokens] == [2, 2, 2] and tokens[0].top_logprobs[0].token == "sky"
    streamed = [
        c.choices[0].logprobs.content[0].token
        for c in client.chat.completions.create(
            model="gpt-4o-mini", messages=user("sky is blue"), logprobs=True, stream=True
        )
        if c.choices and c.choices[0].logprobs
    ]
    assert streamed == ["sky", " is", " blue"]
    assert client.chat.completions.create(model="gpt-4o-mini", messages=user("x")).choices[0].logprobs is None


# --- the Responses API ----------------------------------------------------------------------------


def test_a_responses_only_model_refuses_chat_completions_as_openai_does(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="only supported in v1/responses") as caught:
        client.chat.completions.create(model="o3-pro", messages=user("hi"))
    assert caught.value.body == {
        "message": "This model is only supported in v1/responses and not in v1/chat/completions.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_responses_answer_in_openais_shapes(client: openai.OpenAI) -> None:
    response = client.responses.create(model="o3-pro", input="one two three", max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == "one two"
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 192
    with client.responses.stream(
        model="gpt-4o-mini",
        input="call get_weather",
        tools=[{"type": "function", **WEATHER_TOOL["function"]}],
    ) as stream:
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["location"] == "example"


def test_responses_refuse_chat_fields(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"'messages'\. In the Responses API"):
        client.responses.create(model="o3-pro", input="hi", extra_body={"messages": user("hi")})
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\].name"):
        client.responses.create(model="o3-pro", input="hi", tools=[WEATHER_TOOL])


def test_a_responses_stream_error_is_openais_error_event(fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.stream_error(after=2))
    body = {"model": "o3-pro", "input": "hi", "stream": True}
    headers = {"authorization": f"Bearer {fake_openai.api_key}"}
    reply = httpx.post(f"{fake_openai.base_url}/responses", json=body, headers=headers, timeout=5)
    last = reply.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    assert json.loads(last.split("data: ", 1)[1])["type"] == "error"
