"""OpenAI's Codex CLI (and any Responses API agent) through Weir, as the official `openai` SDK sends
Codex's traffic: `store: false`, `include: ["reasoning.encrypted_content"]`, reasoning summaries, a
custom (freeform) `apply_patch` tool with its lark grammar beside function and built-in tools, and the
output items sent back as input on the next turn. On OpenAI's Responses API it all goes through as it
came; on chat backends a custom tool is a function of one string, and OpenAI's encrypted reasoning is
left out."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gateway.config import Backend
from gateway.providers import openai_responses
from gateway.providers.base import CONTINUE_INSTRUCTION, custom_arguments
from gateway.responses_inbound import ResponsesRequest, to_canonical
from gateway.types import ChatChunk, ChatRequest, ChunkChoice, Delta, FunctionCall, Message
from gateway.usage import Usage
from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fakes.openai_responses import ENCRYPTED, SUMMARY
from tests.fixtures.vendor_gateway import RunningGateway, full_config_text, module_gateway
from tests.gateway.test_responses import _chunk, _events
from tests.gateway.test_responses_outbound import BACKENDS, FAST, MODELS

# The routes that fail codex's streams over have no breaker: the module's cuts of codex would open it.
ROUTES = f"""\
routes:
  - {{name: claude-then-codex, candidates: [{{model: claude-sonnet}}, {{model: codex}}], {FAST}}}
  - {{name: codex-then-mini, candidates: [{{model: codex}}, {{model: gpt-4o-mini}}], breaker: null, {FAST}}}
  - {{name: codex-then-pro, candidates: [{{model: codex}}, {{model: o3-pro}}], breaker: null, {FAST}}}
"""
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello, world!\n*** End Patch\n"
GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
APPLY_PATCH: Any = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool.",
    "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR},
}
SHELL: Any = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
        "additionalProperties": False,
    },
    "strict": False,
}
WEB_SEARCH: Any = {"type": "web_search"}
ASK = 'Add hello.txt. call apply_patch {"input": ' + repr(PATCH).replace("'", '"') + "}"
# What Codex sends on every turn beside its tools and input.
CODEX: Any = {
    "instructions": "You are Codex, a coding agent.",
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199d7c1-session",
    "text": {"verbosity": "low"},
}


_module_gateway, gateway = module_gateway(
    full_config_text()
    .replace("models:", "models:\n" + MODELS.rstrip("\n"), 1)
    .replace("backends:\n", "backends:\n" + BACKENDS, 1)
    + ROUTES
)


def _turn(gateway: RunningGateway, model: str, items: list[Any], tools: list[Any], stream: bool) -> Any:
    """One Codex turn: the final Response, and the stream's event types (none unstreamed)."""
    client = gateway.openai()
    if not stream:
        return client.responses.create(model=model, input=items, tools=tools, **CODEX), []
    events = list(client.responses.create(model=model, input=items, tools=tools, stream=True, **CODEX))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events[-1].response, kinds


def _items(response: Any) -> list[dict[str, Any]]:
    """The output items as Codex sends them back (store: false, so every one, whole)."""
    return [item.model_dump(exclude_none=True) for item in response.output]


