"""Token usage, normalised once for every backend.

Every provider adapter turns its vendor's usage report into this one shape; accounting prices it and
the API layer renders it back in the shape the client's API expects.
"""

from __future__ import annotations

import msgspec


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int = 0  # prompt tokens billed at the full input price (cache reads and writes excluded)
    cached_input_tokens: int = 0  # prompt-cache reads
    cache_write_5m_tokens: int = 0  # prompt-cache writes at the 5-minute TTL price (Anthropic's default)
    cache_write_1h_tokens: int = 0  # prompt-cache writes at the 1-hour TTL price
    output_tokens: int = 0  # every generated token, reasoning included
    reasoning_tokens: int = 0  # the part of output_tokens spent on hidden reasoning

    @property
    def cache_write_tokens(self) -> int:
        return self.cache_write_5m_tokens + self.cache_write_1h_tokens

    @property
    def prompt_tokens(self) -> int:
        """All prompt tokens, however they were billed (OpenAI's `prompt_tokens`)."""
        return self.input_tokens + self.cached_input_tokens + self.cache_write_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens
