"""Failover through a real gateway, with the official SDKs as clients and faults injected in the fakes.

For each fault: what the client sees, which backends were tried (x-weir-route and the fakes' request
logs), and what the ledger holds (one usage event per attempt, exactly one successful one per request).
"""

from __future__ import annotations

import time

import openai
import pytest

from gateway.state import MemoryState
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import (
    counted_micro_usd,
    fallbacks,
    ledger,
    route_header,
    routed_gateway,
    runtime,
    settled,
)

# `gateway` is the routed gateway of tests/routing/conftest.py, with the shared routes (routed.ROUTES).
HI = [{"role": "user", "content": "one two three four five six"}]
ECHO = "one two three four five six"


def chat(gateway: RunningGateway, model: str, **kwargs: object) -> tuple[str, dict[str, str]]:
    raw = gateway.openai().chat.completions.with_raw_response.create(model=model, messages=HI, **kwargs)  # type: ignore[arg-type]
    return raw.parse().choices[0].message.content or "", route_header(raw)


def test_429_with_retry_after_is_retried_on_the_same_backend(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.status(429, retry_after=0.3))
    started = time.monotonic()
    text, route = chat(gateway, "resilient")
    assert text == ECHO
    assert time.monotonic() - started >= 0.3  # retry-after honoured
    assert (route["candidate"], route["attempts"]) == ("gpt-4o-mini", "2")
    assert ledger(gateway) == [("openai", 429), ("openai", 200)]
    assert not fake_anthropic.requests
    assert fallbacks(gateway) == [False, False]  # a retry is no fallback


def test_429_with_a_long_retry_after_fails_over_at_once(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.status(429, retry_after=30))
    started = time.monotonic()
    text, route = chat(gateway, "resilient")
    assert text == ECHO and time.monotonic() - started < 5
    assert route["candidate"] == "claude-sonnet" and route["tried"] == "gpt-4o-mini:429,claude-sonnet:ok"
    assert ledger(gateway) == [("openai", 429), ("anthropic", 200)]
    assert fallbacks(gateway) == [False, True]


