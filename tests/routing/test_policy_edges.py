"""Routing policies at their edges, planned in-process (no HTTP): weights far apart, nothing that
fits, cold and failing candidates, scores at and around a threshold, strong shares on little, equal or
split traffic. Each checks the plan's order and what `x-weir-route` says about it."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable

import msgspec
import pytest

from gateway import anthropic_inbound
from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import price_usage
from gateway.auth import Principal
from gateway.config import parse_config
from gateway.estimate import CHAT_TOKENS, MESSAGE_TOKENS
from gateway.pipeline import price_sheet
from gateway.router_basic import ModelTable
from gateway.types import ChatRequest
from gateway.usage import Usage
from routing.plan import Features, Plan, features, prompt_features
from routing.router import Router
from routing.routes import Candidate, Conditions, Route
from routing.stats import REMEASURE_S, RETRY_UNMEASURED_S
from tests.control.events import usage_event
from tests.routing.routed import sent

CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
  - {name: other, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
  - {name: claude, type: anthropic, base_url: "http://127.0.0.1:9", api_key: k}
models:
  - {name: small, backend: openai, price: {input: 0.15, cached_input: 0.015, output: 0.6}}
  - {name: mid, backend: openai, price: {input: 1, cached_input: 0.1, output: 4}}
  - {name: big, backend: other, price: {input: 3, cached_input: 0.3, output: 15}}
  - {name: writes, backend: other, price: {input: 3, cached_input: 0.3, cache_write_5m: 3.75, cache_write_1h: 6, output: 15}}
  - {name: plain, backend: openai, price: {input: 2, output: 15}}
  - {name: terse, backend: other, price: {input: 5, output: 5}}
  - {name: sonnet, backend: claude, price: {input: 3, cached_input: 0.3, cache_write_5m: 3.75, output: 15}}
"""
ACME = Principal(tenant_id="t1", tenant_name="acme", key_id="k1")
OTHER = Principal(tenant_id="t2", tenant_name="other", key_id="k2")


def router(*routes: Route, seed: int = 0) -> Router:
    r = Router(ModelTable(parse_config(CONFIG, {})), routes)
    r.context.rng = random.Random(seed)
    return r


def route(name: str, policy: str, *models: str, **fields: object) -> Route:
    return Route(
        name=name,
        policy=policy,  # type: ignore[arg-type]
        candidates=[Candidate(model=m) for m in models],
        probe_interval=None,
        **fields,  # type: ignore[arg-type]
    )


def feats(
    text: str = "hello",
    principal: Principal = ACME,
    tools: bool = False,
    image: bool = False,
    max_tokens: int | None = None,
    cache: bool = False,
    n: int | None = None,
) -> Features:
    content: object = text
    if cache:  # an Anthropic prompt-cache breakpoint at the end of the prompt
        content = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]
    if image:
        url = "data:image/png;base64,iVBORw0KGgo="
        content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    body: dict[str, object] = {"model": "r", "messages": [{"role": "user", "content": content}]}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if n is not None:
        body["n"] = n
    return features(msgspec.convert(body, ChatRequest), principal.tenant_name, principal.key_id)


def header(plan: Plan) -> dict[str, str]:
    return dict(part.split("=", 1) for part in plan.header().split("; "))


def event(
    model: str,
    *,
    status: int = 200,
    ttft_s: float | None = 0.1,
    decode_s: float = 0.4,
    cached: int = 0,
    usage: Usage | None = None,
) -> UsageEvent:
    backend = {"big": "other", "writes": "other", "terse": "other", "sonnet": "claude"}.get(model, "openai")
    return usage_event(
        "r",
        tenant_id=None,
        key_id=None,
        route="r",
        backend=backend,
        model=model,
        usage=usage or Usage(input_tokens=1000 - cached, cached_input_tokens=cached, output_tokens=40),
        latency_ms=((ttft_s or 0.1) + decode_s) * 1000,
        ttft_ms=None if ttft_s is None else ttft_s * 1000,
        status=status,
    )


def within_binomial(count: int, n: int, p: float) -> bool:
    """`count` of `n` draws is within 5 standard deviations of n·p (a false alarm in ~1 of 2 million)."""
    return abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1


# --- weighted ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights",
    [
        (100.0, 1.0, 1.0),  # one weight far above the rest
        (0.0001, 0.0003, 0.0003),  # small weights: u^(1/w) underflowed to 0, ties went to the first
        (1e17, 3e17, 3e17),  # huge ones: it rounded to 1
        (1e-12, 3e-12, 3e-12),  # below 1e-9: each was taken as 1e-9, so drawn alike
        (5e-324, 1.5e-323, 1.5e-323),  # the smallest floats: ln(u)/w overflowed to -inf, a tie
    ],
)
async def test_weighted_first_choice_follows_the_weights(weights: tuple[float, ...]) -> None:
    r = Route(
        name="w",
        policy="weighted",
        candidates=[
            Candidate(model=m, weight=w) for m, w in zip(("small", "mid", "big"), weights, strict=True)
        ],
        probe_interval=None,
    )
    planner = router(r, seed=11)
    n, first = 2000, {"small": 0, "mid": 0, "big": 0}
    for _ in range(n):
        plan = await planner.plan("w", ACME, feats())
        first[plan.choices[0].candidate.model] += 1
        assert sorted(c.candidate.model for c in plan.choices) == ["big", "mid", "small"]
    total = sum(weights)
    for model, weight in zip(("small", "mid", "big"), weights, strict=True):
        assert within_binomial(first[model], n, weight / total), (first, weights)
    # The header's score is the chosen candidate's weight.
    chosen = plan.choices[0]
    assert header(plan)["score"] == f"{chosen.candidate.weight:.6g}" and header(plan)["reason"] == "weighted"


async def test_weighted_shares_an_open_candidates_traffic_by_the_others_weights() -> None:
    """The executor skips a candidate whose breaker is open and takes the next in plan order: the
    order after the first is weighted too, so the rest split its traffic by their own weights."""
    r = Route(
        name="w",
        policy="weighted",
        candidates=[
            Candidate(model="small", weight=8),
            Candidate(model="mid"),
            Candidate(model="big", weight=3),
        ],
        probe_interval=None,
    )
    planner = router(r, seed=5)
    n, served = 2000, {"mid": 0, "big": 0}
    for _ in range(n):
        plan = await planner.plan("w", ACME, feats())
        served[next(c.candidate.model for c in plan.choices if c.candidate.model != "small")] += 1
    assert within_binomial(served["mid"], n, 0.25), served


# --- cheapest ---------------------------------------------------------------------------------------


async def test_cheapest_fits_the_window_with_the_output_the_candidate_is_sent() -> None:
    """Claude Code asks for 32,000 output tokens; `small` writes 16,384 at most, and an attempt there
    is sent with that limit, so its 20,000-token window holds the prompt and all it may write.
    Counted at the 32,000 asked for, it was ruled out (`reason=context_window`) and the dearer `big`
    answered every such request."""

    def cheap_small(limit: int | None) -> Route:
        return Route(
            name="c",
            policy="cheapest",
            candidates=[
                Candidate(model="small", context_window=20_000, max_output_tokens=limit),
                Candidate(model="big", context_window=200_000),
            ],
            probe_interval=None,
        )

    plan = await router(cheap_small(16_384)).plan("c", ACME, feats("hi", max_tokens=32_000))
    assert [(c.candidate.model, c.reason) for c in plan.choices] == [
        ("small", "cheapest_fit"),
        ("big", "cheapest_fit"),
    ]
    assert header(plan)["output_capped"] == "16384"
    # Undeclared, the model may write the whole limit: it does not fit.
    plan = await router(cheap_small(None)).plan("c", ACME, feats("hi", max_tokens=32_000))
    assert [c.candidate.model for c in plan.choices] == ["big"]


async def test_cheapest_with_nothing_that_fits_asks_the_likeliest_candidate_first() -> None:
    """A 400 is never failed over, so the first candidate is the only one asked: where nothing fits by
    the estimate, the largest window (the prompt's size is estimated) goes first, and a candidate that
    lacks a capability the request needs goes last. Before, the first listed went first."""
    r = Route(
        name="c",
        policy="cheapest",
        candidates=[
            Candidate(model="small", context_window=1000),
            Candidate(model="big", context_window=4000, tools=False),
            Candidate(model="mid", context_window=3000),
        ],
        probe_interval=None,
    )
    planner = router(r)
    long = "word " * 4000  # ~5,000 tokens by the estimate: above every window
    plan = await planner.plan("c", ACME, feats(long))
    assert [c.candidate.model for c in plan.choices] == ["big", "mid", "small"]
    route_header = header(plan)
    assert (route_header["candidate"], route_header["reason"]) == ("big", "context_window")
    assert float(route_header["score"]) > 0  # still the expected USD
    # With tools: big cannot take them whatever the prompt's real size, so the widest that can.
    plan = await planner.plan("c", ACME, feats(long, tools=True))
    assert [c.candidate.model for c in plan.choices] == ["mid", "small", "big"]
    assert [c.reason for c in plan.choices] == ["context_window", "context_window", "context_window"]
    # A short prompt with tools: only big misfits, and a misfit is not in the failover order.
    plan = await planner.plan("c", ACME, feats("hi", tools=True))
    assert [c.candidate.model for c in plan.choices] == ["small", "mid"]
    assert header(plan)["reason"] == "cheapest_fit"
    # An image, and no candidate says it lacks vision: they fit.
    plan = await planner.plan("c", ACME, feats("hi", image=True))
    assert plan.choices[0].candidate.model == "small"


async def test_cheapest_fits_a_candidate_in_the_window_its_backend_serves() -> None:
    """A candidate's `context_window` declared larger than its backend serves (`max_model_len` in its
    model list, `ContextWindows.served`) no longer fits a prompt the backend cannot hold: `cheapest`
    fits it in the window its attempt is fitted in (`ContextWindows.of`), the smaller, as a declared
    window below the served one is kept (an operator's limit). Fitted on the declared 128,000 alone,
    the cheap `small` took a prompt its 2,000-token server refuses."""
    r = Route(
        name="c",
        policy="cheapest",
        candidates=[
            Candidate(model="small", context_window=128_000),
            Candidate(model="big", context_window=128_000),
        ],
        probe_interval=None,
    )
    planner = router(r)
    planner.windows.served("openai", {"small": 2_000})
    long = "word " * 2000  # ~2,500 tokens by the estimate: above the served 2,000
    plan = await planner.plan("c", ACME, feats(long))
    assert [(c.candidate.model, c.reason) for c in plan.choices] == [("big", "cheapest_fit")]
    plan = await planner.plan("c", ACME, feats("hi"))
    assert [(c.candidate.model, c.reason) for c in plan.choices] == [
        ("small", "cheapest_fit"),
        ("big", "cheapest_fit"),
    ]
    # Nothing fits: the largest window the gateway knows goes first, the served one where it is
    # smaller than declared (it was a tie at the declared 128,000, and the cheaper `small` first).
    planner.windows.served("other", {"big": 3_000})
    plan = await planner.plan("c", ACME, feats("word " * 4000))
    assert [(c.candidate.model, c.reason) for c in plan.choices] == [
        ("big", "context_window"),
        ("small", "context_window"),
    ]
    # A declared window below the served one is the operator's limit, as for the attempt's room.
    capped = [Candidate(model="small", context_window=1_000), r.candidates[1]]
    planner.set_routes([msgspec.structs.replace(r, candidates=capped)])
    plan = await planner.plan("c", ACME, feats("word " * 1000))  # ~1,250 tokens: fits 2,000, not 1,000
    assert [c.candidate.model for c in plan.choices] == ["big"]


