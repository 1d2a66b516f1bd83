"""Gemini has no `$defs`, so the gateway inlines a tool's local `$ref`s. A kilobyte of definitions each
referring twice to the next doubles per level: without a bound shared by the whole request, a body of
many such tools (any tenant may send one, within `server.max_body_bytes`) became gigabytes and held
the event loop for minutes. Ordinary references are still inlined."""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.errors import decode_body
from gateway.providers import gemini
from gateway.types import ChatRequest


def _doubling_tool(i: int, levels: int = 20) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"a{n}": {"anyOf": [{"$ref": f"#/$defs/a{n + 1}"}, {"$ref": f"#/$defs/a{n + 1}"}]}
        for n in range(levels)
    }
    defs[f"a{levels}"] = {"type": "string"}
    parameters = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "$defs": defs}
    return {"type": "function", "function": {"name": f"t{i}", "parameters": parameters}}


def _request(tools: list[dict[str, Any]]) -> ChatRequest:
    body = {"model": "gemini-flash", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    return decode_body(json.dumps(body).encode(), ChatRequest)


def test_inlining_is_bounded_per_request_not_per_tool() -> None:
    request = _request([_doubling_tool(i) for i in range(200)])  # ~300 KB sent
    started = time.perf_counter()
    body = gemini.chat_body(request, "gemini-2.5-flash")
    elapsed = time.perf_counter() - started
    size = len(json.dumps(body))
    # Per tool, each became ~80 KB (16 MB here; 1 GB for a 20 MiB body) and took ~80 ms (16 s here).
    assert size < 2_000_000, size
    assert elapsed < 2.0, elapsed
    declarations = body["tools"][0]["functionDeclarations"]
    assert len(declarations) == 200  # every tool is still sent, its reference an object past the budget


def test_a_definition_holding_many_definitions_is_not_copied_per_reference() -> None:
    # One definition that carries 50,000 definitions of its own, referred to 5,000 times.
    inner = {f"d{n}": {"type": "string"} for n in range(50_000)}
    parameters = {
        "type": "object",
        "properties": {f"p{n}": {"$ref": "#/$defs/big"} for n in range(5_000)},
        "$defs": {"big": {"type": "object", "$defs": inner}},
    }
    request = _request([{"type": "function", "function": {"name": "f", "parameters": parameters}}])
    started = time.perf_counter()
    gemini.chat_body(request, "gemini-2.5-flash")
    assert time.perf_counter() - started < 2.0


def test_ordinary_references_are_still_inlined() -> None:
    address = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"ship{i}",
                "parameters": {
                    "type": "object",
                    "properties": {"to": {"$ref": "#/$defs/Address"}, "from": {"$ref": "#/$defs/Address"}},
                    "$defs": {"Address": address},
                },
            },
        }
        for i in range(300)
    ]
    body = gemini.chat_body(_request(tools), "gemini-2.5-flash")
    for declaration in body["tools"][0]["functionDeclarations"]:
        properties = declaration["parameters"]["properties"]
        assert properties["to"] == address and properties["from"] == address