@pytest.mark.parametrize("stream", [True, False])
def test_a_codex_tool_loop_on_the_responses_api_goes_through_as_it_came(
    gateway: RunningGateway, fake_openai: FakeOpenAI, stream: bool
) -> None:
    ask: list[Any] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    tools = [SHELL, APPLY_PATCH, WEB_SEARCH]
    first, kinds = _turn(gateway, "codex", ask, tools, stream)
    sent = fake_openai.posts[-1].json
    assert sent["tools"] == tools and sent["tool_choice"] == "auto"  # custom and built-in tools as they are
    assert sent["include"] == ["reasoning.encrypted_content"] and sent["store"] is False
    assert sent["reasoning"] == {"effort": "medium", "summary": "auto"}
    assert sent["prompt_cache_key"] == "0199d7c1-session" and sent["text"]["verbosity"] == "low"
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content.startswith(ENCRYPTED)
    assert [part.text for part in reasoning.summary] == [SUMMARY]
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
    assert first.usage.output_tokens_details.reasoning_tokens > 0
    if stream:
        assert "response.reasoning_summary_text.delta" in kinds
        assert "response.custom_tool_call_input.delta" in kinds
        assert "response.function_call_arguments.delta" not in kinds
    # The next turn: everything so far, the model's items as they came, and the patch's result.
    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success."}
    second, _ = _turn(gateway, "codex", [*ask, *_items(first), result], tools, stream)
    assert second.output_text == "Tool apply_patch returned: Success."
    sent = fake_openai.posts[-1].json
    sent_back = sent["input"][1:]
    assert [item["type"] for item in sent_back] == [
        "reasoning",
        "custom_tool_call",
        "custom_tool_call_output",
    ]
    assert sent_back[0]["encrypted_content"] == reasoning.encrypted_content
    assert sent_back[1]["input"] == PATCH and sent_back[2]["output"] == "Success."
    assert len(gateway.sink.events) == 2  # both turns in the ledger


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("model", ["claude-sonnet", "gpt-4o-mini"])
def test_a_custom_tool_is_a_function_of_one_string_on_chat_backends(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, model: str, stream: bool
) -> None:
    fake: FakeOpenAI | FakeAnthropic = fake_anthropic if model == "claude-sonnet" else fake_openai
    # An earlier turn OpenAI served: its encrypted reasoning no other vendor can read.
    earlier: list[Any] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": ENCRYPTED + "xyz"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
    ]
    first, kinds = _turn(gateway, model, earlier, [SHELL, APPLY_PATCH], stream)
    sent = fake.posts[-1].json
    tools = {tool.get("name") or tool["function"]["name"]: tool for tool in sent["tools"]}
    patch = tools["apply_patch"]
    schema = patch.get("input_schema") or patch["function"]["parameters"]
    assert schema["properties"] == {
        "input": {"type": "string", "description": "The tool's freeform input, as plain text."}
    }
    assert GRAMMAR in (patch.get("description") or patch["function"]["description"])
    assert "responses" not in sent and ENCRYPTED not in str(sent)  # nothing Responses-only leaks
    call = first.output[-1]  # after its reasoning and text, where the model gives any
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
    if stream:
        assert "response.custom_tool_call_input.done" in kinds
    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success."}
    second, _ = _turn(gateway, model, [*earlier, *_items(first), result], [SHELL, APPLY_PATCH], stream)
    assert second.output_text == "Tool apply_patch returned: Success."
    assert ENCRYPTED not in str(fake.posts[-1].json)


def test_built_in_tools_pass_chat_candidates_over_for_the_responses_api(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    raw = gateway.openai().responses.with_raw_response.create(
        model="claude-then-codex", input="search the web", tools=[WEB_SEARCH, APPLY_PATCH], store=False
    )
    assert raw.parse().output_text
    assert "claude-sonnet:unsupported" in raw.headers["x-weir-route"]
    assert fake_openai.posts[-1].json["tools"] == [WEB_SEARCH, APPLY_PATCH]
    with pytest.raises(
        openai.BadRequestError, match="'local_shell' are not supported by Anthropic"
    ) as caught:
        gateway.openai().responses.create(model="claude-sonnet", input="hi", tools=[{"type": "local_shell"}])
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "tools[0].type"


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ({"type": "web_search_preview"}, "tool_choice.type"),
        (
            {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search_preview"}, SHELL]},
            "tool_choice.tools[0].type",
        ),
    ],
    ids=["forced", "allowed"],
)
def test_a_built_in_tool_choice_reaches_the_responses_api(
    gateway: RunningGateway, fake_openai: FakeOpenAI, choice: Any, param: str
) -> None:
    """Choosing a built-in tool was a 400 before any backend was tried, though OpenAI's Responses
    API, which gets the tools and the choice as sent, runs it."""
    tools = [{"type": "web_search_preview"}, SHELL]
    raw = gateway.openai().responses.with_raw_response.create(
        model="claude-then-codex", input="search the web", tools=tools, tool_choice=choice, store=False
    )
    assert raw.parse().tool_choice.type == choice["type"]  # type: ignore[union-attr]
    assert "claude-sonnet:unsupported" in raw.headers["x-weir-route"]
    assert fake_openai.posts[-1].json["tool_choice"] == choice
    # Without the tool to run, still Weir's own 400, whatever the backend.
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().responses.create(model="codex", input="hi", tools=[SHELL], tool_choice=choice)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


