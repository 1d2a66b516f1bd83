"""A route whose first candidate cannot honour a parameter that changes the answer (Claude: token
biases, repetition penalties, audio output, web search; Gemini after 2.0: repetition penalties)
skips it for the next candidate that can (`tried=claude-sonnet:unsupported`), streamed or not, with
nothing sent to it. Before, Claude was asked without the parameter and answered, and the route never
reached the candidate that honours it; Gemini 2.5 was sent the penalty, and its 400 ("Penalty is not
enabled") ended the request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import RunningGateway, gateway_on_fakes
from tests.routing.routed import route_header, routed_config_text

FAST = "retry: {attempts: 1}, probe_interval: null"
ROUTES = f"""\
routes:
  - {{name: claude-then-gemini, candidates: [{{model: claude-sonnet}}, {{model: gemini-flash}}], {FAST}}}
  - {{name: claude-then-openai, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: gemini-then-gemini-2, candidates: [{{model: gemini-flash}}, {{model: gemini-2-flash}}], {FAST}}}
"""
GEMINI_2 = "  - {name: gemini-2-flash, backend: gemini, model: gemini-2.0-flash}"
HI: Any = [{"role": "user", "content": "sky is blue"}]


@pytest.fixture
def gateway(fake_vendors: FakeVendors, fresh_fakes: None) -> Iterator[RunningGateway]:
    text = routed_config_text(ROUTES).replace("models:", "models:\n" + GEMINI_2, 1)
    with gateway_on_fakes(text, fake_vendors) as running:
        yield running


@pytest.mark.parametrize(
    "params",
    [
        {"logit_bias": {"50256": -100}},
        {"frequency_penalty": 0.5},
        {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
        {"web_search_options": {}},
    ],
    ids=["logit_bias", "frequency_penalty", "modalities", "web_search_options"],
)
def test_claude_is_skipped_for_openai_which_honours_the_parameter(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_openai: FakeOpenAI, params: dict[str, Any]
) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="claude-then-openai", messages=HI, **params
    )
    header = route_header(raw)
    assert header["candidate"] == "gpt-4o-mini"
    assert header["tried"] == "claude-sonnet:unsupported,gpt-4o-mini:ok"
    name = next(iter(params))
    assert fake_openai.last_request.json[name] == params[name]  # reached the candidate that honours it
    assert not fake_anthropic.requests


@pytest.mark.parametrize("stream", [False, True])
def test_a_penalty_skips_gemini_2_5_for_gemini_2_0_which_takes_it(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="gemini-then-gemini-2", messages=HI, presence_penalty=0.5, frequency_penalty=0, stream=stream
    )
    assert route_header(raw)["tried"] == "gemini-flash:unsupported,gemini-2-flash:ok"
    [sent] = fake_gemini.requests
    assert "/models/gemini-2.0-flash:" in sent.path
    assert sent.json["generationConfig"]["presencePenalty"] == 0.5
    assert "frequencyPenalty" not in sent.json["generationConfig"]  # 0 asks for nothing


def test_a_parameter_no_candidate_honours_is_the_first_ones_400(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(
            model="claude-then-gemini", messages=HI, logit_bias={"50256": -100}
        )
    assert route_header(caught.value.response)["tried"] == (
        "claude-sonnet:unsupported,gemini-flash:unsupported"
    )
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "logit_bias" and "Anthropic" in body["message"]
    assert not fake_anthropic.requests and not fake_gemini.requests
