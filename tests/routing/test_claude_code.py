"""A Claude Code session through a route that fails over between Claude and OpenAI: Claude Code's own
request shape (its key as `Authorization: Bearer`, beta flags, a cached system prompt in blocks,
thinking with a budget, a tool loop), with the official anthropic SDK."""

from __future__ import annotations

from typing import Any

import anthropic

from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway

BASH = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
    "cache_control": {"type": "ephemeral"},
}
SYSTEM = [
    {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
]
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "fine-grained-tool-streaming-2025-05-14"]


def claude_code(gateway: RunningGateway) -> anthropic.Anthropic:
    # ANTHROPIC_AUTH_TOKEN: the key goes as a bearer token, not as x-api-key.
    return anthropic.Anthropic(base_url=gateway.url, auth_token=DEMO_KEY, max_retries=0, timeout=20)


def _turn(client: anthropic.Anthropic, messages: list[dict[str, Any]]) -> Any:
    with client.beta.messages.stream(
        model="anthropic-first",
        # Claude Code asks for 32,000; gpt-4o-mini, which this config gives no `max_output_tokens`,
        # refuses more than 16,384 (docs/gateway.md, "Claude Code").
        max_tokens=16000,
        system=SYSTEM,
        tools=[BASH],
        thinking={"type": "enabled", "budget_tokens": 4000},
        metadata={"user_id": "user_0123_account__session_abcd"},
        betas=BETAS,
        messages=messages,
    ) as stream:
        return stream.get_final_message()


def test_a_tool_turn_another_candidate_answered_goes_on_with_claude(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_openai: FakeOpenAI
) -> None:
    """Claude overloaded, the route's OpenAI candidate answered a tool call, which has no signed
    thinking (OpenAI has none to give). Claude back, the tool loop's next turn asks for thinking as
    every Claude Code turn does: Anthropic refuses thinking beside a tool turn that did not start with
    its own, so every retry was the same 400 and the session could not go on. It goes on without
    thinking for that turn, and with it again once the loop is Claude's own."""
    client = claude_code(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": 'call Bash {"command": "ls"}'}]
    fake_anthropic.fail_next(529, times=2)  # the route's two tries on Claude
    first = _turn(client, messages)
    assert [block.type for block in first.content] == ["tool_use"]  # gpt-4o-mini's, unthought
    assert len(fake_openai.posts) == 1
    [call] = first.content
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "a.txt"}]},
    ]

    second = _turn(client, messages)
    sent = fake_anthropic.last_request
    assert "thinking" not in sent.json
    assert sent.json["max_tokens"] == 16000  # the client's limit, no thinking to make room for
    assert sent.headers["anthropic-beta"] == ",".join(BETAS)
    assert sent.json["system"] == SYSTEM and sent.json["tools"] == [BASH]
    assert [block.type for block in second.content] == ["text"]
    assert second.content[0].text == "Tool Bash returned: a.txt"  # type: ignore[union-attr]

    # The next tool loop is Claude's own: thinking again, its signed block sent back intact.
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in second.content]},
        {"role": "user", "content": 'call Bash {"command": "pwd"}'},
    ]
    third = _turn(client, messages)
    assert [block.type for block in third.content] == ["thinking", "text", "tool_use"]
    assert fake_anthropic.last_request.json["thinking"] == {"type": "enabled", "budget_tokens": 4000}
    tool_use = third.content[-1]
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in third.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "/w"}]},
    ]
    fourth = _turn(client, messages)
    sent_turn = fake_anthropic.last_request.json["messages"][-2]
    assert sent_turn["content"][0]["type"] == "thinking" and sent_turn["content"][0]["signature"]
    assert fake_anthropic.last_request.json["thinking"] == {"type": "enabled", "budget_tokens": 4000}
    assert [block.type for block in fourth.content] == ["thinking", "text"]
