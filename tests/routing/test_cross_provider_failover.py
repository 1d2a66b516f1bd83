"""Failover between OpenAI, Anthropic and Gemini backends as each inbound API's client sees it, with the
official SDKs: the tools, tool choices and schemas a candidate gets when the one before it failed, the
client's own wire format for what the next one answered, Gemini's own signals (finish reasons, blocked
prompts) in each API's terms, and the usage event of every attempt, cached prompt tokens included,
when a stream was cut mid-way and continued elsewhere."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pydantic
import pytest

from gateway.usage import Usage
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.reliability.raw_backend import RawBackend, Send, Sleep, http_head
from tests.routing.routed import FAST, ROUTES, fresh, route_header, routed_config_text, settled

HI: Any = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"
LOOKUP = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
XROUTES = f"""{ROUTES}\
  - {{name: claude-then-gemini, candidates: [{{model: claude-sonnet}}, {{model: gemini-flash}}], {FAST}}}
  - {{name: gemini-then-openai, candidates: [{{model: gemini-flash}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: openai-then-gemini, candidates: [{{model: gpt-4o-mini}}, {{model: gemini-flash}}], {FAST}}}
  - {{name: scripted-gemini, candidates: [{{model: scripted-gemini}}, {{model: claude-sonnet}}], {FAST}}}
"""
# A Gemini backend that answers what a test scripts: the signals the fake does not send (safety
# stops, recitation, blocked prompts, malformed function calls).
SCRIPTED_BACKEND = """\
  - {name: scripted, type: gemini, base_url: "${SCRIPTED_URL}", api_key: unused}
"""
SCRIPTED_MODEL = """\
  - {name: scripted-gemini, backend: scripted, model: gemini-2.5-flash, price: {input: 0.30, cached_input: 0.03, output: 2.50}}
"""
USAGE = {"promptTokenCount": 6, "candidatesTokenCount": 2, "totalTokenCount": 8}


class Script:
    """What the scripted Gemini answers to every generation: a JSON body, or SSE events."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.calls = 0

    def __call__(self, send: Send, sleep: Sleep) -> None:
        with self.lock:
            self.calls += 1
        payloads = self.payloads
        if len(payloads) == 1:  # generateContent; a stream test scripts several events
            send(http_head() + json.dumps(payloads[0]).encode())
            return
        send(http_head(content_type="text/event-stream"))
        for payload in payloads:
            send(b"data: " + json.dumps(payload).encode() + b"\r\n\r\n")


def candidate(parts: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish is not None:
        found["finishReason"] = finish
    return {"candidates": [found], "usageMetadata": USAGE, "modelVersion": "gemini-2.5-flash"}


@pytest.fixture(scope="module")
def _scripted() -> Iterator[tuple[RawBackend, Script]]:
    script = Script()
    with RawBackend(script) as backend:
        yield backend, script


@pytest.fixture(scope="module")
def gateway_config() -> str:
    text = routed_config_text(XROUTES)
    text = text.replace("backends:\n", "backends:\n" + SCRIPTED_BACKEND, 1)
    return text.replace("models:", "models:\n" + SCRIPTED_MODEL.rstrip("\n"), 1)


@pytest.fixture(scope="module")
def gateway_env(_scripted: tuple[RawBackend, Script]) -> dict[str, str]:
    return {"SCRIPTED_URL": _scripted[0].url.removesuffix("/v1")}


@pytest.fixture
def script(_scripted: tuple[RawBackend, Script]) -> Script:
    _scripted[1].reset()
    return _scripted[1]


@pytest.fixture
def gateway(_routed: RunningGateway, script: Script, fresh_fakes: None) -> RunningGateway:
    return fresh(_routed)


def events(gateway: RunningGateway, count: int) -> list[Any]:
    settled(gateway, count)
    return sorted(gateway.sink.events, key=lambda e: e.attempt)


# --- sampling parameters on the next candidate ----------------------------------------------------


def test_an_openai_temperature_above_claudes_range_is_served_by_claude_after_failover(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """OpenAI takes temperature 0..2, Claude 0..1 (the fake refuses above 1, as Anthropic does): the
    fallback Claude is sent its top, 1, and answers, rather than end the failover with a 400 about a
    temperature the route's own model takes."""
    fake_openai.fail_next(500, times=2)
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="resilient", messages=HI, temperature=1.5, max_tokens=20
    )
    assert route_header(raw)["candidate"] == "claude-sonnet"
    assert raw.parse().choices[0].message.content
    assert fake_anthropic.last_request.json["temperature"] == 1.0


# --- tools and tool choices on the next candidate -------------------------------------------------


def test_a_forced_tool_fails_over_to_gemini_as_the_same_forced_tool_in_openais_shape(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    fake_openai.fail_next(500, times=2)
    tools: Any = [
        {"type": "function", "function": {"name": "lookup", "description": "Look up", "parameters": LOOKUP}}
    ]
    forced: Any = {"type": "function", "function": {"name": "lookup"}}
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="openai-then-gemini",
        messages=[{"role": "user", "content": "hello"}],
        tools=tools,
        tool_choice=forced,
    )
    choice = raw.parse().choices[0]
    assert route_header(raw)["candidate"] == "gemini-flash"
    sent = fake_gemini.last_request.json
    assert sent["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["lookup"]}
    }
    assert sent["tools"][0]["functionDeclarations"][0]["parameters"] == LOOKUP
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "lookup" and json.loads(calls[0].function.arguments) == {"q": "example"}


def test_an_anthropic_tool_loop_answered_by_gemini_keeps_its_ids_across_turns(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    """tool_choice any becomes Gemini's ANY; Gemini's call comes back as a tool_use block whose id the
    client sends back with its tool_result, which Gemini then gets as the same function's response."""
    client = gateway.anthropic()
    tools: Any = [{"name": "lookup", "description": "Look up", "input_schema": LOOKUP}]
    fake_anthropic.fail_next(529, times=2)
    asked: Any = [{"role": "user", "content": "hello"}]
    first = client.messages.create(
        model="claude-then-gemini", max_tokens=200, messages=asked, tools=tools, tool_choice={"type": "any"}
    )
    assert fake_gemini.last_request.json["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "lookup" and call.input == {"q": "example"}
    fake_anthropic.fail_next(529, times=2)
    turn: Any = [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}]
    history: Any = [*asked, {"role": "assistant", "content": [b.model_dump() for b in first.content]}]
    second = client.messages.create(
        model="claude-then-gemini",
        max_tokens=200,
        messages=[*history, {"role": "user", "content": turn}],
        tools=tools,
    )
    contents = fake_gemini.last_request.json["contents"]
    assert contents[1] == {
        "role": "model",
        "parts": [{"functionCall": {"name": "lookup", "args": {"q": "example"}}}],
    }
    assert contents[2]["parts"] == [{"functionResponse": {"name": "lookup", "response": {"result": 42}}}]
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"


def test_a_tool_parameter_named_strict_survives_failover_to_gemini(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    """Gemini's schema subset has no `strict` or `additionalProperties` keyword; a *parameter* may be
    called so all the same. Left out of `properties` (while `required` still named it), the call came
    back without it."""
    schema = {
        "type": "object",
        "properties": {"url": {"type": "string"}, "strict": {"type": "boolean"}},
        "required": ["url", "strict"],
        "additionalProperties": False,
    }
    tools: Any = [{"type": "function", "function": {"name": "fetch", "parameters": schema, "strict": True}}]
    fake_openai.fail_next(500, times=2)
    reply = gateway.openai().chat.completions.create(
        model="openai-then-gemini", messages=[{"role": "user", "content": "call fetch"}], tools=tools
    )
    sent = fake_gemini.last_request.json["tools"][0]["functionDeclarations"][0]["parameters"]
    assert sent == {k: v for k, v in schema.items() if k != "additionalProperties"}
    (call,) = reply.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments).keys() == {"url", "strict"}  # type: ignore[union-attr]


class City(pydantic.BaseModel):
    name: str


class Person(pydantic.BaseModel):
    name: str
    home: City
    visited: list[City]


def test_a_nested_pydantic_response_format_parses_after_failover_to_gemini(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_gemini: FakeGemini
) -> None:
    """The OpenAI SDK's `parse` sends nested models as `$defs` and `$ref`s. Gemini has no `$defs`: they
    were dropped and the references left dangling, so Gemini's answer had a string for each nested
    object and the SDK's validation failed."""
    fake_openai.fail_next(500, times=2)
    reply = gateway.openai().chat.completions.parse(
        model="openai-then-gemini", messages=HI, response_format=Person
    )
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.home, City) and person.visited
    schema = json.dumps(fake_gemini.last_request.json["generationConfig"]["responseSchema"])
    assert "$ref" not in schema and "$defs" not in schema and "additionalProperties" not in schema


# --- usage of a cut attempt ------------------------------------------------------------------------


def test_an_anthropic_stream_cut_mid_way_bills_the_cache_reads_and_writes_it_reported(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_openai: FakeOpenAI
) -> None:
    """Anthropic counts the prompt, cache reads and writes apart, in message_start. A stream cut after it
    and continued on OpenAI was billed a prompt estimated from the body's size, all of it at the full
    input price, the cache reads (a tenth of it) and writes (1.25 times) unseen."""
    fake_anthropic.set_next_usage(input_tokens=100, cached_input_tokens=5000, cache_write_5m_tokens=300)
    fake_anthropic.fail_next(Fault.cut_stream(after=6))
    with gateway.anthropic().messages.stream(model="anthropic-first", max_tokens=100, messages=HI) as stream:
        assert stream.get_final_text() == ECHO
    cut, answered = events(gateway, 2)
    assert (cut.backend, cut.status, cut.estimated) == ("anthropic", 502, True)
    assert (cut.usage.input_tokens, cut.usage.cached_input_tokens, cut.usage.cache_write_5m_tokens) == (
        100,
        5000,
        300,
    )
    assert cut.usage.output_tokens >= 2
    assert answered.backend == "openai" and answered.ok and not answered.estimated


def test_a_gemini_stream_cut_mid_way_bills_its_cached_prompt_as_reported(
    gateway: RunningGateway, fake_gemini: FakeGemini, fake_openai: FakeOpenAI
) -> None:
    """Every Gemini stream event carries the usage so far, cachedContentTokenCount included."""
    fake_gemini.set_next_usage(input_tokens=100, cached_input_tokens=5000)
    fake_gemini.fail_next(Fault.cut_stream(after=3))
    stream = gateway.openai().chat.completions.create(
        model="gemini-then-openai", messages=HI, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ECHO
    cut, answered = events(gateway, 2)
    assert (cut.backend, cut.estimated) == ("gemini", True)
    assert (cut.usage.input_tokens, cut.usage.cached_input_tokens) == (100, 5000)
    assert cut.usage.output_tokens >= 3
    assert answered.backend == "openai" and answered.ok and not answered.estimated


# --- Gemini's own signals, in each API's terms ------------------------------------------------------


@pytest.mark.parametrize("finish", ["SAFETY", "RECITATION"])
def test_a_gemini_safety_or_recitation_stop_is_each_apis_content_filter(
    gateway: RunningGateway, script: Script, finish: str
) -> None:
    """Not a failure to fail over from: the answer Gemini gave, stopped by its filter."""
    script.payloads = [candidate([], finish)]
    chat = gateway.openai().chat.completions.create(model="scripted-gemini", messages=HI)
    assert chat.choices[0].finish_reason == "content_filter" and chat.choices[0].message.content is None
    script.payloads = [candidate([], finish)]
    message = gateway.anthropic().messages.create(model="scripted-gemini", max_tokens=100, messages=HI)
    assert message.stop_reason == "refusal" and message.content == []
    script.payloads = [candidate([{"text": "one "}]), candidate([{"text": "two"}]), candidate([], finish)]
    with gateway.anthropic().messages.stream(model="scripted-gemini", max_tokens=100, messages=HI) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "refusal" and [b.text for b in streamed.content if b.type == "text"] == [
        "one two"
    ]
    script.payloads = [candidate([{"text": "one two"}], finish)]
    response = gateway.openai().responses.create(model="scripted-gemini", input="hi")
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "content_filter" and response.output_text == "one two"
    assert script.calls == 4 and not gateway.sink.events[-1].fallback


@pytest.mark.parametrize("finish", ["LANGUAGE", "IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION"])
def test_gemini_stops_of_its_filters_beyond_safety_are_each_apis_content_filter(
    gateway: RunningGateway, fake_gemini: FakeGemini, finish: str
) -> None:
    """Gemini's other filter stops (a language it does not serve, an image's prohibited content or
    recitation) reached clients as `stop`/`end_turn`: an answer cut by the filter read as complete."""
    fake_gemini.stop_next_with(finish)
    chat = gateway.openai().chat.completions.create(model="gemini-flash", messages=HI)
    assert chat.choices[0].finish_reason == "content_filter" and chat.choices[0].message.content == ECHO
    fake_gemini.stop_next_with(finish)
    with gateway.anthropic().messages.stream(model="gemini-flash", max_tokens=100, messages=HI) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "refusal"


@pytest.mark.parametrize("finish", ["TOO_MANY_TOOL_CALLS", "MALFORMED_RESPONSE", "MISSING_THOUGHT_SIGNATURE"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_gemini_finish_that_says_it_failed_fails_over_instead_of_ending_the_answer(
    gateway: RunningGateway, fake_gemini: FakeGemini, finish: str, stream: bool
) -> None:
    """Gemini's finishes for an answer it could not give (more tool calls than it allows, a response
    it could not form, a thought signature missing from the request) reached the client as the
    model's `stop`, with whatever half-answer came before: as MALFORMED_FUNCTION_CALL, the backend's
    failure, which the next candidate answers."""
    for _ in range(2):  # the attempt and its retry in place, as for any 502
        fake_gemini.stop_next_with(finish)
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="gemini-then-openai", messages=HI, stream=stream
    )
    if stream:
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        chat = raw.parse()
        text, finishes = chat.choices[0].message.content or "", [chat.choices[0].finish_reason]
    assert text == ECHO and finishes == ["stop"]
    attempts = events(gateway, 2 if stream else 3)  # a stream goes on elsewhere from where it broke
    assert (attempts[0].backend, attempts[0].status) == ("gemini", 502)
    assert (attempts[-1].backend, attempts[-1].status) == ("openai", 200)


@pytest.mark.parametrize("finish", ["OTHER", "NO_IMAGE"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_gemini_stop_for_no_named_reason_before_any_answer_fails_over_and_is_billed(
    gateway: RunningGateway, fake_gemini: FakeGemini, finish: str, stream: bool
) -> None:
    """OTHER is Google's "Unknown reason." (NO_IMAGE: an image expected, none made): with no text and
    no tool call before it, it reached the client as an empty `stop` answer. It is an answer Gemini
    failed to give, as MALFORMED_RESPONSE is: the backend's 502, failed over, billed what Gemini
    reported."""
    for _ in range(2):  # the attempt and its retry in place, as for any 502
        fake_gemini.stop_next_with(finish, empty=True)
    chat = gateway.openai().chat.completions.create(model="gemini-then-openai", messages=HI, stream=stream)
    if stream:
        chunks = list(chat)  # type: ignore[arg-type]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = chat.choices[0].message.content or ""  # type: ignore[union-attr]
    assert text == ECHO
    attempts = events(gateway, 3)
    assert [(a.backend, a.status) for a in attempts] == [("gemini", 502), ("gemini", 502), ("openai", 200)]
    reported = fake_gemini.usages[:2]
    assert [a.usage for a in attempts[:2]] == [
        Usage(input_tokens=r.input_tokens, output_tokens=r.output_tokens) for r in reported
    ]
    assert all(a.usage != Usage() and a.cost_pico_usd > 0 and not a.estimated for a in attempts[:2])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_gemini_stop_without_any_answer_fails_over_and_is_billed(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    """Gemini (2.5 Flash-Lite and Pro, mostly deep in tool loops) now and then says STOP before any text
    or function call: a candidate without parts. It reached the client as an empty answer it could
    not tell from a real one; asked again, Gemini answers. It is the backend's 502, failed over (after
    its retry in place, as any 502), each attempt billed what Gemini reported."""
    for _ in range(2):
        fake_gemini.stop_next_with("STOP", empty=True)
    chat = gateway.openai().chat.completions.create(model="gemini-then-openai", messages=HI, stream=stream)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)  # type: ignore[union-attr]
    else:
        text = chat.choices[0].message.content or ""  # type: ignore[union-attr]
    assert text == ECHO
    attempts = events(gateway, 3)
    assert [(a.backend, a.status) for a in attempts] == [("gemini", 502), ("gemini", 502), ("openai", 200)]
    assert all(a.usage != Usage() and a.cost_pico_usd > 0 for a in attempts[:2])


def test_a_gemini_stop_with_an_empty_text_fails_over_for_an_anthropic_client(
    gateway: RunningGateway, script: Script, fake_anthropic: FakeAnthropic
) -> None:
    """The other shape of it: one text part, empty. Claude answers the Anthropic client instead."""
    script.payloads = [candidate([{"text": ""}], "STOP")]
    message = gateway.anthropic().messages.create(model="scripted-gemini", max_tokens=100, messages=HI)
    assert message.content[0].type == "text" and message.content[0].text == ECHO
    assert [(a.backend, a.status) for a in events(gateway, 3)][-1] == ("anthropic", 200)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_empty_gemini_stop_is_the_answer_where_a_stop_sequence_may_end_it_at_once(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    """Gemini says STOP for a stop sequence too: one the answer begins with leaves it empty, and
    that is the answer, not a failure to fail over from."""
    fake_gemini.stop_next_with("STOP", empty=True)
    chat = gateway.openai().chat.completions.create(
        model="gemini-then-openai", messages=HI, stream=stream, stop=["one"]
    )
    if stream:
        chunks = list(chat)  # type: ignore[arg-type]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        text, finishes = chat.choices[0].message.content or "", [chat.choices[0].finish_reason]  # type: ignore[union-attr]
    assert (text, finishes) == ("", ["stop"])
    assert [(a.backend, a.status) for a in events(gateway, 1)] == [("gemini", 200)]


def test_an_empty_gemini_stop_beside_stop_sequences_is_the_answer_to_a_completion_too(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """A completion is asked of Gemini as a chat (legacy prompts often stop at a newline): read as
    a chat answer to that request, its stop sequences count as they do for a chat."""
    fake_gemini.stop_next_with("STOP", empty=True)
    completion = gateway.openai().completions.create(model="gemini-then-openai", prompt=ECHO, stop=["\n"])
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == ("", "stop")
    assert [(a.backend, a.status) for a in events(gateway, 1)] == [("gemini", 200)]


def test_an_empty_gemini_stop_is_the_answer_to_continuing_an_answer_that_was_whole(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Asked to go on from a final assistant message (`continue_final_message`, an Anthropic prefill,
    a stream continued after a failover) that was whole already, Gemini adds nothing: the answer."""
    whole = [*HI, {"role": "assistant", "content": ECHO}]
    chat = gateway.openai().chat.completions.create(
        model="gemini-then-openai", messages=whole, extra_body={"continue_final_message": True}
    )
    assert (chat.choices[0].message.content or "", chat.choices[0].finish_reason) == ("", "stop")
    assert [(a.backend, a.status) for a in events(gateway, 1)] == [("gemini", 200)]
    assert fake_gemini.last_request.json["contents"][-1]["role"] == "model"  # continued, not asked anew


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_gemini_stop_for_no_named_reason_after_its_text_is_the_answers_stop(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    """After some of the answer, OTHER ends it: the client keeps the text that came, finished."""
    fake_gemini.stop_next_with("OTHER")
    chat = gateway.openai().chat.completions.create(model="gemini-then-openai", messages=HI, stream=stream)
    if stream:
        chunks = list(chat)  # type: ignore[arg-type]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        text, finishes = chat.choices[0].message.content or "", [chat.choices[0].finish_reason]  # type: ignore[union-attr]
    assert (text, finishes) == (ECHO, ["stop"])
    assert [(a.backend, a.status) for a in events(gateway, 1)] == [("gemini", 200)]


def streamed_choices(chunks: list[Any]) -> tuple[dict[int, str], list[tuple[int, str]]]:
    """Each choice's text, and the (choice, finish_reason) pairs in the order they came."""
    texts: dict[int, str] = {}
    finishes: list[tuple[int, str]] = []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes.append((choice.index, choice.finish_reason))
    return texts, finishes


def test_gemini_candidates_stream_interleaved_and_each_finishes_on_its_own(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """With candidateCount 3 Gemini streams the candidates interleaved, each finishing in an event of
    its own: every choice reaches the client whole, with one finish of its own."""
    stream = gateway.openai().chat.completions.create(model="gemini-flash", messages=HI, n=3, stream=True)
    chunks = list(stream)
    texts, finishes = streamed_choices(chunks)
    assert texts == {0: ECHO, 1: ECHO, 2: ECHO} and finishes == [(0, "stop"), (1, "stop"), (2, "stop")]
    first_done = next(i for i, c in enumerate(chunks) if any(ch.finish_reason for ch in c.choices))
    assert any(ch.index == 2 and ch.delta.content for c in chunks[first_done + 1 :] for ch in c.choices)
    (attempt,) = events(gateway, 1)
    assert attempt.status == 200 and attempt.usage.output_tokens == fake_gemini.last_usage.output_tokens


def test_a_gemini_stream_that_ends_before_every_candidate_finished_is_no_whole_answer(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """The stream counted as finished once any candidate finished: one that ended (in good order)
    after the first candidate's finish, the second still going, reached the client as complete, its
    second choice cut short without a word, and was recorded as a whole answer. It is a stream that
    ended early, as one without any finishReason is: an error the client is told of."""
    fake_gemini.fail_next(Fault.end_stream(after=len(ECHO.split())))  # up to the first candidate's finish
    stream = gateway.openai().chat.completions.create(model="gemini-flash", messages=HI, n=2, stream=True)
    chunks: list[Any] = []
    with pytest.raises(openai.APIError, match="finishReason"):
        chunks.extend(stream)
    texts, finishes = streamed_choices(chunks)
    assert texts[0] == ECHO and finishes == [(0, "stop")] and texts[1] != ECHO
    (attempt,) = events(gateway, 1)
    assert attempt.status == 502


def test_a_blocked_prompt_is_the_clients_400_in_its_own_shape_and_not_failed_over(
    gateway: RunningGateway, script: Script, fake_anthropic: FakeAnthropic
) -> None:
    script.payloads = [{"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": USAGE}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        gateway.anthropic().messages.create(model="scripted-gemini", max_tokens=100, messages=HI)
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "SAFETY" in refused.value.message and not fake_anthropic.requests


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_blocked_gemini_prompt_is_billed_the_prompt_gemini_reported(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    """Gemini answers a blocked prompt with a 200 whose usage counts the prompt, and bills it (only a
    4xx or 5xx is free). The client's 400 recorded nothing: a tenant's blocked prompts cost its
    budget nothing, and the ledger fell short of Google's bill."""
    fake_gemini.block_next("PROHIBITED_CONTENT")
    with pytest.raises(openai.BadRequestError) as refused:
        gateway.openai().chat.completions.create(model="gemini-flash", messages=HI, stream=stream)
    assert refused.value.code == "content_filter" and "PROHIBITED_CONTENT" in refused.value.message
    (attempt,) = events(gateway, 1)
    assert (attempt.status, attempt.estimated) == (400, False)
    assert attempt.usage == Usage(input_tokens=fake_gemini.last_usage.input_tokens) != Usage()
    assert attempt.cost_pico_usd > 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_gemini_answer_it_failed_to_give_is_billed_what_gemini_reported(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    """A failed finish (here after thinking, which Gemini bills as output) is the backend's 502 and
    fails over, but Gemini billed the answer: each such attempt was recorded at nothing (a JSON
    answer) or at an estimate of its text alone, its thoughts left out (a stream)."""
    for _ in range(2):  # the attempt and its retry in place, as for any 502
        fake_gemini.stop_next_with("MALFORMED_FUNCTION_CALL")
    chat = gateway.openai().chat.completions.create(
        model="gemini-then-openai", messages=HI, stream=stream, reasoning_effort="low"
    )
    if stream:
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == ECHO  # type: ignore[union-attr]
    attempts = events(gateway, 2 if stream else 3)
    failed = [a for a in attempts if a.backend == "gemini"]
    assert [a.status for a in failed] == [502] * len(failed)
    reported = fake_gemini.usages[: len(failed)]
    assert [a.usage for a in failed] == [
        Usage(input_tokens=r.input_tokens, output_tokens=r.output_tokens, reasoning_tokens=r.reasoning_tokens)
        for r in reported
    ]
    assert all(a.usage.reasoning_tokens > 0 and not a.estimated for a in failed)


@pytest.mark.parametrize(
    "answer",
    [{"candidates": [], "usageMetadata": USAGE}, candidate([], "MALFORMED_FUNCTION_CALL")],
    ids=["no-candidates", "malformed-function-call"],
)
def test_a_gemini_answer_without_an_answer_fails_over_instead_of_reaching_the_client_empty(
    gateway: RunningGateway, script: Script, answer: dict[str, Any]
) -> None:
    """Neither an answer nor a blocked prompt, or a function call Gemini could not write: an OpenAI
    client got `choices: []` or an empty `stop`, an Anthropic client an empty `end_turn`, and the
    route's next candidate was never asked."""
    script.payloads = [answer]
    tools: Any = [{"name": "lookup", "input_schema": LOOKUP}]
    raw = gateway.anthropic().messages.with_raw_response.create(
        model="scripted-gemini", max_tokens=100, messages=HI, tools=tools
    )
    message = raw.parse()
    assert route_header(raw)["candidate"] == "claude-sonnet" and message.content
    assert script.calls == 2  # retried in place once, as any 502
    assert [(e.backend, e.status) for e in events(gateway, 3)] == [
        ("scripted", 502),
        ("scripted", 502),
        ("anthropic", 200),
    ]


def test_a_gemini_stream_whose_function_call_failed_after_its_text_continues_on_the_next_candidate(
    gateway: RunningGateway, script: Script
) -> None:
    script.payloads = [candidate([{"text": "one two "}]), candidate([], "MALFORMED_FUNCTION_CALL")]
    stream = gateway.openai().chat.completions.create(model="scripted-gemini", messages=HI, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ECHO
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]


# --- stop sequences -------------------------------------------------------------------------------


def test_an_anthropic_clients_five_stop_sequences_pass_openai_over_for_claude(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """OpenAI takes at most 4 stop sequences; an Anthropic client's five cannot go to gpt-4o-mini, so
    `resilient` passes it over unsent (as Claude is passed over for `n` > 1) and Claude answers."""
    stops = ["AAA", "BBB", "CCC", "DDD", "EEE"]
    raw = gateway.anthropic().messages.with_raw_response.create(
        model="resilient", max_tokens=20, messages=HI, stop_sequences=stops
    )
    assert route_header(raw)["candidate"] == "claude-sonnet"
    assert not fake_openai.requests
    assert fake_anthropic.last_request.json["stop_sequences"] == stops


def test_an_anthropic_client_is_told_which_stop_sequence_ended_the_answer(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """Anthropic says `stop_reason: stop_sequence` and which one; the gateway said `end_turn` and
    `null`, even when Claude itself answered. (OpenAI and Gemini do not say: `end_turn` from them.)"""
    ask: Any = [{"role": "user", "content": "one two three four"}]
    client = gateway.anthropic()
    fake_openai.fail_next(500, times=2)  # `resilient`: OpenAI first, then Claude
    message = client.messages.create(
        model="resilient", max_tokens=100, messages=ask, stop_sequences=["three"]
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "three")
    assert [b.text for b in message.content if b.type == "text"] == ["one two "]
    with client.messages.stream(
        model="anthropic-first", max_tokens=100, messages=ask, stop_sequences=["four", "three"]
    ) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "three")
    other = client.messages.create(
        model="gpt-4o-mini", max_tokens=100, messages=ask, stop_sequences=["three"]
    )
    assert (other.stop_reason, other.stop_sequence) == ("end_turn", None)
    chat = gateway.openai().chat.completions.create(model="claude-sonnet", messages=ask, stop=["three"])
    assert chat.choices[0].finish_reason == "stop" and "stop_sequence" not in chat.choices[0].model_dump()