async def test_cheapest_learns_the_cache_hit_share_of_each_model_from_traffic() -> None:
    """The configured `cache_hit_rate` holds until the model's usage events are seen (of prompts of
    the request's size); then the observed share (of that model, whoever sent the traffic) replaces
    it, in both directions."""
    r = Route(
        name="c",
        policy="cheapest",
        candidates=[Candidate(model="mid", cache_hit_rate=0.95), Candidate(model="small")],
        probe_interval=None,
        expected_output_tokens=1,
    )
    planner = router(r)
    prompt = "w " * 20000  # prompt-heavy: the input price decides
    plan = await planner.plan("c", ACME, feats(prompt))
    assert plan.choices[0].candidate.model == "mid"  # 95% of its prompt at a tenth of 1.00 < 0.15
    # Another tenant's traffic, prompts as long: no cache hits seen.
    planner.stats.record(event("mid", usage=Usage(input_tokens=10_000, output_tokens=40)))
    plan = await planner.plan("c", OTHER, feats(prompt))
    assert [c.candidate.model for c in plan.choices] == ["small", "mid"]
    prompt_tokens = feats(prompt).prompt_tokens  # 40,000 bytes of text and the JSON around it
    one_turn = CHAT_TOKENS + MESSAGE_TOKENS  # and the chat template's allowance for its one turn
    assert 10_000 + one_turn < prompt_tokens < 10_020 + one_turn
    assert float(header(plan)["score"]) == pytest.approx(prompt_tokens * 0.15 / 1e6 + 0.6 / 1e6)


# Traffic whose prompts the cache partly serves and partly is written with, at either TTL.
READ_AND_WRITE_5M = Usage(cached_input_tokens=5000, cache_write_5m_tokens=5000)
READ_AND_WRITE_1H = Usage(input_tokens=2000, cached_input_tokens=4000, cache_write_1h_tokens=4000)


async def test_cheapest_prices_cache_writes_at_what_they_bill() -> None:
    """Cache writes count in the observed share of the prompt the cache did not serve, but were
    priced at the input price, although they bill at `cache_write_5m` (Anthropic: 1.25x input): a
    model whose traffic writes its cache often looked cheaper than it bills, and won over one that is
    cheaper. Half read, half written, `writes` bills 0.5·0.3 + 0.5·3.75 = 2.025/M prompt tokens
    (it was estimated 0.5·0.3 + 0.5·3 = 1.65), above `plain`'s 2.00."""
    r = Route(
        name="c",
        policy="cheapest",
        candidates=[Candidate(model="writes"), Candidate(model="plain")],
        probe_interval=None,
        expected_output_tokens=1,
    )
    planner = router(r)
    planner.stats.record(event("writes", usage=READ_AND_WRITE_5M))
    plan = await planner.plan("c", ACME, feats("w " * 20000))
    assert [c.candidate.model for c in plan.choices] == ["plain", "writes"]


@pytest.mark.parametrize("usage", [READ_AND_WRITE_5M, READ_AND_WRITE_1H], ids=["5m", "1h"])
@pytest.mark.parametrize("model", ["writes", "big"])  # big: no write prices, writes bill as input
async def test_cheapest_expects_a_prompt_to_cost_what_its_models_traffic_bills(
    usage: Usage, model: str
) -> None:
    """Its observed shares of reads and of writes at each TTL, each at the price that bills it."""
    config = parse_config(CONFIG, {})
    planner = router(route("c", "cheapest", model, expected_output_tokens=1))
    planner.stats.record(event(model, usage=usage))
    request = feats("w " * 20000)
    plan = await planner.plan("c", ACME, request)
    sheet = price_sheet(next(m for m in config.models if m.name == model))
    billed = price_usage(msgspec.structs.replace(usage, output_tokens=1), sheet).cost_pico_usd / 1e12
    output = price_usage(Usage(output_tokens=1), sheet).cost_pico_usd / 1e12
    per_prompt = (billed - output) / usage.prompt_tokens
    assert plan.choices[0].score == pytest.approx(request.prompt_tokens * per_prompt + output)


async def test_cheapest_expects_the_usual_answer_not_the_requests_output_limit() -> None:
    """A client's `max_tokens` is a ceiling (the Messages API requires one; 4,096 or 8,192 is the
    usual setting), not the answer's length: priced at it, `terse`'s cheap output won although the
    request costs more than twice as much there. `plain` at 256 expected output tokens: 10,000 prompt
    tokens · 2/M + 256 · 15/M = 0.0238 USD, `terse` 0.0513. The window still has to hold the limit."""
    planner = router(route("c", "cheapest", "terse", "plain"))
    request = feats("w " * 20000, max_tokens=8192)
    plan = await planner.plan("c", ACME, request)
    assert [c.candidate.model for c in plan.choices] == ["plain", "terse"]
    expected = (request.prompt_tokens * 2 + 256 * 15) / 1e6
    assert float(header(plan)["score"]) == pytest.approx(expected, rel=1e-5)
    # A limit below the expected output caps it.
    plan = await planner.plan("c", ACME, feats("w " * 20000, max_tokens=100))
    assert plan.choices[0].score == pytest.approx((request.prompt_tokens * 2 + 100 * 15) / 1e6)
    # The window is checked against the limit, not the expected answer.
    windowed = Route(
        name="w",
        policy="cheapest",
        candidates=[Candidate(model="plain", context_window=12_000), Candidate(model="terse")],
        probe_interval=None,
    )
    plan = await router(windowed).plan("w", ACME, feats("w " * 20000, max_tokens=8192))
    assert [c.candidate.model for c in plan.choices] == ["terse"]


