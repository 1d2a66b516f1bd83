"""Anthropic's own tools on /v1/messages (Claude Code's WebSearch): a server tool such as web search
goes to Claude as the client sent it, its blocks come back as Claude sent them (streamed and not) and
go back to Claude unchanged on the next turn; a candidate of another vendor is skipped, and with none
that can run the tool the client gets a 400 naming it. With the official anthropic SDK."""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Model
from gateway.pipeline import price_sheet
from gateway.usage import Usage, anthropic_usage, normalise_usage
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fakes.behaviour import chunk_words
from tests.fixtures.vendor_gateway import RunningGateway, full_config_text, module_gateway
from tests.gateway.test_messages import WEATHER, final_message

WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}
BASH = {"type": "bash_20250124", "name": "bash"}
TOOL_SEARCH = {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}
DEFERRED = {**WEATHER, "defer_loading": True}
ROUTES = """\
routes:
  - {name: gpt-then-claude, candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}], probe_interval: null}
  - {name: gpt-then-gemini, candidates: [{model: gpt-4o-mini}, {model: gemini-flash}], probe_interval: null}
  - {name: gemini-then-claude, candidates: [{model: gemini-flash}, {model: claude-sonnet}], probe_interval: null}
  - {name: claude-twice, candidates: [{model: claude-sonnet}, {model: claude-opus-46}], probe_interval: null}
"""
ASK = "search the web for the tallest tree"


_module_gateway, routed = module_gateway(full_config_text() + ROUTES, "routed")


def _search(gateway: RunningGateway, stream: bool, model: str = "claude-sonnet", **more: Any) -> Any:
    asked = {
        "model": model,
        "max_tokens": 200,
        "tools": [WEB_SEARCH],
        "messages": [{"role": "user", "content": ASK}],
        **more,
    }
    return final_message(gateway.anthropic(), stream, asked)


@pytest.mark.parametrize("stream", [False, True])
def test_web_search_answer_reaches_the_client_as_claude_sent_it(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    message = _search(gateway, stream)
    assert fake_anthropic.last_request.json["tools"] == [WEB_SEARCH]  # the tool as the client sent it
    assert [block.type for block in message.content] == [
        "text",
        "server_tool_use",
        "web_search_tool_result",
        "text",
        "text",
    ]
    use, result, cited = message.content[1], message.content[2], message.content[4]
    assert use.name == "web_search" and use.input == {"query": ASK}  # type: ignore[union-attr]
    assert use.id.startswith("srvtoolu_") and result.tool_use_id == use.id  # type: ignore[union-attr]
    assert result.content[0].encrypted_content  # type: ignore[union-attr,index]
    assert message.content[3].citations is None  # type: ignore[union-attr]
    [citation] = cited.citations  # type: ignore[union-attr]
    assert citation.url == result.content[0].url and citation.encrypted_index  # type: ignore[union-attr,index]
    assert cited.text == ASK  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert message.usage.server_tool_use is not None
    assert message.usage.server_tool_use.web_search_requests == 1
    [event] = gateway.sink.events
    assert event.backend == "anthropic" and event.usage.web_search_requests == 1
    assert event.usage.output_tokens == message.usage.output_tokens


def test_a_streamed_and_a_whole_web_search_answer_say_the_same(gateway: RunningGateway) -> None:
    def said(message: Any) -> list[tuple[Any, ...]]:
        return [
            (block.type, getattr(block, "text", None), len(getattr(block, "citations", None) or ()))
            for block in message.content
        ]

    assert said(_search(gateway, stream=True)) == said(_search(gateway, stream=False))


def test_streamed_server_tool_input_comes_as_input_json_delta(gateway: RunningGateway) -> None:
    with gateway.anthropic().messages.stream(
        model="claude-sonnet",
        max_tokens=200,
        tools=[WEB_SEARCH],  # type: ignore[list-item]
        messages=[{"role": "user", "content": ASK}],
    ) as stream:
        events = list(stream)
    starts = {e.index: e.content_block.type for e in events if e.type == "content_block_start"}
    deltas = [(e.index, e.delta.type) for e in events if e.type == "content_block_delta"]
    assert starts == {0: "text", 1: "server_tool_use", 2: "web_search_tool_result", 3: "text", 4: "text"}
    assert (1, "input_json_delta") in deltas and (4, "citations_delta") in deltas
    assert not any(index == 2 for index, _ in deltas)  # the result comes whole in its start


@pytest.mark.parametrize("stream", [False, True])
def test_the_next_turn_sends_the_server_blocks_back_unchanged(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    first = _search(gateway, stream)
    sent_back = [block.to_dict() for block in first.content]
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": sent_back},
        {"role": "user", "content": "thanks, say it again"},
    ]
    again = _search(gateway, stream, messages=messages)
    assert [block.type for block in again.content] == ["text"]
    assert fake_anthropic.last_request.json["messages"][1] == {"role": "assistant", "content": sent_back}


def test_function_tools_keep_their_place_around_a_server_tool(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    other = {**WEATHER, "name": "get_time"}
    tools = [WEATHER, WEB_SEARCH, BASH, other]
    gateway.anthropic().messages.create(
        model="claude-sonnet",
        max_tokens=50,
        tools=tools,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "hello"}],
    )
    assert fake_anthropic.last_request.json["tools"] == tools


