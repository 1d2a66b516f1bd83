"""An output limit larger than the context window has room for after the prompt, as Claude Code (32,000)
and many SDKs (4,096 and more) send: the bundled engine refuses it with OpenAI's and vLLM's 400
`context_length_exceeded` (its direct clients still get that), so the gateway asks for the room the
prompt leaves instead, and says so in `x-weir-route` (`output_capped=N`), as it does for a model's own
output limit. The room comes from the engine's own count where the gateway has no window to go by
(its 400 says the window and the prompt's tokens: one more attempt, at once), or from the gateway's
estimate of the prompt where it knows the window. A prompt that alone fills the window still fails
over to the route's next candidate.

The real engine server runs the tiny random Llama (a 1,024-token window, one token per byte) in this
process, behind a real gateway with the fake OpenAI as the route's vendor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.providers.base import context_report
from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.engine_candidate import FAST, HI, engine_gateway, tiny_engine
from tests.routing.routed import ledger, route_header, settled

WINDOW = 1024  # the tiny model's context: max_position_embeddings, and 64 KV blocks of 16
CLAUDE_CODE = 32_000  # the max_tokens Claude Code sends (the fake gpt-4o-mini takes 16,384 at most)
ROUTES = f"""\
  - {{name: spill, candidates: [{{model: small}}], fallbacks: [gpt-4o-mini], failover_on: [429, 5xx, context_length_exceeded], {FAST}}}
  - {{name: declared, candidates: [{{model: small, context_window: 512}}], {FAST}}}
  - {{name: vendor, candidates: [{{model: gpt-4o-mini}}], {FAST}}}
"""
# The engine's EOS (token 0) at once: an answer of no length, so each test's generation takes no time.
EOS = {"0": 100}


@pytest.fixture(scope="module")
def engine() -> Iterator[int]:
    with tiny_engine() as (port, _):
        yield port


@pytest.fixture
def gateway(engine: int, fake_openai: FakeOpenAI) -> Iterator[RunningGateway]:
    """A gateway of its own for each test: no context window learnt from an earlier test's request."""
    with engine_gateway(fake_openai, engine, ROUTES) as gateway:
        yield gateway


def chat(gateway: RunningGateway, **body: Any) -> Any:
    """The raw response (headers and answer) to a chat completion through the gateway."""
    return gateway.openai().chat.completions.with_raw_response.create(**body)


def prompt_tokens(port: int, messages: list[dict[str, Any]]) -> int:
    """The engine's own count of a chat's prompt (`POST /tokenize`, as the chat endpoint counts it)."""
    body = {"model": "tiny", "messages": messages}
    count = httpx.post(f"http://127.0.0.1:{port}/tokenize", json=body, timeout=10).json()["count"]
    assert isinstance(count, int)
    return count


def test_the_engine_itself_still_refuses_more_than_its_window_with_the_room_in_its_words(engine: int) -> None:
    """Its direct clients (`weir engine serve`) get vLLM's 400, which the gateway reads the room from."""
    body = {"model": "tiny", "messages": HI, "max_tokens": CLAUDE_CODE}
    resp = httpx.post(f"http://127.0.0.1:{engine}/v1/chat/completions", json=body, timeout=10)
    error = resp.json()["error"]
    assert (resp.status_code, error["code"], error["param"]) == (400, "context_length_exceeded", "max_tokens")
    assert context_report(error["message"]) == (WINDOW, prompt_tokens(engine, HI))


@pytest.mark.parametrize(("model", "stream"), [("auto", False), ("auto", True), ("small", False)])
def test_a_chat_asking_more_than_the_window_holds_gets_the_room_the_prompt_leaves(
    gateway: RunningGateway, engine: int, model: str, stream: bool
) -> None:
    """Through a route (`auto`) and by the model's own name (a plan of one attempt) alike."""
    room = WINDOW - prompt_tokens(engine, HI)
    raw = chat(gateway, model=model, messages=HI, max_tokens=CLAUDE_CODE, logit_bias=EOS, stream=stream)
    header = route_header(raw)
    answer = raw.parse()
    if stream:
        chunks = list(answer)
        assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason is not None
        assert any(c.choices and c.choices[0].finish_reason == "stop" for c in chunks)
    else:
        assert answer.choices[0].finish_reason == "stop"
    assert (header["candidate"], header["output_capped"]) == ("small", str(room))
    # The gateway's estimate of a one-byte-a-token prompt is low: the engine's 400 said the room, and
    # the same engine was asked again at once with it (the vendor never was).
    assert header["tried"] == "small:400,small:ok"
    settled(gateway, 2)
    assert ledger(gateway) == [("local", 400), ("local", 200)]
    refused = min(gateway.sink.events, key=lambda e: e.attempt)
    assert (refused.usage.input_tokens, refused.cost_pico_usd) == (0, 0)  # refused before any work


