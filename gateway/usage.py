"""Token usage, normalised once for every backend.

Every provider adapter turns its vendor's usage report into this one shape; accounting prices it and
the API layer renders it back in the shape the client's API expects.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int = 0  # prompt tokens billed at the full input price (cache reads and writes excluded)
    cached_input_tokens: int = 0  # prompt-cache reads
    cache_write_5m_tokens: int = 0  # prompt-cache writes at the 5-minute TTL price (Anthropic's default)
    cache_write_1h_tokens: int = 0  # prompt-cache writes at the 1-hour TTL price
    output_tokens: int = 0  # every generated token, reasoning included
    reasoning_tokens: int = 0  # the part of output_tokens spent on hidden reasoning
    # True: `reasoning_tokens` is Weir's estimate, not the vendor's count (Claude's thinking where
    # Anthropic reports no `output_tokens_details`: `gateway.estimate.with_thinking`). A breakdown
    # only, never billed: `output_tokens` holds the thinking either way.
    reasoning_estimated: bool = False
    # The service tier the vendor says it served the attempt at (OpenAI's `service_tier`: "default",
    # "flex", "priority"; Anthropic's `usage.service_tier`: "standard", "priority", "batch"); None
    # where it says none. Its prices bill the attempt (`Price.tiers`); not a token class.
    service_tier: str | None = None
    # Requests an Anthropic server tool made for the attempt (`usage.server_tool_use`). Anthropic bills
    # each web search beside the tokens ($10 per 1,000): priced as the `web_search` class, a ledger
    # column. A web fetch has no fee of its own (its pages are input tokens): counted, not priced.
    web_search_requests: int = 0
    web_fetch_requests: int = 0

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

    def prompt_only(self) -> Usage:
        """The prompt's tokens alone (cache reads and writes included), without any output."""
        return msgspec.structs.replace(self, output_tokens=0, reasoning_tokens=0)


# Usage's fields the ledger keeps no column of: how the tokens were counted or served, and web
# fetches (no fee of their own).
NOT_TOKENS = ("service_tier", "reasoning_estimated", "web_fetch_requests")
# Every amount the ledger keeps a column of, in order (the token classes, reasoning tokens, and web
# searches, billed per search); the ledger's columns, the rollups and the reports use the same names.
TOKEN_FIELDS: tuple[str, ...] = tuple(f for f in Usage.__struct_fields__ if f not in NOT_TOKENS)


# --- how each vendor reports usage ----------------------------------------------------------------
# One row per vendor wire format: where each token class lives (dotted paths into the vendor's usage
# object) and whether cache reads are counted inside the prompt total. This table is the only place
# that knows; tests pin every row, streaming and not.


class UsageShape(msgspec.Struct, frozen=True, kw_only=True):
    prompt: str  # the prompt-token count
    prompt_includes_cache: bool  # True: cache reads/writes are part of `prompt`; False: beside it
    output: str
    cache_read: str | None = None
    # Prompt tokens reported beside `prompt` and billed as uncached input: Gemini's tool-use prompts
    # (what its grounding search and code execution fed the model), outside `promptTokenCount`.
    prompt_beside: str | None = None
    cache_write: str | None = None  # total cache writes
    cache_write_5m: str | None = None  # the split of `cache_write` by TTL, when reported
    cache_write_1h: str | None = None
    reasoning: str | None = None
    reasoning_in_output: bool = True  # False: reasoning is reported beside `output` (Gemini)
    # The service tier served, where the vendor reports it inside its usage object (Anthropic); OpenAI
    # reports it beside the usage, and its adapter passes it to `normalise_usage`. Gemini reports none.
    service_tier: str | None = None
    # Server tools' requests, where the vendor runs tools and counts them (Anthropic's web search and
    # web fetch).
    web_search: str | None = None
    web_fetch: str | None = None


USAGE_SHAPES: dict[str, UsageShape] = {
    "openai": UsageShape(
        prompt="prompt_tokens",
        prompt_includes_cache=True,
        cache_read="prompt_tokens_details.cached_tokens",
        output="completion_tokens",
        reasoning="completion_tokens_details.reasoning_tokens",
    ),
    # OpenAI's Responses API (`api: responses`): the same counts as chat under other names.
    "openai_responses": UsageShape(
        prompt="input_tokens",
        prompt_includes_cache=True,
        cache_read="input_tokens_details.cached_tokens",
        output="output_tokens",
        reasoning="output_tokens_details.reasoning_tokens",
    ),
    "deepseek": UsageShape(
        prompt="prompt_tokens",
        prompt_includes_cache=True,
        cache_read="prompt_cache_hit_tokens",
        output="completion_tokens",
        reasoning="completion_tokens_details.reasoning_tokens",
    ),
    "anthropic": UsageShape(
        prompt="input_tokens",
        prompt_includes_cache=False,
        cache_read="cache_read_input_tokens",
        cache_write="cache_creation_input_tokens",
        cache_write_5m="cache_creation.ephemeral_5m_input_tokens",
        cache_write_1h="cache_creation.ephemeral_1h_input_tokens",
        output="output_tokens",
        # Newer models only (the SDKs' `OutputTokensDetails`): the full thinking's count, even where
        # the thinking text returned is a summary (Claude 4). Elsewhere the adapter estimates it
        # from the thinking text received (`gateway.estimate.with_thinking`).
        reasoning="output_tokens_details.thinking_tokens",
        service_tier="service_tier",
        web_search="server_tool_use.web_search_requests",
        web_fetch="server_tool_use.web_fetch_requests",
    ),
    "gemini": UsageShape(
        prompt="promptTokenCount",
        prompt_includes_cache=True,
        cache_read="cachedContentTokenCount",
        prompt_beside="toolUsePromptTokenCount",
        output="candidatesTokenCount",
        reasoning="thoughtsTokenCount",
        reasoning_in_output=False,
    ),
}


