"""A stream cut on its first candidate and continued on a second that is asked for the rest in a user
turn (`continuation: instruction`), whose model joins the rest as real models often do rather than as
asked: it writes the last words again, starts the whole answer over, or leaves out the space. Through
a routed gateway with the official SDKs as clients, the client gets the answer once, as one text
(`routing.stitch`); continuations of a trailing assistant message (a prefill) are left as they come.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import FAST, ROUTES, fresh, settled

ANSWER = "The quick brown fox jumps over the lazy dog"
CUT = Fault.cut_stream(after=5)  # role, "The", " quick", " brown", " fox"
JOIN_ROUTES = f"""{ROUTES}\
  - {{name: to-deepseek, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], {FAST}}}
  - {{name: to-opus, candidates: [{{model: gpt-4o-mini}}, {{model: claude-opus-46}}], {FAST}}}
"""


@pytest.fixture(scope="module")
def gateway_routes() -> str:
    return JOIN_ROUTES


@pytest.fixture(params=["to-deepseek", "to-opus"])
def route(request: pytest.FixtureRequest) -> str:
    """A route whose second candidate is asked for the rest in a user turn: OpenAI-compatible
    (deepseek-chat) or Claude 4.6 (claude-opus-46)."""
    return str(request.param)


def continuing(
    route: str, fake_deepseek: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> FakeOpenAI | FakeAnthropic:
    return fake_deepseek if route == "to-deepseek" else fake_anthropic


def chat(gateway: RunningGateway, route: str, text: str = ANSWER) -> tuple[str, Any]:
    """One streamed chat completion (the fakes echo `text`): its text and the usage it was told."""
    stream = gateway.openai().chat.completions.create(
        model=route,
        messages=[{"role": "user", "content": text}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return answer, chunks[-1].usage


def asked_for_the_rest(fake: FakeOpenAI | FakeAnthropic) -> bool:
    """Whether the continuation was asked for in a user turn after the partial answer."""
    messages = fake.last_request.json["messages"]
    return messages[-2]["role"] == "assistant" and messages[-1]["role"] == "user"


@pytest.mark.parametrize("restate", [1, 2, 4])
def test_the_last_words_written_again_are_sent_once(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    route: str,
    restate: int,
) -> None:
    """gpt-4o-mini breaks after "The quick brown fox"; the second candidate answers "fox jumps ...",
    "brown fox jumps ..." or the whole answer again (its four words are all of the text sent)."""
    fake = continuing(route, fake_deepseek, fake_anthropic)
    fake.continue_loosely(restate=restate)
    fake_openai.fail_next(CUT)
    answer, _ = chat(gateway, route)
    assert answer == ANSWER and asked_for_the_rest(fake)
    settled(gateway, 2)
    assert [e.ok for e in sorted(gateway.sink.events, key=lambda e: e.attempt)] == [False, True]


def test_an_answer_started_over_is_sent_from_where_the_client_is(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    route: str,
) -> None:
    fake = continuing(route, fake_deepseek, fake_anthropic)
    fake.continue_loosely(restart=True)
    fake_openai.fail_next(CUT)
    answer, _ = chat(gateway, route)
    assert answer == ANSWER and asked_for_the_rest(fake)


def test_the_space_left_out_after_a_sentence_is_put_back(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    route: str,
) -> None:
    """The break comes right after "here."; the continuation starts "Then" (a new message starts
    without a space): the client gets "here. Then", not "here.Then"."""
    text = "Part one ends here. Then part two follows."
    fake = continuing(route, fake_deepseek, fake_anthropic)
    fake.continue_loosely()
    fake_openai.fail_next(CUT)  # role, "Part", " one", " ends", " here."
    answer, _ = chat(gateway, route, text)
    assert answer == text and asked_for_the_rest(fake)


def test_the_client_is_told_the_output_of_the_answer_it_got(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """The continuation wrote "brown fox" again (2 of the 7 words it reports, and bills): the client
    is told the 9 words of the answer it got, as an unbroken stream reports them. The cut attempt is
    billed its estimate for "The quick brown fox" (19 bytes: 5 tokens at 4 bytes a token), and the
    dropped "brown fox" is estimated the same way (9 bytes: 3), so 5 + 7 - 3."""
    _, clean = chat(gateway, "to-deepseek")
    fresh(gateway)
    fake_deepseek.continue_loosely(restate=2)
    fake_openai.fail_next(CUT)
    answer, told = chat(gateway, "to-deepseek")
    assert answer == ANSWER
    settled(gateway, 2)
    cut, answered = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert (cut.estimated, cut.usage.output_tokens) == (True, 5)
    assert (answered.estimated, answered.usage.output_tokens) == (False, 7)  # billed as reported
    assert told.completion_tokens == clean.completion_tokens == 9
    assert told.prompt_tokens <= answered.usage.prompt_tokens  # the prefill and the asking turn left out


def test_a_prefilled_continuation_is_sent_as_it_comes(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """claude-sonnet continues a trailing assistant message literally: a continuation that rightly
    begins with the words the text sent ends with ("brown fox" again) is not taken for a restatement."""
    text = "The quick brown fox brown fox jumps"
    fake_anthropic.continue_loosely(restate=2)  # applies to continuations asked for in a user turn only
    fake_openai.fail_next(CUT)
    answer, _ = chat(gateway, "resilient", text)
    assert answer == text
    assert fake_anthropic.last_request.json["messages"][-1]["role"] == "assistant"  # a prefill


def test_messages_api_client_gets_a_restarted_answer_once(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """The same join on Anthropic's Messages API: one text block holding the answer once."""
    fake_anthropic.continue_loosely(restart=True)
    fake_openai.fail_next(CUT)
    events: list[Any] = list(
        gateway.anthropic().messages.create(
            model="to-opus", max_tokens=100, messages=[{"role": "user", "content": ANSWER}], stream=True
        )
    )
    texts = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert "".join(texts) == ANSWER
    assert [e.type for e in events].count("content_block_start") == 1
    assert asked_for_the_rest(fake_anthropic)
