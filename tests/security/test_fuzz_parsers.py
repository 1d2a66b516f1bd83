"""hypothesis over the parsers the gateway runs on upstream bytes: the SSE reader
(`Transport.events`) and the JSON body decoders (`gateway.providers.base`).

- A valid event stream, split into network reads at any byte (inside a line ending, inside a
  multi-byte UTF-8 character), with LF or CRLF line endings and comment lines, yields exactly the
  events that were sent, in order.
- Arbitrary bytes, split anywhere, yield the same events however they are split, and fail, if at
  all, only with the gateway's own error (a 502 for the client; a timeout is a 504), never with
  anything else.
- Arbitrary bodies to the JSON decoders: a value, or the gateway's 502.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.errors import BadGateway, GatewayError
from gateway.providers.base import decode_json, decode_typed
from gateway.transport import Transport, UpstreamResponse
from gateway.types import ChatResponse

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
Event = tuple[str | None, str]


class _Content:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


class _Raw:
    """The part of aiohttp's ClientResponse the SSE reader uses: the body as network reads."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.content = _Content(pieces)
        self.released = False

    def release(self) -> None:
        self.released = True


def read_events(pieces: list[bytes]) -> tuple[list[Event], type[BaseException] | None]:
    """Every event the reader yields for a body arriving as `pieces`, and what it raised, if anything."""
    raw = _Raw(pieces)
    events: list[Event] = []

    async def run() -> None:
        async for batch in Transport().events(UpstreamResponse(200, {}, raw), "fuzz"):  # type: ignore[arg-type]
            events.extend(batch)

    error: type[BaseException] | None = None
    try:
        asyncio.run(run())
    except GatewayError as exc:
        error = type(exc)
    assert raw.released  # the connection goes back to the pool (or is closed) whatever happened
    return events, error


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


# Event data: any text but CR and LF (those end lines; a multi-line payload is several data lines).
line_text = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=30)
event_names = st.none() | st.text(
    st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs", "Zs", "Cc")),
    min_size=1,
    max_size=15,
)
events = st.lists(st.tuples(event_names, st.lists(line_text, min_size=1, max_size=3)), max_size=8)


def encode(stream: list[tuple[str | None, list[str]]], newline: bytes, comments: bool) -> bytes:
    out = bytearray()
    for name, lines in stream:
        if comments:
            out += b": keep-alive" + newline
        if name is not None:
            out += b"event: " + name.encode() + newline
        for line in lines:
            out += b"data: " + line.encode() + newline
        out += newline
    return bytes(out)


@FUZZ
@given(
    stream=events,
    newline=st.sampled_from([b"\n", b"\r\n"]),
    comments=st.booleans(),
    cuts=st.lists(st.integers(min_value=0), max_size=20),
)
def test_any_split_of_a_valid_stream_yields_the_events_sent(
    stream: list[tuple[str | None, list[str]]], newline: bytes, comments: bool, cuts: list[int]
) -> None:
    body = encode(stream, newline, comments)
    got, error = read_events(split(body, cuts))
    assert error is None
    assert got == [(name, "\n".join(lines)) for name, lines in stream]


@FUZZ
@given(stream=events, cuts=st.lists(st.integers(min_value=0), max_size=10))
def test_a_stream_cut_before_its_last_blank_line_still_yields_its_last_data(
    stream: list[tuple[str | None, list[str]]], cuts: list[int]
) -> None:
    """Vendors end streams with "\\n\\n"; one that stops after a data line's newline or mid-line
    (a proxy cutting it) still hands on what it sent, so usage in the last event is not lost."""
    body = encode(stream, b"\n", False)
    if body:
        body = body[:-1]  # the final blank line is missing
    got, error = read_events(split(body, cuts))
    assert error is None
    assert got == [(name, "\n".join(lines)) for name, lines in stream]


@FUZZ
@given(
    body=st.binary(max_size=300)
    | st.lists(
        st.sampled_from([b"data: ", b"event: x", b"\n", b"\r\n", b"\r", b":", b"\xff", b"\xe2\x82"])
    ).map(b"".join),
    cuts=st.lists(st.integers(min_value=0), max_size=20),
)
@example(body=b"data:\n\n\x80\n", cuts=[7])  # found by this test: an event before broken UTF-8 in one read
def test_garbage_yields_the_same_however_split_and_fails_only_as_a_502(body: bytes, cuts: list[int]) -> None:
    whole = read_events([body])
    pieces = read_events(split(body, cuts))
    assert pieces == whole
    assert whole[1] in (None, BadGateway)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@FUZZ
@given(body=st.binary(max_size=200) | json_like.map(lambda v: json.dumps(v).encode()))
def test_json_decoders_return_a_value_or_a_502(body: bytes) -> None:
    for decoder in (lambda b: decode_json(b, "fuzz"), lambda b: decode_typed(b, ChatResponse, "fuzz")):
        try:
            value: Any = decoder(body)
        except BadGateway as exc:
            assert exc.status == 502 and exc.message
        else:
            assert value is not None or body.strip() == b"null"


def test_a_body_nested_100k_deep_is_a_502_not_a_crash() -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(BadGateway):
        decode_json(body, "fuzz")
    with pytest.raises(BadGateway):
        decode_typed(body, ChatResponse, "fuzz")


def test_an_event_that_never_ends_is_a_502_after_64_mib_not_unbounded_memory() -> None:
    block = b"a" * 1024 * 1024
    got, error = read_events([b"data: "] + [block] * 65 + [b"\n\n"])
    assert (got, error) == ([], BadGateway)
    # Many data lines that never close the event: the same bound.
    line = b"data: " + b"a" * (1024 * 1024) + b"\n"
    got, error = read_events([line] * 65 + [b"\n"])
    assert (got, error) == ([], BadGateway)


def test_keepalives_yield_empty_batches_so_the_caller_sees_no_progress() -> None:
    raw = _Raw([b": ping\n\n", b": ping\n\n", b"data: x\n\n"])
    batches: list[list[Event]] = []

    async def run() -> None:
        async for batch in Transport().events(UpstreamResponse(200, {}, raw), "fuzz"):  # type: ignore[arg-type]
            batches.append(batch)

    asyncio.run(run())
    assert batches == [[], [], [(None, "x")]]