@pytest.mark.parametrize("stream", [False, True])
def test_a_messages_request_asking_more_than_the_window_holds_gets_the_room_the_prompt_leaves(
    gateway: RunningGateway, engine: int, stream: bool
) -> None:
    # Near the window: the Messages API has no logit_bias to end the answer at once, and the room left
    # is as much as the tiny model may write.
    near = [{"role": "user", "content": "word " * 180}]
    room = WINDOW - prompt_tokens(engine, near)
    client = gateway.anthropic()
    message: Any
    if stream:
        with client.messages.stream(model="auto", messages=near, max_tokens=CLAUDE_CODE) as events:  # type: ignore[arg-type]
            header = route_header(events.response)
            message = events.get_final_message()
    else:
        raw = client.messages.with_raw_response.create(model="auto", messages=near, max_tokens=CLAUDE_CODE)  # type: ignore[arg-type]
        header, message = route_header(raw), raw.parse()
    assert 0 < room < 200 and message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens + message.usage.output_tokens <= WINDOW
    assert (header["candidate"], header["output_capped"]) == ("small", str(room))
    settled(gateway, 2)
    assert ledger(gateway) == [("local", 400), ("local", 200)]


def test_a_declared_window_caps_the_first_attempt_by_the_gateways_estimate(
    gateway: RunningGateway, engine: int
) -> None:
    """`context_window` on the candidate (below the engine's own here): the room is taken off the
    gateway's estimate of the prompt before anything is sent, so no attempt is refused."""
    raw = chat(gateway, model="declared", messages=HI, max_tokens=CLAUDE_CODE, logit_bias=EOS)
    capped = int(route_header(raw)["output_capped"])
    assert 0 < capped < 512
    assert raw.parse().choices[0].finish_reason == "stop"
    settled(gateway, 1)
    assert ledger(gateway) == [("local", 200)]


def test_a_limit_the_window_holds_is_sent_as_asked(gateway: RunningGateway, engine: int) -> None:
    raw = chat(gateway, model="auto", messages=HI, max_tokens=64, logit_bias=EOS)
    header = route_header(raw)
    assert "output_capped" not in header and header["attempts"] == "1"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_alone_fills_the_window_still_fails_over_to_the_vendor(
    gateway: RunningGateway, fake_openai: FakeOpenAI, stream: bool
) -> None:
    long = [{"role": "user", "content": "x" * (WINDOW + 100)}]
    raw = chat(gateway, model="spill", messages=long, max_tokens=16_000, stream=stream)
    header = route_header(raw)
    list(raw.parse()) if stream else raw.parse()
    assert header["candidate"] == "gpt-4o-mini" and header["tried"] == "small:400,gpt-4o-mini:ok"
    settled(gateway, 2)
    assert ledger(gateway) == [("local", 400), ("vendor", 200)]  # the engine was not asked twice


def test_a_prompt_that_alone_fills_the_window_is_the_clients_400_where_the_route_does_not_fail_over(
    gateway: RunningGateway,
) -> None:
    long = [{"role": "user", "content": "x" * (WINDOW + 100)}]
    with pytest.raises(openai.BadRequestError) as info:
        gateway.openai().chat.completions.create(model="auto", messages=long, max_tokens=CLAUDE_CODE)  # type: ignore[arg-type]
    assert info.value.code == "context_length_exceeded"


def test_a_window_an_openai_compatible_server_reports_caps_its_later_requests_up_front(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """A vLLM or OpenAI backend words its 400 as the engine does: the retry at the room it reports,
    and the window it reports caps the next request by the gateway's estimate, with no 400."""
    message = (
        "This model's maximum context length is 8192 tokens. However, you requested 16100 tokens "
        "(100 in the messages, 16000 in the completion). Please reduce the length of the messages or "
        "completion."
    )
    fake_openai.fail_next(Fault.status(400, error_code="context_length_exceeded", message=message))
    first = chat(gateway, model="vendor", messages=HI, max_tokens=16000)
    assert route_header(first)["output_capped"] == "8092"
    assert [r.json["max_tokens"] for r in fake_openai.requests] == [16000, 8092]
    second = chat(gateway, model="vendor", messages=HI, max_tokens=16000)
    header = route_header(second)
    assert header["attempts"] == "1" and 8092 < int(header["output_capped"]) < 8192
    assert fake_openai.requests[-1].json["max_tokens"] == int(header["output_capped"])


@pytest.mark.parametrize(
    ("message", "report"),
    [
        # the engine's, and OpenAI's and vLLM's before 0.10 (chat: "messages"; completions: "prompt")
        (
            "This model's maximum context length is 1024 tokens. However, you requested 32040 tokens "
            "(40 in the prompt, 32000 for the completion).",
            (1024, 40),
        ),
        (
            "This model's maximum context length is 8192 tokens. However, you requested 40000 tokens "
            "(8000 in the messages, 32000 in the completion).",
            (8192, 8000),
        ),
        # vLLM since 0.10
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 32000. This model's maximum context "
            "length is 8192 tokens and your request has 100 input tokens (32000 > 8192 - 100).",
            (8192, 100),
        ),
        # Anthropic, before Sonnet 4.5
        (
            "input length and `max_tokens` exceed context limit: 190000 + 32000 > 200000, decrease",
            (200000, 190000),
        ),
        # the prompt alone does not fit: no room to ask for
        ("This model's maximum context length is 1024 tokens; the prompt has 2000 tokens.", None),
        ("prompt is too long: 208656 tokens > 200000 maximum", None),
        (
            "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
            "(9000 in the messages, 0 in the completion).",
            None,
        ),
    ],
)
def test_context_reports_say_the_window_and_the_prompt(message: str, report: tuple[int, int] | None) -> None:
    assert context_report(message) == report
