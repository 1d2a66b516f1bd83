"""Failover for /v1/completions and /v1/embeddings: the chat executor's retries, fallbacks and breakers,
with faults injected in the fakes. For each: what the client sees, which backends were tried
(x-weir-route) and what the ledger holds (one usage event per attempt)."""

from __future__ import annotations

import openai
import pytest

from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import FAST, ledger, route_header

ROUTES = f"""\
routes:
  - {{name: complete, candidates: [{{model: gpt-instruct}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: complete-hedged, hedge: {{delay: 0.15}}, candidates: [{{model: gpt-instruct}}, {{model: deepseek-chat}}], {FAST}}}
  - {{name: embed, candidates: [{{model: text-embedding-3-small}}, {{model: gemini-embedding}}], {FAST}}}
  - {{name: embed-anthropic-first, candidates: [{{model: claude-sonnet}}, {{model: text-embedding-3-small}}], {FAST}}}
  - {{name: embed-none, candidates: [{{model: claude-sonnet}}], {FAST}}}
"""
PROMPT = "one two three four five six"


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return ROUTES


# --- completions -----------------------------------------------------------------------------------


def test_completions_500_on_the_primary_are_answered_by_the_secondary(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(500, times=2)
    raw = gateway.openai().completions.with_raw_response.create(model="complete", prompt=PROMPT)
    completion = raw.parse()
    # Anthropic has no completions endpoint: the prompt went as a chat and came back as a completion.
    assert completion.object == "text_completion" and completion.choices[0].text == PROMPT
    route = route_header(raw)
    assert route["candidate"] == "claude-sonnet" and route["attempts"] == "3"
    assert route["tried"] == "gpt-instruct:502,gpt-instruct:502,claude-sonnet:ok"
    assert ledger(gateway) == [("openai", 500), ("openai", 500), ("anthropic", 200)]
    assert sum(e.ok for e in gateway.sink.events) == 1  # billed once
    assert fake_anthropic.last_request.json["messages"][0]["content"][0]["text"] == PROMPT


def test_completions_stream_fails_over_before_its_first_token(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.reset(), times=2)
    stream = gateway.openai().completions.create(model="complete", prompt=PROMPT, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPT
    assert ledger(gateway) == [("openai", 0), ("openai", 0), ("anthropic", 200)]


def test_a_completions_stream_cut_mid_way_ends_with_an_error_event(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    stream = gateway.openai().completions.create(model="complete", prompt=PROMPT, stream=True)
    received: list[str] = []
    with pytest.raises(openai.APIError):
        for chunk in stream:  # never a clean end: completions streams are not resumed
            received.extend(c.text for c in chunk.choices)
    assert received and "".join(received) != PROMPT
    assert not fake_anthropic.requests


def test_completions_a_400_caused_by_the_request_does_not_fail_over(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.status(400, message="bad suffix"))
    with pytest.raises(openai.BadRequestError, match="bad suffix"):
        gateway.openai().completions.create(model="complete", prompt=PROMPT)
    assert ledger(gateway) == [("openai", 400)]
    assert not fake_anthropic.requests


def test_token_id_prompts_skip_candidates_that_only_chat(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(500, times=2)
    # Token ids cannot become a chat: the Anthropic candidate cannot serve this request, so the
    # client gets the primary's failure, not a translation error.
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().completions.create(model="complete", prompt=[1, 2, 3])
    assert caught.value.status_code == 502
    assert ledger(gateway) == [("openai", 500), ("openai", 500)]
    assert not fake_anthropic.requests


def test_completions_are_hedged(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.delay(2.0))
    raw = gateway.openai().completions.with_raw_response.create(model="complete-hedged", prompt=PROMPT)
    assert raw.parse().choices[0].text
    route = route_header(raw)
    assert route["candidate"] == "deepseek-chat" and route["hedged"] == "deepseek-chat"
    assert len(fake_deepseek.requests) == 1


def test_plain_completions_model_keeps_single_attempt_semantics(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(500)
    with pytest.raises(openai.InternalServerError):
        gateway.openai().completions.create(model="gpt-instruct", prompt=PROMPT)
    assert ledger(gateway) == [("openai", 500)]


# --- embeddings ------------------------------------------------------------------------------------
# A failing embeddings model never fails over to another (its vectors are another size and space), and
# its breaker opens as a chat model's does: tests/routing/test_embeddings_completions_routing.py.


def test_embeddings_skip_candidates_that_cannot_embed(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    raw = gateway.openai().embeddings.with_raw_response.create(model="embed-anthropic-first", input="hi")
    assert raw.parse().data[0].embedding
    route = route_header(raw)
    assert route["candidate"] == "text-embedding-3-small"
    assert route["tried"] == "claude-sonnet:unsupported,text-embedding-3-small:ok"
    assert ledger(gateway) == [("openai", 200)] and not fake_anthropic.requests
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().embeddings.create(model="embed-none", input="hi")
    assert "does not support embeddings" in caught.value.message


def test_embeddings_a_400_does_not_fail_over(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    fake_openai.fail_next(Fault.status(400, message="bad dimensions"))
    with pytest.raises(openai.BadRequestError, match="bad dimensions"):
        gateway.openai().embeddings.create(model="embed", input="hi")
    assert ledger(gateway) == [("openai", 400)] and not fake_gemini.requests