def _get(raw: dict[str, Any], path: str | None) -> int:
    if path is None:
        return 0
    value: Any = raw
    for key in path.split("."):
        if not isinstance(value, dict):
            return 0
        value = value.get(key)
    return value if isinstance(value, int) else 0


def _has(raw: dict[str, Any], path: str | None) -> bool:
    if path is None:
        return False
    value: Any = raw
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return False
        value = value[key]
    return isinstance(value, int)


def openai_flavour(raw: dict[str, Any]) -> str:
    """OpenAI-compatible servers differ only in how they report cache reads."""
    return "deepseek" if "prompt_cache_hit_tokens" in raw else "openai"


# The longest tier a price can name (`gateway.accounting.pricing.TierName`), and the ledger's column.
MAX_TIER = 32


def reported_tier(value: Any) -> str | None:
    """The tier a backend says served it; None for one longer than any a price can name (which bills
    the base price anyway): a server may send any string, and the ledger's column holds 32."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_TIER else None


def normalise_usage(vendor: str, raw: dict[str, Any] | None, service_tier: Any = None) -> Usage:
    """Turn a vendor's usage object into `Usage`, following that vendor's row of USAGE_SHAPES.
    `service_tier`: the tier served as reported beside the usage object (OpenAI's top-level one)."""
    if not raw:
        return Usage(service_tier=reported_tier(service_tier))
    if vendor == "openai":
        vendor = openai_flavour(raw)
    shape = USAGE_SHAPES[vendor]
    cache_read = _get(raw, shape.cache_read)
    write_total = _get(raw, shape.cache_write)
    write_1h = _get(raw, shape.cache_write_1h)
    # Unsplit writes (or a split that does not add up) are priced at the default 5-minute TTL.
    write_5m = max(write_total - write_1h, _get(raw, shape.cache_write_5m))
    prompt = _get(raw, shape.prompt)
    if shape.prompt_includes_cache:
        prompt = max(prompt - cache_read - write_5m - write_1h, 0)
    prompt += _get(raw, shape.prompt_beside)
    reasoning = _get(raw, shape.reasoning)
    output = _get(raw, shape.output)
    if not shape.reasoning_in_output:
        output += reasoning
    return Usage(
        input_tokens=prompt,
        cached_input_tokens=cache_read,
        cache_write_5m_tokens=write_5m,
        cache_write_1h_tokens=write_1h,
        output_tokens=output,
        reasoning_tokens=reasoning,
        service_tier=reported_tier(service_tier)
        or reported_tier(raw.get(shape.service_tier) if shape.service_tier else None),
        web_search_requests=_get(raw, shape.web_search),
        web_fetch_requests=_get(raw, shape.web_fetch),
    )


def openai_usage(usage: Usage) -> dict[str, Any]:
    """`Usage` in the OpenAI shape: cache reads inside `prompt_tokens`, as OpenAI reports them.

    Cache writes have no OpenAI field; they are counted in `prompt_tokens` and also reported as
    `prompt_tokens_details.cache_write_tokens` (an addition clients ignore unless they look for it).
    """
    prompt_details: dict[str, int] = {"cached_tokens": usage.cached_input_tokens}
    if usage.cache_write_tokens:
        prompt_details["cache_write_tokens"] = usage.cache_write_tokens
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": prompt_details,
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


# The tier served (`Usage.service_tier`) in the words Anthropic's `usage.service_tier` has: its own,
# and OpenAI's `default` (standard processing); another (OpenAI's `flex`, `scale`) is not said.
_ANTHROPIC_SERVED_TIERS = {
    "standard": "standard",
    "priority": "priority",
    "batch": "batch",
    "default": "standard",
}


def anthropic_usage(usage: Usage) -> dict[str, Any]:
    """`Usage` in the Anthropic shape: cache reads and writes beside the uncached `input_tokens`;
    reasoning as `output_tokens_details.thinking_tokens` where a vendor counted it, never Weir's
    estimate (Anthropic's own report of Claude's thinking reaches an Anthropic client as it was);
    the tier that served it where the vendor said one Anthropic's usage can name."""
    rendered: dict[str, Any] = {
        "input_tokens": usage.input_tokens,
        "cache_creation_input_tokens": usage.cache_write_tokens,
        "cache_read_input_tokens": usage.cached_input_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": usage.cache_write_5m_tokens,
            "ephemeral_1h_input_tokens": usage.cache_write_1h_tokens,
        },
        "output_tokens": usage.output_tokens,
    }
    if usage.reasoning_tokens and not usage.reasoning_estimated:
        rendered["output_tokens_details"] = {"thinking_tokens": usage.reasoning_tokens}
    if usage.web_search_requests or usage.web_fetch_requests:
        rendered["server_tool_use"] = {
            "web_search_requests": usage.web_search_requests,
            "web_fetch_requests": usage.web_fetch_requests,
        }
    if (tier := _ANTHROPIC_SERVED_TIERS.get(usage.service_tier or "")) is not None:
        rendered["service_tier"] = tier
    return rendered