async def test_cheapest_prices_every_choice_a_request_asks_for() -> None:
    """`n` choices each write (and bill) their own output while the prompt is billed once; priced as
    one answer, `plain` (output 15/M) stayed first for a request of 8 choices that costs far more
    there than on `terse` (output 5/M). A completions request's `n` counts alike."""
    planner = router(route("c", "cheapest", "plain", "terse"))
    prompt = "w " * 4000
    one = feats(prompt)
    plan = await planner.plan("c", ACME, one)
    assert [c.candidate.model for c in plan.choices] == ["plain", "terse"]

    eight = feats(prompt, n=8)
    plan = await planner.plan("c", ACME, eight)
    assert [c.candidate.model for c in plan.choices] == ["terse", "plain"]
    assert [c.score for c in plan.choices] == [
        pytest.approx((one.prompt_tokens * 5 + 8 * 256 * 5) / 1e6),
        pytest.approx((one.prompt_tokens * 2 + 8 * 256 * 15) / 1e6),
    ]
    completion = prompt_features("c", prompt, "acme", "k1", n=8)
    assert completion.choices == 8
    plan = await planner.plan("c", ACME, completion)
    assert [c.candidate.model for c in plan.choices] == ["terse", "plain"]
    # A completion's `best_of` candidates are generated and billed too, for each of its prompts.
    assert prompt_features("c", prompt, "acme", "k1", n=1, best_of=8).choices == 8
    assert prompt_features("c", [prompt, prompt], "acme", "k1", n=2, best_of=4).choices == 8
    assert prompt_features("c", [1, 2, 3], "acme", "k1", n=3).choices == 3  # one prompt of token ids
    plan = await planner.plan("c", ACME, prompt_features("c", prompt, "acme", "k1", best_of=8))
    assert [c.candidate.model for c in plan.choices] == ["terse", "plain"]


async def test_cheapest_counts_the_hidden_reasoning_a_model_writes() -> None:
    """A reasoning model bills thousands of output tokens the client never sees. Priced at the
    route's `expected_output_tokens` alone it looked as cheap as a model that writes just the answer;
    the reasoning its answers were observed to bill is expected on top, up to the request's limit."""
    planner = router(route("c", "cheapest", "plain", "terse"))
    prompt = "w " * 20000
    assert (await planner.plan("c", ACME, feats(prompt))).choices[0].candidate.model == "plain"
    thinking = Usage(input_tokens=9000, output_tokens=4000, reasoning_tokens=3800)
    for _ in range(3):
        planner.stats.record(event("plain", usage=thinking))
        planner.stats.record(event("terse", usage=Usage(input_tokens=9000, output_tokens=200)))
    plan = await planner.plan("c", ACME, feats(prompt))
    assert [c.candidate.model for c in plan.choices] == ["terse", "plain"]
    prompt_tokens = feats(prompt).prompt_tokens
    assert [c.score for c in plan.choices] == [
        pytest.approx((prompt_tokens * 5 + 256 * 5) / 1e6),
        pytest.approx((prompt_tokens * 2 + (256 + 3800) * 15) / 1e6),
    ]
    # A request that lets it write 300 tokens at most costs at most that much output there.
    plan = await planner.plan("c", ACME, feats(prompt, max_tokens=300))
    assert [c.candidate.model for c in plan.choices] == ["plain", "terse"]


async def test_cheapest_expects_a_long_prompt_to_hit_the_cache_as_long_prompts_do() -> None:
    """`big`'s traffic: an agent's long prompts, 90% read from its cache, and three short calls (a
    title, below any vendor's minimum to cache) for each. Averaged per answer, its share was ~25%, so a
    long prompt was expected to cost 2.3/M there, above `plain`'s 2/M; it bills 0.57/M. The share is
    now of tokens: the long prompts', which are where the cost is."""
    planner = router(route("c", "cheapest", "plain", "big", expected_output_tokens=1))
    long = Usage(input_tokens=1000, cached_input_tokens=9000, output_tokens=40)
    short = Usage(input_tokens=100, output_tokens=40)
    for _ in range(5):
        for usage in (long, short, short, short):
            planner.stats.record(event("big", usage=usage))
    plan = await planner.plan("c", ACME, feats("w " * 20000))
    assert [c.candidate.model for c in plan.choices] == ["big", "plain"]
    assert plan.choices[0].score is not None and plan.choices[1].score is not None
    assert plan.choices[0].score < plan.choices[1].score / 2
    # As /routes/status reports it: the share of the model's recent prompt tokens.
    assert planner.stats.get("other", "big").cache_hit_rate == pytest.approx(0.87, abs=0.03)


async def test_cheapest_expects_no_cache_discount_on_anthropic_without_a_breakpoint() -> None:
    """Anthropic reads its prompt cache only up to a `cache_control` breakpoint. `sonnet`'s traffic
    (clients that mark one) reads 90% from it, and that share was expected of every request: one
    without a breakpoint, which bills the full 3/M there, went to it over `plain`'s 2/M."""
    planner = router(route("c", "cheapest", "sonnet", "plain", expected_output_tokens=1))
    for _ in range(3):
        planner.stats.record(event("sonnet", usage=Usage(input_tokens=1000, cached_input_tokens=9000)))
    prompt = "w " * 20000
    plan = await planner.plan("c", ACME, feats(prompt))
    assert [c.candidate.model for c in plan.choices] == ["plain", "sonnet"]
    assert plan.choices[1].score == pytest.approx((feats(prompt).prompt_tokens * 3 + 15) / 1e6)
    plan = await planner.plan("c", ACME, feats(prompt, cache=True))
    assert [c.candidate.model for c in plan.choices] == ["sonnet", "plain"]
    # The configured share, before any traffic, likewise.
    configured = Route(
        name="k",
        policy="cheapest",
        candidates=[Candidate(model="sonnet", cache_hit_rate=0.9), Candidate(model="plain")],
        probe_interval=None,
        expected_output_tokens=1,
    )
    planner = router(configured)
    assert (await planner.plan("k", ACME, feats(prompt))).choices[0].candidate.model == "plain"
    assert (await planner.plan("k", ACME, feats(prompt, cache=True))).choices[0].candidate.model == "sonnet"


async def test_cheapest_counts_automatic_caching_as_a_breakpoint() -> None:
    """An Anthropic client's top-level `cache_control` (automatic caching) has Claude put the
    breakpoint on the last block itself: the request reads the cache as `sonnet`'s marked traffic
    does, so its discount is expected and `sonnet` (0.3/M read) goes before `plain` (2/M)."""
    planner = router(route("c", "cheapest", "sonnet", "plain", expected_output_tokens=1))
    for _ in range(3):
        planner.stats.record(event("sonnet", usage=Usage(input_tokens=1000, cached_input_tokens=9000)))
    body = {
        "model": "c",
        "max_tokens": 1,
        "cache_control": {"type": "ephemeral"},
        "messages": [{"role": "user", "content": "w " * 20000}],
    }
    request = anthropic_inbound.to_canonical(msgspec.convert(body, anthropic_inbound.MessagesRequest))
    plan = await planner.plan("c", ACME, features(request, ACME.tenant_name, ACME.key_id))
    assert [c.candidate.model for c in plan.choices] == ["sonnet", "plain"]


_MARK = {"cache_control": {"type": "ephemeral"}}
_SEARCH = {"type": "web_search_20250305", "name": "web_search"}
_SEARCH_CALL = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}}
_SEARCH_RESULT = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}
_SEARCH_TOOLS = {"type": "tool_use", "id": "toolu_1", "name": "tool_search", "input": {}}
_REFERENCE = {"type": "tool_reference", "tool_name": "grep"}
Marked = dict[str, object]


def _searched(mark: Marked) -> tuple[list[Marked], list[Marked]]:
    """A server tool's turn, kept as the client sent it, `mark`ed on its search result."""
    return [_SEARCH], [{"role": "assistant", "content": [_SEARCH_CALL, {**_SEARCH_RESULT, **mark}]}]


def _referenced(mark: Marked) -> tuple[list[Marked], list[Marked]]:
    """A tool result kept as the client sent it (a tool search's `tool_reference`), `mark`ed there."""
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{**_REFERENCE, **mark}]}
    return [], [{"role": "assistant", "content": [_SEARCH_TOOLS]}, {"role": "user", "content": [result]}]


def _server_tool(mark: Marked) -> tuple[list[Marked], list[Marked]]:
    """A tool of Anthropic's own API (a server tool) `mark`ed: the prefix of tools is cached."""
    return [{**_SEARCH, **mark}], []


@pytest.mark.parametrize("shape", [_searched, _referenced, _server_tool])
async def test_cheapest_sees_a_breakpoint_kept_as_the_client_sent_it(
    shape: Callable[[Marked], tuple[list[Marked], list[Marked]]],
) -> None:
    """A `cache_control` marker in blocks an Anthropic backend is sent as the client sent them (a server
    tool's turn, a tool result with a `tool_reference`) or on a tool of Anthropic's own API is a
    breakpoint Claude caches up to. Unseen, such a request was expected to read none of `sonnet`'s
    cache, and went to `plain` (2/M) over `sonnet` (0.3/M read), as one without a marker does."""
    planner = router(route("c", "cheapest", "sonnet", "plain", expected_output_tokens=1))
    for _ in range(3):
        planner.stats.record(event("sonnet", usage=Usage(input_tokens=1000, cached_input_tokens=9000)))

    async def first(mark: Marked) -> str:
        tools, turns = shape(mark)
        messages = [{"role": "user", "content": "w " * 20000}, *turns, {"role": "user", "content": "go on"}]
        body = {"model": "c", "max_tokens": 1, "messages": messages, "tools": tools}
        request = anthropic_inbound.to_canonical(msgspec.convert(body, anthropic_inbound.MessagesRequest))
        plan = await planner.plan("c", ACME, features(request, ACME.tenant_name, ACME.key_id))
        return plan.choices[0].candidate.model

    assert await first(_MARK) == "sonnet"
    assert await first({}) == "plain"


async def test_cheapest_expects_a_short_prompt_to_miss_the_cache_as_short_prompts_do() -> None:
    """Vendors cache no prompt under a minimum (1,024 tokens at OpenAI, Anthropic, Gemini Flash):
    `big`'s long prompts read 90% from its cache, its short ones nothing. Each size is expected to
    do as the model's prompts of that size do: a short one bills 3/M on `big`, above `plain`'s 2/M."""
    planner = router(route("c", "cheapest", "plain", "big", expected_output_tokens=1))
    for _ in range(5):
        for usage in (Usage(input_tokens=1000, cached_input_tokens=9000), Usage(input_tokens=100)):
            planner.stats.record(event("big", usage=usage))
    short = feats("w " * 200)
    plan = await planner.plan("c", ACME, short)
    assert [c.candidate.model for c in plan.choices] == ["plain", "big"]
    assert plan.choices[1].score == pytest.approx((short.prompt_tokens * 3 + 15) / 1e6)
    assert (await planner.plan("c", ACME, feats("w " * 20000))).choices[0].candidate.model == "big"


# --- lowest_latency -----------------------------------------------------------------------------------


async def test_lowest_latency_measures_each_candidate_then_keeps_the_fastest() -> None:
    planner = router(route("f", "lowest_latency", "small", "mid", "big"))
    explored = []
    for ttft in (0.5, 0.05, 0.3):  # each answer measures the candidate it went to
        plan = await planner.plan("f", ACME, feats())
        first = plan.choices[0]
        assert (first.reason, first.score) == ("unmeasured", None)
        explored.append(first.candidate.model)
        planner.stats.record(event(first.candidate.model, ttft_s=ttft))
    assert explored == ["small", "mid", "big"]
    plan = await planner.plan("f", ACME, feats())
    assert [c.candidate.model for c in plan.choices] == ["mid", "big", "small"]
    route_header = header(plan)
    assert (route_header["candidate"], route_header["reason"]) == ("mid", "expected_seconds")


async def test_lowest_latency_does_not_keep_a_failing_unmeasured_candidate_first() -> None:
    """A candidate that never answered has no slow numbers: it stayed "unmeasured", so it was every
    request's first attempt (with no breaker, for as long as it failed). It had its turn: after its
    failure it goes behind the measured ones, and is tried first again once RETRY_UNMEASURED_S passed."""
    planner = router(route("f", "lowest_latency", "small", "mid", breaker=None))
    planner.stats.record(event("mid", ttft_s=0.2))
    plan = await planner.plan("f", ACME, feats())
    assert plan.choices[0].candidate.model == "small"  # unmeasured: explored first
    planner.stats.record(event("small", status=503, ttft_s=None))
    for _ in range(3):
        plan = await planner.plan("f", ACME, feats())
        assert [c.candidate.model for c in plan.choices] == ["mid", "small"]
    assert plan.choices[1].reason == "unmeasured_failed"
    assert header(plan)["candidate"] == "mid"
    # A 4xx the request caused, or a cancelled attempt (499), says nothing about the candidate.
    for status in (400, 499):
        planner.stats.get("openai", "small").failed_at = None
        planner.stats.record(event("small", status=status, ttft_s=None))
        assert (await planner.plan("f", ACME, feats())).choices[0].candidate.model == "small"
    planner.stats.record(event("small", status=0, ttft_s=None))  # never answered
    assert (await planner.plan("f", ACME, feats())).choices[0].candidate.model == "mid"
    stats = planner.stats.get("openai", "small")
    assert stats.failed_at is not None
    stats.failed_at -= RETRY_UNMEASURED_S + 1
    assert (await planner.plan("f", ACME, feats())).choices[0].candidate.model == "small"


async def test_lowest_latency_follows_a_candidate_that_gets_slower() -> None:
    planner = router(route("f", "lowest_latency", "small", "mid"))
    for _ in range(5):
        planner.stats.record(event("small", ttft_s=0.1))
        planner.stats.record(event("mid", ttft_s=0.3))
    planner.stats.record(event("small", ttft_s=1.0))  # one slow answer: a moving average, not the last
    assert (await planner.plan("f", ACME, feats())).choices[0].candidate.model == "small"
    planner.stats.record(event("small", ttft_s=1.0))
    planner.stats.record(event("small", ttft_s=1.0))
    plan = await planner.plan("f", ACME, feats())
    assert [c.candidate.model for c in plan.choices] == ["mid", "small"]


async def test_lowest_latency_expects_the_usual_answer_not_the_requests_output_limit() -> None:
    """The route's answers are about 40 tokens; `small` starts at once and decodes at ~49 tokens/s,
    `mid` starts in a second at ~195 tokens/s. Expected at the request's `max_tokens` (4,096), the
    decode speed decided (`small` 84 s, `mid` 22 s); what the answer takes is ~0.9 s against ~1.2 s."""
    planner = router(route("f", "lowest_latency", "small", "mid", expected_output_tokens=40))
    for _ in range(3):
        planner.stats.record(event("small", ttft_s=0.1, decode_s=0.8))
        planner.stats.record(event("mid", ttft_s=1.0, decode_s=0.2))
    plan = await planner.plan("f", ACME, feats(max_tokens=4096))
    assert [c.candidate.model for c in plan.choices] == ["small", "mid"]
    assert float(header(plan)["score"]) == pytest.approx(0.1 + 40 / (39 / 0.8), rel=1e-4)


async def test_lowest_latency_measures_again_a_candidate_it_stopped_asking() -> None:
    """A backend measured while slow (an incident) got no more traffic, so its estimate never learned
    that it recovered: it stayed behind for good. Once its estimate is REMEASURE_S old it gets one
    request (`reason=remeasure`), and the answer replaces the stale average."""
    planner = router(route("f", "lowest_latency", "small", "mid"))
    for _ in range(5):
        planner.stats.record(event("small", ttft_s=3.0))
        planner.stats.record(event("mid", ttft_s=0.3))
    plan = await planner.plan("f", ACME, feats())
    assert [c.candidate.model for c in plan.choices] == ["mid", "small"]
    slow = planner.stats.get("openai", "small")
    assert slow.learned_at is not None
    slow.learned_at -= REMEASURE_S + 1  # mid kept answering; small was last heard from long ago
    preview = await planner.plan("f", ACME, feats(), record=False)
    assert preview.choices[0].candidate.model == "small"
    plan = await planner.plan("f", ACME, feats())
    assert [(c.candidate.model, c.reason) for c in plan.choices] == [
        ("small", "remeasure"),
        ("mid", "expected_seconds"),
    ]
    assert header(plan)["reason"] == "remeasure"
    plan.commit()  # sent: the next requests do not all go there before its answer comes
    assert (await planner.plan("f", ACME, feats())).choices[0].candidate.model == "mid"
    planner.stats.record(event("small", ttft_s=0.1))  # it recovered
    plan = await planner.plan("f", ACME, feats())
    assert [c.candidate.model for c in plan.choices] == ["small", "mid"]
    assert plan.choices[0].reason == "expected_seconds"


async def test_lowest_latency_does_not_remeasure_a_candidate_behind_an_open_breaker() -> None:
    planner = router(route("f", "lowest_latency", "small", "mid"))
    for _ in range(5):
        planner.stats.record(event("small", ttft_s=3.0))
        planner.stats.record(event("mid", ttft_s=0.3))
    slow = planner.stats.get("openai", "small")
    assert slow.learned_at is not None
    slow.learned_at -= REMEASURE_S + 1
    breaker = planner.breakers.get(planner.breakers.key("openai", "small"))
    for _ in range(5):
        breaker.failure()
    plan = await planner.plan("f", ACME, feats())
    assert [(c.candidate.model, c.reason) for c in plan.choices] == [
        ("mid", "expected_seconds"),
        ("small", "expected_seconds"),
    ]


