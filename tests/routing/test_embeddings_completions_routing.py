"""/v1/embeddings, legacy /v1/completions and /v1/messages/count_tokens through routes that fail over,
as a production client sees them (the official SDKs against the fakes): vectors that keep the size and
space the client indexes, `encoding_format`, batches, retries, hedges, what the ledger bills, and
completions parameters only some candidates can honour."""

from __future__ import annotations

import base64
import struct
import time

import anthropic
import openai
import pytest

from routing.plan import prompt_features
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway, full_config_text
from tests.routing.routed import FAST, ledger, route_header, runtime

# A second account of OpenAI's text-embedding-3-small (an Azure deployment of the same model, on the
# fake OpenAI's Azure paths: a fault queued for `/v1/embeddings` leaves it alone), and Gemini's
# 768-wide text-embedding-004.
BACKENDS = """\
  - name: azure-embed
    type: openai
    base_url: ${AZURE_EMBED_URL}
    headers: {api-key: "${OPENAI_API_KEY}"}
    query: {api-version: "2024-10-21"}
"""
MODELS = """\
  - {name: small-azure, backend: azure-embed, model: text-embedding-3-small, price: {input: 0.02, output: 0}}
  - {name: gemini-embedding-768, backend: gemini, model: text-embedding-004, price: {input: 0.15, output: 0}}
  - {name: gemini-2-flash, backend: gemini, model: gemini-2.0-flash}
"""
ROUTES = f"""\
routes:
  - {{name: embed, candidates: [{{model: text-embedding-3-small}}, {{model: gemini-embedding}}], {FAST}}}
  - {{name: embed-replicas, candidates: [{{model: text-embedding-3-small}}, {{model: small-azure}}], {FAST}}}
  - {{name: embed-gemini-first, candidates: [{{model: gemini-embedding-768}}, {{model: small-azure}}], {FAST}}}
  - {{name: embed-hedged, hedge: {{delay: 0.15}}, candidates: [{{model: text-embedding-3-small}}, {{model: small-azure}}], {FAST}}}
  - {{name: embed-impatient, ttft_timeout: 0.2, candidates: [{{model: text-embedding-3-small}}, {{model: small-azure}}], {FAST}}}
  - {{name: complete, candidates: [{{model: gpt-instruct}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: complete-short, when: {{max_prompt_tokens: 1000}}, candidates: [{{model: claude-sonnet}}], {FAST}}}
  - {{name: complete-short, candidates: [{{model: gpt-instruct, max_output_tokens: 50}}], {FAST}}}
  - {{name: count, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: count-none, candidates: [{{model: gpt-4o-mini}}], {FAST}}}
"""
TEXT = "one two three four"


@pytest.fixture(scope="module")
def gateway_config() -> str:
    text = full_config_text()
    text = text.replace("  - name: dead\n", BACKENDS + "  - name: dead\n", 1)
    text = text.replace(
        "  - {name: gpt-5, backend: openai}\n", "  - {name: gpt-5, backend: openai}\n" + MODELS, 1
    )
    return text + ROUTES


@pytest.fixture(scope="module")
def gateway_env(_fake_openai_server: FakeOpenAI) -> dict[str, str]:
    return {"AZURE_EMBED_URL": _fake_openai_server.azure_base_url("text-embedding-3-small")}


def _floats(vector: str) -> tuple[float, ...]:
    raw = base64.b64decode(vector)
    return struct.unpack(f"<{len(raw) // 4}f", raw)


# --- embeddings: the vector's size and space ------------------------------------------------------


