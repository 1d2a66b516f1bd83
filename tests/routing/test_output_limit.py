"""A model's or candidate's `max_output_tokens`: an output limit above it is sent as it, from every
inbound API.

Claude Code asks for 32,000 output tokens; gpt-4o (and gpt-4o-mini) write 16,384 at most, and OpenAI
refuses the larger limit with a 400 ("max_tokens is too large: ..."), as the fake vendors do. That 400
ended the request where the model could have answered it. A candidate that declares no limit and gets
that 400 is passed over for the next one, as one whose API cannot express the request is.

A model declares its limit once, in `models:`: a request for it by name and a route's fallback to it,
which have no candidate entry to declare one on, get it, and so does every candidate of it that
declares none of its own.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from gateway.config import ConfigError, parse_config
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import RunningGateway, fakes_env, module_gateway
from tests.routing.routed import route_header, routed_config_text

FAST = "retry: {attempts: 1}, probe_interval: null"
ROUTES = f"""\
routes:
  - {{name: mini, candidates: [{{model: gpt-4o-mini, max_output_tokens: 16384}}], {FAST}}}
  - {{name: sonnet, candidates: [{{model: claude-sonnet, max_output_tokens: 64000}}], {FAST}}}
  - {{name: sonnet-16k, candidates: [{{model: claude-sonnet, max_output_tokens: 16000}}], {FAST}}}
  - {{name: instruct, candidates: [{{model: gpt-instruct, max_output_tokens: 4096}}], {FAST}}}
  - {{name: undeclared, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: to-flash-2, candidates: [{{model: dead-model}}], fallbacks: [flash-2], {FAST}}}
  - {{name: mini-16k-route, candidates: [{{model: mini-16k}}], {FAST}}}
  - {{name: mini-16k-4k, candidates: [{{model: mini-16k, max_output_tokens: 4096}}], {FAST}}}
  - {{name: deepseek-first, candidates: [{{model: deepseek-chat}}, {{model: claude-sonnet}}], {FAST}}}
"""
# Models that declare their output limit (as their vendors document it; the fakes refuse more).
# mini-16k is gpt-4o-mini under another name, so at its price (one price per upstream model).
MODELS = """\
  - {name: mini-16k, backend: openai, model: gpt-4o-mini, max_output_tokens: 16384, price: {input: 0.15, cached_input: 0.075, output: 0.60}}
  - {name: flash-2, backend: gemini, model: gemini-2.0-flash, max_output_tokens: 8192}
"""


def config_text(models: str = MODELS) -> str:
    return routed_config_text(ROUTES).replace("models:", "models:\n" + models.rstrip("\n"), 1)


HI = [{"role": "user", "content": "hello there"}]
CLAUDE_CODE = 32_000  # the max_tokens Claude Code sends


_module_gateway, gateway = module_gateway(config_text())


def _sent_limit(fake: FakeOpenAI) -> Any:
    body = fake.last_request.json
    return body.get("max_completion_tokens", body.get("max_tokens"))


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_chat_completions_above_the_models_limit_are_sent_with_the_limit(
    gateway: RunningGateway, fake_openai: FakeOpenAI, param: str
) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="mini",
        messages=HI,  # type: ignore[arg-type]
        **{param: CLAUDE_CODE},  # type: ignore[arg-type]
    )
    assert raw.parse().choices[0].message.content
    assert fake_openai.last_request.json[param] == 16384
    header = route_header(raw)
    assert (header["candidate"], header["output_capped"]) == ("gpt-4o-mini", "16384")
    # A limit within the model's is sent as asked, and the header says nothing of it.
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="mini",
        messages=HI,  # type: ignore[arg-type]
        **{param: 100},  # type: ignore[arg-type]
    )
    assert fake_openai.last_request.json[param] == 100
    assert "output_capped" not in route_header(raw)


def test_responses_above_the_models_limit_are_sent_with_the_limit(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    raw = gateway.openai().responses.with_raw_response.create(
        model="mini", input="hello there", max_output_tokens=CLAUDE_CODE
    )
    assert raw.parse().output_text
    assert _sent_limit(fake_openai) == 16384
    assert route_header(raw)["output_capped"] == "16384"


def test_messages_from_claude_code_stream_from_gpt_4o_mini(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """Claude Code's own request shape: the Messages API, streamed, max_tokens 32,000."""
    client = gateway.anthropic()
    with client.messages.stream(model="mini", max_tokens=CLAUDE_CODE, messages=HI) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.stop_reason == "end_turn"
    assert _sent_limit(fake_openai) == 16384
    assert len(fake_openai.requests) == 1