async def test_lowest_latency_sends_one_request_to_measure_each_unmeasured_candidate() -> None:
    """An unmeasured candidate is measured by its answer's usage event, which comes when the attempt
    ends (after a whole stream). Until then every request went to it: after each restart, a flood of
    each candidate in turn, the slow ones too. One request measures it; the next go elsewhere."""
    planner = router(route("f", "lowest_latency", "small", "mid", "big"))
    preview = await planner.plan("f", ACME, feats(), record=False)  # sends nothing
    assert preview.choices[0].candidate.model == "small"
    went = []
    for _ in range(4):
        plan = await planner.plan("f", ACME, feats())
        plan.commit()  # sent; no answer yet
        went.append((plan.choices[0].candidate.model, plan.choices[0].reason))
    # Once each is being measured, the listed order, as before any was.
    assert went == [
        ("small", "unmeasured"),
        ("mid", "unmeasured"),
        ("big", "unmeasured"),
        ("small", "measuring"),
    ]
    planner.stats.record(event("mid", ttft_s=0.2))
    plan = await planner.plan("f", ACME, feats())
    assert [(c.candidate.model, c.reason) for c in plan.choices] == [
        ("mid", "expected_seconds"),
        ("small", "measuring"),
        ("big", "measuring"),
    ]
    small = planner.stats.get("openai", "small")
    assert small.measuring_at is not None
    small.measuring_at -= RETRY_UNMEASURED_S + 1  # no answer in that long: asked again
    plan = await planner.plan("f", ACME, feats())
    assert (plan.choices[0].candidate.model, plan.choices[0].reason) == ("small", "unmeasured")


async def test_lowest_latency_spreads_a_burst_planned_before_any_is_sent() -> None:
    """A cold route's opening burst: every request is planned (admission still awaiting a Redis round
    trip or a budget seed) before the first is sent and marks its candidate `measuring`. Each went to
    the first listed candidate, so only it was measured; planned in turn, each candidate gets one."""
    planner = router(route("f", "lowest_latency", "small", "mid", "big"))
    preview = await planner.plan("f", ACME, feats(), record=False)  # sends nothing, moves nothing
    assert preview.choices[0].candidate.model == "small"
    burst = [await planner.plan("f", ACME, feats()) for _ in range(4)]
    assert [(p.choices[0].candidate.model, p.choices[0].reason) for p in burst] == [
        ("small", "unmeasured"),
        ("mid", "unmeasured"),
        ("big", "unmeasured"),
        ("small", "unmeasured"),
    ]
    for plan in burst:
        plan.commit()  # now sent, none answered yet
    assert {c.reason for c in (await planner.plan("f", ACME, feats())).choices} == {"measuring"}


async def test_lowest_latency_expects_a_candidate_without_a_decode_speed_to_decode_at_the_median() -> None:
    """`small` has answered only streams of 8 tokens, too short to time its decode: scored on its time
    to first token alone (0.1 s), it beat candidates whose score counts the whole 400-token answer.
    It is expected to decode at the median of the others' measured speeds."""
    planner = router(route("f", "lowest_latency", "small", "mid", "big", expected_output_tokens=400))
    for _ in range(3):
        planner.stats.record(event("small", ttft_s=0.1, usage=Usage(input_tokens=100, output_tokens=8)))
        planner.stats.record(event("mid", ttft_s=0.3, decode_s=0.4))  # 39 tokens in 0.4 s
        planner.stats.record(event("big", ttft_s=0.3, decode_s=0.2))  # in 0.2 s
    assert planner.stats.get("openai", "small").tokens_per_s is None
    plan = await planner.plan("f", ACME, feats())
    median = (39 / 0.4 + 39 / 0.2) / 2
    assert [(c.candidate.model, c.score) for c in plan.choices] == [
        ("big", pytest.approx(0.3 + 400 / (39 / 0.2))),
        ("small", pytest.approx(0.1 + 400 / median)),
        ("mid", pytest.approx(0.3 + 400 / (39 / 0.4))),
    ]


# --- difficulty ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "p_strong", "strong"),
    [(0.5, 0.5, False), (0.5, 0.5000001, True), (0.0, 0.0, False), (0.0, 0.001, True), (1.0, 1.0, False)],
)
async def test_difficulty_goes_strong_only_above_the_threshold(
    threshold: float, p_strong: float, strong: bool
) -> None:
    planner = router(route("d", "difficulty", "small", "big", threshold=threshold))
    planner.context.scorer = lambda prompt: p_strong
    plan = await planner.plan("d", ACME, feats())
    route_header = header(plan)
    assert route_header["candidate"] == ("big" if strong else "small")
    assert route_header["reason"] == ("hard" if strong else "easy")
    assert float(route_header["score"]) == pytest.approx(p_strong)
    assert float(route_header["threshold"]) == threshold


@pytest.mark.parametrize(("share", "p_strong", "model"), [(0.0, 0.99, "small"), (1.0, 0.01, "big")])
async def test_a_strong_share_of_0_or_1_holds_from_the_first_request(
    share: float, p_strong: float, model: str
) -> None:
    """Until the window holds enough scores the route's `threshold` applies, but a share of 0 means
    never strong and 1 always: the first requests went by the 0.5 threshold instead."""
    planner = router(route("d", "difficulty", "small", "big", strong_share=share))
    planner.context.scorer = lambda prompt: p_strong
    for _ in range(5):
        plan = await planner.plan("d", ACME, feats())
        assert plan.choices[0].candidate.model == model
    assert header(plan)["threshold"] == ("inf" if share == 0 else "-inf")


async def test_a_strong_share_holds_when_scores_are_equal() -> None:
    """Scores tied at the threshold (one repeated prompt, a head that scores many alike): the share of
    them that keeps the target goes strong. Before, none did: 0% strong for any share below 1."""
    planner = router(route("d", "difficulty", "small", "big", strong_share=0.3))
    scores = iter([0.4] * 600 + [0.2 if i % 2 else 0.4 for i in range(3000)])
    planner.context.scorer = lambda prompt: next(scores)
    picks = [(await sent(planner.plan("d", ACME, feats()))).choices[0].candidate.model for _ in range(3600)]
    assert picks[:600].count("big") == pytest.approx(180, abs=2)  # all equal: 30% of them, from the first
    # Half at 0.2, half at 0.4 once the window (2,000) holds only the mix: the 0.4s are the top half,
    # and 60% of them keep the route at 30%.
    assert picks[-1000:].count("big") == pytest.approx(300, abs=3)


