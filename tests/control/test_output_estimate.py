"""What admission reserves for a request's output: its cap for every choice it asks for."""

from __future__ import annotations

import msgspec
import pytest

from gateway.estimate import DEFAULT_OUTPUT_ESTIMATE, output_estimate


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"model": "m", "max_tokens": 100}, 100),
        ({"model": "m", "max_completion_tokens": 80, "max_tokens": 100}, 80),
        ({"model": "m", "max_tokens": 100, "n": 4}, 400),  # OpenAI: every choice is billed
        ({"model": "m", "n": 3}, 3 * DEFAULT_OUTPUT_ESTIMATE),
        ({"generationConfig": {"maxOutputTokens": 50, "candidateCount": 2}}, 100),  # Gemini
        ({"model": "m", "max_tokens": 64, "messages": []}, 64),  # Anthropic
        ({"model": "m"}, DEFAULT_OUTPUT_ESTIMATE),
        ({"model": "m", "max_tokens": 10, "n": 0}, 10),
    ],
)
def test_the_output_reserved_covers_every_choice(body: dict, tokens: int) -> None:
    assert output_estimate(msgspec.json.encode(body)) == tokens


def test_an_unreadable_body_reserves_the_default() -> None:
    assert output_estimate(b"not json") == DEFAULT_OUTPUT_ESTIMATE
    assert output_estimate(b'{"max_tokens": "lots"}') == DEFAULT_OUTPUT_ESTIMATE