def test_anthropic_vendor_gets_its_models_limit(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="sonnet",
        messages=HI,  # type: ignore[arg-type]
        max_tokens=100_000,
    )
    assert raw.parse().choices[0].message.content
    assert fake_anthropic.last_request.json["max_tokens"] == 64000
    assert route_header(raw)["output_capped"] == "64000"


def test_completions_native_or_as_a_chat_are_sent_with_the_models_limit(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    completion = gateway.openai().completions.create(model="instruct", prompt="hello there", max_tokens=8000)
    assert completion.choices[0].text
    assert fake_openai.last_request.path.endswith("/completions")
    assert fake_openai.last_request.json["max_tokens"] == 4096
    # Claude has no completions endpoint: the prompt goes as a chat, with the candidate's limit.
    completion = gateway.openai().completions.create(model="sonnet", prompt="hello there", max_tokens=100_000)
    assert completion.choices[0].text
    assert fake_anthropic.last_request.json["max_tokens"] == 64000


def test_a_thinking_budget_is_kept_below_the_lowered_limit(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Claude Code thinking hard: max_tokens 32,000 with a budget of 31,999. Sent with the model's
    16,000 and the budget as it was, Anthropic refused it (the budget must be below max_tokens)."""
    message = gateway.anthropic().messages.create(
        model="sonnet-16k",
        max_tokens=CLAUDE_CODE,
        thinking={"type": "enabled", "budget_tokens": CLAUDE_CODE - 1},
        messages=HI,  # type: ignore[arg-type]
    )
    assert message.content
    sent = fake_anthropic.last_request.json
    assert (sent["max_tokens"], sent["thinking"]) == (16000, {"type": "enabled", "budget_tokens": 15999})


def test_the_vendors_400_for_an_undeclared_limit_moves_on_to_the_next_candidate(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """gpt-4o-mini declares no limit: OpenAI's 400 says the model cannot write that much, which is
    the model's, not the request's (claude-sonnet writes 64,000). Before, that 400 ended the request."""
    client = gateway.anthropic()
    raw = client.messages.with_raw_response.create(model="undeclared", max_tokens=CLAUDE_CODE, messages=HI)  # type: ignore[arg-type]
    assert raw.parse().content
    header = route_header(raw)
    assert header["candidate"] == "claude-sonnet"
    assert header["tried"] == "gpt-4o-mini:400,claude-sonnet:ok"
    assert fake_anthropic.last_request.json["max_tokens"] == CLAUDE_CODE
    assert len(fake_openai.requests) == 1


def test_the_vendors_400_reaches_the_client_when_no_candidate_takes_the_limit(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """A plain model (no route): the vendor's own 400, as it said it."""
    with pytest.raises(openai.BadRequestError) as info:
        gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=CLAUDE_CODE)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "max_tokens"
    assert body["message"].startswith("max_tokens is too large: 32000.")
    with pytest.raises(anthropic.BadRequestError) as refused:
        gateway.anthropic().messages.create(model="gpt-4o-mini", max_tokens=CLAUDE_CODE, messages=HI)  # type: ignore[arg-type]
    assert "max_tokens is too large" in str(refused.value)


def test_a_model_asked_for_by_name_is_sent_with_its_declared_limit(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """No route: the plan's one candidate is a bare one, so the limit can only be the model's. Before,
    it could be declared on a route's candidate alone, and Claude Code's 32,000 got OpenAI's 400."""
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="mini-16k",
        messages=HI,  # type: ignore[arg-type]
        max_tokens=CLAUDE_CODE,
    )
    assert raw.parse().choices[0].message.content
    assert fake_openai.last_request.json["max_tokens"] == 16384
    header = route_header(raw)
    assert (header["reason"], header["output_capped"]) == ("model", "16384")
    with gateway.anthropic().messages.stream(model="mini-16k", max_tokens=CLAUDE_CODE, messages=HI) as stream:  # type: ignore[arg-type]
        assert "".join(stream.text_stream)
    assert _sent_limit(fake_openai) == 16384


def test_a_fallback_is_sent_with_its_models_limit(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    """`fallbacks:` name models, not candidates: Gemini 2.0 Flash writes 8,192 at most, and Gemini
    refuses a larger maxOutputTokens with a 400 that, the last choice's, reached the client."""
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="to-flash-2",
        messages=HI,  # type: ignore[arg-type]
        max_tokens=CLAUDE_CODE,
    )
    assert raw.parse().choices[0].message.content
    assert fake_gemini.last_request.json["generationConfig"]["maxOutputTokens"] == 8192
    header = route_header(raw)
    assert (header["candidate"], header["output_capped"]) == ("flash-2", "8192")
    assert header["tried"].endswith(",flash-2:ok")


@pytest.mark.parametrize(("route", "sent"), [("mini-16k-route", 16384), ("mini-16k-4k", 4096)])
def test_a_candidate_has_its_models_limit_unless_it_declares_its_own(
    gateway: RunningGateway, fake_openai: FakeOpenAI, route: str, sent: int
) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=route,
        messages=HI,  # type: ignore[arg-type]
        max_completion_tokens=CLAUDE_CODE,
    )
    assert raw.parse().choices[0].message.content
    assert fake_openai.last_request.json["max_completion_tokens"] == sent
    assert route_header(raw)["output_capped"] == str(sent)