def test_500_exhausts_retries_then_falls_over(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(500, times=2)
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["candidate"] == "claude-sonnet" and route["attempts"] == "3"
    assert ledger(gateway) == [("openai", 500), ("openai", 500), ("anthropic", 200)]
    # The retry on gpt-4o-mini is no fallback; the failover to claude-sonnet is.
    assert fallbacks(gateway) == [False, False, True]
    assert len(fake_openai.requests) == 2 and len(fake_anthropic.requests) == 1


def test_529_overloaded_anthropic_falls_over_to_openai(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.fail_next(529, times=2)
    text, route = chat(gateway, "anthropic-first")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini"
    assert ledger(gateway) == [("anthropic", 529), ("anthropic", 529), ("openai", 200)]


def test_connection_reset_is_retried(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.reset())
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini" and route["attempts"] == "2"
    assert ledger(gateway) == [("openai", 0), ("openai", 200)]  # 0: the backend never answered


def test_a_400_caused_by_the_request_does_not_fail_over(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.status(400, message="bad temperature"))
    with pytest.raises(openai.BadRequestError, match="bad temperature"):
        chat(gateway, "resilient")
    assert ledger(gateway) == [("openai", 400)]
    assert not fake_anthropic.requests


def test_slow_first_byte_hits_the_route_ttft_timeout_and_fails_over_invisibly(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.delay(3), times=2)
    started = time.monotonic()
    stream = gateway.openai().chat.completions.create(model="impatient-route", messages=HI, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ECHO
    assert time.monotonic() - started < 2.5  # two 0.3 s timeouts, not the 3 s delays
    settled(gateway, 3)
    assert [b for b, _ in ledger(gateway)] == ["openai", "openai", "anthropic"]
    assert ledger(gateway)[-1] == ("anthropic", 200)


def test_a_stream_cut_mid_way_continues_on_the_next_candidate(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    stream = gateway.openai().chat.completions.create(model="resilient", messages=HI, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ECHO  # one uninterrupted stream
    assert len({c.id for c in chunks}) == 1
    # The second backend was asked to continue the text already sent.
    resumed = fake_anthropic.last_request.json["messages"]
    prefill = "".join(block["text"] for block in resumed[-1]["content"])
    assert resumed[-1]["role"] == "assistant" and prefill and ECHO.startswith(prefill)
    settled(gateway, 2)
    assert [b for b, _ in ledger(gateway)] == ["openai", "anthropic"]
    assert sum(e.ok for e in gateway.sink.events) == 1  # billed once, for the attempt that finished


def test_a_stream_cut_where_resuming_is_forbidden_ends_with_an_error_event(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    stream = gateway.openai().chat.completions.create(model="no-resume", messages=HI, stream=True)
    received = []
    with pytest.raises(openai.APIError):
        for chunk in stream:  # never a clean end
            received.extend(c.delta.content or "" for c in chunk.choices)
    assert received and "".join(received) != ECHO
    assert not fake_anthropic.requests


@pytest.mark.parametrize(
    "extra",
    [{"n": 2}, {"response_format": {"type": "json_object"}}],
)
def test_a_cut_stream_of_several_choices_or_of_json_is_not_resumed(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, extra: dict
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    stream = gateway.openai().chat.completions.create(
        model="resilient",
        messages=HI,
        stream=True,
        **extra,  # type: ignore[arg-type]
    )
    with pytest.raises(openai.APIError):
        for _ in stream:  # the text sent so far cannot be continued as one assistant turn
            pass
    assert not fake_anthropic.requests


def test_a_backend_that_is_down_and_comes_back(
    gateway: RunningGateway, fake_deepseek: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    # Its own route and backend, with a 2 s cooldown: with the shared 0.5 s one, a busy machine could
    # spend the whole cooldown between two requests and find the breaker half-open already.
    breakers = runtime(gateway).router.breakers
    key = "deepseek/deepseek-chat"
    fake_deepseek.stop()
    for _ in range(2):
        text, route = chat(gateway, "recovering")
        assert text == ECHO and route["candidate"] == "claude-sonnet"
    assert breakers.state(key) == "open"  # three refused connections (with retries) opened it
    text, route = chat(gateway, "recovering")
    assert route["tried"] == "deepseek-chat:open,claude-sonnet:ok"  # not even tried while open
    fake_deepseek.start()
    deadline = time.monotonic() + 10
    while breakers.state(key) != "half_open":  # the cooldown
        assert time.monotonic() < deadline
        time.sleep(0.05)
    text, route = chat(gateway, "recovering")
    assert text == ECHO and route["candidate"] == "deepseek-chat"  # the trial request succeeded
    assert breakers.state(key) == "closed"
    refused = [e for e in gateway.sink.events if e.backend == "deepseek" and e.status == 0]
    assert len(refused) >= 3  # attempts that never got an answer are in the ledger too


def test_fallback_chain_after_the_candidates(gateway: RunningGateway, fake_gemini: FakeGemini) -> None:
    text, route = chat(gateway, "chain")
    assert text == ECHO and route["candidate"] == "gemini-flash" and route["reason"] == "fallback"
    assert [b for b, _ in ledger(gateway)] == ["dead", "dead", "gemini"]


def test_hedging_takes_the_first_to_stream_and_cancels_the_other(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    fake_openai.set_latency(first_token=2.0)
    started = time.monotonic()
    raw = gateway.openai().chat.completions.with_raw_response.create(model="hedged", messages=HI, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text == ECHO and time.monotonic() - started < 1.5
    route = route_header(raw)
    assert route["candidate"] == "deepseek-chat" and route["hedged"] == "deepseek-chat"
    assert len(fake_openai.requests) == 1 and len(fake_deepseek.requests) == 1
    settled(gateway, 2)
    by_backend = {e.backend: e.status for e in gateway.sink.events}
    assert by_backend == {"deepseek": 200, "openai": 499}  # the loser was cancelled
    # Every attempt gave its in-flight slot back (the loser's stream was closed, never iterated).
    assert all(n == 0 for n in runtime(gateway).router.context.in_flight.values())


def test_hedging_respects_the_tenant_spend_cap(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    fake_openai.set_latency(first_token=0.4)
    text, route = chat(gateway, "hedged-capped")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini" and route["hedge"] == "capped"
    assert not fake_deepseek.requests


def test_the_hedge_cap_counts_what_hedges_cost_not_their_estimate(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    """A hedge asked for 1,000 tokens is charged about $0.015 of the tenant's hourly cap when it
    starts; once its usage event is priced the cap holds what it cost instead: the winner's short
    answer, the cancelled loser's prompt."""
    hedges = runtime(gateway).executor.hedges
    hedges.state = MemoryState()  # this test's window only
    fake_openai.set_latency(first_token=1.0)  # the primary is slow: the hedge wins
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="hedged-sonnet", messages=HI, stream=True, max_tokens=1000
    )
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    assert route_header(raw)["hedged"] == "claude-sonnet"
    fake_openai.set_latency(first_token=0.4)  # the primary answers first: the hedge loses
    fake_anthropic.set_latency(first_token=2.0)
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="hedged-sonnet", messages=HI, stream=True, max_tokens=1000
    )
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == ECHO
    assert route_header(raw)["candidate"] == "gpt-4o-mini"
    settled(gateway, 4)
    hedged = [e for e in gateway.sink.events if e.backend == "anthropic"]
    assert [e.status for e in hedged] == [200, 499]
    assert all(e.cost_pico_usd > 0 for e in hedged)  # both cost something: the loser its prompt
    spent = sum(e.cost_pico_usd for e in hedged) // 10**6
    assert spent < 15_000 // 10  # micro-USD: far below one estimate
    assert counted_micro_usd(hedges, hedged[0].tenant_id or "anonymous", "hedged-sonnet", spent, tolerance=3)


def test_plain_models_keep_single_attempt_semantics(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(500)
    with pytest.raises(openai.InternalServerError):
        chat(gateway, "gpt-4o-mini")
    assert ledger(gateway) == [("openai", 500)]


def test_usage_events_store_the_route_decision(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(500)
    _, route = chat(gateway, "resilient")
    events = sorted(gateway.sink.events, key=lambda e: e.attempt)
    assert [e.route for e in events] == ["resilient", "resilient"]  # the name the client asked for
    assert all(e.routing is not None and "policy=fixed" in e.routing for e in events)
    assert "candidate=gpt-4o-mini" in (events[-1].routing or "") and route["attempts"] == "2"


def test_anthropic_clients_fail_over_too(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(500, times=2)
    raw = gateway.anthropic().messages.with_raw_response.create(
        model="resilient", max_tokens=100, messages=HI
    )
    message = raw.parse()
    assert message.content[0].text == ECHO  # type: ignore[union-attr]
    assert route_header(raw)["candidate"] == "claude-sonnet"
    assert ledger(gateway) == [("openai", 500), ("openai", 500), ("anthropic", 200)]


PROBED = """\
routes:
  - name: probed
    probe_interval: 0.1
    retry: {attempts: 1}
    breaker: {failures: 2, cooldown: 60}
    candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}]
"""


def test_health_probes_open_and_half_open_the_breaker(
    fake_vendors: FakeVendors, fresh_fakes: None, fake_openai: FakeOpenAI
) -> None:
    with routed_gateway(fake_vendors, PROBED) as gateway:
        breakers = runtime(gateway).router.breakers
        key = "openai/gpt-4o-mini"
        fake_openai.stop()
        deadline = time.monotonic() + 5
        while breakers.state(key) != "open":  # the probes alone open it, before any request fails
            assert time.monotonic() < deadline
            time.sleep(0.05)
        text, route = chat(gateway, "probed")
        assert text == ECHO and route["tried"] == "gpt-4o-mini:open,claude-sonnet:ok"
        fake_openai.start()
        deadline = time.monotonic() + 5
        while breakers.state(key) != "half_open":  # a probe answered: no need to sit out the 60 s
            assert time.monotonic() < deadline
            time.sleep(0.05)
        text, route = chat(gateway, "probed")
        assert text == ECHO and route["candidate"] == "gpt-4o-mini"
        assert breakers.state(key) == "closed"


def test_a_half_open_trial_answered_with_a_400_closes_the_breaker(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    breakers = runtime(gateway).router.breakers
    key = "openai/gpt-4o-mini"
    settings = runtime(gateway).router.routes["resilient"][0].breaker
    breakers.get(key, settings).trip(now=time.monotonic() - 1)  # opened a second ago; cooldown 0.5 s
    assert breakers.state(key) == "half_open"
    fake_openai.fail_next(Fault.status(400, message="bad request"))
    with pytest.raises(openai.BadRequestError):
        chat(gateway, "resilient")
    assert breakers.state(key) == "closed"  # the backend answered: it is up
    text, route = chat(gateway, "resilient")
    assert text == ECHO and route["candidate"] == "gpt-4o-mini"


def test_metrics_count_attempts_and_show_breakers(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(f"{gateway.url}/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    attempt_502 = (
        "weir_route_attempts_total",
        (("candidate", "gpt-4o-mini"), ("outcome", "502"), ("route", "resilient")),
    )
    before = samples().get(attempt_502, 0.0)
    fake_openai.fail_next(500, times=2)
    chat(gateway, "resilient")
    after = samples()
    assert after[attempt_502] == before + 2
    assert after[("weir_route_breaker_state", (("breaker", "openai/gpt-4o-mini"),))] == 0  # 2 of 3: closed


def test_a_resumed_stream_keeps_to_the_client_output_limit(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic
) -> None:
    fake_openai.fail_next(Fault.cut_stream(after=3))
    stream = gateway.openai().chat.completions.create(
        model="resilient", messages=HI, stream=True, max_tokens=4
    )
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    # Four tokens in all, across both backends (the fake drops the continuation's leading space when
    # it truncates at max_tokens, hence the comparison without spaces).
    assert len(pieces) == 4 and "".join(pieces).replace(" ", "") == "onetwothreefour"
    sent = fake_anthropic.last_request.json
    prefill = "".join(block["text"] for block in sent["messages"][-1]["content"])
    assert sent["max_tokens"] == 4 - len(prefill.split())


def test_count_tokens_skips_candidates_that_cannot_count_and_fails_over(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, fake_gemini: FakeGemini
) -> None:
    # `counted`: gpt-4o-mini (OpenAI has no count endpoint), claude-sonnet, then gemini-flash.
    client = gateway.anthropic()
    raw = client.messages.with_raw_response.count_tokens(model="counted", messages=HI)  # type: ignore[arg-type]
    assert raw.parse().input_tokens == 6 and route_header(raw)["candidate"] == "claude-sonnet"
    assert ledger(gateway) == [("anthropic", 200)] and not fake_openai.requests
    gateway.sink.events.clear()
    fake_anthropic.fail_next(500, times=2)
    raw = client.messages.with_raw_response.count_tokens(model="counted", messages=HI)  # type: ignore[arg-type]
    assert raw.parse().input_tokens == 6 and route_header(raw)["candidate"] == "gemini-flash"
    assert ledger(gateway) == [("anthropic", 500), ("anthropic", 500), ("gemini", 200)]
