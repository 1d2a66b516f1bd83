"""OpenAI's Responses API through routes that fail over, with the official openai SDK as the client:
replies and streams served by OpenAI, Anthropic and Gemini candidates, function calls and their ids
across a failover, output limits and instructions on the candidate that answered, stateful parameters
on a route, and streams cut after their first text (resumed, or ended with `response.failed`)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseOutputMessage

from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import FAST, ROUTES, attempts, route_header, settled

ECHO = "one two three four five six"
RESPONSES_ROUTES = f"""{ROUTES}\
  - {{name: gemini-first, candidates: [{{model: gemini-flash}}, {{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: claude-then-reasoner, candidates: [{{model: claude-sonnet}}, {{model: deepseek-reasoner}}], {FAST}}}
  - {{name: pro-first, candidates: [{{model: gemini-pro}}, {{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}}}
"""
LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}
ASK_TOOL = 'call lookup {"q": "weir"}'


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return RESPONSES_ROUTES


def kinds(events: list[Any]) -> list[str]:
    return [e.type for e in events]


def check_sequence(events: list[Any]) -> None:
    """What every Responses stream holds: one response.created first, increasing sequence numbers,
    at most one terminal event and it comes last."""
    types = kinds(events)
    assert types[0] == "response.created" and types.count("response.created") == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    terminal = [t for t in types if t in ("response.completed", "response.incomplete", "response.failed")]
    assert len(terminal) == 1 and types[-1] == terminal[0]


# --- not streamed --------------------------------------------------------------------------------


def test_a_failed_over_reply_carries_instructions_limit_and_route(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(500, times=2)
    raw = gateway.openai().responses.with_raw_response.create(
        model="resilient", input=ECHO, instructions="Be brief.", max_output_tokens=50, store=True
    )
    response = raw.parse()
    assert response.output_text == ECHO and response.status == "completed"
    assert response.instructions == "Be brief." and response.max_output_tokens == 50
    assert raw.http_response.json()["store"] is False  # accepted, never stored, and the reply says so
    route = route_header(raw)
    assert route["candidate"] == "claude-sonnet" and route["attempts"] == "3"
    sent = fake_anthropic.last_request.json
    system = sent["system"]
    assert (system[0]["text"] if isinstance(system, list) else system) == "Be brief."
    assert sent["max_tokens"] == 50
    assert attempts(gateway) == [("openai", False), ("openai", False), ("anthropic", True)]


def test_max_output_tokens_on_a_failed_over_reply_is_incomplete(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(500, times=2)
    response = gateway.openai().responses.create(model="resilient", input=ECHO, max_output_tokens=3)
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    [message] = response.output
    assert isinstance(message, ResponseOutputMessage) and message.status == "incomplete"
    assert response.output_text == "one two three"


@pytest.mark.parametrize("param", ["previous_response_id", "conversation"])
def test_stateful_parameters_are_refused_on_a_route_whatever_its_candidates(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, param: str
) -> None:
    value = "resp_123" if param == "previous_response_id" else "conv_123"
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().responses.create(model="anthropic-first", input=ECHO, **{param: value})  # type: ignore[call-overload]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param
    assert not fake_openai.requests and not fake_anthropic.requests  # refused before any candidate


def test_a_function_call_from_anthropic_goes_back_to_openai_with_its_call_id(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The tool loop a Responses client runs: a call made after failing over to Claude, answered on
    the next turn by the same route's first candidate, OpenAI."""
    client = gateway.openai()
    fake_openai.fail_next(500, times=2)
    first = client.responses.create(model="resilient", input=ASK_TOOL, tools=[LOOKUP])  # type: ignore[list-item]
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "lookup" and json.loads(call.arguments) == {"q": "weir"}
    assert call.call_id and call.id and call.id != call.call_id
    second_input: list[Any] = [
        {"role": "user", "content": ASK_TOOL},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "a river dam"},
    ]
    second = client.responses.create(model="resilient", input=second_input, tools=[LOOKUP])  # type: ignore[list-item]
    assert second.output_text == "Tool lookup returned: a river dam"
    messages = fake_openai.last_request.json["messages"]
    [assistant] = [m for m in messages if m["role"] == "assistant"]
    [tool] = [m for m in messages if m["role"] == "tool"]
    assert assistant["tool_calls"][0]["id"] == tool["tool_call_id"]


def test_a_gemini_function_call_goes_back_to_gemini_with_its_signature_and_to_others_without(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    client = gateway.openai()
    first = client.responses.create(model="gemini-first", input=ASK_TOOL, tools=[LOOKUP])  # type: ignore[list-item]
    [call] = [item for item in first.output if item.type == "function_call"]
    loop: list[Any] = [
        {"role": "user", "content": ASK_TOOL},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "a river dam"},
    ]
    fake_gemini.fail_next(500, times=2)
    fake_gemini.fail_next(500, times=2)
    second = client.responses.create(model="resilient", input=loop, tools=[LOOKUP])  # type: ignore[list-item]
    assert second.output_text == "Tool lookup returned: a river dam"
    messages = fake_openai.last_request.json["messages"]
    ids = [messages[1]["tool_calls"][0]["id"], messages[2]["tool_call_id"]]
    assert ids[0] == ids[1] and len(ids[0]) <= 40


# --- streamed ------------------------------------------------------------------------------------


def test_a_stream_failing_over_before_its_first_token_has_the_route_header(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.stream_error(after=0, code=500), times=2)
    raw = gateway.openai().responses.with_raw_response.create(model="resilient", input=ECHO, stream=True)
    events = list(raw.parse())
    check_sequence(events)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == ECHO
    route = route_header(raw)
    assert route["candidate"] == "claude-sonnet" and route["attempts"] == "3"


def test_a_streamed_function_call_after_failover_keeps_one_call_id(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(500, times=2)
    with gateway.openai().responses.stream(model="resilient", input=ASK_TOOL, tools=[LOOKUP]) as stream:  # type: ignore[list-item]
        events = list(stream)
        final = stream.get_final_response()
    check_sequence(events)
    [call] = [item for item in final.output if item.type == "function_call"]
    added = [
        e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"
    ]
    done = [
        e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"
    ]
    assert [i.call_id for i in added] == [i.call_id for i in done] == [call.call_id]
    assert [i.id for i in added] == [i.id for i in done] == [call.id]
    assert json.loads(call.arguments) == {"q": "weir"} and call.status == "completed"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments


def test_a_stream_cut_after_text_resumes_in_the_same_item(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    raw = gateway.openai().responses.with_raw_response.create(
        model="resilient", input=ECHO, instructions="Echo.", max_output_tokens=50, stream=True
    )
    events = list(raw.parse())
    check_sequence(events)
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.completed" and final.output_text == ECHO
    assert kinds(events).count("response.output_item.added") == 1
    assert kinds(events).count("response.content_part.added") == 1
    assert kinds(events).count("response.output_text.done") == 1
    [message] = final.output
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {message.id}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == ECHO
    continuation = fake_anthropic.last_request.json
    assert continuation["messages"][-1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "one two"}],
    }
    assert continuation["max_tokens"] == 48  # what the limit has left after the two words sent
    system = continuation["system"]
    assert (system[0]["text"] if isinstance(system, list) else system) == "Echo."
    settled(gateway, 2)
    assert attempts(gateway) == [("openai", False), ("anthropic", True)]


def test_a_resumed_stream_that_reaches_the_limit_is_incomplete_once(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, "one", " two"
    with gateway.openai().responses.stream(model="resilient", input=ECHO, max_output_tokens=4) as stream:
        events = list(stream)
    check_sequence(events)
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.output_text == "one two three four"
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    [message] = final.output
    assert isinstance(message, ResponseOutputMessage) and message.status == "incomplete"


def test_a_stream_cut_without_resume_ends_failed_never_completed(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    raw = gateway.openai().responses.with_raw_response.create(model="no-resume", input=ECHO, stream=True)
    events = list(raw.parse())
    check_sequence(events)
    assert kinds(events)[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds(events)
    assert not fake_anthropic.requests
    assert route_header(raw)["candidate"] == "gpt-4o-mini"
    failed = events[-1].response  # type: ignore[union-attr]
    [message] = failed.output
    assert isinstance(message, ResponseOutputMessage) and message.status == "incomplete"
    assert failed.output_text == "one two"
    # The item the client saw streaming is closed out with the text it had, as the failure says.
    assert kinds(events).count("response.output_item.added") == 1


def test_a_stream_cut_after_its_answer_ended_fails_without_a_second_answer(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=8))  # role, six words, finish
    with gateway.openai().responses.stream(model="resilient", input=ECHO) as stream:
        events = list(stream)
    check_sequence(events)
    assert kinds(events)[-2:] == ["error", "response.failed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == ECHO
    assert "response.completed" not in kinds(events)
    assert not fake_anthropic.requests


def test_a_gemini_stream_cut_resumes_on_anthropic_in_the_same_item(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_anthropic: FakeAnthropic
) -> None:
    fake_gemini.fail_next(Fault.cut_stream(after=2))
    with gateway.openai().responses.stream(model="gemini-first", input=ECHO, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_sequence(events)
    assert final.output_text == ECHO and final.status == "completed"
    assert [item.type for item in final.output] == ["message"]
    assert final.usage is not None and final.usage.output_tokens == 6
    sent_limit = fake_anthropic.last_request.json["max_tokens"]
    assert sent_limit < 40


def test_a_stream_over_its_first_token_timeout_fails_over_invisibly(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.delay(2.0), times=2)
    raw = gateway.openai().responses.with_raw_response.create(
        model="impatient-route", input=ECHO, stream=True
    )
    events = list(raw.parse())
    check_sequence(events)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == ECHO
    assert route_header(raw)["candidate"] == "claude-sonnet"


def test_a_hedged_stream_is_one_response(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.set_latency(first_token=1.0)
    raw = gateway.openai().responses.with_raw_response.create(model="hedged-sonnet", input=ECHO, stream=True)
    events = list(raw.parse())
    check_sequence(events)
    assert kinds(events).count("response.output_item.added") == 1
    assert events[-1].response.output_text == ECHO  # type: ignore[union-attr]
    assert route_header(raw)["candidate"] == "claude-sonnet"


def loop_input(call: Any, result: str = "a river dam") -> list[Any]:
    return [
        {"role": "user", "content": ASK_TOOL},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_gemini_3_call_goes_back_to_gemini_3_signed_through_the_route(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    client = gateway.openai()
    first: Response
    if stream:
        with client.responses.stream(model="pro-first", input=ASK_TOOL, tools=[LOOKUP]) as s:  # type: ignore[list-item]
            list(s)
            first = s.get_final_response()
    else:
        first = client.responses.create(model="pro-first", input=ASK_TOOL, tools=[LOOKUP])  # type: ignore[list-item]
    [call] = [item for item in first.output if item.type == "function_call"]
    second = client.responses.create(model="pro-first", input=loop_input(call), tools=[LOOKUP])  # type: ignore[list-item]
    # Gemini gets a string result as {"result": ...}, which its fake echoes.
    assert second.output_text.startswith("Tool lookup returned:") and "a river dam" in second.output_text
    assert len(fake_gemini.requests) == 2  # no failover: the signature came back


@pytest.mark.parametrize("first_route", ["resilient", "anthropic-first"])
def test_another_vendors_call_goes_on_to_gemini_3_mid_loop(
    gateway: RunningGateway, fake_gemini: FakeGemini, first_route: str
) -> None:
    client = gateway.openai()
    with client.responses.stream(model=first_route, input=ASK_TOOL, tools=[LOOKUP]) as s:  # type: ignore[list-item]
        list(s)
        first = s.get_final_response()
    [call] = [item for item in first.output if item.type == "function_call"]
    raw = client.responses.with_raw_response.create(model="pro-first", input=loop_input(call), tools=[LOOKUP])  # type: ignore[list-item]
    assert raw.parse().output_text == 'Tool lookup returned: {"result": "a river dam"}'
    assert route_header(raw)["candidate"] == "gemini-pro"


def test_a_gemini_3_call_goes_on_to_anthropic_when_gemini_fails(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_anthropic: FakeAnthropic
) -> None:
    client = gateway.openai()
    first = client.responses.create(model="pro-first", input=ASK_TOOL, tools=[LOOKUP])  # type: ignore[list-item]
    [call] = [item for item in first.output if item.type == "function_call"]
    fake_gemini.fail_next(500, times=2)
    with client.responses.stream(model="pro-first", input=loop_input(call), tools=[LOOKUP]) as s:  # type: ignore[list-item]
        events = list(s)
        second = s.get_final_response()
    check_sequence(events)
    assert second.output_text == "Tool lookup returned: a river dam"
    messages = fake_anthropic.last_request.json["messages"]
    use = messages[1]["content"][0]
    result = messages[2]["content"][0]
    assert use["type"] == "tool_use" and result["type"] == "tool_result"
    assert use["id"] == result["tool_use_id"]


def test_a_stream_cut_after_text_resumed_on_a_reasoning_model_stays_one_message(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_deepseek: FakeOpenAI
) -> None:
    fake_anthropic.fail_next(Fault.cut_stream(after=5))  # its start events, "one", " two"
    with gateway.openai().responses.stream(model="claude-then-reasoner", input=ECHO) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_sequence(events)
    assert fake_deepseek.requests
    assert final.output_text == ECHO and final.status == "completed"
    assert [item.type for item in final.output] == ["message"]
    assert kinds(events).count("response.output_item.added") == 1