def test_deepseeks_400_for_a_limit_above_the_models_moves_on_to_the_next_candidate(
    gateway: RunningGateway, fake_deepseek: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """DeepSeek words it its own way ("Invalid max_tokens value, the valid range of max_tokens is
    [1, 8192]", no param): before, that 400 ended the request as one of the request's own."""
    raw = gateway.anthropic().messages.with_raw_response.create(
        model="deepseek-first",
        max_tokens=CLAUDE_CODE,
        messages=HI,  # type: ignore[arg-type]
    )
    assert raw.parse().content
    assert route_header(raw)["tried"] == "deepseek-chat:400,claude-sonnet:ok"
    assert fake_deepseek.last_request.json["max_tokens"] == CLAUDE_CODE
    assert fake_anthropic.last_request.json["max_tokens"] == CLAUDE_CODE
    # Alone, the model's 400 reaches the client as DeepSeek said it.
    with pytest.raises(openai.BadRequestError) as info:
        gateway.openai().chat.completions.create(model="deepseek-chat", messages=HI, max_tokens=CLAUDE_CODE)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict)
    assert body["message"] == "Invalid max_tokens value, the valid range of max_tokens is [1, 8192]"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("0", "Expected `int` >= 1"),
        ("-16384", "Expected `int` >= 1"),
        ("lots", "Expected `int | null`, got `str`"),
    ],
)
def test_a_models_limit_must_be_a_whole_number_at_least_1(
    fake_vendors: FakeVendors, value: str, why: str
) -> None:
    """Every request for it would have been sent with an output limit the vendor refuses."""
    models = f"  - {{name: bad, backend: openai, model: gpt-4o-mini, max_output_tokens: {value}}}\n"
    with pytest.raises(ConfigError) as info:
        parse_config(config_text(models), fakes_env(*fake_vendors))
    assert str(info.value) == f"models[0].max_output_tokens: {why}"
