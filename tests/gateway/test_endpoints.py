"""/v1/completions, /v1/embeddings, /v1/models, health, readiness, metrics, request ids and the log line."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
import structlog

from tests.fakes import FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import DEMO_KEY, LIMITED_KEY, RunningGateway


def test_completions_native_on_openai_compatible_backends(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    response = gateway.openai().completions.create(
        model="gpt-instruct", prompt="once upon a time", max_tokens=3
    )
    assert response.object == "text_completion"
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None and response.usage.completion_tokens == 3
    assert fake_openai.last_request.path == "/v1/completions"
    assert fake_openai.last_request.json["model"] == "gpt-3.5-turbo-instruct"
    assert gateway.sink.events[0].usage.output_tokens == 3


@pytest.mark.parametrize("model", ["gpt-instruct", "claude-sonnet", "gemini-flash"])
def test_completions_stream(gateway: RunningGateway, model: str) -> None:
    chunks = list(
        gateway.openai().completions.create(
            model=model, prompt="the quick brown fox", stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.split() == ["the", "quick", "brown", "fox"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


@pytest.mark.parametrize("model", ["claude-sonnet", "gemini-flash"])
def test_completions_through_chat_backends(gateway: RunningGateway, model: str) -> None:
    response = gateway.openai().completions.create(model=model, prompt="say exactly this")
    assert response.choices[0].text == "say exactly this"
    assert response.usage is not None and response.usage.prompt_tokens > 0


def test_completions_with_token_ids_need_an_openai_compatible_backend(gateway: RunningGateway) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().completions.create(model="claude-sonnet", prompt=[1, 2, 3])
    assert caught.value.param == "prompt"


@pytest.mark.parametrize("model", ["text-embedding-3-small", "gemini-embedding"])
def test_embeddings(gateway: RunningGateway, model: str) -> None:
    response = gateway.openai().embeddings.create(
        model=model, input=["first text", "second text"], dimensions=8
    )
    assert [item.index for item in response.data] == [0, 1]
    assert all(len(item.embedding) == 8 for item in response.data)
    assert response.data[0].embedding != response.data[1].embedding
    assert gateway.sink.events[0].route == model


def test_embeddings_usage_from_openai(gateway: RunningGateway) -> None:
    response = gateway.openai().embeddings.create(
        model="text-embedding-3-small", input="four words right here"
    )
    assert response.usage.prompt_tokens == 4
    assert gateway.sink.events[0].usage.input_tokens == 4


def test_gemini_embeddings_use_batch_embed_contents(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    gateway.openai().embeddings.create(model="gemini-embedding", input="hello")
    sent = fake_gemini.last_request
    assert sent.path.endswith("/models/gemini-embedding-001:batchEmbedContents")
    assert sent.json["requests"][0]["content"] == {"parts": [{"text": "hello"}]}


def test_embeddings_on_a_chat_only_backend_is_400(gateway: RunningGateway) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().embeddings.create(model="claude-sonnet", input="x")
    assert caught.value.param == "model" and "does not support embeddings" in caught.value.message


def test_models_lists_what_the_tenant_may_use(gateway: RunningGateway) -> None:
    models = {m.id: m.owned_by for m in gateway.openai().models.list()}
    assert models["gpt-4o-mini"] == "openai" and models["claude-sonnet"] == "anthropic"
    assert set(models) == {m.name for m in gateway.config.models}
    assert gateway.openai().models.retrieve("gemini-flash").id == "gemini-flash"
    with pytest.raises(openai.NotFoundError):
        gateway.openai().models.retrieve("nope")


def test_anthropic_clients_page_through_the_models(gateway: RunningGateway) -> None:
    """Anthropic's `GET /v1/models` pages (`limit`, `after_id`, `before_id`; `first_id`, `last_id`,
    `has_more`): Weir's ignored them and sent every model with `has_more` false."""
    every = [m.id for m in gateway.openai().models.list()]
    assert len(every) > 5
    client = gateway.anthropic()
    first = client.models.list(limit=2)
    assert [m.id for m in first.data] == every[:2] and first.has_more is True
    assert (first.first_id, first.last_id) == (every[0], every[1])
    assert [m.id for m in client.models.list(limit=3)] == every  # the SDK follows `last_id` to the end
    after = client.models.list(limit=3, after_id=every[1])
    assert [m.id for m in after.data] == every[2:5] and after.has_more is True
    last = client.models.list(limit=3, after_id=every[-3])
    assert [m.id for m in last.data] == every[-2:] and last.has_more is False
    before = client.models.list(limit=2, before_id=every[3])
    assert [m.id for m in before.data] == every[1:3] and before.has_more is True
    start = client.models.list(limit=5, before_id=every[2])
    assert [m.id for m in start.data] == every[:2] and start.has_more is False
    whole = client.models.list(limit=1000)
    assert [m.id for m in whole.data] == every and whole.has_more is False


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": "many"}, "limit"),
        ({"after_id": "no-such-model"}, "after_id"),
        ({"before_id": "no-such-model"}, "before_id"),
        ({"after_id": "gpt-4o-mini", "before_id": "gemini-flash"}, "before_id"),
    ],
)
def test_a_bad_page_of_models_is_an_anthropic_400(gateway: RunningGateway, query: dict, param: str) -> None:
    response = httpx.get(
        f"{gateway.url}/v1/models",
        params=query,
        headers={"x-api-key": DEMO_KEY, "anthropic-version": "2023-06-01"},
    )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(param)


