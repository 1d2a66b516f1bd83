"""Routes: a public model name mapped to a policy, its candidates, conditions and failover settings.

Routes are plain msgspec Structs so the same definition is read from the config's `routes:` section,
from the admin API and from the admin DB. Nothing here imports the gateway (the config imports this).
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

# A trained difficulty head's name (routing.heads), as routes and the admin API take it.
HEAD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")

MAX_NAME = 200  # the admin DB's `routes.name` column, and the ledger's `route` (the name clients send)
# What a route's or a config model's name must be, both names clients send as `model`: it goes into
# x-weir-route (`route=`, `candidate=`), whose fields `;` separates (a name holding one could pass for
# another field there) and where a control character breaks the header.
NAME_RULE = (
    f"1 to {MAX_NAME} characters, no control characters or ';' (it is a model name clients send, and "
    "x-weir-route's fields are separated by ';')"
)
_UNFIT = re.compile(r"[\x00-\x1f\x7f;]")


def fit_name(name: str) -> bool:
    """Whether `name` may name a route or a configured model (`NAME_RULE`)."""
    return 0 < len(name) <= MAX_NAME and _UNFIT.search(name) is None


PolicyName = Literal["fixed", "weighted", "cheapest", "lowest_latency", "difficulty", "prefix_affinity"]


class Candidate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One configured model (by its public name in `models:`) a route may send a request to."""

    model: str
    weight: float = 1.0  # `weighted`
    # What the model can take (context_window None: the window its backend says, where it says one,
    # else assumed to fit; one the backend says smaller wins: `routing.windows`). `cheapest` weighs
    # all three; every policy skips a candidate declared without the tools or images a request has.
    context_window: int | None = None
    # The most output tokens the model writes in one answer (None: the model's own, `models[]
    # .max_output_tokens`, which this overrides; `routing.plan.Choice.max_output_tokens`). A request
    # asking for more is sent with this limit instead (vendors refuse a larger one with a 400: gpt-4o
    # takes 16,384, Claude Code asks for 32,000), and its context window must hold the prompt and this.
    max_output_tokens: int | None = None
    tools: bool = True
    vision: bool = True
    # Share of prompt tokens expected to be read from the vendor's prompt cache (`cheapest`); the
    # observed share replaces it once traffic has been seen.
    cache_hit_rate: float = 0.0
    max_in_flight: int | None = None  # `prefix_affinity`: above this the replica counts as overloaded
    # `prefix_affinity`: a replica whose last load report (within 10 s) shows this many requests queued
    # counts as overloaded too; engines report to every gateway replica (routing/load.py)
    max_waiting: int | None = None


class Conditions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """When a route applies; every field that is set must hold (None: any)."""

    tenants: list[str] | None = None  # tenant names
    keys: list[str] | None = None  # key ids
    metadata: dict[str, str] | None = None  # request `metadata` entries that must be present and equal
    tags: list[str] | None = None  # all of these in the request's `metadata.tags` (comma separated)
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    tools: bool | None = None  # True: only requests offering tools; False: only requests without
    images: bool | None = None


class Retry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    attempts: int = 2  # tries per candidate before moving on to the next
    backoff: float = 0.2  # seconds before the first retry; doubles per retry
    max_backoff: float = 5.0
    jitter: float = 0.5  # each wait is scaled by a random factor in [1 - jitter, 1]
    # A retry-after longer than this is not waited for: the next candidate is tried instead.
    max_retry_after: float = 10.0