def test_a_stream_that_breaks_midway_goes_on_elsewhere_in_order(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    # created, in_progress, the reasoning item and its summary's first part and delta, then an error
    # event: codex had begun to answer, so gpt-4o-mini on chat completions goes on from there.
    fake_openai.fail_next(Fault.stream_error(after=5))
    ask = [{"role": "user", "content": ASK}]
    events = list(
        gateway.openai().responses.create(
            model="codex-then-mini", input=ask, tools=[APPLY_PATCH], stream=True, **CODEX
        )
    )
    _well_formed(events)
    final = events[-1].response
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(final.output)))  # every item closed, in order
    assert [item.status for item in final.output[:-1]] == ["incomplete"] * (len(final.output) - 1)
    call = final.output[-1]
    assert call.type == "custom_tool_call" and call.input == PATCH and call.status == "completed"


ECHO = "one two three four five six seven eight nine ten"
# The number of codex's first text delta in its answer to ECHO: after created and in_progress, its
# reasoning item (added, the summary's part added, a delta a word, the text's, part's and item's done
# events) and the message's added and part added events.
FIRST_TEXT_DELTA = 2 + 2 + len(SUMMARY.split()) + 3 + 2


def _well_formed(events: list[Any]) -> None:
    """One Responses event sequence, as a client that checks every event sees it: numbered in order,
    one response.created first and one response.completed last; each item opened once, then its
    events, then closed once, at the next output index; each content or summary part of it opened at
    the next index, its deltas, and closed once, its done events saying the text its deltas made."""
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[0] == "response.created" and kinds.count("response.created") == 1
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    items: dict[int, Any] = {}  # output index -> the item as added
    closed: set[int] = set()
    parts: dict[tuple[int, str, int], str] = {}  # (output index, content/summary, index) -> its text
    parts_closed: set[tuple[int, str, int]] = set()
    for event in events[1:-1]:
        index = getattr(event, "output_index", None)
        if event.type == "response.output_item.added":
            assert index == len(items) and closed == set(items), "an item opened before the last closed"
            items[index] = event.item
            continue
        if index is None:
            continue
        assert index in items and index not in closed, f"{event.type} outside its item"
        if hasattr(event, "item_id"):
            assert event.item_id == items[index].id
        if event.type == "response.output_item.done":
            assert event.item.id == items[index].id
            assert all(key in parts_closed for key in parts if key[0] == index), (
                "an item closed with a part open"
            )
            closed.add(index)
            continue
        summary = "summary_index" in type(event).model_fields
        key = (
            index,
            "summary" if summary else "content",
            event.summary_index if summary else getattr(event, "content_index", -1),
        )
        if event.type.endswith("part.added"):
            assert key not in parts and key[2] == sum(1 for k in parts if k[:2] == key[:2])
            parts[key] = ""
        elif key[2] >= 0 and not event.type.startswith(("response.function_call", "response.custom_tool")):
            assert key in parts and key not in parts_closed, f"{event.type} outside its part"
            if event.type.endswith(".delta"):
                parts[key] += event.delta
            elif event.type.endswith("part.done"):
                parts_closed.add(key)
            elif event.type.endswith(".done"):
                assert getattr(event, "text", None) in (None, parts[key])
    assert closed == set(items) and set(parts) == parts_closed
    final = events[-1].response
    assert [item.id for item in final.output] == [items[i].id for i in range(len(items))]


