"""Tool call ids across vendors: Gemini 3's thought signatures ride in the ids Weir hands out and go
back to Gemini with the calls; ids from one vendor reach another in a shape it accepts (OpenAI: at most
40 characters; Anthropic: [a-zA-Z0-9_-]). The fakes refuse what the vendors refuse."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from gateway.providers import gemini
from gateway.providers.base import call_id_with_signature, split_call_id, upstream_call_id
from gateway.types import ChatRequest
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = {"role": "user", "content": 'call get_weather {"city": "Paris"}'}


def _first_turn(gateway: RunningGateway, model: str = "gemini-pro") -> dict[str, Any]:
    """The assistant message of a tool call, as the OpenAI SDK hands it back for the next request."""
    reply = gateway.openai().chat.completions.create(model=model, messages=[ASK], tools=[WEATHER])
    assert reply.choices[0].finish_reason == "tool_calls"
    return reply.choices[0].message.model_dump(exclude_none=True)


def _tool_loop(call: dict[str, Any], result: str = '{"temp": 21}') -> list[dict[str, Any]]:
    tool_id = call["tool_calls"][0]["id"]
    return [ASK, call, {"role": "tool", "tool_call_id": tool_id, "content": result}]


def test_gemini_3_signature_goes_round_trip(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    call = _first_turn(gateway)
    [issued] = fake_gemini.signatures
    tool_id = call["tool_calls"][0]["id"]
    assert split_call_id(tool_id) == (tool_id.split("__ts_")[0], issued)
    assert all(c.isalnum() or c in "_-" for c in tool_id)  # Anthropic-safe as handed out

    second = gateway.openai().chat.completions.create(
        model="gemini-pro", messages=_tool_loop(call), tools=[WEATHER]
    )
    assert second.choices[0].message.content == 'Tool get_weather returned: {"temp": 21}'
    contents = fake_gemini.last_request.json["contents"]
    [part] = contents[1]["parts"]
    assert part == {
        "functionCall": {"name": "get_weather", "args": {"city": "Paris"}, "id": part["functionCall"]["id"]},
        "thoughtSignature": issued,
    }
    assert contents[2]["parts"][0]["functionResponse"]["id"] == part["functionCall"]["id"]


def test_gemini_3_signature_from_a_stream(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    stream = gateway.openai().chat.completions.create(
        model="gemini-pro", messages=[ASK], tools=[WEATHER], stream=True
    )
    deltas = [c.choices[0].delta for c in stream if c.choices and c.choices[0].delta.tool_calls]
    tool_id = deltas[0].tool_calls[0].id
    assert tool_id is not None and split_call_id(tool_id)[1] in fake_gemini.signatures
    call = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": tool_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": deltas[0].tool_calls[0].function.arguments},
            }
        ],
    }
    second = gateway.openai().chat.completions.create(
        model="gemini-pro", messages=_tool_loop(call), tools=[WEATHER]
    )
    assert second.choices[0].message.content.startswith("Tool get_weather returned")


def test_gemini_3_anthropic_client_tool_loop(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    client = gateway.anthropic()
    ask = {"role": "user", "content": ASK["content"]}
    first = client.messages.create(model="gemini-pro", max_tokens=200, messages=[ask], tools=[tool])
    use = next(b for b in first.content if b.type == "tool_use")
    assert split_call_id(use.id)[1] in fake_gemini.signatures
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    second = client.messages.create(
        model="gemini-pro",
        max_tokens=200,
        tools=[tool],
        messages=[
            ask,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ],
    )
    assert second.content[0].text.startswith("Tool get_weather returned")


def _parallel_calls(stream: bool, gateway: RunningGateway) -> dict[str, Any]:
    """The assistant message of two parallel calls to one function, as the client keeps it."""
    if not stream:
        return _first_turn(gateway)
    chunks = gateway.openai().chat.completions.create(
        model="gemini-pro", messages=[ASK], tools=[WEATHER], stream=True
    )
    calls = [
        {"id": call.id, "type": "function", "function": call.function.model_dump()}
        for chunk in chunks
        if chunk.choices and chunk.choices[0].delta.tool_calls
        for call in chunk.choices[0].delta.tool_calls
    ]
    return {"role": "assistant", "tool_calls": calls}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_gemini_call_ids_go_back_with_the_calls_and_their_results(
    gateway: RunningGateway, fake_gemini: FakeGemini, stream: bool
) -> None:
    """Gemini 3 gives each function call an id and matches each functionResponse to its call by it:
    two parallel calls to one function are told apart by their ids alone. Each id goes back on its
    call and on the result that answers it (Weir sent neither, and results were matched by name)."""
    fake_gemini.call_in_parallel(2)
    call = _parallel_calls(stream, gateway)
    tool_ids = [tool_call["id"] for tool_call in call["tool_calls"]]
    assert len(set(tool_ids)) == 2
    results = [
        {"role": "tool", "tool_call_id": tool_id, "content": f'{{"n": {k}}}'}
        for k, tool_id in enumerate(tool_ids)
    ]
    second = gateway.openai().chat.completions.create(
        model="gemini-pro", messages=[ASK, call, *results], tools=[WEATHER]
    )
    assert second.choices[0].message.content == 'Tool get_weather returned: {"n": 1}'
    contents = fake_gemini.last_request.json["contents"]
    issued = [part["functionCall"].get("id") for part in contents[1]["parts"]]
    answered = [part["functionResponse"].get("id") for part in contents[2]["parts"]]
    assert issued == answered == fake_gemini.call_ids[-2:]


def test_gemini_call_ids_round_trip_for_an_anthropic_client(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    client = gateway.anthropic()
    ask = {"role": "user", "content": ASK["content"]}
    first = client.messages.create(model="gemini-pro", max_tokens=200, messages=[ask], tools=[tool])
    issued = fake_gemini.call_ids[-1]
    use = next(b for b in first.content if b.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    client.messages.create(
        model="gemini-pro",
        max_tokens=200,
        tools=[tool],
        messages=[
            ask,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ],
    )
    contents = fake_gemini.last_request.json["contents"]
    assert contents[1]["parts"][-1]["functionCall"]["id"] == issued
    assert contents[2]["parts"][0]["functionResponse"]["id"] == issued


def test_ids_gemini_did_not_issue_are_not_sent_as_its_own(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Another vendor's ids, and those Weir makes for calls Gemini 2 gives without one, stay Weir's:
    sent as Gemini's, a result's id would name a call Gemini never made."""
    for first, then in (("gpt-4o-mini", "gemini-pro"), ("gemini-flash", "gemini-flash")):
        call = _first_turn(gateway, first)
        gateway.openai().chat.completions.create(model=then, messages=_tool_loop(call), tools=[WEATHER])
        sent = json.dumps(fake_gemini.last_request.json["contents"])
        assert '"id"' not in sent, (first, sent)