async def test_routes_sharing_a_name_keep_their_own_strong_share() -> None:
    """Two routes of one name (`when:` tells them apart) with their own targets: they shared one
    window, each replacing the other's whenever its target differed, so neither left the warm-up and
    both went by the 0.5 threshold (half strong, whatever the target)."""
    routes = [
        route("d", "difficulty", "small", "big", strong_share=0.1, when=Conditions(tenants=["acme"])),
        route("d", "difficulty", "small", "big", strong_share=0.7),
    ]
    planner = router(*routes)
    rng = random.Random(3)
    planner.context.scorer = lambda prompt: rng.random()
    strong = {"acme": 0, "other": 0}
    for i in range(1200):
        principal = ACME if i % 2 else OTHER
        plan = await sent(planner.plan("d", principal, feats(principal=principal)))
        if i >= 400:  # both windows past their warm-up
            strong[principal.tenant_name] += plan.choices[0].candidate.model == "big"
    assert strong["acme"] / 400 == pytest.approx(0.1, abs=0.06)
    assert strong["other"] / 400 == pytest.approx(0.7, abs=0.08)
    assert len(planner.context.calibrators) == 2


async def test_a_strong_share_holds_from_a_replicas_first_requests() -> None:
    """Each replica's window starts empty (at start, with a new head or a new target). Its first 50
    requests went by the route's `threshold` (0.5 unless set), above nearly all of the shipped head's
    scores (1.4% of MMLU's): ten fresh replicas' first 20 requests each at a target of 30% sent none
    strong. Ranked among the scores seen so far, they keep the share."""
    rng = random.Random(5)
    strong = 0
    for _ in range(10):
        planner = router(route("d", "difficulty", "small", "big", strong_share=0.3))
        planner.context.scorer = lambda prompt: rng.uniform(0.05, 0.45)
        for _ in range(20):
            plan = await sent(planner.plan("d", ACME, feats()))
            strong += plan.choices[0].candidate.model == "big"
    assert strong / 200 == pytest.approx(0.3, abs=0.05)


async def test_a_nan_score_goes_weak_and_the_route_keeps_routing() -> None:
    """A scorer's NaN (no order: every comparison false) went into the window's sorted index out of
    place, and the index then dropped other scores in its place as the window moved: the threshold was
    no longer the window's quantile, and once a score the window still held was gone from the index,
    planning could raise (ZeroDivisionError, IndexError) for the route's requests."""
    planner = router(route("d", "difficulty", "small", "big", strong_share=0.3))
    rng = random.Random(2)
    scores = iter([rng.random() for _ in range(10)] + [math.nan] + [rng.random() for _ in range(2500)])
    planner.context.scorer = lambda prompt: next(scores)
    picks = [(await sent(planner.plan("d", ACME, feats()))).choices[0].candidate.model for _ in range(11)]
    assert picks[-1] == "small"
    picks = [(await sent(planner.plan("d", ACME, feats()))).choices[0].candidate.model for _ in range(2500)]
    assert picks[-500:].count("big") == pytest.approx(150, abs=30)
    (calibrator,) = planner.context.calibrators.values()
    assert len(calibrator) == 2000 and sorted(calibrator._recent) == calibrator._sorted


async def test_x_weir_route_shows_the_threshold_as_precisely_as_the_score() -> None:
    """At 4 digits a threshold of 0.612345 read 0.6123, below the score 0.61234 that went easy."""
    planner = router(route("d", "difficulty", "small", "big", threshold=0.612345))
    planner.context.scorer = lambda prompt: 0.61234
    route_header = header(await planner.plan("d", ACME, feats()))
    assert route_header["reason"] == "easy"
    assert float(route_header["score"]) <= float(route_header["threshold"]) == 0.612345


async def test_a_preview_of_a_strong_share_route_changes_no_later_decision() -> None:
    """Previews and token counts learn nothing: with tied scores at the share's edge, the requests
    sent between previews go as they would without them."""
    decisions = []
    for previews in (False, True):
        planner = router(route("d", "difficulty", "small", "big", strong_share=0.3))
        planner.context.scorer = lambda prompt: 0.4
        picks = []
        for _ in range(40):
            if previews:
                await planner.plan("d", ACME, feats(), record=False)
            plan = await sent(planner.plan("d", ACME, feats()))
            picks.append(plan.choices[0].candidate.model)
        decisions.append(picks)
    assert decisions[0] == decisions[1]
    assert decisions[0].count("big") == pytest.approx(12, abs=1)


async def test_a_new_strong_share_applies_to_the_window_at_once() -> None:
    """The window holds the head's scores, whatever share is asked of them. Edited from 30% to 10%,
    the route started an empty one: its next requests were ranked among a few scores, so one at
    0.95 of scores uniform on [0, 1) went weak and the threshold read 0.95, not 0.9."""
    planner = router(route("d", "difficulty", "small", "big", strong_share=0.3))
    rng = random.Random(8)
    planner.context.scorer = lambda prompt: rng.random()
    for _ in range(2000):
        await sent(planner.plan("d", ACME, feats()))
    planner.set_routes([route("d", "difficulty", "small", "big", strong_share=0.1)])
    planner.context.scorer = lambda prompt: 0.95
    plan = await sent(planner.plan("d", ACME, feats()))
    assert plan.choices[0].candidate.model == "big"
    assert float(header(plan)["threshold"]) == pytest.approx(0.9, abs=0.03)
    ((target, window),) = [(c.target_share, len(c)) for c in planner.context.calibrators.values()]
    assert (target, window) == (0.1, 2000)


async def test_a_burst_on_a_new_strong_share_route_keeps_the_share() -> None:
    """A route's first requests, planned together before any is sent (a batch job's opening burst),
    are each ranked alone, owed the target share: one credit across them spreads it. Each made a
    window of its own, kept only once sent, so each read an empty credit and all went weak."""
    planner = router(route("d", "difficulty", "small", "big", strong_share=0.3))
    rng = random.Random(6)
    planner.context.scorer = lambda prompt: rng.random()
    plans = await asyncio.gather(*(planner.plan("d", ACME, feats()) for _ in range(100)))
    assert sum(plan.choices[0].candidate.model == "big" for plan in plans) == pytest.approx(30, abs=1)
