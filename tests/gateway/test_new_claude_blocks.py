"""Forward compatibility with Claude's content blocks: a block of a type Weir does not model (a newer
Claude's `compaction`, MCP's, one added later) that Claude returns reaches an Anthropic client as
Claude sent it, streamed and not, and the client's next turn that holds it goes back to Claude
unchanged. Another vendor's candidate is skipped for such a turn (the block may carry what the
conversation needs: a compaction stands for the turns before it), while a server tool's blocks,
whose outcome the turn's text says, are left out there as before. With the official anthropic SDK."""

from __future__ import annotations

from typing import Any

import anthropic
import msgspec
import pytest

from gateway.anthropic_inbound import MessagesRequest, to_canonical
from gateway.errors import InvalidRequest
from gateway.types import ChatRequest
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway, full_config_text, module_gateway
from tests.gateway.test_messages import final_message

COMPACTION = {
    "type": "compaction",
    "content": "Earlier: the user asked for the tallest tree; it is Hyperion.",
}
MCP_USE = {"type": "mcp_tool_use", "id": "mcptoolu_01", "name": "lookup", "server_name": "trees", "input": {}}
ROUTES = """\
routes:
  - {name: gpt-then-claude, candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}], probe_interval: null}
  - {name: gpt-then-gemini, candidates: [{model: gpt-4o-mini}, {model: gemini-flash}], probe_interval: null}
"""


_module_gateway, routed = module_gateway(full_config_text() + ROUTES, "routed")


def _ask(
    gateway: RunningGateway, stream: bool, messages: list[dict[str, Any]], model: str = "claude-sonnet"
) -> Any:
    return final_message(
        gateway.anthropic(), stream, {"model": model, "max_tokens": 100, "messages": messages}
    )


def _two_turns(gateway: RunningGateway, fake: FakeAnthropic, stream: bool) -> list[dict[str, Any]]:
    """A first turn whose answer Claude leads with a compaction block, and the conversation the
    client sends next: that answer as it came, and a new question."""
    fake.lead_next_with(COMPACTION)
    first = _ask(gateway, stream, [{"role": "user", "content": "which tree is tallest"}])
    sent_back = [block.to_dict() for block in first.content]
    assert sent_back[0] == COMPACTION  # as Claude sent it, whatever the SDK makes of the type
    return [
        {"role": "user", "content": "which tree is tallest"},
        {"role": "assistant", "content": sent_back},
        {"role": "user", "content": "and how tall is it"},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_block_type_goes_back_to_claude_unchanged(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    messages = _two_turns(gateway, fake_anthropic, stream)
    # The fake takes the block back only as it issued it (a 400 otherwise): so did the gateway.
    again = _ask(gateway, stream, messages)
    assert [block.type for block in again.content] == ["text"]
    assert fake_anthropic.last_request.json["messages"][1] == messages[1]


def test_such_a_turn_skips_a_candidate_of_another_vendor(
    routed: RunningGateway, fake_anthropic: FakeAnthropic, fake_openai: FakeOpenAI
) -> None:
    messages = _two_turns(routed, fake_anthropic, stream=False)
    response = routed.anthropic().messages.with_raw_response.create(
        model="gpt-then-claude",
        max_tokens=100,
        messages=messages,  # type: ignore[arg-type]
    )
    assert response.parse().content[0].type == "text"
    assert "gpt-4o-mini:unsupported" in response.headers["x-weir-route"]
    assert not fake_openai.posts  # not sent a conversation missing what the compaction stood for
    assert fake_anthropic.last_request.json["messages"][1] == messages[1]


@pytest.mark.parametrize("stream", [False, True])
def test_with_no_claude_candidate_the_client_gets_a_400_naming_the_block(
    routed: RunningGateway,
    fake_anthropic: FakeAnthropic,
    fake_openai: FakeOpenAI,
    fake_gemini: FakeGemini,
    stream: bool,
) -> None:
    messages = _two_turns(routed, fake_anthropic, stream=False)
    with pytest.raises(anthropic.BadRequestError) as caught:
        _ask(routed, stream, messages, model="gpt-then-gemini")
    assert "`compaction`" in caught.value.message
    assert not fake_openai.posts and not fake_gemini.posts


def _turn(*blocks: dict[str, Any]) -> ChatRequest:
    """The canonical request of an Anthropic client whose assistant turn holds `blocks` and text."""
    asked = {
        "model": "m",
        "max_tokens": 10,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [*blocks, {"type": "text", "text": "said"}]},
            {"role": "user", "content": "more"},
        ],
    }
    return to_canonical(msgspec.convert(asked, MessagesRequest))


def test_only_blocks_safe_to_leave_out_go_to_another_vendor() -> None:
    """A server tool's blocks (MCP's among them) are left out for another vendor, the turn's text
    saying what came of them; a block of a type Weir does not know is refused there."""
    from gateway.providers.base import refuse_claude_blocks  # here: the other tests run without it

    chat = _turn(MCP_USE, {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_01", "content": []})
    assert chat.messages[1].anthropic_content is not None and chat.messages[1].content == "said"
    refuse_claude_blocks(chat, "OpenAI-compatible")  # nothing to refuse: raises nothing
    for kind in ("compaction", "container_file_reference_2027"):
        chat = _turn({"type": kind, "data": "x"})
        assert chat.messages[1].anthropic_content is not None
        with pytest.raises(InvalidRequest) as caught:
            refuse_claude_blocks(chat, "OpenAI-compatible")
        assert caught.value.code == "unsupported_content" and f"`{kind}`" in str(caught.value)


def test_a_tool_results_blocks_of_claudes_own_go_to_claude_and_are_refused_elsewhere() -> None:
    """A tool result's `tool_reference` is left out for another vendor (it only loads a deferred
    tool); a block of a type Weir does not model is kept for Claude and refused elsewhere, as an
    assistant turn's is. Text, images and documents are the tool message's parts for every vendor."""
    from gateway.providers.base import refuse_claude_blocks

    def result(*blocks: dict[str, Any]) -> ChatRequest:
        asked = {
            "model": "m",
            "max_tokens": 10,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": list(blocks)}],
                },
            ],
        }
        return to_canonical(msgspec.convert(asked, MessagesRequest))

    text = {"type": "text", "text": "found"}
    plain = result(text)
    assert plain.messages[2].anthropic_content is None  # nothing of Claude's own: parts alone
    chat = result({"type": "tool_reference", "tool_name": "g"}, text)
    assert chat.messages[2].anthropic_content == [{"type": "tool_reference", "tool_name": "g"}, text]
    assert chat.messages[2].content == plain.messages[2].content
    refuse_claude_blocks(chat, "OpenAI-compatible")  # raises nothing
    chat = result({"type": "search_result_2027", "source": "s"}, text)
    with pytest.raises(InvalidRequest) as caught:
        refuse_claude_blocks(chat, "OpenAI-compatible")
    assert caught.value.code == "unsupported_content" and "`search_result_2027`" in str(caught.value)


def test_one_rule_says_what_is_claudes_own_both_ways() -> None:
    from gateway.providers.base import claude_only

    assert not claude_only(
        [{"type": "text", "text": "a"}, {"type": "tool_use", "id": "t", "name": "f", "input": {}}]
    )
    assert claude_only([{"type": "text", "text": "a", "citations": [{"url": "u"}]}])
    assert claude_only([COMPACTION]) and claude_only([MCP_USE])