def test_embeddings_never_fail_over_to_another_embedding_model(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    # A client indexing text-embedding-3-small's 1536-wide vectors must not get Gemini's 3072-wide
    # ones (another size, and another space) because OpenAI had a bad minute: it gets the error.
    fake_openai.fail_next(500, times=2)
    with pytest.raises(openai.InternalServerError) as caught:
        gateway.openai().embeddings.create(model="embed", input=["a b", "c"])
    route = route_header(caught.value.response)
    assert (
        route["tried"] == "gemini-embedding:unsupported,text-embedding-3-small:502,text-embedding-3-small:502"
    )
    assert not fake_gemini.requests
    assert ledger(gateway) == [("openai", 500), ("openai", 500)]


def test_embeddings_fail_over_to_a_replica_of_the_same_model(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(500, times=2, path="/v1/embeddings")
    raw = gateway.openai().embeddings.with_raw_response.create(
        model="embed-replicas", input=["a b", "c"], dimensions=256
    )
    result = raw.parse()
    assert [len(d.embedding) for d in result.data] == [256, 256]
    route = route_header(raw)
    assert route["candidate"] == "small-azure" and route["attempts"] == "3"
    assert ledger(gateway) == [("openai", 500), ("openai", 500), ("azure-embed", 200)]
    assert fake_openai.last_request.json["dimensions"] == 256


def test_the_first_planned_model_sets_the_space_even_when_its_breaker_is_open(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    fake_openai.stop()
    try:
        for _ in range(2):
            with pytest.raises(openai.APIStatusError):
                gateway.openai().embeddings.create(model="embed", input="hi")
        assert runtime(gateway).router.breakers.state("openai/text-embedding-3-small") == "open"
        with pytest.raises(openai.APIStatusError) as caught:  # fails fast, Gemini still no answer
            gateway.openai().embeddings.create(model="embed", input="hi")
    finally:
        fake_openai.start()
    assert caught.value.status_code == 503  # every candidate of the space is open: retry later
    assert (
        route_header(caught.value.response)["tried"]
        == "gemini-embedding:unsupported,text-embedding-3-small:open"
    )
    assert not fake_gemini.requests


# --- embeddings: encoding, batches, usage ---------------------------------------------------------


def test_base64_is_honoured_by_a_vendor_that_only_returns_floats(gateway: RunningGateway) -> None:
    client = gateway.openai()
    floats = client.embeddings.create(
        model="gemini-embedding-768", input=["x y", "z"], encoding_format="float"
    )
    encoded = client.embeddings.create(
        model="gemini-embedding-768", input=["x y", "z"], encoding_format="base64"
    )
    for plain, packed in zip(floats.data, encoded.data, strict=True):
        assert isinstance(packed.embedding, str)  # what OpenAI sends for base64: little-endian float32
        assert _floats(packed.embedding) == pytest.approx(plain.embedding, abs=1e-6)
    # The SDK's default (base64 on the wire, floats to the caller) works for both vendors.
    default = client.embeddings.create(model="gemini-embedding-768", input="x y")
    assert default.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    assert len(default.data[0].embedding) == 768


def test_every_vector_is_an_embedding_object(gateway: RunningGateway) -> None:
    # OpenAI's shape: `"object": "embedding"` on every item, as typed clients (and the SDKs' models) expect.
    for model in ("embed-replicas", "embed-gemini-first"):
        raw = gateway.openai().embeddings.with_raw_response.create(model=model, input=["a", "b"])
        body = raw.http_response.json()
        assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["embedding"] * 2


def test_base64_from_openai_passes_through(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    result = gateway.openai().embeddings.create(
        model="embed-replicas", input="x y", encoding_format="base64", dimensions=16
    )
    assert isinstance(result.data[0].embedding, str) and len(_floats(result.data[0].embedding)) == 16
    assert fake_openai.last_request.json["encoding_format"] == "base64"


def test_token_ids_for_a_text_only_model_are_its_400_not_another_models_vectors(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    # Gemini cannot embed token ids, and the OpenAI candidate embeds with another model than the one
    # text requests to this route get: the client gets Gemini's refusal, and nothing is sent anywhere.
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().embeddings.create(model="embed-gemini-first", input=[[1, 2, 3], [4, 5]])
    assert caught.value.param == "input" and "token ids" in caught.value.message
    assert not fake_gemini.requests and not fake_openai.requests
    # Text goes to Gemini, one entry per input, in order.
    result = gateway.openai().embeddings.create(model="embed-gemini-first", input=["a", "b c", "d"])
    assert [d.index for d in result.data] == [0, 1, 2]
    assert len(fake_gemini.last_request.json["requests"]) == 3


def test_an_invalid_input_in_a_batch_is_the_clients_400_and_never_fails_over(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError):
        gateway.openai().embeddings.create(model="embed-replicas", input=["fine", ""])
    assert ledger(gateway) == [("openai", 400)]
    assert len(fake_openai.requests) == 1


def test_gemini_embeddings_are_billed_for_their_input(gateway: RunningGateway) -> None:
    # Gemini's batchEmbedContents reports no usage; the attempt is still billed for its input tokens.
    result = gateway.openai().embeddings.create(model="embed-gemini-first", input=["one two three", "four"])
    (event,) = gateway.sink.events
    assert event.backend == "gemini" and event.status == 200
    assert event.usage.input_tokens > 0 and event.usage.output_tokens == 0
    assert event.cost_pico_usd > 0
    assert result.usage.prompt_tokens == event.usage.input_tokens == result.usage.total_tokens


def test_each_embeddings_attempt_is_one_usage_event_and_only_the_answer_is_billed(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(503, times=1, path="/v1/embeddings")
    result = gateway.openai().embeddings.create(model="embed-replicas", input=TEXT)
    events = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert [(e.backend, e.status, e.usage.input_tokens) for e in events] == [
        ("openai", 503, 0),
        ("openai", 200, 4),
    ]
    assert result.usage.prompt_tokens == 4 and events[1].usage.output_tokens == 0


def test_embeddings_429_waits_for_retry_after_then_retries_in_place(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.status(429, retry_after=0.4), path="/v1/embeddings")
    started = time.monotonic()
    raw = gateway.openai().embeddings.with_raw_response.create(model="embed-replicas", input=TEXT)
    assert time.monotonic() - started >= 0.4
    assert route_header(raw)["tried"] == "text-embedding-3-small:429,text-embedding-3-small:ok"


def test_embeddings_hedge_answers_when_the_whole_reply_is_late(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.delay(2.0), path="/v1/embeddings")
    started = time.monotonic()
    raw = gateway.openai().embeddings.with_raw_response.create(model="embed-hedged", input=TEXT)
    assert time.monotonic() - started < 1.5
    route = route_header(raw)
    assert route["candidate"] == "small-azure" and route["hedged"] == "small-azure"
    assert len(raw.parse().data[0].embedding) == 1536


def test_ttft_timeout_does_not_cut_a_json_reply(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    # Streams only: a JSON reply has no first token, and the backend's own timeouts bound it.
    fake_openai.fail_next(Fault.delay(0.4), path="/v1/embeddings")
    raw = gateway.openai().embeddings.with_raw_response.create(model="embed-impatient", input=TEXT)
    assert route_header(raw)["candidate"] == "text-embedding-3-small"


# --- completions -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"echo": True},
        {"logprobs": 2},
        {"suffix": " the end"},
        {"best_of": 3},
        {"logit_bias": {"50256": -100}},
    ],
    ids=["echo", "logprobs", "suffix", "best_of", "logit_bias"],
)
def test_completions_options_a_chat_candidate_cannot_honour_are_not_dropped_on_failover(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, extra: dict[str, object]
) -> None:
    fake_openai.fail_next(500, times=2)
    with pytest.raises(openai.InternalServerError) as caught:
        gateway.openai().completions.create(model="complete", prompt=TEXT, **extra)  # type: ignore[call-overload]
    assert route_header(caught.value.response)["tried"] == (
        "claude-sonnet:unsupported,gpt-instruct:502,gpt-instruct:502"
    )
    assert not fake_anthropic.requests


def test_completions_without_those_options_still_fail_over_to_chat(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(500, times=2)
    completion = gateway.openai().completions.create(model="complete", prompt=TEXT, echo=False, max_tokens=2)
    assert completion.choices[0].text == "one two" and completion.choices[0].finish_reason == "length"


def test_completions_penalties_reach_a_chat_candidate(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    gateway.openai().completions.create(  # Gemini 2.0: later models take no penalties
        model="gemini-2-flash", prompt=TEXT, presence_penalty=0.5, frequency_penalty=0.25
    )
    config = fake_gemini.last_request.json["generationConfig"]
    assert config["presencePenalty"] == 0.5 and config["frequencyPenalty"] == 0.25


def test_completions_prompt_lists_and_n_go_natively(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    completion = gateway.openai().completions.create(model="complete", prompt=["a b", "c d"], n=2)
    assert len(completion.choices) == 4
    assert fake_openai.last_request.json["prompt"] == ["a b", "c d"]


def test_completions_token_ids_and_output_limit_are_what_the_route_sees(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """A prompt of token ids is that many tokens to a route's prompt-length condition (read as no text,
    5,000 ids passed a `max_prompt_tokens: 1000` branch), and a completions request's `max_tokens` is
    its output limit to the route, as a chat's is: lowered to the candidate's `max_output_tokens`, the
    header says `output_capped` (it said nothing, and `cheapest` fitted the route's expected output)."""
    ids = [1000 + i % 500 for i in range(5000)]
    completion = gateway.openai().completions.with_raw_response.create(
        model="complete-short", prompt=[ids], max_tokens=400
    )
    route = route_header(completion)
    assert (route["candidate"], route["output_capped"]) == ("gpt-instruct", "50")
    assert fake_openai.last_request.json["max_tokens"] == 50
    assert not fake_anthropic.requests
    # A short text prompt takes the first branch, as before.
    short = gateway.openai().completions.with_raw_response.create(model="complete-short", prompt=TEXT)
    assert route_header(short)["candidate"] == "claude-sonnet"


def test_a_prompt_of_token_ids_is_as_long_whether_flat_or_in_a_list() -> None:
    ids = [1000 + i % 500 for i in range(5000)]
    flat, nested = prompt_features("r", ids, None, None), prompt_features("r", [ids], None, None)
    assert flat.prompt_tokens == nested.prompt_tokens >= len(ids)


def test_completions_n_with_a_chat_candidate_is_skipped_not_truncated(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(500, times=2)
    with pytest.raises(openai.InternalServerError) as caught:
        gateway.openai().completions.create(model="complete", prompt=TEXT, n=2)
    assert "claude-sonnet:unsupported" in route_header(caught.value.response)["tried"]
    assert not fake_anthropic.requests


def test_a_chat_candidates_completions_stream_cut_mid_way_ends_with_an_error_event(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(500, times=2)
    fake_anthropic.fail_next(Fault.cut_stream(after=4))
    stream = gateway.openai().completions.create(model="complete", prompt=TEXT, stream=True)
    received: list[str] = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            received.extend(c.text for c in chunk.choices)
    assert received and "".join(received) != TEXT


# --- count_tokens --------------------------------------------------------------------------------------


def test_count_tokens_skips_a_candidate_that_cannot_count(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    raw = gateway.anthropic().messages.with_raw_response.count_tokens(
        model="count", messages=[{"role": "user", "content": TEXT}]
    )
    assert raw.parse().input_tokens > 0 and raw.headers["x-weir-token-count"] == "backend"
    assert route_header(raw)["tried"] == "gpt-4o-mini:unsupported,claude-sonnet:ok"
    assert not fake_openai.requests
    assert all(e.cost_pico_usd == 0 for e in gateway.sink.events)  # counting is free


def test_count_tokens_with_no_counter_estimates(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    raw = gateway.anthropic().messages.with_raw_response.count_tokens(
        model="count-none", messages=[{"role": "user", "content": TEXT}]
    )
    assert raw.parse().input_tokens > 0 and raw.headers["x-weir-token-count"] == "estimate"
    assert not fake_openai.requests and not gateway.sink.events


def test_count_tokens_counter_down_is_an_error_not_a_silent_estimate(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.fail_next(500, times=2)
    with pytest.raises(anthropic.InternalServerError):
        gateway.anthropic().messages.count_tokens(model="count", messages=[{"role": "user", "content": TEXT}])