class Hedge(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Send a second attempt to the next candidate when the first has not answered (first token when
    streaming) within `delay` seconds, or within the observed p95 time to first token."""

    delay: float | Literal["p95"] = "p95"
    min_delay: float = 0.05  # floor for the observed p95
    # USD a tenant may spend on hedged attempts per hour (each admitted on its estimate, then counted at
    # what it cost); beyond it, no more hedges.
    max_spend_usd_per_hour: float = 1.0


class Breaker(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    failures: int = 5  # consecutive failures that open the breaker
    cooldown: float = 30.0  # seconds open before one trial request (half-open)


class Compare(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """`difficulty`: answer a share of requests with both candidates and have a judge grade the two
    answers (routing.compare), so a head can be trained on both outcomes of the route's own traffic."""

    judge: str  # the model (its public name in `models:`) that grades the answers
    share: float = 0.02  # of the route's requests that can be compared (see routing.compare)
    # Estimated USD a tenant may spend on comparisons (the other candidate and the judge) per hour.
    max_spend_usd_per_hour: float = 1.0
    max_in_flight: int = 4  # this route's comparisons running at once on one replica; beyond, none starts
    # Grade twice, the answers swapped the second time, and keep the comparison only when both
    # verdicts agree on which answers are acceptable: fewer labels, far fewer wrong ones, for a second
    # judge call (benchmarks/routing_adapt.py: it recovers what a 10%-wrong judge loses). False: once.
    both_orders: bool = True


class Route(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    name: str  # the public model name clients send
    policy: PolicyName = "fixed"
    candidates: list[Candidate]
    when: Conditions | None = None  # several routes may share a name; the first that matches wins
    fallbacks: list[str] = []  # models tried, in order, after every candidate failed
    retry: Retry = Retry()
    # Which failures move on to a retry or the next candidate: statuses, "5xx" (which covers
    # timeouts, 504, and unreachable or reset backends, 502/503), or "context_length_exceeded" (a
    # prompt too long for one model: the next may have a larger window; never retried in place).
    failover_on: list[int | Literal["5xx", "context_length_exceeded"]] = msgspec.field(
        default_factory=lambda: [429, "5xx"]
    )
    ttft_timeout: float | None = None  # seconds to the first token of a stream before failing over
    hedge: Hedge | None = None
    # A stream that breaks after its first token: continue on the next candidate from the text
    # already sent (True) or end it with an SSE error event (False).
    resume: bool = True
    breaker: Breaker | None = Breaker()  # None: no circuit breaker (a plain model, tried once)
    # Seconds between active health probes of the candidates' backends (None: outcomes only).
    probe_interval: float | None = 10.0
    # `difficulty`: candidates[0] is the weak model, candidates[1] the strong one. Strong when the
    # classifier's p_strong is above `threshold`, or, when `strong_share` is set, in the top
    # `strong_share` of recent traffic.
    threshold: float = 0.5
    strong_share: float | None = None
    # `difficulty`: the name of a head trained on your own outcomes, stored in the admin DB
    # (routing.heads); None: the shipped head (the config's `difficulty_head`).
    head: str | None = None
    compare: Compare | None = None  # `difficulty`: grade both candidates' answers on a share of requests
    # `prefix_affinity`: characters of the prompt that name its prefix for rendezvous hashing.
    prefix_chars: int = 2048
    # `prefix_affinity`: follow the replica that served the longest prefix of this prompt recently
    # when that prefix is at least this share of it (a conversation's history always is). 0.3 is
    # the cache threshold vLLM's and SGLang's routers default to.
    prefix_share: float = 0.3
    # `cheapest`/`lowest_latency`: output tokens to expect of an answer (`cheapest` adds the hidden
    # reasoning each model has been seen to bill); a request's `max_tokens` caps it.
    expected_output_tokens: int = 256

    def models(self) -> list[str]:
        return [c.model for c in self.candidates] + [m for m in self.fallbacks]


_decoder = msgspec.json.Decoder(Route)
_list_decoder = msgspec.json.Decoder(list[Route])


def decode_route(data: bytes) -> Route:
    return _decoder.decode(data)


def decode_routes(data: bytes) -> list[Route]:
    return _list_decoder.decode(data)


def encode(value: Route | list[Route]) -> bytes:
    return msgspec.json.encode(value)
