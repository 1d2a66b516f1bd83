"""`tool_choice: {"type": "allowed_tools", ...}` (chat) and its Responses form: the model may call only
the listed tools. Weir resolves it into that subset of `tools` and the mode, which every backend takes."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway


def _tool(name: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }


TOOLS = [_tool("get_weather"), _tool("get_time"), _tool("book_flight")]
ASK = [{"role": "user", "content": "What now?"}]


def _allowed(mode: str, *names: str) -> dict:
    return {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": mode,
            "tools": [{"type": "function", "function": {"name": n}} for n in names],
        },
    }


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet", "gemini-flash"])
def test_only_the_allowed_tools_reach_the_backend(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    model: str,
) -> None:
    reply = gateway.openai().chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=_allowed("required", "get_time", "unknown")
    )
    assert [call.function.name for call in reply.choices[0].message.tool_calls or ()] == ["get_time"]
    if model == "gpt-4o-mini":
        sent = fake_openai.last_request.json
        assert [t["function"]["name"] for t in sent["tools"]] == ["get_time"]
        assert sent["tool_choice"] == "required"
    elif model == "claude-sonnet":
        sent = fake_anthropic.last_request.json
        assert [t["name"] for t in sent["tools"]] == ["get_time"] and sent["tool_choice"] == {"type": "any"}
    else:
        sent = fake_gemini.last_request.json
        assert [d["name"] for d in sent["tools"][0]["functionDeclarations"]] == ["get_time"]
        assert sent["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}


def test_auto_mode_lets_the_model_answer_in_text(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    reply = gateway.openai().chat.completions.create(
        model="gpt-4o-mini",
        messages=ASK,
        tools=TOOLS,
        tool_choice=_allowed("auto", "get_weather", "get_time"),
    )
    assert reply.choices[0].message.content == "What now?"
    sent = fake_openai.last_request.json
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather", "get_time"]
    assert sent["tool_choice"] == "auto"


@pytest.mark.parametrize(
    "choice",
    [
        _allowed("required", "unknown"),  # names no function of tools
        _allowed("none", "get_time"),  # not a mode allowed_tools has
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "web_search"}]}},
    ],
)
def test_bad_allowed_tools_is_a_400_that_changes_nothing(
    gateway: RunningGateway, fake_openai: FakeOpenAI, choice: dict
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(
            model="gpt-4o-mini", messages=ASK, tools=TOOLS, tool_choice=choice
        )
    assert "tool_choice" in caught.value.message
    assert fake_openai.requests == [] and gateway.sink.events == []


def test_responses_allowed_tools(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    tools = [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
        for t in TOOLS
    ]
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "book_flight"}],
    }
    response = gateway.openai().responses.create(
        model="gemini-flash", input="Fly me", tools=tools, tool_choice=choice
    )
    assert [item.name for item in response.output if item.type == "function_call"] == ["book_flight"]
    assert response.tool_choice.type == "allowed_tools"  # echoed as sent
    declarations = fake_gemini.last_request.json["tools"][0]["functionDeclarations"]
    assert [d["name"] for d in declarations] == ["book_flight"]

    for bad, param in (
        ({**choice, "tools": [{"type": "web_search"}]}, "tool_choice.tools[0].type"),
        ({**choice, "tools": [{"type": "function", "name": "nothing"}]}, "tool_choice.tools"),
        ({**choice, "mode": "sometimes"}, "tool_choice.mode"),
    ):
        raw = httpx.post(
            f"{gateway.url}/v1/responses",
            json={"model": "gemini-flash", "input": "Fly me", "tools": tools, "tool_choice": bad},
            headers={"authorization": f"Bearer {DEMO_KEY}"},
        )
        assert raw.status_code == 400, raw.text
        assert json.loads(raw.text)["error"]["param"] == param