@pytest.mark.parametrize("restate", [0, 2])
def test_a_stream_cut_midway_goes_on_on_another_responses_backend_in_one_message(
    gateway: RunningGateway, fake_openai: FakeOpenAI, restate: int
) -> None:
    """codex breaks three words into its answer; o3-pro, on the Responses API too, is asked for the
    rest and goes on in the same message (its own reasoning left out: the answer is under way), as one
    event sequence, joined as a continuation asked for in a user turn is, whatever the model repeats."""
    fake_openai.fail_next(Fault.stream_error(after=FIRST_TEXT_DELTA + 3))
    if restate:
        fake_openai.continue_loosely(restate=restate)
    with gateway.openai().responses.stream(
        model="codex-then-pro", input=ECHO, tools=[SHELL, APPLY_PATCH], **CODEX
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _well_formed(events)
    sent = fake_openai.posts[-1].json
    assert sent["model"] == "o3-pro" and sent["input"][-1]["content"] == CONTINUE_INSTRUCTION
    assert final.status == "completed" and final.output_text == ECHO
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content.startswith(ENCRYPTED)
    assert [part.text for part in reasoning.summary] == [SUMMARY]
    assert message.type == "message" and message.status == "completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == ECHO


@pytest.mark.parametrize("route", ["codex-then-pro", "codex-then-mini"])
def test_reasoning_cut_while_its_summary_streams_keeps_the_summary_streamed(
    gateway: RunningGateway, fake_openai: FakeOpenAI, route: str
) -> None:
    """codex breaks three words into its reasoning summary: the cut item is closed incomplete with
    those words as its summary (its text and part done events, and the item itself, say them), and
    the next candidate answers afresh after it."""
    fake_openai.fail_next(Fault.stream_error(after=4 + 3))
    with gateway.openai().responses.stream(
        model=route, input=ECHO, tools=[SHELL, APPLY_PATCH], **CODEX
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _well_formed(events)
    streamed = " ".join(SUMMARY.split()[:3])
    cut = final.output[0]
    assert cut.type == "reasoning" and cut.status == "incomplete"
    assert [part.text for part in cut.summary] == [streamed]
    [done] = [e for e in events if e.type == "response.reasoning_summary_text.done" and e.output_index == 0]
    assert done.text == streamed and done.summary_index == 0
    [item_done] = [e for e in events if e.type == "response.output_item.done" and e.output_index == 0]
    assert [part.text for part in item_done.item.summary] == [streamed]
    assert final.status == "completed" and final.output_text == ECHO
    if route == "codex-then-pro":
        # o3-pro answered afresh on the Responses API: its items as they came, its reasoning whole.
        _, reasoning, message = final.output
        assert reasoning.type == "reasoning" and reasoning.encrypted_content.startswith(ENCRYPTED)
        assert [part.text for part in reasoning.summary] == [SUMMARY] and message.type == "message"
        assert fake_openai.posts[-1].json["input"] == [{"role": "user", "content": ECHO}]


def _passed(event: dict[str, Any], delta: Delta | None = None) -> ChatChunk:
    """A chunk read from an event of OpenAI's Responses API, as its adapter gives a Responses client."""
    choices = [ChunkChoice(index=0, delta=delta)] if delta is not None else []
    return ChatChunk(id="c", created=0, model="m", choices=choices, responses_event=event)


async def test_a_message_cut_after_its_text_was_said_done_is_not_gone_on_in() -> None:
    """OpenAI's stream breaks between a message's `output_text.done` and its part's done event: the
    cut message closes its part once (no second text done event) and the continuation's text is a
    message of its own, the answer's text whole across the two."""
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "logprobs": []}
    item = {"type": "message", "id": "msg_1", "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    events = await _events(
        [
            _passed({"type": "response.created", "response": {}}, Delta(role="assistant", content="")),
            _passed({"type": "response.output_item.added", "output_index": 0, "item": item}),
            _passed({"type": "response.content_part.added", **where, "part": part}),
            _passed(
                {"type": "response.output_text.delta", **where, "delta": "one two"}, Delta(content="one two")
            ),
            _passed({"type": "response.output_text.done", **where, "text": "one two"}),
            _chunk(Delta(content=" three")),  # the continuation, translated
            _chunk(Delta(), "stop", Usage(input_tokens=4, output_tokens=3)),
        ]
    )
    _well_formed(events)
    final = events[-1].response
    assert [(item.status, item.content[0].text) for item in final.output] == [
        ("incomplete", "one two"),
        ("completed", " three"),
    ]
    assert [e.output_index for e in events if e.type == "response.output_text.done"] == [0, 1]


OPENAI = Backend(
    name="openai", type="openai", base_url="https://api.openai.com/v1", api_key="k", api="responses"
)


def test_items_only_the_responses_api_reads_reach_it_as_the_client_sent_them() -> None:
    """Codex's history of built-in calls, OpenAI's encrypted reasoning and custom calls goes to the
    Responses API item for item (ids left out but the reasoning's, which OpenAI never stored), while
    the canonical request other backends get holds the custom call as a function of one string."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": ENCRYPTED + "a"}
    shell = {"type": "local_shell_call", "id": "lsh_1", "call_id": "c1", "status": "completed",
             "action": {"type": "exec", "command": ["ls"]}}  # fmt: skip
    patch = {
        "type": "custom_tool_call",
        "id": "ctc_1",
        "call_id": "c2",
        "name": "apply_patch",
        "input": PATCH,
    }
    items: list[Any] = [
        {"role": "user", "content": "go"},
        reasoning,
        shell,
        {"type": "local_shell_call_output", "call_id": "c1", "output": "a.txt"},
        patch,
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "Success."},
    ]
    body = ResponsesRequest(model="codex", input=items, tools=[APPLY_PATCH, {"type": "local_shell"}])
    canonical = to_canonical(body)
    call = canonical.messages[-2].tool_calls or []
    assert [c.function for c in call] == [FunctionCall(name="apply_patch", arguments=custom_arguments(PATCH))]
    sent = json.loads(openai_responses.chat_request(OPENAI, canonical, "codex-mini-latest").body)
    without_id = [{k: v for k, v in item.items() if k != "id"} for item in items[2:]]
    assert sent["input"] == [{"role": "user", "content": "go"}, reasoning, *without_id]
    assert sent["tools"] == [APPLY_PATCH, {"type": "local_shell"}]


@pytest.mark.parametrize("text", [PATCH, 'say "hi"\\n\tand 👋 ünïcode', ""])
def test_a_streamed_custom_call_is_whole_json_arguments_for_the_canonical_stream(text: str) -> None:
    """The canonical stream (failover, the ledger, chat clients) gets a custom call's input as the
    JSON arguments of a function of one string, written around the input as it streams."""
    request = ChatRequest(model="codex", messages=[Message(role="user", content="go")], responses={})
    stream = openai_responses.ChatStream(request, "codex")
    item = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c1", "name": "apply_patch", "input": ""}
    events = [
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        *({"type": "response.custom_tool_call_input.delta", "item_id": "ctc_1", "output_index": 0, "delta": c}
          for c in text),
        {"type": "response.output_item.done", "output_index": 0, "item": item | {"input": text}},
    ]  # fmt: skip
    chunks = [chunk for event in events for chunk in stream.feed(None, json.dumps(event))]
    assert [chunk.responses_event for chunk in chunks if chunk.responses_event] == events  # each as it came
    deltas = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or ()]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(arguments) == {"input": text} and arguments == custom_arguments(text)
