"""A prompt longer than a model's context window: each vendor says so its own way (OpenAI's code
`context_length_exceeded`, Anthropic's "prompt is too long: N tokens > M maximum", Gemini's "The input
token count (N) exceeds the maximum number of tokens allowed (M)."), and clients get it as OpenAI's
code whichever answered. A route whose `failover_on` names `context_length_exceeded` asks its next
candidate at once (the same model would refuse the same prompt again; no wait, no breaker failure),
as LiteLLM's context-window fallbacks do; other 400s still never fail over."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import ledger, route_header, routed_gateway, settled

RULES = "failover_on: [429, 5xx, context_length_exceeded], retry: {attempts: 2, backoff: 0.5}, probe_interval: null"
RULES += ", breaker: {failures: 1, cooldown: 30}"
ROUTES = f"""\
routes:
  - {{name: long-openai, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], {RULES}}}
  - {{name: long-anthropic, candidates: [{{model: claude-sonnet}}, {{model: gemini-flash}}], {RULES}}}
  - {{name: long-gemini, candidates: [{{model: gemini-flash}}, {{model: gpt-4o-mini}}], {RULES}}}
  - {{name: strict, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], probe_interval: null}}
  - {{name: strict-openai, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], probe_interval: null}}
"""
OPENAI_TOO_LONG = Fault.status(
    400,
    error_code="context_length_exceeded",
    message="This model's maximum context length is 128000 tokens. However, your messages resulted in "
    "130013 tokens. Please reduce the length of the messages.",
)
ANTHROPIC_TOO_LONG = Fault.status(400, message="prompt is too long: 208656 tokens > 200000 maximum")
GEMINI_TOO_LONG = Fault.status(
    400, message="The input token count (1137761) exceeds the maximum number of tokens allowed (1048576)."
)
HI = [{"role": "user", "content": "a very long document"}]


@pytest.fixture
def gateway(fake_vendors: FakeVendors, fresh_fakes: None) -> Iterator[RunningGateway]:
    with routed_gateway(fake_vendors, ROUTES) as running:
        yield running


@pytest.mark.parametrize(
    ("route", "first", "fault", "backends"),
    [
        ("long-openai", "gpt-4o-mini", OPENAI_TOO_LONG, [("openai", 400), ("anthropic", 200)]),
        ("long-anthropic", "claude-sonnet", ANTHROPIC_TOO_LONG, [("anthropic", 400), ("gemini", 200)]),
        ("long-gemini", "gemini-flash", GEMINI_TOO_LONG, [("gemini", 400), ("openai", 200)]),
    ],
)
def test_a_prompt_too_long_for_one_model_goes_to_the_next_at_once(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    route: str,
    first: str,
    fault: Fault,
    backends: list[tuple[str, int]],
) -> None:
    fake = {"gpt-4o-mini": fake_openai, "claude-sonnet": fake_anthropic, "gemini-flash": fake_gemini}[first]
    fake.fail_next(fault)
    client = gateway.openai()
    raw = client.chat.completions.with_raw_response.create(model=route, messages=HI)  # type: ignore[arg-type]
    header = route_header(raw)
    assert header["tried"].startswith(f"{first}:400,") and header["candidate"] != first
    assert len(fake.requests) == 1  # not asked again in place (the route allows 2 tries, 0.5 s apart)
    settled(gateway, 2)
    assert ledger(gateway) == backends
    # the refusal said nothing against the backend: with `failures: 1` an opened breaker would skip it
    raw = client.chat.completions.with_raw_response.create(model=route, messages=HI)  # type: ignore[arg-type]
    assert route_header(raw)["candidate"] == first


# How self-hosted OpenAI-compatible servers and other vendors say a prompt does not fit, in their own
# words (none sends OpenAI's code), and with their own status: TGI refuses it with a 422.
SERVERS_TOO_LONG = {
    "llama.cpp": Fault.status(
        400,
        message="request (4476 tokens) exceeds the available context size (4096 tokens), try increasing it",
    ),
    "sglang": Fault.status(
        400, message="The input (140000 tokens) is longer than the model's context length (131072 tokens)."
    ),
    "xai": Fault.status(
        400, message="This model's maximum prompt length is 131072 but the request contains 140000 tokens."
    ),
    "tgi": Fault.status(
        422,
        message="Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 "
        "`inputs` tokens and 1000 `max_new_tokens`",
    ),
}


@pytest.mark.parametrize("server", list(SERVERS_TOO_LONG))
def test_a_prompt_too_long_for_a_self_hosted_server_goes_to_the_next_at_once(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, server: str
) -> None:
    """llama.cpp, SGLang (and Together), xAI and TGI word it otherwise than OpenAI: the route's
    `context_length_exceeded` still moves the request to the next candidate at once."""
    fake_openai.fail_next(SERVERS_TOO_LONG[server])
    raw = gateway.openai().chat.completions.with_raw_response.create(model="long-openai", messages=HI)  # type: ignore[arg-type]
    assert route_header(raw)["candidate"] == "claude-sonnet"
    assert len(fake_openai.requests) == 1  # not asked again in place
    settled(gateway, 2)
    assert [backend for backend, _ in ledger(gateway)] == ["openai", "anthropic"]


def test_a_self_hosted_servers_prompt_too_long_reaches_the_client_as_openais_code(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """Without the rule, TGI's 422 keeps its status, with OpenAI's code that clients handle."""
    fake_openai.fail_next(SERVERS_TOO_LONG["tgi"])
    with pytest.raises(openai.UnprocessableEntityError) as info:
        gateway.openai().chat.completions.create(model="strict-openai", messages=HI)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("route", "fault"),
    [("strict", ANTHROPIC_TOO_LONG), ("strict-openai", OPENAI_TOO_LONG)],
    ids=["anthropic", "openai"],
)
def test_without_the_rule_the_client_gets_openais_code_from_any_vendor(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, route: str, fault: Fault
) -> None:
    """The default `failover_on`: a prompt too long is the request's fault; the next is not asked."""
    first, second = (fake_anthropic, fake_openai) if route == "strict" else (fake_openai, fake_anthropic)
    first.fail_next(fault)
    with pytest.raises(openai.BadRequestError) as info:
        gateway.openai().chat.completions.create(model=route, messages=HI)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert "too long" in body["message"] or "maximum context length" in body["message"]
    assert second.requests == []


def test_an_anthropic_client_sees_its_own_error_shape(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.fail_next(ANTHROPIC_TOO_LONG)
    with pytest.raises(anthropic.BadRequestError) as info:
        gateway.anthropic().messages.create(model="strict", max_tokens=10, messages=HI)  # type: ignore[arg-type]
    assert "prompt is too long" in str(info.value)


def test_other_400s_still_never_fail_over(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.status(400, message="Invalid value for 'temperature'."))
    with pytest.raises(openai.BadRequestError):
        gateway.openai().chat.completions.create(model="long-openai", messages=HI)  # type: ignore[arg-type]
    settled(gateway, 1)
    assert ledger(gateway) == [("openai", 400)]
