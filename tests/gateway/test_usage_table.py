"""Every row of the usage table, pinned: unit tests on the vendors' own usage objects, then end to end
(streaming and not) through the gateway, checking the ledger and what the client sees."""

from __future__ import annotations

import pytest

from gateway.responses_inbound import responses_usage
from gateway.usage import USAGE_SHAPES, Usage, anthropic_usage, normalise_usage, openai_usage
from tests.fakes import FakeGemini
from tests.fixtures.vendor_gateway import RunningGateway

# vendor, its usage object as the vendor sends it, the normalised Usage
ROWS = [
    (
        "openai",
        {
            "prompt_tokens": 2000,
            "completion_tokens": 300,
            "total_tokens": 2300,
            "prompt_tokens_details": {"cached_tokens": 1536},
            "completion_tokens_details": {"reasoning_tokens": 192},
        },
        Usage(input_tokens=464, cached_input_tokens=1536, output_tokens=300, reasoning_tokens=192),
    ),
    (
        "deepseek",
        {
            "prompt_tokens": 1000,
            "completion_tokens": 50,
            "total_tokens": 1050,
            "prompt_cache_hit_tokens": 640,
            "prompt_cache_miss_tokens": 360,
        },
        Usage(input_tokens=360, cached_input_tokens=640, output_tokens=50),
    ),
    (
        "anthropic",
        {
            "input_tokens": 20,
            "cache_read_input_tokens": 3000,
            "cache_creation_input_tokens": 1500,
            "cache_creation": {"ephemeral_5m_input_tokens": 500, "ephemeral_1h_input_tokens": 1000},
            "output_tokens": 70,
            # Newer models' thinking share (older ones send none: `test_reasoning` estimates it)
            "output_tokens_details": {"thinking_tokens": 50},
        },
        Usage(
            input_tokens=20,
            cached_input_tokens=3000,
            cache_write_5m_tokens=500,
            cache_write_1h_tokens=1000,
            output_tokens=70,
            reasoning_tokens=50,
        ),
    ),
    (
        "gemini",
        {
            "promptTokenCount": 5000,
            "cachedContentTokenCount": 4096,
            "candidatesTokenCount": 40,
            "thoughtsTokenCount": 100,
            # What grounding or code execution fed the model: beside the prompt, billed as input.
            "toolUsePromptTokenCount": 250,
            "totalTokenCount": 5390,
        },
        Usage(input_tokens=1154, cached_input_tokens=4096, output_tokens=140, reasoning_tokens=100),
    ),
    (
        "openai_responses",
        {
            "input_tokens": 2000,
            "input_tokens_details": {"cached_tokens": 1536},
            "output_tokens": 300,
            "output_tokens_details": {"reasoning_tokens": 192},
            "total_tokens": 2300,
        },
        Usage(input_tokens=464, cached_input_tokens=1536, output_tokens=300, reasoning_tokens=192),
    ),
]


def test_the_table_has_a_row_for_every_vendor_tested_here() -> None:
    assert {row[0] for row in ROWS} == set(USAGE_SHAPES)


@pytest.mark.parametrize(("vendor", "raw", "expected"), ROWS, ids=[row[0] for row in ROWS])
def test_row(vendor: str, raw: dict, expected: Usage) -> None:
    assert normalise_usage(vendor, raw) == expected


def test_openai_row_detects_deepseek_dialect() -> None:
    raw = ROWS[1][1]
    assert normalise_usage("openai", raw) == ROWS[1][2]


def test_the_responses_row_reads_what_the_responses_api_inbound_writes() -> None:
    usage = ROWS[-1][2]
    assert normalise_usage("openai_responses", responses_usage(usage)) == usage


def test_anthropic_writes_without_the_ttl_split_are_5_minute_writes() -> None:
    usage = normalise_usage(
        "anthropic", {"input_tokens": 5, "cache_creation_input_tokens": 800, "output_tokens": 1}
    )
    assert (usage.cache_write_5m_tokens, usage.cache_write_1h_tokens) == (800, 0)


def test_missing_usage_is_zero() -> None:
    assert normalise_usage("openai", None) == Usage()
    assert normalise_usage("gemini", {}) == Usage()


def test_rendering_round_trips_through_each_client_shape() -> None:
    usage = ROWS[2][2]
    assert normalise_usage("anthropic", anthropic_usage(usage)) == usage
    rendered = openai_usage(usage)
    assert rendered["prompt_tokens"] == 20 + 3000 + 1500
    assert rendered["prompt_tokens_details"] == {"cached_tokens": 3000, "cache_write_tokens": 1500}
    assert rendered["total_tokens"] == 4520 + 70


# --- end to end: the fake vendors report these numbers in their own format -----------------------

