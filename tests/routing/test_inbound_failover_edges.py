"""Failover as each inbound API's client sees it, with the official SDKs: the Anthropic Messages API
(streamed and not), OpenAI's Responses API, legacy completions, embeddings and count_tokens, through
routes whose candidates span OpenAI, Anthropic and Gemini (and DeepSeek's reasoner)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.providers.base import CONTINUE_INSTRUCTION
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway
from tests.routing.routed import FAST, ROUTES, attempts, fresh, route_header, settled

HI = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"
EDGE_ROUTES = f"""{ROUTES}\
  - {{name: three, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}, {{model: gemini-flash}}], {FAST}}}
  - {{name: gemini-first, candidates: [{{model: gemini-flash}}, {{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: reasoners, candidates: [{{model: deepseek-reasoner}}, {{model: claude-sonnet}}], {FAST}}}
  - {{name: thinkers, candidates: [{{model: claude-sonnet}}, {{model: claude-opus-46}}], {FAST}}}
  - {{name: complete, candidates: [{{model: claude-sonnet}}, {{model: gpt-instruct}}], {FAST}}}
  - {{name: embed, candidates: [{{model: gemini-embedding}}, {{model: text-embedding-3-small}}], {FAST}}}
  - {{name: hedged-anthropic-first, hedge: {{delay: 0.15}}, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: count, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}, {{model: gemini-flash}}], {FAST}}}
"""
THINKING = {"type": "enabled", "budget_tokens": 1024}


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return EDGE_ROUTES


def sse(
    gateway: RunningGateway, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, list[tuple[str, Any]]]:
    """(response, [(event name, data)]) of a streamed request, read raw."""
    headers = {"authorization": f"Bearer {DEMO_KEY}", "anthropic-version": "2023-06-01"}
    with (
        httpx.Client(timeout=20) as client,
        client.stream("POST", f"{gateway.url}{path}", json=body, headers=headers) as response,
    ):
        text = "".join(response.iter_text())
    events: list[tuple[str, Any]] = []
    for block in text.split("\n\n"):
        name, data = "", None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        if data is not None:
            events.append((name, data))
    return response, events


# --- the Messages API ------------------------------------------------------------------------------


def check_anthropic_events(events: list[Any]) -> None:
    """One message_start; each content block started once, its deltas and its stop at its own index,
    indices counting up from 0 without gaps; message_delta then message_stop last."""
    kinds = [e.type for e in events]
    assert kinds.count("message_start") == 1 and kinds[0] == "message_start"
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(starts)))
    open_index: int | None = None
    for e in events:
        if e.type == "content_block_start":
            assert open_index is None
            open_index = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_index
        elif e.type == "content_block_stop":
            assert e.index == open_index
            open_index = None
    assert open_index is None


def test_messages_stream_failing_before_its_first_token_is_one_clean_stream(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=1), times=2)  # the role only
    fake_anthropic.fail_next(Fault.stream_error(after=1, code=529), times=2)  # message_start only
    raw = gateway.anthropic().messages.with_raw_response.create(
        model="three", max_tokens=100, messages=HI, stream=True
    )
    events = list(raw.parse())
    check_anthropic_events(events)
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == ECHO and events[-1].type == "message_stop"
    assert route_header(raw)["candidate"] == "gemini-flash"


def test_messages_stream_resumed_mid_way_is_one_message(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    with gateway.anthropic().messages.stream(model="three", max_tokens=100, messages=HI) as stream:
        events = list(stream)
        final = stream.get_final_message()
    check_anthropic_events(events)
    assert final.content[0].type == "text" and final.content[0].text == ECHO
    assert len(final.content) == 1 and final.stop_reason == "end_turn"
    # The usage is the answering attempt's, reported once at the end (message_start says zeros).
    [start] = [e for e in events if e.type == "message_start"]
    assert start.message.usage.output_tokens == 0 and final.usage.output_tokens > 0
    assert fake_anthropic.last_request.json["messages"][-1]["role"] == "assistant"  # the prefill
    settled(gateway, 2)
    assert attempts(gateway) == [("openai", False), ("anthropic", True)]


def test_messages_stream_cut_where_resuming_is_forbidden_raises_in_the_sdk(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    seen: list[Any] = []
    with (
        pytest.raises(anthropic.APIError),
        gateway.anthropic().messages.stream(model="no-resume", max_tokens=100, messages=HI) as stream,
    ):
        for event in stream:
            seen.append(event)
    assert "message_stop" not in [e.type for e in seen]
    assert not fake_anthropic.requests


TOOL = {"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}


def test_messages_stream_whose_tool_use_broke_ends_with_an_error_event(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, the call's head, its first arguments
    ask = [{"role": "user", "content": 'call lookup {"q": "one two three"}'}]
    response, events = sse(
        gateway,
        "/v1/messages",
        {"model": "resilient", "max_tokens": 100, "messages": ask, "tools": [TOOL], "stream": True},
    )
    names = [n for n, _ in events]
    assert response.status_code == 200 and names[-1] == "error" and "message_stop" not in names
    assert events[-1][1]["type"] == "error" and events[-1][1]["error"]["type"]
    assert not fake_anthropic.requests


def test_messages_json_output_cut_mid_way_is_not_continued(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    _, events = sse(
        gateway,
        "/v1/messages",
        {
            "model": "resilient",
            "max_tokens": 100,
            "messages": HI,
            "stream": True,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    names = [n for n, _ in events]
    assert names[-1] == "error" and "message_stop" not in names and not fake_anthropic.requests


def test_messages_every_candidate_failing_is_an_anthropic_error(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    for stream in (False, True):
        fresh(gateway)  # closed breakers: every candidate is tried each time
        fake_openai.fail_next(500, times=2)
        fake_anthropic.fail_next(Fault.status(529), times=2)
        with pytest.raises(anthropic.APIStatusError) as caught:
            gateway.anthropic().messages.create(model="resilient", max_tokens=100, messages=HI, stream=stream)
        err = caught.value
        assert err.status_code == 529  # the last failure: Anthropic overloaded, as Anthropic says it
        assert err.body == {  # Anthropic's error shape on the Messages API, not OpenAI's
            "type": "error",
            "error": {"type": "overloaded_error", "message": "Anthropic backend error (529): Overloaded"},
            "request_id": err.response.headers["request-id"],
        }
        assert route_header(err.response)["tried"].endswith("claude-sonnet:503")


def test_messages_all_breakers_open_is_529_with_retry_after_in_anthropic_shape(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(500, times=6)
    fake_anthropic.fail_next(500, times=6)
    for _ in range(3):
        with pytest.raises(anthropic.APIStatusError):
            gateway.anthropic().messages.create(model="resilient", max_tokens=100, messages=HI)
    with pytest.raises(anthropic.APIStatusError) as caught:
        gateway.anthropic().messages.create(model="resilient", max_tokens=100, messages=HI)
    err = caught.value
    assert err.status_code == 529 and err.response.headers["retry-after"] == "1"
    assert isinstance(err.body, dict) and err.body["type"] == "error"
    assert err.body["error"]["type"] == "overloaded_error"
    assert route_header(err.response)["tried"] == "gpt-4o-mini:open,claude-sonnet:open"


# --- reasoning across a resume --------------------------------------------------------------------


def sent_back(content: list[Any]) -> list[dict[str, Any]]:
    """The conversation as a multi-turn client with thinking sends it next: the answer as it came."""
    answer = [
        block.model_dump(exclude_none=True, exclude={"parsed_output", "citations"}) for block in content
    ]
    return [*HI, {"role": "assistant", "content": answer}, {"role": "user", "content": "seven"}]


@pytest.mark.parametrize(
    ("route", "first_thought"),
    [("reasoners", "The user"), ("thinkers", "Let me")],  # DeepSeek's reasoning, then Claude's
)
def test_messages_thinking_cut_mid_reasoning_is_two_thinking_blocks_the_next_turn_accepts(
    gateway: RunningGateway,
    fake_deepseek: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    route: str,
    first_thought: str,
) -> None:
    """The stream breaks two words into its reasoning, before any text: the next candidate reasons
    afresh. Its signed thinking must be a block of its own: run on into the cut block, the block
    held both attempts' text under the second one's signature, and the client's next turn, sending
    it back, was refused (400 invalid signature)."""
    if route == "reasoners":
        fake_deepseek.fail_next(Fault.cut_stream(after=3))  # role, "The", " user"
    else:
        fake_anthropic.fail_next(Fault.cut_stream(after=5))  # start, block start, ping, "Let", " me"
    with gateway.anthropic().messages.stream(
        model=route, max_tokens=2000, messages=HI, thinking=THINKING
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    check_anthropic_events(events)
    assert [block.type for block in final.content] == ["thinking", "thinking", "text"]
    cut, thought, text = final.content
    assert cut.thinking == first_thought and cut.signature == ""  # type: ignore[union-attr]
    assert thought.thinking == f"Let me think about: {ECHO}" and thought.signature  # type: ignore[union-attr]
    assert text.text == ECHO  # type: ignore[union-attr]
    reply = gateway.anthropic().messages.create(
        model="claude-sonnet", max_tokens=2000, messages=sent_back(final.content), thinking=THINKING
    )
    assert reply.content[-1].text == "seven"  # type: ignore[union-attr]
    # The unsigned block (what the cut attempt reasoned) is left out; the signed one goes back as it came.
    sent = fake_anthropic.last_request.json["messages"][1]["content"]
    assert [b["type"] for b in sent] == ["thinking", "text"] and sent[0]["signature"] == thought.signature  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("route", "cut", "thought_tokens"),
    # DeepSeek's "The user" (8 bytes), then Claude's "Let me" (6 bytes): 2 tokens at 4 bytes each.
    [("reasoners", Fault.cut_stream(after=3), 2), ("thinkers", Fault.cut_stream(after=5), 2)],
)
def test_a_stream_cut_mid_thinking_estimates_its_reasoning_and_the_client_gets_no_estimate_as_a_count(
    gateway: RunningGateway,
    fake_deepseek: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    route: str,
    cut: Fault,
    thought_tokens: int,
) -> None:
    """The stream breaks in its reasoning, before any usage report: the cut attempt is billed its
    reasoning too, estimated from the reasoning received (it was 0). The continuation's model counts
    its thinking (`thinking_tokens`), and the resumed stream's usage adds the cut attempt's
    estimate to it: the sum is an estimate, which an Anthropic client is never told as
    `output_tokens_details.thinking_tokens` (it was told 40 + the estimate as Anthropic's count)."""
    fresh(gateway)
    (fake_deepseek if route == "reasoners" else fake_anthropic).fail_next(cut)
    for _ in range(2):  # whichever response reports usage first, the continuation reports its count
        fake_anthropic.set_next_usage(output_tokens=50, reasoning_tokens=40)
    with gateway.anthropic().messages.stream(
        model=route, max_tokens=2000, messages=HI, thinking=THINKING
    ) as stream:
        final = stream.get_final_message()
    settled(gateway, 2)
    first, second = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert first.estimated and first.usage.output_tokens >= thought_tokens
    assert (first.usage.reasoning_tokens, first.usage.reasoning_estimated) == (thought_tokens, True)
    assert (second.usage.reasoning_tokens, second.usage.reasoning_estimated) == (40, False)
    assert final.usage.output_tokens == 50 + first.usage.output_tokens
    assert final.usage.output_tokens_details is None


def test_messages_thinking_cut_after_text_resumes_on_claude_without_thinking(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """The stream breaks after its reasoning and two words of text; the next candidate is Claude.
    Anthropic refuses a text prefill while thinking is on (the final assistant message must start
    with a thinking block), so the continuation asks without thinking: the answer continues, its
    reasoning is the first attempt's."""
    fake_anthropic.fail_next(Fault.cut_stream(after=18))
    with gateway.anthropic().messages.stream(
        model="thinkers", max_tokens=2000, messages=HI, thinking=THINKING
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    check_anthropic_events(events)
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert "".join(b.text for b in final.content if b.type == "text") == ECHO  # type: ignore[union-attr]
    continuation = fake_anthropic.last_request.json
    # Opus 4.6 refuses a prefill: the text sent so far, then a user turn asking for the rest.
    assert "thinking" not in continuation and continuation["messages"][-2]["role"] == "assistant"
    assert continuation["messages"][-1]["content"][0]["text"] == CONTINUE_INSTRUCTION


def test_responses_reasoning_cut_mid_way_is_two_reasoning_items(
    gateway: RunningGateway, fake_deepseek: FakeOpenAI
) -> None:
    """The same break seen by a Responses client: the cut reasoning is an item of its own, marked
    incomplete, not the head of the continuation's reasoning text."""
    fake_deepseek.fail_next(Fault.cut_stream(after=3))
    with gateway.openai().responses.stream(
        model="reasoners", input=ECHO, reasoning={"effort": "low"}
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_responses_events(events)
    assert [(item.type, item.status) for item in final.output] == [
        ("reasoning", "incomplete"),
        ("reasoning", "completed"),
        ("message", "completed"),
    ]
    cut, thought, _ = final.output
    assert [c.text for c in cut.content or []] == ["The user"]  # type: ignore[union-attr]
    assert [c.text for c in thought.content or []] == [f"Let me think about: {ECHO}"]  # type: ignore[union-attr]
    assert final.output_text == ECHO and final.status == "completed"
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1, 2]


# --- the Responses API ---------------------------------------------------------------------------


def check_responses_events(events: list[Any]) -> None:
    kinds = [e.type for e in events]
    assert kinds.count("response.created") == 1 and kinds[0] == "response.created"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_stream_failing_before_its_first_token(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_anthropic: FakeAnthropic
) -> None:
    fake_gemini.fail_next(Fault.cut_stream(after=0), times=2)
    fake_anthropic.fail_next(Fault.stream_error(after=1, code=529), times=2)
    with gateway.openai().responses.stream(model="gemini-first", input=ECHO) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_responses_events(events)
    assert final.output_text == ECHO and final.status == "completed"


def test_responses_stream_resumed_keeps_text_and_usage(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_anthropic: FakeAnthropic
) -> None:
    fake_gemini.fail_next(Fault.cut_stream(after=2))
    with gateway.openai().responses.stream(model="gemini-first", input=ECHO) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_responses_events(events)
    assert final.output_text == ECHO and final.status == "completed"
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 1 and kinds.count("response.content_part.added") == 1
    assert {e.output_index for e in events if hasattr(e, "output_index")} == {0}
    assert final.usage is not None and final.usage.output_tokens > 0
    settled(gateway, 2)
    assert attempts(gateway) == [("gemini", False), ("anthropic", True)]


def test_responses_stream_cut_without_resume_reports_failed(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    stream = gateway.openai().responses.create(model="no-resume", input=ECHO, stream=True)
    events = list(stream)
    check_responses_events(events)
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"
    # What the client had is in the failed response, marked incomplete; never response.completed.
    assert failed.output[0].status == "incomplete"
    assert failed.output[0].content[0].text == "one two"  # type: ignore[union-attr]


def test_responses_function_call_cut(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    tools = [{"type": "function", "name": "lookup", "parameters": TOOL["input_schema"]}]
    stream = gateway.openai().responses.create(
        model="resilient", input='call lookup {"q": "one two three"}', tools=tools, stream=True
    )
    events = list(stream)
    check_responses_events(events)
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    [call] = events[-1].response.output  # type: ignore[union-attr]
    assert call.type == "function_call" and call.status == "incomplete"
    assert len(fake_openai.requests) == 1  # a tool call under way is never continued elsewhere


def test_responses_every_candidate_failing(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(500, times=2)
    fake_anthropic.fail_next(Fault.status(529), times=2)
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().responses.create(model="resilient", input=ECHO, stream=True)
    err = caught.value
    assert err.status_code == 503 and isinstance(err.body, dict) and err.body["code"] == "backend_unavailable"
    assert route_header(err.response)["attempts"] == "4"


# --- completions, embeddings, count_tokens ---------------------------------------------------------


def test_completions_stream_via_chat_candidate_cut(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.fail_next(Fault.cut_stream(after=5))
    stream = gateway.openai().completions.create(model="complete", prompt=ECHO, stream=True, max_tokens=50)
    got = []
    with pytest.raises(openai.APIError):
        for c in stream:
            got.append(c)
    assert "".join(c.choices[0].text for c in got if c.choices) == "one two"
    settled(gateway, 1)
    assert attempts(gateway) == [("anthropic", False)]  # no resumption for completions


def test_completions_stream_before_first_token(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.fail_next(Fault.stream_error(after=1, code=529), times=2)
    raw = gateway.openai().completions.with_raw_response.create(
        model="complete", prompt=ECHO, stream=True, max_tokens=50, stream_options={"include_usage": True}
    )
    chunks = list(raw.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ECHO
    assert len({c.id for c in chunks}) == 1 and chunks[-1].usage is not None
    assert route_header(raw)["candidate"] == "gpt-instruct"


def test_embeddings_all_failed(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    fake_gemini.fail_next(Fault.status(429, retry_delay=30), times=2)
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().embeddings.create(model="embed", input="hello")
    err = caught.value
    assert not fake_openai.requests  # another embedding model: never asked (other vectors)
    # The last failure's status and its wait (Gemini's RetryInfo) as retry-after, in OpenAI's shape.
    assert err.status_code == 429 and err.response.headers["retry-after"] == "30"
    assert isinstance(err.body, dict) and err.body["type"] == "rate_limit_error"
    assert route_header(err.response)["tried"].endswith("gemini-embedding:429")


def test_count_tokens_all_failed(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    fake_anthropic.fail_next(500, times=2)
    fake_gemini.fail_next(Fault.status(503), times=2)
    with pytest.raises(anthropic.APIStatusError) as caught:
        gateway.anthropic().messages.count_tokens(model="count", messages=HI)  # type: ignore[arg-type]
    err = caught.value
    assert err.status_code == 529 and isinstance(err.body, dict)
    assert err.body["type"] == "error" and err.body["error"]["type"] == "overloaded_error"
    assert route_header(err.response)["tried"].startswith("gpt-4o-mini:unsupported,claude-sonnet:502")


# --- n > 1 on a route whose first candidate cannot give several choices ---------------------------


def test_completions_n_above_one_skips_a_candidate_that_cannot_and_is_answered_by_the_next(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """`complete` lists claude-sonnet first. An Anthropic model cannot give several choices: the
    request is not the client's fault (the route's next candidate can), so it is no 400, and nothing
    went to Anthropic."""
    raw = gateway.openai().completions.with_raw_response.create(model="complete", prompt=ECHO, n=2)
    completion = raw.parse()
    assert [c.text for c in completion.choices] == [ECHO, ECHO]
    assert route_header(raw)["tried"] == "claude-sonnet:unsupported,gpt-instruct:ok"
    assert not fake_anthropic.requests
    assert attempts(gateway) == [("openai", True)]


@pytest.mark.parametrize("route", ["anthropic-first", "hedged-anthropic-first"])
def test_chat_n_above_one_on_a_route_skips_a_candidate_that_cannot(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, route: str
) -> None:
    raw = gateway.openai().chat.completions.with_raw_response.create(model=route, messages=HI, n=2)
    assert [c.message.content for c in raw.parse().choices] == [ECHO, ECHO]
    route = route_header(raw)
    assert (
        route["candidate"] == "gpt-4o-mini" and route["tried"] == "claude-sonnet:unsupported,gpt-4o-mini:ok"
    )
    assert not fake_anthropic.requests


def test_n_above_one_that_no_candidate_can_take_is_still_the_400(gateway: RunningGateway) -> None:
    for model in ("claude-sonnet", "thinkers"):  # a plain model; a route of Anthropic models only
        with pytest.raises(openai.BadRequestError) as caught:
            gateway.openai().chat.completions.create(model=model, messages=HI, n=2)
        assert "n > 1" in caught.value.message and caught.value.body["param"] == "n"  # type: ignore[index]
    assert not gateway.sink.events  # nothing was sent, nothing billed