def test_gemini_3_refuses_what_weir_does_not_repair(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    """The fake holds Gemini 3 to its rule: a made-up signature is refused, and Weir passes the
    client's id through as it is (it cannot tell a damaged signature from a real one)."""
    call = _first_turn(gateway)
    tool_id = call["tool_calls"][0]["id"]
    base = tool_id.split("__ts_")[0]
    call["tool_calls"][0]["id"] = call_id_with_signature(base, "AAAA" + split_call_id(tool_id)[1][4:])
    with pytest.raises(Exception, match="Corrupted thought signature"):
        gateway.openai().chat.completions.create(
            model="gemini-pro", messages=_tool_loop(call), tools=[WEATHER]
        )


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet"])
def test_calls_without_a_signature_reach_gemini_3(
    gateway: RunningGateway, fake_gemini: FakeGemini, model: str
) -> None:
    """A conversation begun on another vendor (or by a client that shortened the ids) continues on
    Gemini 3: the calls Weir has no signature for get Google's documented stand-in."""
    call = _first_turn(gateway, model)
    assert "__ts_" not in call["tool_calls"][0]["id"]
    second = gateway.openai().chat.completions.create(
        model="gemini-pro", messages=_tool_loop(call), tools=[WEATHER]
    )
    assert second.choices[0].message.content.startswith("Tool get_weather returned")
    parts = fake_gemini.last_request.json["contents"][1]["parts"]
    call_part = next(part for part in parts if "functionCall" in part)  # Claude writes a text first
    assert call_part["thoughtSignature"] == gemini.UNSIGNED


def test_gemini_2_is_sent_no_stand_in(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    call = _first_turn(gateway, "gpt-4o-mini")
    gateway.openai().chat.completions.create(model="gemini-flash", messages=_tool_loop(call), tools=[WEATHER])
    assert "thoughtSignature" not in json.dumps(fake_gemini.last_request.json)


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet"])
def test_gemini_ids_move_to_other_vendors(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, model: str
) -> None:
    """A tool loop begun on Gemini 3 continues on OpenAI or Claude (a fallback, a model switch): the
    signature stays behind, and the id each vendor sees for the call matches its tool result."""
    call = _first_turn(gateway)
    assert len(call["tool_calls"][0]["id"]) > 40
    second = gateway.openai().chat.completions.create(model=model, messages=_tool_loop(call), tools=[WEATHER])
    assert "get_weather returned" in (second.choices[0].message.content or "")
    sent = (fake_openai if model == "gpt-4o-mini" else fake_anthropic).last_request.json
    assert "__ts_" not in json.dumps(sent)


def test_long_and_odd_ids_are_fitted_per_vendor(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """Ids other vendors or frameworks make (Responses' 53-character fc_ ids, Kimi's
    functions.name:0) reach OpenAI within 40 characters and Claude within its alphabet, paired."""
    for odd in ("fc_" + "0f0e50a1476a6c35006912c58dc9f8819192c25864eb16f07f", "functions.get_weather:0"):
        call = {
            "role": "assistant",
            "tool_calls": [
                {"id": odd, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        }
        for model in ("gpt-4o-mini", "claude-sonnet"):
            reply = gateway.openai().chat.completions.create(
                model=model, messages=_tool_loop(call), tools=[WEATHER]
            )
            assert "get_weather returned" in (reply.choices[0].message.content or "")
        sent = fake_openai.last_request.json["messages"]
        assert sent[1]["tool_calls"][0]["id"] == sent[2]["tool_call_id"] == upstream_call_id(odd, 40)
    # what fits is passed as it is: OpenAI takes Kimi's id, only Claude needs it replaced
    assert fake_openai.last_request.json["messages"][1]["tool_calls"][0]["id"] == "functions.get_weather:0"


def test_upstream_call_id() -> None:
    assert upstream_call_id("call_abc", 40) == "call_abc"
    assert upstream_call_id("toolu_01ABC-def_9", anthropic=True) == "toolu_01ABC-def_9"
    long = "x" * 41
    fitted = upstream_call_id(long, 40)
    assert len(fitted) <= 40 and fitted == upstream_call_id(long, 40) != upstream_call_id("y" * 41, 40)
    assert upstream_call_id("a.b:0", anthropic=True).startswith("call_")
    signed = call_id_with_signature("call_1", "ab+/cd==")
    assert signed == "call_1__ts_ab-_cd" and split_call_id(signed) == ("call_1", "ab+/cd==")
    assert upstream_call_id(signed, 40) == "call_1" == upstream_call_id(signed, anthropic=True)
    assert split_call_id("call_1") == ("call_1", None)


def test_stand_in_only_for_the_current_turn() -> None:
    """Gemini 3 checks the function calls since the last user text; earlier steps are left alone."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = msgspec.convert(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "first"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
                {"role": "assistant", "content": "done"},
                {"role": "user", "content": "again"},
                {"role": "assistant", "tool_calls": [{**call, "id": "c2"}, {**call, "id": "c3"}]},
                {"role": "tool", "tool_call_id": "c2", "content": "2"},
                {"role": "tool", "tool_call_id": "c3", "content": "3"},
            ],
        },
        ChatRequest,
    )
    contents = gemini.chat_body(request, "gemini-3-flash-preview")["contents"]
    signed = [
        [part.get("thoughtSignature") for part in content["parts"] if "functionCall" in part]
        for content in contents
        if content["role"] == "model"
    ]
    assert signed == [[None], [], [gemini.UNSIGNED, None]]
    assert "thoughtSignature" not in json.dumps(gemini.chat_body(request, "gemini-2.5-pro"))