E2E = [
    (
        "gpt-4o-mini",
        "fake_openai",
        dict(input_tokens=464, cached_input_tokens=1536, output_tokens=30, reasoning_tokens=12),
        "default",  # the service tier served: OpenAI's top-level `service_tier`
    ),
    (
        "deepseek-chat",
        "fake_deepseek",
        dict(input_tokens=360, cached_input_tokens=640, output_tokens=50),
        None,
    ),
    (
        "claude-sonnet",
        "fake_anthropic",
        dict(
            input_tokens=20,
            cached_input_tokens=3000,
            cache_write_5m_tokens=500,
            cache_write_1h_tokens=1000,
            output_tokens=7,
            reasoning_tokens=5,
        ),
        "standard",  # Anthropic's `usage.service_tier`
    ),
    (
        "gemini-flash",
        "fake_gemini",
        dict(input_tokens=904, cached_input_tokens=4096, output_tokens=14, reasoning_tokens=10),
        None,  # Gemini reports no tier
    ),
]


PLAIN_AND_STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
EACH_ROW = pytest.mark.parametrize(("model", "fake_name", "fields", "tier"), E2E, ids=[row[0] for row in E2E])
ASK = [{"role": "user", "content": "count my tokens please"}]


@pytest.fixture
def expected(
    gateway: RunningGateway, request: pytest.FixtureRequest, fake_name: str, fields: dict, tier: str | None
) -> Usage:
    """The row's usage: its fake reports it for the next request, in its vendor's own format."""
    request.getfixturevalue(fake_name).set_next_usage(**fields)
    return Usage(**fields, service_tier=tier)


@PLAIN_AND_STREAMED
@EACH_ROW
def test_row_end_to_end(gateway: RunningGateway, model: str, expected: Usage, stream: bool) -> None:
    client = gateway.openai()
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=model, messages=ASK, stream=True, stream_options={"include_usage": True}
            )
        )
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
    else:
        usage = client.chat.completions.create(model=model, messages=ASK).usage
    assert usage is not None
    assert usage.prompt_tokens == expected.prompt_tokens
    assert usage.completion_tokens == expected.output_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == expected.cached_input_tokens
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == expected.reasoning_tokens
    [event] = gateway.sink.events
    assert event.usage == expected
    assert event.route == model


@PLAIN_AND_STREAMED
@EACH_ROW
def test_row_end_to_end_anthropic_client(
    gateway: RunningGateway, model: str, expected: Usage, stream: bool
) -> None:
    client = gateway.anthropic()
    if stream:
        with client.messages.stream(model=model, max_tokens=100, messages=ASK) as events:
            usage = events.get_final_message().usage
    else:
        usage = client.messages.create(model=model, max_tokens=100, messages=ASK).usage
    assert usage.input_tokens == expected.input_tokens
    assert usage.cache_read_input_tokens == expected.cached_input_tokens
    assert usage.cache_creation_input_tokens == expected.cache_write_tokens
    # Streamed, the SDK's accumulator takes the TTL split from message_start only: Anthropic counted
    # it there, and Weir's message_start says it (the other vendors write no cache: zeros either way).
    assert usage.cache_creation is not None
    assert usage.cache_creation.ephemeral_1h_input_tokens == expected.cache_write_1h_tokens
    assert usage.output_tokens == expected.output_tokens
    assert gateway.sink.events[0].usage == expected


@PLAIN_AND_STREAMED
def test_geminis_tool_use_prompt_tokens_are_billed_input(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    """`toolUsePromptTokenCount` (what Gemini's grounding search or code execution fed the model) is
    outside `promptTokenCount` and billed as input: it was dropped, under-billing every grounded
    answer."""
    fake_gemini.set_next_usage(
        raw={"toolUsePromptTokenCount": 1200}, input_tokens=900, cached_input_tokens=0, output_tokens=14
    )
    client = gateway.openai()
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="gemini-flash", messages=ASK, stream=True, stream_options={"include_usage": True}
            )
        )
        usage = chunks[-1].usage
    else:
        usage = client.chat.completions.create(model="gemini-flash", messages=ASK).usage
    assert usage is not None and usage.prompt_tokens == 900 + 1200
    assert usage.total_tokens == 900 + 1200 + 14
    [event] = gateway.sink.events
    assert (event.usage.input_tokens, event.usage.output_tokens) == (2100, 14)
    assert event.cost_pico_usd > 0


@pytest.mark.parametrize(
    ("vendor", "raw", "beside", "tier"),
    [
        ("openai", {"prompt_tokens": 5, "completion_tokens": 1}, "flex", "flex"),  # top-level, beside usage
        ("openai", {"prompt_tokens": 5, "completion_tokens": 1}, None, None),
        ("anthropic", {"input_tokens": 5, "output_tokens": 1, "service_tier": "priority"}, None, "priority"),
        ("anthropic", {"input_tokens": 5, "output_tokens": 1, "service_tier": None}, None, None),
        ("gemini", {"promptTokenCount": 5, "candidatesTokenCount": 1}, None, None),  # Gemini reports none
    ],
)
def test_the_service_tier_served_is_read_with_the_usage(
    vendor: str, raw: dict, beside: str | None, tier: str | None
) -> None:
    assert normalise_usage(vendor, raw, beside).service_tier == tier
