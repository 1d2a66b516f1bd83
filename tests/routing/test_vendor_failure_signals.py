"""How each vendor signals a failure, as the failover executor sees it, through a real routed gateway
with the official SDKs as clients.

- Gemini says when to retry in its error body (a `google.rpc.RetryInfo` in `error.details`,
  `"retryDelay": "30s"`), never in a header: it must be honoured like `retry-after` (and capped by
  `max_retry_after`), and reach the client as `retry-after`, in the status line or inside a stream.
- OpenAI's 429 `insufficient_quota` is an account out of credit, not a rate limit, and a 404 is a
  model the backend does not have: waiting lifts neither, so the next candidate is tried at once
  instead of the same backend again.
- A vendor refusing the gateway's own key or account is no fault of the request: a 502 that fails
  over, however the vendor words it (a 401/403; Anthropic's 400 "credit balance is too low"; Gemini's
  400 `INVALID_ARGUMENT` with reason `API_KEY_INVALID`).
- An OpenAI-compatible server (OpenRouter, say) that has already sent its 200 reports a failure in the
  body (`{"error": {...}}`, no `choices`): a failure to fail over from, never an empty answer. So is a
  200 stream that ends (`[DONE]`) with no finish reason and none of an answer; an empty answer with a
  finish reason is the model's own, and is passed on.
- Errors inside a 200 stream and streams that just stop, for each vendor: before the first token they
  fail over invisibly, after it the stream continues on the next candidate. An error inside a stream
  has the status it would have in the status line (Anthropic's `rate_limit_error` a 429, OpenRouter's
  `"code": 429` a 429), so a route's `failover_on` reads it the same, streamed or not.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from gateway.usage import Usage
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.reliability.raw_backend import Send, Sleep, http_head
from tests.routing.routed import FAST, ROUTES, ledger, raw_config_text, route_header, runtime, settled

HI = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"

# Routes that fail over on rate limits only (no `5xx`): what a 429 is must not depend on whether the
# vendor said it in the status line or inside its 200 stream.
ONLY_429 = FAST + ", failover_on: [429]"
EXTRA_ROUTES = f"""\
  - {{name: gemini-first, candidates: [{{model: gemini-flash}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: raw-first, candidates: [{{model: raw-model}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: vendors, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}, {{model: gemini-flash}}], {FAST}}}
  - {{name: vendors-from-claude, candidates: [{{model: claude-sonnet}}, {{model: gemini-flash}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: vendors-from-gemini, candidates: [{{model: gemini-flash}}, {{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: gemini-key-first, candidates: [{{model: gemini-revoked}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: raw-gemini-first, candidates: [{{model: raw-gemini}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: model-gone-first, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}, failover_on: [429, 5xx, 404]}}
  - {{name: too-large-first, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}, failover_on: [429, 5xx, 413, 422]}}
  - {{name: claude-first-429, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {ONLY_429}}}
  - {{name: raw-first-429, candidates: [{{model: raw-model}}, {{model: claude-sonnet}}], {ONLY_429}}}
"""
# A Gemini backend whose key the fake does not know: refused as Google refuses a wrong or expired key.
REVOKED_BACKEND = """\
  - {name: gemini-revoked, type: gemini, base_url: "${GEMINI_BASE_URL}", api_key: revoked-key}
"""
REVOKED_MODEL = """\
  - {name: gemini-revoked, backend: gemini-revoked, model: gemini-2.5-flash}"""
# The raw backend again, spoken to as Gemini: its scripted bytes are whatever a test puts there.
RAW_GEMINI_BACKEND = """\
  - {name: raw-gemini, type: gemini, base_url: "${RAW_URL}", api_key: unused}
"""
RAW_GEMINI_MODEL = """\
  - {name: raw-gemini, backend: raw-gemini, model: gemini-2.5-flash}"""

# OpenRouter commits its 200 before the provider behind it answers; a provider's failure then comes
# in the body, with the provider's status as a number in `error.code`.
IN_BAND_429 = (
    b'{"error": {"message": "Provider returned error", "code": 429,'
    b' "metadata": {"raw": "rate limited upstream", "provider_name": "Example"}},'
    b' "user_id": "user_123"}'
)
NO_CHOICES = b'{"id": "gen-1", "object": "chat.completion", "created": 0, "model": "gpt-4o-mini"}'
CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "gpt-4o-mini"}
ROLE = {
    **CHUNK,
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
}
USAGE = {**CHUNK, "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 0, "total_tokens": 6}}


class Script:
    """What the raw backend answers to every request."""

    answer: bytes
    calls: int

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.answer, self.calls = http_head() + IN_BAND_429, 0

    def __call__(self, send: Send, sleep: Sleep) -> None:
        with self.lock:
            self.calls += 1
        send(self.answer)


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return ROUTES + EXTRA_ROUTES


@pytest.fixture(scope="module")
def gateway_config(gateway_routes: str) -> str:
    text = raw_config_text(gateway_routes)
    text = text.replace("backends:\n", "backends:\n" + REVOKED_BACKEND + RAW_GEMINI_BACKEND, 1)
    return text.replace("models:", "models:\n" + REVOKED_MODEL + "\n" + RAW_GEMINI_MODEL, 1)


@pytest.fixture(scope="module")
def raw_script() -> Script:
    return Script()


def client(gateway: RunningGateway) -> openai.OpenAI:
    """The OpenAI SDK without its own retries: what the client sees is what the gateway answered."""
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.openai().api_key, max_retries=0)


def chat(gateway: RunningGateway, model: str, **kwargs: Any) -> tuple[str, dict[str, str]]:
    raw = client(gateway).chat.completions.with_raw_response.create(model=model, messages=HI, **kwargs)
    return raw.parse().choices[0].message.content or "", route_header(raw)


def streamed(gateway: RunningGateway, model: str) -> tuple[str, dict[str, str]]:
    """The text of a streamed chat and its x-weir-route header."""
    raw = client(gateway).chat.completions.with_raw_response.create(model=model, messages=HI, stream=True)  # type: ignore[arg-type]
    return "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices), route_header(raw)


def generations(fake: FakeGemini) -> int:
    return sum(1 for r in fake.requests if r.method == "POST" and "Content" in r.path)


# --- Gemini's retry hint is in the body ----------------------------------------------------------


def test_gemini_retry_delay_beyond_max_retry_after_fails_over_at_once(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    """Gemini asks for 30 s, past the route's `max_retry_after` (1 s): the next candidate is asked at
    once, as for a `retry-after: 30`, not Gemini again after the route's own 20 ms backoff."""
    fake_gemini.fail_next(Fault.status(429, retry_delay=30), times=2)
    text, route = chat(gateway, "gemini-first")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini"
    assert route["tried"] == "gemini-flash:429,gpt-4o-mini:ok"
    assert generations(fake_gemini) == 1
    settled(gateway, 2)
    assert ledger(gateway) == [("gemini", 429), ("openai", 200)]


def test_gemini_short_retry_delay_is_waited_for_on_the_same_backend(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    """Gemini asks for 0.4 s, within `max_retry_after`: the same backend is asked again after that
    wait (not after the 20 ms backoff, which would only meet the same 429)."""
    fake_gemini.fail_next(Fault.status(429, retry_delay=0.4))
    started = time.monotonic()
    text, route = chat(gateway, "gemini-first")
    assert text == ECHO and route["candidate"] == "gemini-flash"
    assert route["tried"] == "gemini-flash:429,gemini-flash:ok"
    assert time.monotonic() - started >= 0.4
    assert not fake_openai.requests


def test_a_gemini_retry_delay_reaches_the_client_as_retry_after(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """A plain model (one attempt): the client is told when to retry, as Gemini said, in the header
    its SDK reads (whole seconds, rounded up, and exactly in `retry-after-ms`)."""
    fake_gemini.fail_next(Fault.status(429, retry_delay=6.5))
    with pytest.raises(openai.RateLimitError) as caught:
        client(gateway).chat.completions.create(model="gemini-flash", messages=HI)  # type: ignore[arg-type]
    headers = caught.value.response.headers
    assert headers["retry-after"] == "7" and headers["retry-after-ms"] == "6500"
    assert caught.value.status_code == 429


def test_a_gemini_503_with_a_retry_delay_in_a_stream_error_is_honoured(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    """The same hint on an overloaded 503 before the stream's first token: past `max_retry_after`,
    so the stream fails over at once and the client sees one normal stream."""
    fake_gemini.fail_next(Fault.status(503, retry_delay=30), times=2)
    stream = client(gateway).chat.completions.create(model="gemini-first", messages=HI, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ECHO
    assert generations(fake_gemini) == 1


def test_a_gemini_retry_delay_inside_its_200_stream_is_honoured_like_the_status_lines(
    gateway: RunningGateway, raw: Script, fake_openai: FakeOpenAI
) -> None:
    """Gemini's error inside its 200 stream has the shape of its error body: a 429 RESOURCE_EXHAUSTED
    with a RetryInfo (`retryDelay: 30s`). Read without its details, the 30 s (past the route's
    `max_retry_after` of 1 s) went unseen, and Gemini was asked again after the 20 ms backoff, only to
    refuse again: the next candidate is asked at once, as for the same error in the status line."""
    retry_info = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "30s"}
    error = {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED", "details": [retry_info]}
    raw.answer = sse({"error": error})
    text, route = streamed(gateway, "raw-gemini-first")
    assert text == ECHO and route["tried"] == "raw-gemini:429,gpt-4o-mini:ok"
    assert raw.calls == 1


# --- failures no wait lifts: OpenAI's insufficient_quota, a model the backend does not have ----------


def test_insufficient_quota_fails_over_without_retrying_in_place(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.status(429, error_code="insufficient_quota"), times=2)
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["candidate"] == "claude-sonnet"
    assert route["tried"] == "gpt-4o-mini:429,claude-sonnet:ok"
    assert len(fake_openai.requests) == 1  # the account is out of credit: asking again cannot help
    settled(gateway, 2)
    assert ledger(gateway) == [("openai", 429), ("anthropic", 200)]


def test_a_404_model_not_found_listed_in_failover_on_is_not_retried_in_place(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """A route that lists 404 to move past a model the vendor does not have (retired, misnamed) asked
    that backend again after its backoff first: `model_not_found` never lifts with a wait, any more
    than `insufficient_quota` does, so the next candidate is asked at once."""
    fake_openai.fail_next(Fault.status(404, error_code="model_not_found"), times=2)
    text, route = streamed(gateway, "model-gone-first")
    assert text == ECHO and route["tried"] == "gpt-4o-mini:404,claude-sonnet:ok"
    assert len(fake_openai.requests) == 1


@pytest.mark.parametrize("status", [413, 422])
def test_a_4xx_listed_in_failover_on_is_not_retried_in_place(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, status: int
) -> None:
    """Anthropic's 413 `request_too_large` (a body over its 32 MB) or a 422 the backend's validation
    gave: the same request to the same backend gets the same answer after any wait. A route that
    lists them to move on asked that backend again after its backoff first (uploading the body
    again); the next candidate is asked at once, as after a 404."""
    fake_anthropic.fail_next(Fault.status(status), times=2)
    text, route = chat(gateway, "too-large-first")
    assert text == ECHO and route["tried"] == f"claude-sonnet:{status},gpt-4o-mini:ok"
    assert len(fake_anthropic.requests) == 1
    settled(gateway, 2)
    assert ledger(gateway) == [("anthropic", status), ("openai", 200)]


# OpenAI's 429 for a request larger than the organisation's tokens-per-minute limit on its own.
TOO_LARGE_FOR_TPM = (
    "Request too large for gpt-4o-mini in organization org-abc on tokens per min (TPM): Limit 30000, "
    "Requested 50000. The input or output tokens must be reduced in order to run successfully."
)


def test_a_request_too_large_for_the_rate_limit_moves_on_at_once_and_opens_no_breaker(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """No wait lifts it (what it asks is more than the limit), so asking again after the backoff
    only got the same 429; and it says nothing of the backend's health: the route's 3-failure breaker
    opened on three such requests, turning every other request away from a backend that serves them."""
    breakers = runtime(gateway).router.breakers
    key = "openai/gpt-4o-mini"
    seen = len(breakers.transitions)
    for _ in range(3):
        fake_openai.fail_next(Fault.status(429, message=TOO_LARGE_FOR_TPM, error_code="rate_limit_exceeded"))
        text, route = chat(gateway, "resilient")
        assert text == ECHO and route["tried"] == "gpt-4o-mini:429,claude-sonnet:ok"
    assert len(fake_openai.requests) == 3  # once each
    assert (key, "open") not in list(breakers.transitions)[seen:]
    assert breakers.state(key) == "closed"


def test_a_rate_limit_429_is_still_retried_in_place(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.status(429))  # rate_limit_exceeded: it lifts
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["tried"] == "gpt-4o-mini:429,gpt-4o-mini:ok"
    assert not fake_anthropic.requests


# --- a vendor refusing the gateway's own key --------------------------------------------------


@pytest.mark.parametrize("status", [401, 403])
def test_a_vendor_refusing_the_gateways_key_fails_over_at_once(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, status: int
) -> None:
    """A revoked or mistyped vendor key (or a project without access) is the gateway's fault, not the
    request's: the next candidate answers, and the refusing backend is not asked again."""
    fake_openai.fail_next(Fault.status(status), times=3)
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["tried"] == "gpt-4o-mini:502,claude-sonnet:ok"
    assert len(fake_openai.requests) == 1


def test_a_vendor_refusing_the_gateways_key_is_a_502_not_the_clients_401(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Passed on as a 401, it read as the client's own Weir key refused, with the vendor's words
    about the gateway's key: a 502 saying the backend refused the gateway's credentials."""
    fake_anthropic.fail_next(Fault.status(401))
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="claude-sonnet", messages=HI)  # type: ignore[arg-type]
    assert caught.value.status_code == 502
    body: Any = caught.value.body
    assert body["code"] == "upstream_auth_failed" and "credentials" in body["message"]
    assert "x-api-key" not in body["message"]


def test_gemini_refusing_the_gateways_key_with_a_400_fails_over_at_once(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    """Google refuses a wrong or expired key with 400 INVALID_ARGUMENT (reason API_KEY_INVALID), as if
    the request were at fault. Passed on as that 400, the route ended there with no breaker failure:
    it is the gateway's key, so the route moves on at once, as after another vendor's 401."""
    text, route = chat(gateway, "gemini-key-first")
    assert text == ECHO and route["tried"] == "gemini-revoked:502,gpt-4o-mini:ok"
    assert generations(fake_gemini) == 1
    assert runtime(gateway).router.breakers.breakers["gemini-revoked/gemini-2.5-flash"].failures == 1


def test_gemini_refusing_the_gateways_key_is_a_502_not_the_clients_400(gateway: RunningGateway) -> None:
    """The client's key and request are fine: a 502 saying the backend refused the gateway's
    credentials, not Google's "API key not valid", which read as the client's key refused."""
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="gemini-revoked", messages=HI)  # type: ignore[arg-type]
    body: Any = caught.value.body
    assert caught.value.status_code == 502 and body["code"] == "upstream_auth_failed"
    assert "API key not valid" not in body["message"]


FREE_TIER_REFUSED = (
    "Gemini API free tier is not available in your country. Please enable billing on your project in "
    "Google AI Studio."
)


def test_gemini_refusing_the_gateways_project_fails_over_and_is_no_400_to_the_client(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    """Google refuses a project it will not serve (no free tier in the region, no billing) with 400
    FAILED_PRECONDITION, as if the request were at fault: passed on as that 400, a route's fallback was
    never asked, and the client was told to enable billing. It is the gateway's account, as a 403."""
    refused = Fault.status(400, message=FREE_TIER_REFUSED, error_code="FAILED_PRECONDITION")
    fake_gemini.fail_next(refused, times=3)
    text, route = chat(gateway, "gemini-first")
    assert text == ECHO and route["tried"] == "gemini-flash:502,gpt-4o-mini:ok"
    assert generations(fake_gemini) == 1
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="gemini-flash", messages=HI, stream=True)  # type: ignore[arg-type]
    body: Any = caught.value.body
    assert caught.value.status_code == 502 and body["code"] == "upstream_auth_failed"
    assert "billing" not in body["message"]


def test_an_anthropic_account_out_of_credit_fails_over_and_is_no_400_to_the_client(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Anthropic says an account is out of credit with a 400 invalid_request_error, as if the
    request were at fault: it is the gateway's account, so the route moves on, and a client of the
    plain model gets a 502, not a 400 telling it to buy credits."""
    no_credit = (
        "Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing to "
        "upgrade or purchase credits."
    )
    fake_anthropic.fail_next(Fault.status(400, message=no_credit), times=2)
    text, route = chat(gateway, "vendors-from-claude")
    assert text == ECHO and route["tried"] == "claude-sonnet:502,gemini-flash:ok"
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="claude-sonnet", messages=HI)  # type: ignore[arg-type]
    body: Any = caught.value.body
    assert caught.value.status_code == 502 and body["code"] == "upstream_billing_failed"
    assert "credit balance" not in body["message"]


def test_a_vendors_own_error_type_mints_no_metric_series(gateway: RunningGateway, raw: Script) -> None:
    """An OpenAI-compatible server's 4xx passes its `type` on to the client, but any string there
    must not become a `weir_errors_total` label value (a series per string, for ever)."""
    raw.answer = http_head(400) + b'{"error": {"message": "no", "type": "made_up_type_4821", "code": null}}'
    with pytest.raises(openai.BadRequestError) as caught:
        client(gateway).chat.completions.create(model="raw-model", messages=HI)  # type: ignore[arg-type]
    assert caught.value.body["type"] == "made_up_type_4821"  # type: ignore[index]
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert "made_up_type_4821" not in metrics
    assert 'backend="raw",endpoint="chat",model="raw-model",type="invalid_request_error"' in metrics


# --- a 200 that is not an answer ---------------------------------------------------------------


def test_an_error_inside_a_200_fails_over(gateway: RunningGateway, raw: Script) -> None:
    text, route = chat(gateway, "raw-first")
    assert text == ECHO and route["candidate"] == "claude-sonnet"
    assert route["tried"].startswith("raw-model:429,")
    settled(gateway, 3)
    assert [backend for backend, _ in ledger(gateway)][-1] == "anthropic"
    assert all(status != 200 for backend, status in ledger(gateway) if backend == "raw")


def test_an_error_inside_a_200_reaches_a_plain_model_client_as_that_error(
    gateway: RunningGateway, raw: Script
) -> None:
    with pytest.raises(openai.RateLimitError) as caught:
        client(gateway).chat.completions.create(model="raw-model", messages=HI)  # type: ignore[arg-type]
    assert "Provider returned error" in caught.value.message


def test_a_200_without_choices_is_a_bad_gateway_not_an_empty_answer(
    gateway: RunningGateway, raw: Script
) -> None:
    raw.answer = http_head() + NO_CHOICES
    text, route = chat(gateway, "raw-first")
    assert text == ECHO and route["tried"].startswith("raw-model:502,")
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="raw-model", messages=HI)  # type: ignore[arg-type]
    assert caught.value.status_code == 502


def test_a_200_without_choices_is_billed_the_usage_it_reports(gateway: RunningGateway, raw: Script) -> None:
    """A server that answers 200 without choices but with a usage block bills that usage: the
    attempt was recorded at nothing, and the ledger fell short of the vendor's bill."""
    reported = {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    raw.answer = http_head() + json.dumps({**json.loads(NO_CHOICES), "usage": reported}).encode()
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="raw-model", messages=HI)  # type: ignore[arg-type]
    assert caught.value.status_code == 502
    settled(gateway, raw.calls)
    failed = gateway.sink.events
    assert failed and all((e.backend, e.status, e.estimated) == ("raw", 502, False) for e in failed)
    assert all(e.usage == Usage(input_tokens=6, output_tokens=3) and e.cost_pico_usd > 0 for e in failed)


def sse(*chunks: dict[str, Any]) -> bytes:
    """A 200 stream of these chunks, ended by OpenAI's `[DONE]` (which a stream whose first event is
    an error, whatever its vendor, never gets to)."""
    events = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks)
    return http_head(content_type="text/event-stream") + events + b"data: [DONE]\n\n"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_error_status_inside_a_200_stream_is_that_status_as_in_a_whole_200(
    gateway: RunningGateway, raw: Script, fake_anthropic: FakeAnthropic, endpoint: str
) -> None:
    """OpenRouter reports the failure of the provider behind it with its status as a number in
    `error.code`, in a stream as in a whole 200. Read as the 429 it is only without streaming, every
    in-band error of a stream was a 502: a route failing over on 429 only gave a streaming client
    that 502 instead of asking its next candidate."""
    raw.answer = sse({"error": {"message": "Provider returned error", "code": 429}})
    if endpoint == "chat":
        text, route = streamed(gateway, "raw-first-429")
    else:
        response = client(gateway).completions.with_raw_response.create(
            model="raw-first-429", prompt=ECHO, stream=True
        )
        text = "".join(c.choices[0].text for c in response.parse() if c.choices)
        route = route_header(response)
    assert text == ECHO and route["tried"] == "raw-model:429,raw-model:429,claude-sonnet:ok"


# Streams that end cleanly with no answer in them: no text, tool call or reasoning, no finish reason.
NO_ANSWER = {"done-only": sse(), "role-then-done": sse(ROLE), "role-usage-done": sse(ROLE, USAGE)}


@pytest.mark.parametrize("stream", list(NO_ANSWER))
def test_a_200_stream_without_an_answer_fails_over_invisibly(
    gateway: RunningGateway, raw: Script, fake_anthropic: FakeAnthropic, stream: str
) -> None:
    """Taken for an answer, the client got a clean, empty one (`[DONE]`), the route never asked the
    next candidate and the breaker counted a success. It is the backend's failure (502): the client
    sees one normal stream from the next candidate, and the ledger and breaker count the failures."""
    raw.answer = NO_ANSWER[stream]
    response = client(gateway).chat.completions.with_raw_response.create(
        model="raw-first", messages=HI, stream=True
    )
    chunks = list(response.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ECHO
    assert [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role] == ["assistant"]
    assert route_header(response)["tried"] == "raw-model:502,raw-model:502,claude-sonnet:ok"
    assert len(fake_anthropic.requests) == 1
    settled(gateway, 3)
    assert ledger(gateway) == [("raw", 502), ("raw", 502), ("anthropic", 200)]
    assert runtime(gateway).router.breakers.breakers["raw/gpt-4o-mini"].failures == 2


def test_a_200_stream_without_an_answer_is_a_502_to_a_plain_model_client(
    gateway: RunningGateway, raw: Script
) -> None:
    """Nothing was sent yet: the client gets an HTTP 502 in the OpenAI error shape, not a 200."""
    raw.answer = NO_ANSWER["role-then-done"]
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="raw-model", messages=HI, stream=True)  # type: ignore[arg-type]
    assert caught.value.status_code == 502
    assert "without an answer" in caught.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_an_empty_streamed_answer_with_a_finish_reason_is_the_models_answer(
    gateway: RunningGateway, raw: Script, fake_anthropic: FakeAnthropic, finish: str
) -> None:
    """Nothing but a finish reason (an empty reply, or `length` under a tiny max_tokens): what the
    model said, passed on, not a failure to fail over from."""
    ended = {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    raw.answer = sse(ROLE, ended, USAGE)
    response = client(gateway).chat.completions.with_raw_response.create(
        model="raw-first", messages=HI, stream=True, max_tokens=1
    )
    chunks = list(response.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert route_header(response)["attempts"] == "1"
    assert not fake_anthropic.requests


# A legacy completion's chunk with no text and no finish reason (vLLM's, before it generated anything).
NO_TEXT = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 0,
    "model": "gpt-4o-mini",
    "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}],
}


def test_a_200_completions_stream_without_text_fails_over_invisibly(
    gateway: RunningGateway, raw: Script, fake_anthropic: FakeAnthropic
) -> None:
    """As a chat stream: a legacy completions stream of one empty chunk and `[DONE]` holds no answer.
    Taken for its first token, it was handed over, and its client got a 200 stream that broke (an
    error event) instead of the next candidate's answer."""
    raw.answer = sse(NO_TEXT)
    response = client(gateway).completions.with_raw_response.create(
        model="raw-first", prompt=ECHO, stream=True
    )
    chunks = list(response.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ECHO
    assert route_header(response)["tried"] == "raw-model:502,raw-model:502,claude-sonnet:ok"
    settled(gateway, 3)
    assert ledger(gateway) == [("raw", 502), ("raw", 502), ("anthropic", 200)]


def test_a_200_completions_stream_without_text_is_a_502_to_a_plain_model_client(
    gateway: RunningGateway, raw: Script
) -> None:
    raw.answer = sse(NO_TEXT)
    with pytest.raises(openai.APIStatusError) as caught:
        list(client(gateway).completions.create(model="raw-model", prompt=ECHO, stream=True))
    assert caught.value.status_code == 502
    assert "without an answer" in caught.value.body["message"]  # type: ignore[index]


# --- errors inside a 200 stream, and streams that just stop -----------------------------------------

# (route, the fake that breaks, the fault, which backend continues): each vendor's own in-stream error
# event, and its connection dropped with no terminator (OpenAI's [DONE], Anthropic's message_stop,
# Gemini's finishReason).
FIRST = {"vendors": "openai", "vendors-from-claude": "anthropic", "vendors-from-gemini": "gemini"}


@pytest.mark.parametrize("route", list(FIRST))
@pytest.mark.parametrize(
    "fault",
    [Fault.stream_error(after=3, code=500), Fault.stream_error(after=3, code=529), Fault.cut_stream(after=3)],
    ids=["error-event", "overloaded-event", "cut"],
)
def test_a_stream_broken_after_its_first_token_continues_on_the_next_vendor(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    route: str,
    fault: Fault,
) -> None:
    fakes = {"openai": fake_openai, "anthropic": fake_anthropic, "gemini": fake_gemini}
    fakes[FIRST[route]].fail_next(fault)
    stream = client(gateway).chat.completions.create(
        model=route, messages=HI, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ECHO
    assert len({c.id for c in chunks}) == 1 and chunks[-1].usage is not None
    settled(gateway, 2)
    events = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert events[0].backend == FIRST[route] and not events[0].ok
    assert events[-1].ok and len(events) == 2


@pytest.mark.parametrize("route", list(FIRST))
def test_a_stream_that_stops_before_its_first_token_fails_over_invisibly(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    route: str,
) -> None:
    """No text yet (OpenAI: the role chunk; Anthropic: message_start; Gemini: nothing): each attempt
    on the first vendor stops, the client sees one normal stream from the next."""
    fakes = {"openai": fake_openai, "anthropic": fake_anthropic, "gemini": fake_gemini}
    after = {"openai": 1, "anthropic": 1, "gemini": 0}[FIRST[route]]
    fakes[FIRST[route]].fail_next(Fault.cut_stream(after=after), times=2)
    raw = client(gateway).chat.completions.with_raw_response.create(model=route, messages=HI, stream=True)
    chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ECHO
    assert [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role] == ["assistant"]
    assert route_header(raw)["attempts"] == "3"


def test_an_anthropic_rate_limit_inside_its_200_stream_fails_over_on_a_429_only_route(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_openai: FakeOpenAI
) -> None:
    """Anthropic may send any error type inside a 200 stream ("an error can occur after returning a
    200"), `rate_limit_error` included. Every type but `overloaded_error` read as a 500 (a 502 to the
    client): a route failing over on 429 only ended the request with that 502 instead of asking its
    next candidate, as it does for the same 429 in the status line."""
    fake_anthropic.fail_next(Fault.stream_error(after=0, code=429), times=2)
    text, route = streamed(gateway, "claude-first-429")
    assert text == ECHO and route["tried"] == "claude-sonnet:429,claude-sonnet:429,gpt-4o-mini:ok"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def test_a_stream_with_tools_that_broke_mid_text_continues_as_one_stream(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Tools offered but only text sent when the stream broke: the next vendor continues the text
    with the same tools; the client sees one stream."""
    fake_openai.fail_next(Fault.cut_stream(after=3))
    stream = client(gateway).chat.completions.create(model="vendors", messages=HI, stream=True, tools=TOOLS)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ECHO
    sent = fake_anthropic.last_request.json
    assert [t["name"] for t in sent["tools"]] == ["lookup"] and sent["messages"][-1]["role"] == "assistant"


def test_a_stream_whose_tool_call_broke_ends_with_an_sse_error(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """A tool call under way cannot be continued by another vendor: an explicit error event, never a
    silent end."""
    fake_openai.fail_next(Fault.cut_stream(after=3))  # the role, the call's head, its first arguments
    ask = [{"role": "user", "content": 'call lookup {"q": "one two three"}'}]
    with httpx_stream(gateway, "vendors", messages=ask, tools=TOOLS) as lines:
        data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] != "data: [DONE]" and "error" in json.loads(data[-1][6:])
    assert not fake_anthropic.requests


@contextmanager
def httpx_stream(gateway: RunningGateway, model: str, **body: Any) -> Iterator[list[str]]:
    """A chat stream read raw: its SSE lines, to see how it ended."""
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        json={"model": model, "stream": True, **body},
        headers={"authorization": f"Bearer {gateway.openai().api_key}"},
        timeout=20,
    ) as response:
        assert response.status_code == 200
        yield list(response.iter_lines())
