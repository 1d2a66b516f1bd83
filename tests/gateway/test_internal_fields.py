"""The canonical request's internal fields, one client API's own (an Anthropic client's server tool
blocks, a Responses client's settings and the items only OpenAI's Responses API reads), never reach a
vendor under their own names, and reach only the vendor they were kept for: OpenAI's encrypted
reasoning goes to OpenAI's Responses API alone, Claude's server tool blocks to Claude alone."""

from __future__ import annotations

import pytest

from gateway.config import Backend
from gateway.providers import anthropic, gemini, openai, openai_responses
from gateway.types import ChatRequest, Message

ENCRYPTED = "gAAAA-openai-encrypted-reasoning"
SERVER_BLOCK = "srvtoolu_01"
SEARCHED = Message(
    role="assistant",
    content="The tallest tree is Hyperion.",
    anthropic_content=[
        {"type": "server_tool_use", "id": SERVER_BLOCK, "name": "web_search", "input": {"query": "tree"}},
        {"type": "text", "text": "The tallest tree is Hyperion."},
    ],
)
REASONED = Message(
    role="assistant",
    content="Done.",
    responses_items=[
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": ENCRYPTED},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
    ],
)
REQUEST = ChatRequest(
    model="m",
    messages=[
        Message(role="user", content="search"),
        SEARCHED,
        Message(role="user", content="and now"),
        REASONED,
        Message(role="user", content="thanks"),
    ],
    responses={"include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1"},
)
INTERNAL = (b"anthropic_content", b"responses_items", b'"responses"', b"anthropic_tools")


def _backend(kind: str, api: str | None = None) -> Backend:
    return Backend(name="b", type=kind, base_url="http://127.0.0.1:9", api_key="k", api=api)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("chat_request", "backend", "model", "kept"),
    [
        (openai.chat_request, _backend("openai"), "gpt-4o-mini", ()),
        (openai.chat_request, _backend("engine"), "tiny", ()),
        (gemini.chat_request, _backend("gemini"), "gemini-2.5-flash", ()),
        (anthropic.chat_request, _backend("anthropic"), "claude-sonnet-4-5", (SERVER_BLOCK,)),
        (openai_responses.chat_request, _backend("openai", "responses"), "o3-pro", (ENCRYPTED,)),
    ],
    ids=["openai-chat", "engine", "gemini", "anthropic", "responses-api"],
)
def test_internal_fields_reach_their_own_vendor_alone(
    chat_request: object, backend: Backend, model: str, kept: tuple[str, ...]
) -> None:
    body = chat_request(backend, REQUEST, model).body  # type: ignore[operator]
    assert not [name for name in INTERNAL if name in body]
    for secret in (ENCRYPTED, SERVER_BLOCK):
        assert (secret.encode() in body) == (secret in kept), secret