def test_models_in_the_anthropic_shape_for_anthropic_clients(gateway: RunningGateway) -> None:
    client = gateway.anthropic()
    page = client.models.list()
    assert {m.id for m in page.data} == {m.name for m in gateway.config.models}
    assert all(m.type == "model" and m.display_name == m.id for m in page.data)
    assert page.has_more is False and page.first_id == page.data[0].id and page.last_id == page.data[-1].id
    claude = client.models.retrieve("claude-sonnet")
    assert (claude.type, claude.id) == ("model", "claude-sonnet")
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("nope")
    # Limited to gemini-flash: it sees that alone, and the others do not exist for it.
    limited = gateway.anthropic(api_key=LIMITED_KEY)
    assert [m.id for m in limited.models.list().data] == ["gemini-flash"]
    with pytest.raises(anthropic.NotFoundError):
        limited.models.retrieve("claude-sonnet")


def test_model_errors_in_the_anthropic_shape_for_anthropic_clients(gateway: RunningGateway) -> None:
    """/v1/models answers an Anthropic client (its `anthropic-version` header) in Anthropic's shape,
    but its errors came in OpenAI's: `models.retrieve` of an unknown model, a wrong key. They come
    in the shape of the answer the client would have had; an OpenAI client's stay OpenAI's."""
    with pytest.raises(anthropic.NotFoundError) as missing:
        gateway.anthropic().models.retrieve("nope")
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as refused:
        gateway.anthropic(api_key="sk-wrong").models.list()
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as openai_missing:
        gateway.openai().models.retrieve("nope")
    assert openai_missing.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_an_anthropic_clients_model_answers_carry_the_request_id_header_it_reads(
    gateway: RunningGateway,
) -> None:
    """The anthropic SDK reads a request's id from `request-id` (`_request_id`, and its errors'
    `request_id`); /v1/models answers it in Anthropic's shape, and sent that header only under
    /v1/messages. An OpenAI client's answers keep `x-request-id` alone."""
    listed = gateway.anthropic().models.with_raw_response.list()
    assert listed.headers["request-id"] == listed.headers["x-request-id"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        gateway.anthropic().models.retrieve("nope")
    assert missing.value.request_id == missing.value.body["request_id"] is not None  # type: ignore[index]
    assert "request-id" not in gateway.openai().models.with_raw_response.list().headers
    # A path only sharing the Messages API's prefix is not Anthropic's: its error is OpenAI's too.
    other = httpx.post(f"{gateway.url}/v1/messagesx", headers={"authorization": f"Bearer {DEMO_KEY}"})
    assert "request-id" not in other.headers and "type" not in other.json()


def test_health_and_readiness(gateway: RunningGateway) -> None:
    assert httpx.get(f"{gateway.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{gateway.url}/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


@pytest.mark.parametrize("path", ["/", "/api/hello"])
def test_claude_codes_probes_find_the_gateway_up_without_a_key(gateway: RunningGateway, path: str) -> None:
    """Claude Code sends `HEAD /` to its ANTHROPIC_BASE_URL as a connectivity preflight and `HEAD
    /api/hello` to warm its connection: a 404 read as the endpoint being down."""
    head = httpx.head(f"{gateway.url}{path}")
    assert head.status_code == 200 and head.content == b""
    got = httpx.get(f"{gateway.url}{path}")
    assert got.status_code == 200 and got.json() == {"status": "ok"}


def test_metrics(gateway: RunningGateway) -> None:
    client = gateway.openai()
    client.chat.completions.create(model="claude-sonnet", messages=[{"role": "user", "content": "a b"}])
    list(
        client.chat.completions.create(
            model="gemini-flash", messages=[{"role": "user", "content": "c"}], stream=True
        )
    )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "c"}])
    text = httpx.get(f"{gateway.url}/metrics").text
    assert (
        'weir_requests_total{backend="anthropic",endpoint="chat",model="claude-sonnet",status="200"}' in text
    )
    assert 'weir_requests_total{backend="none",endpoint="chat",model="none",status="404"}' in text
    assert "ghost" not in text  # clients cannot mint label values
    assert (
        'weir_request_duration_seconds_bucket{backend="anthropic",endpoint="chat",le="0.5",model="claude-sonnet"}'
        in text
    )
    assert (
        'weir_time_to_first_token_seconds_count{backend="gemini",endpoint="chat",model="gemini-flash"}'
        in text
    )
    assert 'weir_tokens_total{backend="anthropic",class="output",model="claude-sonnet"}' in text
    assert "weir_requests_in_flight" in text


