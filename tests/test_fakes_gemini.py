"""The fake Gemini server over its REST wire format (the shape `google-genai` sends and reads)."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.providers.base import CONTINUE_INSTRUCTION
from tests.fakes import FakeGemini, Fault

MODEL = "gemini-2.5-flash"


@pytest.fixture
def http(fake_gemini: FakeGemini) -> httpx.Client:
    return httpx.Client(
        base_url=f"{fake_gemini.base_url}/v1beta", headers={"x-goog-api-key": fake_gemini.api_key}
    )


def ask(text: str, **extra: object) -> dict:
    return {"contents": [{"role": "user", "parts": [{"text": text}]}], **extra}


def test_generate_content_echo_with_usage_metadata(http: httpx.Client) -> None:
    body = http.post(f"/models/{MODEL}:generateContent", json=ask("hello gemini")).json()
    candidate = body["candidates"][0]
    assert candidate["content"] == {"role": "model", "parts": [{"text": "hello gemini"}]}
    assert candidate["finishReason"] == "STOP"
    meta = body["usageMetadata"]
    assert (meta["promptTokenCount"], meta["candidatesTokenCount"], meta["totalTokenCount"]) == (2, 2, 4)
    assert "cachedContentTokenCount" not in meta and body["modelVersion"] == MODEL


def test_sse_stream_frames_and_running_usage(http: httpx.Client) -> None:
    with http.stream("POST", f"/models/{MODEL}:streamGenerateContent?alt=sse", json=ask("a b c")) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = [f for f in raw.split("\r\n\r\n") if f]
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames]
    assert [c["candidates"][0]["content"]["parts"][0]["text"] for c in chunks] == ["a", " b", " c"]
    assert [c["candidates"][0].get("finishReason") for c in chunks] == [None, None, "STOP"]
    assert chunks[-1]["usageMetadata"]["candidatesTokenCount"] == 3


def test_stream_without_sse_is_a_json_array(http: httpx.Client) -> None:
    chunks = http.post(f"/models/{MODEL}:streamGenerateContent", json=ask("x y")).json()
    assert isinstance(chunks, list) and len(chunks) == 2


def test_function_call_and_response_round_trip(http: httpx.Client) -> None:
    tools = [
        {
            "functionDeclarations": [
                {
                    "name": "get_weather",
                    "parameters": {"type": "OBJECT", "properties": {"city": {"type": "STRING"}}},
                }
            ]
        }
    ]
    call = http.post(f"/models/{MODEL}:generateContent", json=ask("call get_weather", tools=tools)).json()
    part = call["candidates"][0]["content"]["parts"][0]
    assert part == {"functionCall": {"name": "get_weather", "args": {"city": "example"}}}
    forced = http.post(
        f"/models/{MODEL}:generateContent",
        json=ask("weather?", tools=tools, toolConfig={"functionCallingConfig": {"mode": "ANY"}}),
    ).json()
    assert "functionCall" in forced["candidates"][0]["content"]["parts"][0]
    result = {
        "contents": [
            {"role": "user", "parts": [{"text": "weather?"}]},
            {"role": "model", "parts": [part]},
            {
                "role": "user",
                "parts": [{"functionResponse": {"name": "get_weather", "response": {"sky": "clear"}}}],
            },
        ],
        "tools": tools,
    }
    answer = http.post(f"/models/{MODEL}:generateContent", json=result).json()
    assert (
        answer["candidates"][0]["content"]["parts"][0]["text"]
        == 'Tool get_weather returned: {"sky": "clear"}'
    )


def test_generation_config(http: httpx.Client) -> None:
    cut = http.post(
        f"/models/{MODEL}:generateContent", json=ask("a b c", generationConfig={"maxOutputTokens": 1})
    ).json()
    assert cut["candidates"][0]["finishReason"] == "MAX_TOKENS"
    schema = {"type": "OBJECT", "properties": {"answer": {"type": "STRING"}}}
    as_json = http.post(
        f"/models/{MODEL}:generateContent",
        json=ask("yes", generationConfig={"responseMimeType": "application/json", "responseSchema": schema}),
    ).json()
    assert json.loads(as_json["candidates"][0]["content"]["parts"][0]["text"]) == {"answer": "yes"}
    image = {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}}
    seen = http.post(
        f"/models/{MODEL}:generateContent",
        json={"contents": [{"role": "user", "parts": [image, {"text": "what"}]}]},
    )
    assert seen.json()["usageMetadata"]["promptTokenCount"] == 258 + 1


def test_thoughts_are_counted_apart_from_candidates(http: httpx.Client) -> None:
    config = {"thinkingConfig": {"thinkingBudget": 1024, "includeThoughts": True}}
    body = http.post(f"/models/{MODEL}:generateContent", json=ask("a b", generationConfig=config)).json()
    meta = body["usageMetadata"]
    assert (meta["candidatesTokenCount"], meta["thoughtsTokenCount"], meta["totalTokenCount"]) == (
        2,
        64,
        2 + 2 + 64,
    )
    assert body["candidates"][0]["content"]["parts"][0]["thought"] is True


def test_cached_content_reports_cached_tokens(http: httpx.Client, fake_gemini: FakeGemini) -> None:
    doc = {"role": "user", "parts": [{"text": " ".join(f"p{i}" for i in range(1100))}]}
    too_small = http.post(
        "/cachedContents", json={"model": f"models/{MODEL}", "contents": [ask("x")["contents"][0]]}
    )
    assert too_small.status_code == 400
    cache = http.post(
        "/cachedContents", json={"model": f"models/{MODEL}", "contents": [doc], "ttl": "600s"}
    ).json()
    assert cache["usageMetadata"]["totalTokenCount"] == 1100
    body = http.post(f"/models/{MODEL}:generateContent", json=ask("q", cachedContent=cache["name"])).json()
    meta = body["usageMetadata"]
    assert (meta["promptTokenCount"], meta["cachedContentTokenCount"]) == (1101, 1100)
    assert fake_gemini.last_usage.cached_input_tokens == 1100 and fake_gemini.last_usage.input_tokens == 1
    assert http.delete(f"/{cache['name']}").status_code == 200
    gone = http.post(f"/models/{MODEL}:generateContent", json=ask("q", cachedContent=cache["name"]))
    assert gone.status_code == 403 and gone.json()["error"]["status"] == "PERMISSION_DENIED"


def test_auth_errors_match_google(fake_gemini: FakeGemini) -> None:
    url = f"{fake_gemini.base_url}/v1beta/models/{MODEL}:generateContent"
    wrong = httpx.post(url, headers={"x-goog-api-key": "nope"}, json=ask("x"))
    assert wrong.status_code == 400 and wrong.json()["error"]["status"] == "INVALID_ARGUMENT"
    details = wrong.json()["error"]["details"]
    assert [d["@type"].rsplit(".", 1)[1] for d in details] == ["ErrorInfo", "LocalizedMessage"]
    assert details[0]["reason"] == "API_KEY_INVALID"
    missing = httpx.post(url, json=ask("x"))
    assert missing.status_code == 403 and missing.json()["error"]["status"] == "PERMISSION_DENIED"
    by_query = httpx.post(url, params={"key": fake_gemini.api_key}, json=ask("ok"))
    assert by_query.status_code == 200


def test_unknown_model_and_faults(http: httpx.Client, fake_gemini: FakeGemini) -> None:
    missing = http.post("/models/gemini-9:generateContent", json=ask("x"))
    assert missing.status_code == 404 and missing.json()["error"]["status"] == "NOT_FOUND"
    fake_gemini.fail_next(Fault.status(429, retry_after=2))
    limited = http.post(f"/models/{MODEL}:generateContent", json=ask("x"))
    assert limited.status_code == 429 and limited.headers["retry-after"] == "2"
    assert limited.json()["error"] == {
        "code": 429,
        "message": "Resource has been exhausted (e.g. check quota).",
        "status": "RESOURCE_EXHAUSTED",
    }
    fake_gemini.fail_next(Fault.stream_error(after=1, code=503))
    with http.stream("POST", f"/models/{MODEL}:streamGenerateContent?alt=sse", json=ask("a b c")) as response:
        frames = [f for f in response.read().decode().split("\r\n\r\n") if f]
    assert json.loads(frames[-1].removeprefix("data: "))["error"]["status"] == "UNAVAILABLE"


def test_embeddings_count_tokens_and_models(http: httpx.Client) -> None:
    one = http.post(
        "/models/gemini-embedding-001:embedContent", json={"content": {"parts": [{"text": "hi"}]}}
    ).json()
    assert len(one["embedding"]["values"]) == 3072
    batch = http.post(
        "/models/text-embedding-004:batchEmbedContents",
        json={
            "requests": [
                {"model": "models/text-embedding-004", "content": {"parts": [{"text": t}]}}
                for t in ("a", "b")
            ]
        },
    ).json()
    assert [len(e["values"]) for e in batch["embeddings"]] == [768, 768]
    assert http.post(f"/models/{MODEL}:countTokens", json=ask("a b c")).json()["totalTokens"] == 3
    names = [m["name"] for m in http.get("/models").json()["models"]]
    assert f"models/{MODEL}" in names


def test_official_google_genai_sdk_round_trip(fake_gemini: FakeGemini) -> None:
    from google import genai
    from google.genai import errors, types

    client = genai.Client(
        api_key=fake_gemini.api_key, http_options=types.HttpOptions(base_url=fake_gemini.base_url)
    )
    reply = client.models.generate_content(model=MODEL, contents="hello there")
    assert reply.text == "hello there" and reply.usage_metadata.total_token_count == 4
    assert fake_gemini.last_request.headers["x-goog-api-key"] == fake_gemini.api_key
    assert [c.text for c in client.models.generate_content_stream(model=MODEL, contents="a b c")] == [
        "a",
        " b",
        " c",
    ]

    weather = types.FunctionDeclaration(
        name="get_weather",
        parameters=types.Schema(type="OBJECT", properties={"city": types.Schema(type="STRING")}),
    )
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[weather])])
    call = client.models.generate_content(model=MODEL, contents="call get_weather", config=config)
    assert [(f.name, f.args) for f in call.function_calls] == [("get_weather", {"city": "example"})]

    cache = client.caches.create(
        model=MODEL, config=types.CreateCachedContentConfig(contents=["w " * 1100], ttl="300s")
    )
    cached = client.models.generate_content(
        model=MODEL, contents="q", config=types.GenerateContentConfig(cached_content=cache.name)
    )
    assert cached.usage_metadata.cached_content_token_count == 1100
    assert cached.usage_metadata.prompt_token_count == 1101

    vectors = client.models.embed_content(model="gemini-embedding-001", contents=["a", "b"])
    assert [len(e.values) for e in vectors.embeddings] == [3072, 3072]
    fake_gemini.fail_next(Fault.status(503))
    with pytest.raises(errors.ServerError) as err:
        client.models.generate_content(model=MODEL, contents="x")
    assert err.value.code == 503 and err.value.status == "UNAVAILABLE"


def test_rejects_what_gemini_rejects(http: httpx.Client) -> None:
    too_many = http.post(
        f"/models/{MODEL}:generateContent", json=ask("x", generationConfig={"maxOutputTokens": 100000})
    )
    assert too_many.status_code == 400 and "maxOutputTokens" in too_many.json()["error"]["message"]
    # Each model's own limit, as its `outputTokenLimit` says: Gemini 2.0 Flash writes 8,192 at most.
    assert http.get("/models/gemini-2.0-flash").json()["outputTokenLimit"] == 8192
    flash_2 = "/models/gemini-2.0-flash:generateContent"
    assert http.post(flash_2, json=ask("x", generationConfig={"maxOutputTokens": 8192})).status_code == 200
    above = http.post(flash_2, json=ask("x", generationConfig={"maxOutputTokens": 8193}))
    assert (
        "value of 8193 but the supported range is from 1 (inclusive) to 8193 (exclusive)"
        in (above.json()["error"]["message"])
    )
    empty = http.post(f"/models/{MODEL}:generateContent", json={"contents": []})
    assert empty.status_code == 400 and empty.json()["error"]["status"] == "INVALID_ARGUMENT"


def test_trailing_model_turn_is_continued(http: httpx.Client) -> None:
    body = {
        "contents": [
            {"role": "user", "parts": [{"text": "red green blue"}]},
            {"role": "model", "parts": [{"text": "red green"}]},
        ]
    }
    reply = http.post(f"/models/{MODEL}:generateContent", json=body).json()
    assert reply["candidates"][0]["content"]["parts"][0]["text"] == " blue"


def test_continue_loosely_joins_only_continuations_asked_for_in_a_user_turn(
    http: httpx.Client, fake_gemini: FakeGemini
) -> None:
    contents = [
        {"role": "user", "parts": [{"text": "red green blue"}]},
        {"role": "model", "parts": [{"text": "red green"}]},
    ]
    asked = [*contents, {"role": "user", "parts": [{"text": CONTINUE_INSTRUCTION}]}]
    fake_gemini.continue_loosely(restate=1)
    reply = http.post(f"/models/{MODEL}:generateContent", json={"contents": asked}).json()
    assert reply["candidates"][0]["content"]["parts"][0]["text"] == "green blue"
    reply = http.post(f"/models/{MODEL}:generateContent", json={"contents": contents}).json()
    assert reply["candidates"][0]["content"]["parts"][0]["text"] == " blue"  # a prefill stays exact


def test_newer_models_refuse_a_trailing_model_turn(http: httpx.Client, fake_gemini: FakeGemini) -> None:
    fake_gemini.models.add("gemini-3.6-flash")
    body = {
        "contents": [
            {"role": "user", "parts": [{"text": "red green blue"}]},
            {"role": "model", "parts": [{"text": "red green"}]},
        ]
    }
    refused = http.post("/models/gemini-3.6-flash:generateContent", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "Requests ending with a model turn are not supported."


def test_logprobs_as_the_google_genai_sdk_reads_them(fake_gemini: FakeGemini) -> None:
    from google import genai
    from google.genai import types

    client = genai.Client(
        api_key=fake_gemini.api_key, http_options=types.HttpOptions(base_url=fake_gemini.base_url)
    )
    config = types.GenerateContentConfig(response_logprobs=True, logprobs=2)
    result = client.models.generate_content(model=MODEL, contents="sky is blue", config=config)
    logprobs = result.candidates[0].logprobs_result  # type: ignore[index]
    assert fake_gemini.last_request.json["generationConfig"] == {"responseLogprobs": True, "logprobs": 2}
    chosen = logprobs.chosen_candidates  # type: ignore[union-attr]
    assert [c.token for c in chosen] == ["sky", " is", " blue"]  # type: ignore[union-attr]
    assert chosen[0].log_probability is None and chosen[1].log_probability == -0.25  # type: ignore[index]
    tops = logprobs.top_candidates  # type: ignore[union-attr]
    expected = [["sky", "sky1"], [" is", " is1"], [" blue", " blue1"]]
    assert [[c.token for c in step.candidates] for step in tops] == expected  # type: ignore[union-attr]
    streamed = client.models.generate_content_stream(model=MODEL, contents="a b", config=config)
    assert [[c.token for c in r.candidates[0].logprobs_result.chosen_candidates] for r in streamed] == [  # type: ignore[index, union-attr]
        ["a"],
        [" b"],
    ]
    plain = client.models.generate_content(model=MODEL, contents="a")
    assert plain.candidates[0].logprobs_result is None  # type: ignore[index]
