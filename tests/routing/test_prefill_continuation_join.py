"""A client's own prefill (an Anthropic client's trailing assistant message, an OpenAI client's
`continue_final_message`) on a backend asked for the rest in a user turn (`continuation:
instruction`), whose model joins the rest as real models often do rather than as asked: it writes the
last words again, starts the whole answer over, or leaves out the space after a sentence. Through a
gateway with the official SDKs as clients, asked by a plain model name and by a route, the reply is
the rest of the answer only, as a model that continues the prefill literally gives it
(`routing.stitch`); a backend that continues it literally is left as it answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gateway.providers.base import CONTINUE_INSTRUCTION
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import FAST, ROUTES, routed_config_text, settled

ANSWER = "The quick brown fox jumps over the lazy dog"
PREFILL = "The quick brown fox"
REST = " jumps over the lazy dog"  # what a model that continues the prefill literally writes
TO_OPUS = f"""{ROUTES}\
  - {{name: to-opus, candidates: [{{model: gpt-4o-mini}}, {{model: claude-opus-46}}], {FAST}}}
"""
# Gemini 3.6 refuses contents ending with a model turn: asked for the rest in a user turn.
GEMINI_36 = "  - {name: gemini-36, backend: gemini, model: gemini-3.6-flash}\n"


@pytest.fixture(scope="module")
def gateway_config() -> str:
    # The first `tenants:` ends the models list.
    return routed_config_text(TO_OPUS).replace("tenants:", GEMINI_36 + "tenants:", 1)


@pytest.fixture(params=["claude-opus-46", "resilient"])
def model(request: pytest.FixtureRequest) -> str:
    """A plain model (Claude Opus 4.6, which refuses a prefill) or a route whose first candidate
    answers (gpt-4o-mini, which answers a trailing assistant message afresh): both asked for the rest
    in a user turn."""
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["whole", "streamed"])
def stream(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def answering(
    model: str, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> FakeOpenAI | FakeAnthropic:
    return fake_anthropic if model == "claude-opus-46" else fake_openai


@dataclass
class Reply:
    text: str
    output_tokens: int  # what the client is told
    input_tokens: int | None = None  # what the client is told (not streamed)


def messages_api(gateway: RunningGateway, model: str, stream: bool, text: str, prefill: str) -> Reply:
    """One Messages API call whose answer (the fakes echo `text`) the client begins with `prefill`."""
    client = gateway.anthropic()
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": prefill}]
    if not stream:
        message = client.messages.create(model=model, max_tokens=100, messages=messages)
        assert [block.type for block in message.content] == ["text"]
        return Reply(message.content[0].text, message.usage.output_tokens, message.usage.input_tokens)
    events = list(client.messages.create(model=model, max_tokens=100, messages=messages, stream=True))
    texts = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert [e.type for e in events].count("content_block_start") == 1
    (delta,) = [e for e in events if e.type == "message_delta"]
    return Reply("".join(texts), delta.usage.output_tokens)


def asked_for_the_rest(fake: FakeOpenAI | FakeAnthropic) -> bool:
    last = fake.last_request.json["messages"][-1]
    content = last["content"]
    said = content if isinstance(content, str) else "".join(block["text"] for block in content)
    return last["role"] == "user" and said == CONTINUE_INSTRUCTION


@pytest.mark.parametrize("restate", [1, 3])
def test_the_last_words_written_again_are_left_out(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    model: str,
    stream: bool,
    restate: int,
) -> None:
    """The model answers "fox jumps ..." or "quick brown fox jumps ...": the client gets the rest."""
    fake = answering(model, fake_openai, fake_anthropic)
    fake.continue_loosely(restate=restate)
    reply = messages_api(gateway, model, stream, ANSWER, PREFILL)
    assert reply.text == REST and asked_for_the_rest(fake)


def test_an_answer_started_over_is_sent_from_the_prefill_on(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    model: str,
    stream: bool,
) -> None:
    fake = answering(model, fake_openai, fake_anthropic)
    fake.continue_loosely(restart=True)
    reply = messages_api(gateway, model, stream, ANSWER, PREFILL)
    assert reply.text == REST and asked_for_the_rest(fake)


def test_the_space_left_out_after_the_prefill_sentence_is_put_back(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    model: str,
    stream: bool,
) -> None:
    """The prefill ends "here."; the model starts "Then" (a new message starts without a space)."""
    fake = answering(model, fake_openai, fake_anthropic)
    fake.continue_loosely()
    reply = messages_api(
        gateway, model, stream, "Part one ends here. Then part two follows.", "Part one ends here."
    )
    assert reply.text == " Then part two follows." and asked_for_the_rest(fake)


def test_the_client_is_told_the_output_it_got_and_the_ledger_what_was_billed(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """The model wrote "brown fox jumps over the lazy dog" (7 words, as it reports and bills); the
    client got " jumps over the lazy dog" and is told 7 less the dropped "brown fox" estimated at
    4 bytes a token (9 bytes: 3)."""
    fake_anthropic.continue_loosely(restate=2)
    reply = messages_api(gateway, "claude-opus-46", stream, ANSWER, PREFILL)
    assert reply.text == REST
    settled(gateway, 1)
    (event,) = gateway.sink.events
    assert (event.estimated, event.usage.output_tokens) == (False, 7)
    assert reply.output_tokens == 7 - 3
    if not stream:  # the turn asking for the rest, which the client never sent, is not its prompt
        asking = -(-len(CONTINUE_INSTRUCTION.encode()) // 4)
        assert reply.input_tokens == event.usage.input_tokens - asking


def test_a_literal_prefill_continuation_is_left_as_it_comes(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, stream: bool
) -> None:
    """Claude Sonnet 4.5 continues a trailing assistant message: a reply that rightly begins with the
    words the prefill ends with ("brown fox" again) is not taken for a restatement."""
    fake_anthropic.continue_loosely(restate=2)  # applies to continuations asked for in a user turn only
    reply = messages_api(gateway, "claude-sonnet", stream, "The quick brown fox brown fox jumps", PREFILL)
    assert reply.text == " brown fox jumps"
    assert fake_anthropic.last_request.json["messages"][-1]["role"] == "assistant"  # a prefill


@pytest.mark.parametrize("name", ["gpt-4o-mini", "resilient"])
def test_an_openai_client_continuing_its_final_message_gets_the_rest_once(
    gateway: RunningGateway, fake_openai: FakeOpenAI, stream: bool, name: str
) -> None:
    """vLLM's `continue_final_message`, which Weir's chat API takes too, on OpenAI (asked for the rest
    in a user turn): the model starts over, the client gets the rest, and is told its output."""
    fake_openai.continue_loosely(restart=True)
    client = gateway.openai()
    messages = [{"role": "user", "content": ANSWER}, {"role": "assistant", "content": PREFILL}]
    extra = {"continue_final_message": True}
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=name,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        completion = client.chat.completions.create(model=name, messages=messages, extra_body=extra)
        text, usage = completion.choices[0].message.content or "", completion.usage
    assert text == REST and asked_for_the_rest(fake_openai)
    settled(gateway, 1)
    (event,) = gateway.sink.events
    assert event.usage.output_tokens == len(ANSWER.split())  # billed as reported: the whole answer again
    assert usage is not None and usage.completion_tokens == 9 - 5  # less "The quick brown fox" (19 bytes)
    asking = -(-len(CONTINUE_INSTRUCTION.encode()) // 4)  # the turn asking for the rest: not the client's
    assert usage.prompt_tokens == event.usage.input_tokens - asking


def test_an_openai_client_gets_the_joined_text_not_the_models_own(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """The prefill ends "here."; OpenAI's model starts "Then": the stream's chunks, which an OpenAI
    client otherwise gets as OpenAI sent them, go out with the space put back."""
    fake_openai.continue_loosely()
    messages = [
        {"role": "user", "content": "Part one ends here. Then part two follows."},
        {"role": "assistant", "content": "Part one ends here."},
    ]
    chunks = gateway.openai().chat.completions.create(
        model="gpt-4o-mini", messages=messages, stream=True, extra_body={"continue_final_message": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " Then part two follows."
    assert asked_for_the_rest(fake_openai)


def test_a_gemini_answer_keeps_its_role_while_its_first_text_is_held(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    """Gemini sends the role and the first text in one chunk; that text is held (it may be a
    restatement), and the OpenAI client still gets the role first."""
    fake_gemini.models.add("gemini-3.6-flash")
    fake_gemini.continue_loosely(restate=1)
    chunks = list(
        gateway.openai().chat.completions.create(
            model="gemini-36",
            messages=[{"role": "user", "content": ANSWER}, {"role": "assistant", "content": PREFILL}],
            stream=True,
            extra_body={"continue_final_message": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REST
    assert chunks[0].choices[0].delta.role == "assistant"
    assert fake_gemini.last_request.json["contents"][-1]["role"] == "user"  # asked for the rest


@pytest.mark.parametrize("route", ["to-opus", "resilient"])
def test_a_prefilled_stream_resumed_goes_on_from_the_prefill_and_the_text_sent(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, route: str
) -> None:
    """gpt-4o-mini goes on from the client's "The quick" and breaks after " brown fox"; the next
    candidate is asked to go on from "The quick brown fox", one assistant message, in a user turn
    (claude-opus-46, whose model starts the answer over) or literally (claude-sonnet): either way the
    client gets the rest once."""
    fake_anthropic.continue_loosely(restart=True)  # applies to continuations asked for in a user turn only
    fake_openai.fail_next(Fault.cut_stream(after=3))  # role, " brown", " fox"
    reply = messages_api(gateway, route, True, ANSWER, "The quick")
    assert reply.text == " brown fox" + REST
    continued = fake_anthropic.last_request.json["messages"]
    said = [m for m in continued if m["role"] == "assistant"]
    assert len(said) == 1 and "".join(b["text"] for b in said[0]["content"]) == PREFILL