def test_errors_are_counted_by_type(gateway: RunningGateway) -> None:
    httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "dead-model", "messages": [{"role": "user", "content": "x"}]},
        headers={"authorization": f"Bearer {DEMO_KEY}"},
    )
    text = httpx.get(f"{gateway.url}/metrics").text
    assert (
        'weir_errors_total{backend="dead",endpoint="chat",model="dead-model",type="upstream_error"}' in text
    )


def test_request_id_is_returned_and_honoured(gateway: RunningGateway) -> None:
    response = gateway.openai().chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}]
    )
    generated = response.headers["x-request-id"]
    assert len(generated) == 32
    assert gateway.sink.events[0].request_id == generated
    mine = httpx.get(
        f"{gateway.url}/v1/models",
        headers={"authorization": f"Bearer {DEMO_KEY}", "x-request-id": "trace-42"},
    )
    assert mine.headers["x-request-id"] == "trace-42"
    failed = httpx.get(f"{gateway.url}/v1/models")
    assert failed.status_code == 401 and len(failed.headers["x-request-id"]) == 32


def test_one_log_line_per_request(gateway: RunningGateway) -> None:
    with structlog.testing.capture_logs() as logs:
        response = gateway.openai().chat.completions.with_raw_response.create(
            model="claude-sonnet", messages=[{"role": "user", "content": "log me"}], stream=True
        )
        list(response.parse())
    [line] = [entry for entry in logs if entry["event"] == "request"]
    assert line["request_id"] == response.headers["x-request-id"]
    assert (line["status"], line["model"], line["backend"], line["tenant"]) == (
        200,
        "claude-sonnet",
        "anthropic",
        "demo",
    )
    assert line["stream"] is True and line["output_tokens"] == 2 and line["ttft_ms"] > 0


@pytest.mark.parametrize("include_usage", [False, True])
def test_completions_stream_keeps_its_last_chunk_when_that_also_reports_usage(
    compat_gateway: RunningGateway, include_usage: bool
) -> None:
    """As on chat: Mistral's last chunk holds the finish reason and the usage, and goes to every
    client, with the usage only for one that asked for it."""
    chunks = list(
        compat_gateway.openai().completions.create(
            model="mistral-small",
            prompt="hello",
            stream=True,
            stream_options={"include_usage": include_usage},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    assert [c.usage.completion_tokens for c in chunks if c.usage is not None] == (
        [2] if include_usage else []
    )