def test_tool_search_and_its_deferred_tools_reach_claude_as_sent(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    tools = [TOOL_SEARCH, DEFERRED, {**WEATHER, "name": "get_time"}]
    gateway.anthropic().messages.create(
        model="claude-sonnet",
        max_tokens=50,
        tools=tools,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "hello"}],
    )
    assert fake_anthropic.last_request.json["tools"] == tools  # `defer_loading` kept


# Client-side tool search: the client's own search tool answers with `tool_reference` blocks, each
# loading one of its `defer_loading` tools.
FIND_TOOLS = {
    "name": "find_tools",
    "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
}
REFERENCE = {"type": "tool_reference", "tool_name": "get_weather"}


def _searched_tools(*result: dict[str, Any]) -> list[dict[str, Any]]:
    """A conversation whose last turn answers the client's tool search with `result`."""
    call = {"type": "tool_use", "id": "toolu_find1", "name": "find_tools", "input": {"q": "weather"}}
    return [
        {"role": "user", "content": "what is the weather in Paris"},
        {"role": "assistant", "content": [call]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_find1", "content": list(result)}],
        },
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_reference_in_a_tool_result_reaches_claude_as_sent(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """The fake checks the reference names a deferred tool of the request, as Anthropic does."""
    messages = _searched_tools({**REFERENCE, "cache_control": {"type": "ephemeral"}})
    asked = {
        "model": "claude-sonnet",
        "max_tokens": 50,
        "tools": [FIND_TOOLS, DEFERRED],
        "messages": messages,
    }
    answer = final_message(gateway.anthropic(), stream, asked)
    assert answer.content
    assert fake_anthropic.last_request.json["messages"][2] == messages[2]


CACHED = {"type": "ephemeral"}


def _marked(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The blocks of `blocks` (a tool result's included) that carry a `cache_control` breakpoint."""
    found = []
    for block in blocks:
        if block.get("type") == "tool_result" and isinstance(block.get("content"), list):
            found += _marked(block["content"])
        if "cache_control" in block:
            found.append(block)
    return found


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_results_own_breakpoints_count_toward_claudes_four(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """Five breakpoints, one on the `tool_reference` of a tool result kept as the client sent it:
    Anthropic refuses more than four, so one between the first three and the last is left out, and
    the rest reach Claude as sent. The count endpoint gets the same body."""
    messages = _searched_tools({**REFERENCE, "cache_control": CACHED})
    messages[0]["content"] = [
        {"type": "text", "text": "what is the weather in Paris", "cache_control": CACHED}
    ]
    messages[2]["content"][0]["cache_control"] = CACHED
    asked = {
        "model": "claude-sonnet",
        "max_tokens": 50,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": CACHED}],
        "tools": [{**FIND_TOOLS, "cache_control": CACHED}, DEFERRED],
        "messages": messages,
    }
    answer = final_message(gateway.anthropic(), stream, asked)
    assert answer.content
    sent = fake_anthropic.last_request.json
    marked = [
        *_marked(sent["tools"]),
        *_marked(sent["system"]),
        *(block for message in sent["messages"] for block in _marked(message["content"])),
    ]
    assert len(marked) == 4
    result = sent["messages"][2]["content"][0]
    assert result["content"] == [REFERENCE] and result["cache_control"] == CACHED
    assert sent["messages"][0]["content"][0]["cache_control"] == CACHED
    counted = gateway.anthropic().messages.count_tokens(
        **{k: v for k, v in asked.items() if k != "max_tokens"}
    )
    assert counted.input_tokens > 0


def test_automatic_caching_takes_one_of_claudes_four_breakpoints(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Four breakpoints of the client's and automatic caching (the request's own `cache_control`),
    which Anthropic counts as a fifth: one of the client's between the first two and the last is
    left out."""
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "first", "cache_control": CACHED}]},
        {"role": "assistant", "content": [{"type": "text", "text": "noted", "cache_control": CACHED}]},
        {"role": "user", "content": [{"type": "text", "text": "second", "cache_control": CACHED}]},
    ]
    gateway.anthropic().messages.create(
        model="claude-sonnet",
        max_tokens=50,
        system=[{"type": "text", "text": "You are terse.", "cache_control": CACHED}],
        messages=turns,  # type: ignore[arg-type]
        extra_body={"cache_control": CACHED},
    )
    sent = fake_anthropic.last_request.json
    assert sent["cache_control"] == CACHED
    assert [len(_marked(message["content"])) for message in sent["messages"]] == [1, 0, 1]
    assert _marked(sent["system"])


def test_a_tool_reference_is_left_out_for_another_vendor(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """Sent where the tools are all loaded up front (a request with deferred tools is Claude's alone),
    the reference loads nothing: the result is the rest of its content."""
    messages = _searched_tools(REFERENCE, {"type": "text", "text": "get_weather loaded"})
    gateway.anthropic().messages.create(
        model="gpt-4o-mini",
        max_tokens=50,
        tools=[FIND_TOOLS, WEATHER],  # type: ignore[list-item]
        messages=messages,  # type: ignore[arg-type]
    )
    sent = fake_openai.last_request.json["messages"][2]
    assert sent["role"] == "tool" and sent["content"] == [{"type": "text", "text": "get_weather loaded"}]


def test_a_deferred_tools_search_skips_a_candidate_of_another_vendor(
    routed: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    response = routed.anthropic().messages.with_raw_response.create(
        model="gpt-then-claude",
        max_tokens=50,
        tools=[FIND_TOOLS, DEFERRED],  # type: ignore[list-item]
        messages=_searched_tools(REFERENCE),  # type: ignore[arg-type]
    )
    assert response.parse().content and "gpt-4o-mini:unsupported" in response.headers["x-weir-route"]
    assert not fake_openai.posts
    assert fake_anthropic.last_request.json["messages"][2]["content"][0]["content"] == [REFERENCE]


def test_a_server_tool_skips_a_candidate_of_another_vendor(
    routed: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    response = routed.anthropic().messages.with_raw_response.create(
        model="gpt-then-claude",
        max_tokens=200,
        tools=[WEB_SEARCH],  # type: ignore[list-item]
        messages=[{"role": "user", "content": ASK}],
    )
    message = response.parse()
    assert "server_tool_use" in [block.type for block in message.content]
    assert "gpt-4o-mini:unsupported" in response.headers["x-weir-route"]
    assert not fake_openai.posts  # nothing was sent where the tool cannot run
    [event] = routed.sink.events
    assert event.backend == "anthropic" and event.usage.web_search_requests == 1


@pytest.mark.parametrize(
    ("model", "tool"), [("gpt-then-gemini", WEB_SEARCH), ("gpt-4o-mini", BASH), ("gemini-flash", DEFERRED)]
)
@pytest.mark.parametrize("stream", [False, True])
def test_with_no_candidate_that_can_run_the_tool_the_client_gets_a_400_naming_it(
    routed: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_gemini: FakeGemini,
    model: str,
    tool: dict[str, Any],
    stream: bool,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        final_message(
            routed.anthropic(),
            stream,
            {
                "model": model,
                "max_tokens": 50,
                "tools": [WEATHER, tool],
                "messages": [{"role": "user", "content": ASK}],
            },
        )
    assert (
        f"`{tool.get('type', tool['name'])}`" in caught.value.message and "tools[1]" in caught.value.message
    )
    assert not fake_openai.posts and not fake_gemini.posts


def test_a_client_tool_without_a_schema_is_still_refused_naming_it(gateway: RunningGateway) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        gateway.anthropic().messages.create(
            model="claude-sonnet",
            max_tokens=50,
            tools=[WEB_SEARCH, {"name": "broken"}],  # type: ignore[list-item]
            messages=[{"role": "user", "content": "hello"}],
        )
    assert "tools[1].input_schema" in caught.value.message


def test_server_tool_requests_are_read_from_anthropic_usage_and_rendered_back() -> None:
    raw = {
        "input_tokens": 10,
        "output_tokens": 5,
        "server_tool_use": {"web_search_requests": 3, "web_fetch_requests": 2},
    }
    usage = normalise_usage("anthropic", raw)
    assert (usage.web_search_requests, usage.web_fetch_requests) == (3, 2)
    assert anthropic_usage(usage)["server_tool_use"] == {"web_search_requests": 3, "web_fetch_requests": 2}
    assert "server_tool_use" not in anthropic_usage(Usage(input_tokens=1))


# claude-sonnet's prices in the example config (tests/fixtures/vendor_gateway.py), in micro-USD per 1M
# tokens (or searches: `web_search_per_1k: 10`, $10 per 1,000 searches, is $10,000 per 1M).
INPUT_PRICE, OUTPUT_PRICE, SEARCH_PRICE = 3 * 10**6, 15 * 10**6, 10_000 * 10**6


@pytest.mark.parametrize("stream", [False, True])
def test_web_searches_are_billed_beside_the_tokens(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """Anthropic bills $10 per 1,000 web searches beside the tokens: the attempt's cost (what the
    ledger, budgets and every usage sink take) holds both, at the model's `web_search_per_1k`."""
    searches = {"server_tool_use": {"web_search_requests": 3, "web_fetch_requests": 0}}
    fake_anthropic.set_next_usage(searches, input_tokens=1000, output_tokens=100)
    message = _search(gateway, stream)
    assert message.usage.server_tool_use is not None
    assert message.usage.server_tool_use.web_search_requests == 3
    [event] = gateway.sink.events
    assert event.usage.web_search_requests == 3
    assert event.prices["web_search"] == SEARCH_PRICE  # as the ledger row keeps it
    # $0.0045 of tokens and $0.03 of searches, in pico-USD.
    assert event.cost_pico_usd == 1000 * INPUT_PRICE + 100 * OUTPUT_PRICE + 3 * SEARCH_PRICE


def _tool_uses(gateway: RunningGateway) -> dict[tuple[str, ...], float]:
    """`weir_server_tool_uses_total` as /metrics exports it: (backend, model, tenant, tool) -> count."""
    return {
        tuple(sample.labels[name] for name in ("backend", "model", "tenant", "tool")): sample.value
        for family in text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text)
        for sample in family.samples
        if sample.name == "weir_server_tool_uses_total"
    }


def test_server_tool_uses_are_counted_on_metrics_per_tenant_model_and_backend(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Each attempt's web searches and fetches (Anthropic's `server_tool_use`) are counted on
    /metrics, labelled as the token counter is (backend, the model the client named), and with the
    tenant: searches are billed per search, and one tenant's agent can run many."""
    before = _tool_uses(gateway)
    searched = ("anthropic", "claude-sonnet", "demo", "web_search")
    fetched = ("anthropic", "claude-sonnet", "demo", "web_fetch")
    for stream in (False, True):
        tools = {"server_tool_use": {"web_search_requests": 3, "web_fetch_requests": 2}}
        fake_anthropic.set_next_usage(tools, input_tokens=10, output_tokens=5)
        _search(gateway, stream)
    gateway.anthropic().messages.create(
        model="claude-sonnet", max_tokens=20, messages=[{"role": "user", "content": "no tools"}]
    )
    deadline = time.monotonic() + 5  # a stream's usage event may land just after its last byte
    after = _tool_uses(gateway)
    while after.get(searched, 0) - before.get(searched, 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
        after = _tool_uses(gateway)
    assert after[searched] - before.get(searched, 0) == 6
    assert after[fetched] - before.get(fetched, 0) == 4
    assert {key for key, count in after.items() if count != before.get(key, 0)} == {searched, fetched}


def test_a_search_price_is_checked_as_the_config_loads() -> None:
    def sheet(price: dict[str, Any]) -> dict[str, int]:
        return {
            str(c): p
            for c, p in price_sheet(
                msgspec.convert({"name": "m", "backend": "b", "price": price}, Model)
            ).items()
        }

    assert sheet({"input": 3, "web_search_per_1k": "10"})["web_search"] == SEARCH_PRICE
    assert sheet({"web_search_per_1k": "0.000000001"})["web_search"] == 1  # a billionth of a dollar
    assert "web_search" not in sheet({"input": 3})  # no price: searches cost nothing
    for wrong in ("-1", "1000.5", "0.0000000001"):
        with pytest.raises(msgspec.ValidationError, match="web_search_per_1k: USD per 1,000 searches"):
            sheet({"web_search_per_1k": wrong})
    with pytest.raises(msgspec.ValidationError):  # a service tier has no search price of its own
        sheet({"tiers": {"priority": {"input": 4, "web_search_per_1k": 10}}})


@pytest.mark.parametrize("stream", [False, True])
def test_a_paused_turn_goes_back_to_claude_as_it_was_for_claude_to_go_on(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """Claude pauses a long server-tool turn (`pause_turn`); the client sends it back as the last
    message for Claude to go on with. That is no prefill for Weir to turn into a "continue" request
    (on Claude 4.6, which takes no prefill): it goes as it is."""
    fake_anthropic.stop_next_with("pause_turn")
    paused = _search(gateway, stream, model="claude-opus-46")
    assert paused.stop_reason == "pause_turn"
    sent_back = [block.to_dict() for block in paused.content]
    messages = [{"role": "user", "content": ASK}, {"role": "assistant", "content": sent_back}]
    _search(gateway, stream, model="claude-opus-46", messages=messages)
    sent = fake_anthropic.last_request.json["messages"]
    assert len(sent) == 2 and sent[-1] == messages[-1]  # no "continue" turn after it


def test_count_tokens_counts_a_server_tool_on_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    counted = gateway.anthropic().messages.count_tokens(
        model="claude-sonnet",
        tools=[WEB_SEARCH],  # type: ignore[list-item]
        messages=[{"role": "user", "content": ASK}],
    )
    assert counted.input_tokens > 0
    assert fake_anthropic.last_request.path.endswith("/count_tokens")
    assert fake_anthropic.last_request.json["tools"] == [WEB_SEARCH]


@pytest.mark.parametrize("tool", [WEB_SEARCH, DEFERRED])
def test_a_gemini_count_is_refused_where_its_message_would_be(
    routed: RunningGateway, fake_gemini: FakeGemini, fake_anthropic: FakeAnthropic, tool: dict[str, Any]
) -> None:
    """Gemini cannot be sent a tool of Anthropic's API (nor a deferred one): a count made without it
    was a count of a request that is never sent, below what the message bills wherever it goes. Now
    the count is refused as the message is, and a route counts on the candidate that takes it."""
    asked = {"tools": [WEATHER, tool], "messages": [{"role": "user", "content": ASK}]}
    with pytest.raises(anthropic.BadRequestError) as caught:
        routed.anthropic().messages.count_tokens(model="gemini-flash", **asked)  # type: ignore[arg-type]
    assert "tools[1]" in caught.value.message and not fake_gemini.posts
    raw = routed.anthropic().messages.with_raw_response.count_tokens(model="gemini-then-claude", **asked)  # type: ignore[arg-type]
    assert "gemini-flash:unsupported" in raw.headers["x-weir-route"]
    assert raw.headers["x-weir-token-count"] == "backend" and not fake_gemini.posts
    assert fake_anthropic.last_request.json["tools"][1] == tool


@pytest.mark.parametrize("model", ["gpt-4o-mini", "gemini-flash"])
def test_a_searched_turn_goes_to_another_vendor_as_its_text(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini, model: str
) -> None:
    """A later request without the server tools may go anywhere: Claude's searched turn is its text
    there (the search blocks are Claude's alone), never Weir's internal copy of the blocks."""
    first = _search(gateway, stream=False)
    said = "".join(getattr(block, "text", "") for block in first.content)
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [block.to_dict() for block in first.content]},
        {"role": "user", "content": "thanks"},
    ]
    answer = gateway.anthropic().messages.create(model=model, max_tokens=50, messages=messages)  # type: ignore[arg-type]
    assert [block.type for block in answer.content] == ["text"]
    sent = (fake_openai if model == "gpt-4o-mini" else fake_gemini).last_request.json
    if model == "gpt-4o-mini":
        assert sent["messages"][1] == {"role": "assistant", "content": said}
    else:
        assert sent["contents"][1] == {"role": "model", "parts": [{"text": said}]}


def _search_until_cut(gateway: RunningGateway) -> tuple[list[Any], anthropic.APIStatusError]:
    """A web search streamed from `claude-twice` that the fake Anthropic cuts (the test queued the
    fault): the events the client got, and the error the stream ended with."""
    events: list[Any] = []
    with (
        pytest.raises(anthropic.APIStatusError) as caught,
        gateway.anthropic().messages.stream(
            model="claude-twice",
            max_tokens=200,
            tools=[WEB_SEARCH],  # type: ignore[list-item]
            messages=[{"role": "user", "content": ASK}],
        ) as stream,
    ):
        events.extend(stream)
    return events, caught.value


def test_a_stream_cut_after_a_server_tool_block_is_not_continued_from_its_text(
    routed: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """A cut answer that already holds a server tool's block cannot go on from its text alone: the
    continuation would not have the search it made (its results are in the blocks, not the text) and
    would follow a half-sent `server_tool_use`. It ends as a cut tool call does, with an error event,
    and no second candidate is asked."""
    opening = _search(routed, stream=False).content[0].text  # type: ignore[union-attr]
    # message_start; the opening text's start, ping, words and stop; the search's start and two of
    # its input's deltas: then the break.
    fake_anthropic.fail_next(Fault.stream_error(after=len(chunk_words(opening)) + 8, code=529))
    events, _ = _search_until_cut(routed)
    started = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert "server_tool_use" in started
    assert len(fake_anthropic.posts) == 2  # the opening's and the cut one's: nobody continued it


def _events_before_cited_text(fake: FakeAnthropic) -> int:
    """How many events the fake streams of a search answer up to the end of its results block."""
    asked = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 200,
        "stream": True,
        "tools": [WEB_SEARCH],
        "messages": [{"role": "user", "content": ASK}],
    }
    headers = {"x-api-key": fake.api_key or "", "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{fake.base_url}/v1/messages", json=asked, headers=headers) as raw:
        data = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: ")]
    starts = [e.get("content_block", {}).get("type") for e in data]
    return starts.index("web_search_tool_result") + 2  # its start and its stop


def test_a_stream_cut_after_a_searchs_results_is_not_resumed_either(
    routed: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Cut while the text after the search's results streams: a continuation could have those results
    only as a prefill of Claude's blocks, which Anthropic documents for its own `pause_turn` alone
    (whole blocks) and Claude 4.6 on refuses, and running the search again would bill another one
    and may find other pages than the client was shown. The client keeps what it got and an `error`
    event saying why (an overload, as Anthropic says one inside a stream); no other candidate is
    asked."""
    sent = _events_before_cited_text(fake_anthropic) + 2  # and the next text's start and first words
    asked_before = len(fake_anthropic.posts)
    fake_anthropic.fail_next(Fault.stream_error(after=sent, code=529))
    events, error = _search_until_cut(routed)
    started = [i for i, e in enumerate(events) if e.type == "content_block_start"]
    kinds = [events[i].content_block.type for i in started]
    assert kinds == ["text", "server_tool_use", "web_search_tool_result", "text"]
    after = events[started[-1] :]  # the text after the results had begun
    assert any(e.type == "content_block_delta" and e.delta.type == "text_delta" for e in after)
    assert error.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert len(fake_anthropic.posts) == asked_before + 1  # the cut one's alone: nobody continued it
