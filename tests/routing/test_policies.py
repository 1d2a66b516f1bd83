"""Routing policies and route conditions through a real gateway (official openai SDK as client)."""

from __future__ import annotations

import collections
import contextlib
import random
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from gateway.types import ChatRequest, Message
from routing.difficulty import DifficultyClassifier
from routing.plan import Choice, Lesson, Plan, features
from routing.policies import PolicyContext, order
from routing.routes import Candidate, Route
from routing.stats import RoutingStats
from tests.fakes import FakeAnthropic, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import LIMITED_KEY, RunningGateway
from tests.routing.routed import route_header, routed_config_text, runtime

ROUTES = """\
routes:
  - {name: weighted, policy: weighted, candidates: [{model: gpt-4o-mini, weight: 3}, {model: deepseek-chat, weight: 1}]}
  - name: cheap
    policy: cheapest
    candidates:
      - {model: claude-sonnet, context_window: 200000}
      - {model: gpt-4o-mini, context_window: 300, vision: false}
      - {model: gemini-flash, context_window: 1000000}
  - {name: fast, policy: lowest_latency, candidates: [{model: gpt-4o-mini}, {model: deepseek-chat}]}
  - name: fast-reasoner
    policy: lowest_latency
    expected_output_tokens: 10
    candidates: [{model: deepseek-reasoner}, {model: gpt-4o-mini}]
  - name: fast-hedged
    policy: lowest_latency
    hedge: {delay: 0.5}
    candidates: [{model: gpt-4o-mini}, {model: deepseek-chat}]
  - {name: smart, policy: difficulty, threshold: 0.5, candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}]}
  - {name: smart-share, policy: difficulty, strong_share: 0.25, candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}]}
  - name: replicas
    policy: prefix_affinity
    prefix_chars: 40
    candidates: [{model: gpt-4o-mini, max_in_flight: 1000}, {model: deepseek-chat, max_in_flight: 1000}, {model: gpt-5, max_in_flight: 1000}]
  - {name: tiered, when: {tools: true}, candidates: [{model: claude-sonnet}]}
  - {name: tiered, when: {metadata: {tier: gold}}, candidates: [{model: gpt-5}]}
  - {name: tiered, when: {tags: [batch]}, candidates: [{model: deepseek-chat}]}
  - {name: tiered, when: {min_prompt_tokens: 50}, candidates: [{model: gemini-flash}]}
  - {name: tiered, candidates: [{model: gpt-4o-mini}]}
  - {name: demo-only, when: {tenants: [demo]}, candidates: [{model: gpt-4o-mini}]}
  - {name: smart-half, policy: difficulty, strong_share: 0.5, candidates: [{model: gpt-4o-mini}, {model: deepseek-chat}]}
  - name: smart-hedged
    policy: difficulty
    strong_share: 0.5
    retry: {attempts: 1}
    hedge: {delay: 0.1}
    candidates: [{model: gpt-4o-mini}, {model: deepseek-chat}]
  - {name: replicas-once, policy: prefix_affinity, retry: {attempts: 1}, candidates: [{model: gpt-4o-mini}, {model: deepseek-chat}]}
"""
HARD = (
    "Prove that every finite integral domain is a field, then derive the order of its multiplicative group."
)
EASY = "hi"
ONE_STREAM_KEY = "sk-weir-one-stream-0123456789"


@pytest.fixture(scope="module")
def gateway_config() -> str:
    # A tenant allowed one stream at a time: its second is refused by the gateway itself (429),
    # before anything goes upstream.
    tenant = '  - {name: one-stream, api_keys: ["${ONE_STREAM_KEY}"], max_concurrent_streams: 1}'
    return routed_config_text(ROUTES).replace("\nserver:\n", f"\n{tenant}\nserver:\n", 1)


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return {"ONE_STREAM_KEY": ONE_STREAM_KEY}  # tenant keys come from the environment, never the file


@pytest.fixture(scope="module")
def _routed(_routed: RunningGateway) -> RunningGateway:
    # A deterministic stand-in for the shipped classifier (tested on its own in test_difficulty): the
    # policy is what is under test here.
    runtime(_routed).router.context.scorer = lambda prompt: 0.9 if "Prove" in prompt else 0.1
    return _routed


def ask(gateway: RunningGateway, model: str, text: str = "hello there", **kwargs: object) -> dict[str, str]:
    raw = gateway.openai(
        kwargs.pop("api_key", None) or "sk-weir-demo-0123456789"
    ).chat.completions.with_raw_response.create(  # type: ignore[arg-type]
        model=model, messages=[{"role": "user", "content": text}], **kwargs
    )
    assert raw.parse().choices[0].message.content
    return route_header(raw)


def test_weighted_follows_the_weights(gateway: RunningGateway) -> None:
    picks = collections.Counter(ask(gateway, "weighted")["candidate"] for _ in range(60))
    assert set(picks) == {"gpt-4o-mini", "deepseek-chat"}
    assert 30 <= picks["gpt-4o-mini"] <= 57  # expected 45 of 60 (3:1)


def test_cheapest_counts_fit_and_price(gateway: RunningGateway) -> None:
    route = ask(gateway, "cheap")
    assert route["candidate"] == "gpt-4o-mini" and route["reason"] == "cheapest_fit"
    # Too long for gpt-4o-mini's 300-token window: the next cheapest that fits.
    route = ask(gateway, "cheap", text="word " * 400)
    assert route["candidate"] == "gemini-flash"
    # An image: gpt-4o-mini (vision: false here) is skipped.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="cheap", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
    )
    assert route_header(raw)["candidate"] == "gemini-flash"
    assert float(route["score"]) > 0  # the expected cost in USD


def test_cheapest_counts_the_expected_cache_discount(gateway: RunningGateway) -> None:
    from gateway.types import ChatRequest, Message
    from routing.plan import Choice, features
    from routing.policies import expected_cost
    from routing.routes import Candidate

    gw = runtime(gateway)
    target = gw.models.targets["claude-sonnet"]
    # A breakpoint: Anthropic caches only what one marks.
    marked = Message(role="user", content="w " * 4000, cache_control={"type": "ephemeral"})
    feats = features(ChatRequest(model="x", messages=[marked]), None, None)
    cold = expected_cost(Choice(target, Candidate(model="claude-sonnet")), feats, 100, gw.router.context)
    warm = expected_cost(
        Choice(target, Candidate(model="claude-sonnet", cache_hit_rate=0.9)), feats, 100, gw.router.context
    )
    assert warm < cold * 0.5  # cached reads at a tenth of the input price


def test_lowest_latency_learns_from_observed_ttft(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    # The same decode speed on both, so time to first token decides. (Three-token replies teach no
    # decode speed: see MIN_DECODE_TOKENS; 0.5 s leaves room for scheduling stalls on a busy host.)
    fake_openai.set_latency(first_token=0.5, per_token=0.01)
    fake_deepseek.set_latency(first_token=0.0, per_token=0.01)
    for _ in range(4):  # both measured (unmeasured candidates are tried first)
        stream = gateway.openai().chat.completions.create(
            model="fast", messages=[{"role": "user", "content": "a b c"}], stream=True
        )
        list(stream)
    # A short answer: time to first token dominates the expected seconds.
    route = ask(gateway, "fast", max_tokens=5)
    assert route["candidate"] == "deepseek-chat"
    assert route["reason"] == "expected_seconds" and float(route["score"]) > 0


def test_lowest_latency_counts_the_reasoning_a_model_streams_after_its_first_token(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """DeepSeek's reasoner streams its reasoning: its first token is the first reasoning token, at
    once, and its 63 reasoning tokens (0.63 s) come after it, before its 10-token answer (the route's
    `expected_output_tokens`). gpt-4o-mini writes no reasoning and takes 0.3 s to its first token: the
    faster of the two, though by time to first token alone (the reasoning taken to be inside it, as a
    hidden reasoning model's is) DeepSeek looked it."""
    stats = runtime(gateway).router.stats
    stats.models.clear()  # what earlier tests taught about these models
    fake_openai.set_latency(first_token=0.3, per_token=0.01)
    fake_deepseek.set_latency(first_token=0.0, per_token=0.01)
    words = " ".join(["word"] * 60)  # echoed, and in the reasoner's reasoning ("The user wants: ...")
    for _ in range(3):  # both measured (unmeasured candidates are tried first)
        stream = gateway.openai().chat.completions.create(
            model="fast-reasoner", messages=[{"role": "user", "content": words}], stream=True
        )
        list(stream)
    reasoner = stats.get("deepseek", "deepseek-reasoner")
    assert reasoner.ttft_s is not None and stats.get("openai", "gpt-4o-mini").ttft_s is not None
    route = ask(gateway, "fast-reasoner")
    assert (route["candidate"], route["reason"]) == ("gpt-4o-mini", "expected_seconds"), route
    assert reasoner.streams_reasoning and (reasoner.reasoning_tokens or 0) > 60
    stats.models.clear()


def test_lowest_latency_stops_trying_first_a_candidate_that_slowed_down(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """Its slow attempts end without an answer: the hedge that wins cancels them (499). Learned from
    answers alone, its moving average stayed that of its fast days, and it was every request's first
    attempt: each waited the hedge delay and paid for a cancelled attempt. The time a cancelled
    attempt waited counts as a lower bound of its time to first token."""
    stats = runtime(gateway).router.stats
    stats.models.clear()  # what earlier tests taught about these models
    fake_deepseek.set_latency(first_token=0.05)

    def first_token() -> str:
        stream = gateway.openai().chat.completions.create(
            model="fast-hedged", messages=[{"role": "user", "content": "one two three"}], stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    for _ in range(3):  # each unmeasured one is tried first: both measured, gpt-4o-mini the faster
        first_token()
    fast, other = stats.get("openai", "gpt-4o-mini"), stats.get("deepseek", "deepseek-chat")
    assert fast.ttft_s is not None and other.ttft_s is not None and fast.ttft_s < other.ttft_s

    fake_openai.set_latency(first_token=3.0)  # gpt-4o-mini slows down: every hedge to deepseek wins
    gateway.sink.events.clear()
    for _ in range(6):
        assert first_token()
    # The loser's event is recorded before the winner's answer goes out (routing.execute._hedged):
    # each request was planned with the one before it counted.
    asked_first = [e.status for e in gateway.sink.events if e.backend == "openai"]
    assert asked_first in ([499], [499, 499]), (asked_first, fast.ttft_s, other.ttft_s)
    assert fast.ttft_s > other.ttft_s
    stats.models.clear()  # gpt-4o-mini's 3 s is this test's


def test_difficulty_threshold(gateway: RunningGateway) -> None:
    assert ask(gateway, "smart", EASY)["candidate"] == "gpt-4o-mini"
    route = ask(gateway, "smart", HARD)
    assert (route["candidate"], route["reason"], route["score"], route["threshold"]) == (
        "claude-sonnet",
        "hard",
        "0.9",
        "0.5",
    )


def test_difficulty_target_strong_share(gateway: RunningGateway) -> None:
    router = runtime(gateway).router
    rng = random.Random(7)
    router.context.scorer = lambda prompt: rng.random()
    try:
        picks = [ask(gateway, "smart-share", f"q{i}")["candidate"] for i in range(120)]
    finally:
        router.context.scorer = lambda prompt: 0.9 if "Prove" in prompt else 0.1
    late = picks[60:]  # calibrated on what it has seen
    assert 0.1 <= late.count("claude-sonnet") / len(late) <= 0.45


def window(gateway: RunningGateway, route: str) -> int:
    """How many scores the route's strong-share windows hold."""
    calibrators = runtime(gateway).router.context.calibrators
    return sum(len(c) for key, c in calibrators.items() if key[0] == route)


@contextmanager
def one_stream_held(gateway: RunningGateway, fake_anthropic: FakeAnthropic) -> Iterator[openai.OpenAI]:
    """The one-stream tenant's client while its one stream slot is held (by a stream to a model that
    hangs, which no route below uses): every stream it asks for meanwhile is refused by the gateway
    itself."""
    client = gateway.openai(ONE_STREAM_KEY)
    fake_anthropic.fail_next(Fault.hang())

    def hold() -> None:
        with contextlib.suppress(openai.APIError):  # the hang's release: a 503
            for _ in client.chat.completions.create(
                model="claude-sonnet", messages=[{"role": "user", "content": "hold"}], stream=True
            ):
                pass

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        deadline = time.monotonic() + 10
        # Admitted and sent: the slot is taken (a health probe's model-list GET says nothing of it).
        while not fake_anthropic.posts:
            assert time.monotonic() < deadline, "the stream that holds the slot never went upstream"
            time.sleep(0.01)
        yield client
    finally:
        fake_anthropic.reset()  # releases the hanging request, and with it the slot
        holder.join(10)


def refused_60_times(gateway: RunningGateway, fake_anthropic: FakeAnthropic, model: str, prompt: str) -> None:
    """A client retrying a stream the gateway itself refuses (429: its stream slots; with a control
    plane its rate limits and budgets, alike), 60 times: nothing is sent to any candidate."""
    with one_stream_held(gateway, fake_anthropic) as refused:
        for _ in range(60):
            with pytest.raises(openai.RateLimitError):
                refused.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], stream=True
                )


def test_requests_the_gateway_refuses_do_not_move_the_strong_share(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """Scored into the `strong_share` window as they were planned, 60 refused retries of one hard
    prompt filled its top, and then 8 of the next 50 served requests went strong for a target of
    half (27 now). The window is what was sent."""
    context = runtime(gateway).router.context
    scorer, before = context.scorer, window(gateway, "smart-half")
    # "hard ..." scores 0.9; "q<i>" a permutation of 100 distinct scores below it.
    context.scorer = lambda prompt: (
        0.9 if prompt.startswith("hard") else 0.1 + (int(prompt[1:]) * 37 % 100) / 150
    )
    try:
        refused_60_times(gateway, fake_anthropic, "smart-half", "hard question")
        # Nothing was sent for them (the health probes' GETs aside).
        assert not [r for r in fake_openai.requests + fake_deepseek.requests if r.method == "POST"]
        assert window(gateway, "smart-half") == before
        picks = [ask(gateway, "smart-half", f"q{i}")["candidate"] for i in range(100)]
    finally:
        context.scorer = scorer
    assert window(gateway, "smart-half") == before + 100
    assert 15 <= picks[50:].count("deepseek-chat") <= 35  # calibrated on them alone: about half


def test_prefix_affinity_learns_nothing_from_requests_the_gateway_refuses(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    """Counted as they were planned, 60 refused retries were 60 prefix-affinity hits (the route's hit
    rate: routes/status, /metrics), and their prompt was remembered as on a replica that never saw it,
    where its first request served then followed it."""
    context = runtime(gateway).router.context
    prompt = "A question asked only while refused, then once more."
    hits, requests = context.affinity.get("replicas", (0, 0))
    refused_60_times(gateway, fake_anthropic, "replicas", prompt)
    assert context.affinity.get("replicas", [0, 0]) == [hits, requests]
    route = ask(gateway, "replicas", prompt)
    assert route["affinity_by"] == "prefix"  # nothing remembered of it: placed by its hash
    assert context.affinity["replicas"] == [hits + 1, requests + 1]


def test_a_token_count_is_no_traffic_to_learn_from(gateway: RunningGateway) -> None:
    """`count_tokens` asks a route's candidates to count, and generates nothing: its prompt is not
    scored into a strong-share window, nor counted or remembered by prefix affinity."""
    context = runtime(gateway).router.context

    def learnt() -> tuple[int, list[int], int]:
        return (
            window(gateway, "smart-half"),
            list(context.affinity.get("replicas", [])),
            len(context.prefixes.recent),
        )

    before = learnt()
    client = gateway.anthropic()
    for model in ("smart-half", "replicas"):
        for _ in range(5):
            counted = client.messages.count_tokens(
                model=model, messages=[{"role": "user", "content": "a b c"}]
            )
            assert counted.input_tokens > 0
    assert learnt() == before


def test_a_request_that_fails_over_or_is_hedged_is_learnt_from_once(
    gateway: RunningGateway, fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI
) -> None:
    """Its policy learns from a request once, when its first attempt is sent, however many follow."""
    context = runtime(gateway).router.context
    for _ in range(4):  # the top half of the route's window: the easy prompts below go weak
        ask(gateway, "smart-hedged", HARD)
    before = window(gateway, "smart-hedged")
    fake_openai.fail_next(500)  # the weak candidate fails: the strong one answers
    route = ask(gateway, "smart-hedged", EASY)
    assert route["tried"] == "gpt-4o-mini:502,deepseek-chat:ok"
    fake_openai.fail_next(Fault.delay(2.0))  # the weak candidate is slow: a hedge to the strong wins
    route = ask(gateway, "smart-hedged", EASY)
    assert route["candidate"] == "deepseek-chat" and route["hedged"] == "deepseek-chat", route
    assert window(gateway, "smart-hedged") == before + 2
    # Prefix affinity: the hit or miss and the prefixes, once.
    hits, requests = context.affinity.get("replicas-once", (0, 0))
    home = ask(gateway, "replicas-once", "a question about this document")["candidate"]
    (fake_openai if home == "gpt-4o-mini" else fake_deepseek).fail_next(500)
    route = ask(gateway, "replicas-once", "a question about this document")
    # Served by the other replica: a miss there, counted once.
    assert route["tried"].startswith(f"{home}:502,") and route["affinity"] == "miss"
    assert context.affinity["replicas-once"] == [hits + 1, requests + 2]


def test_prefix_affinity_sticks_and_reports_its_hit_rate(gateway: RunningGateway) -> None:
    prefixes = [f"You are assistant number {i}. " * 3 for i in range(12)]
    first = {p: ask(gateway, "replicas", p + "question one")["candidate"] for p in prefixes}
    assert len(set(first.values())) >= 2  # prefixes spread over the replicas
    for p in prefixes:
        route = ask(gateway, "replicas", p + "another question")
        assert route["candidate"] == first[p] and route["affinity"] == "hit"
    assert runtime(gateway).router.context.affinity_hit_rate("replicas") == 1.0


def test_prefix_affinity_keeps_a_conversation_on_its_replica(gateway: RunningGateway) -> None:
    """Every turn starts with the previous turn's prompt; once the reply is in the route's 40-character
    prefix the hash alone would move most conversations, the conversation memory keeps them."""
    client = gateway.openai("sk-weir-demo-0123456789")
    conversations = [[{"role": "user", "content": f"Chat {i}: hi"}] for i in range(12)]
    replica = {}
    for turn in range(3):
        for i, messages in enumerate(conversations):
            raw = client.chat.completions.with_raw_response.create(model="replicas", messages=messages)  # type: ignore[arg-type]
            route = route_header(raw)
            if turn == 0:
                replica[i] = route["candidate"]
                assert route["affinity_by"] == "prefix"
            else:
                assert route["candidate"] == replica[i] and route["affinity_by"] == "conversation"
            reply = raw.parse().choices[0].message.content
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"more {turn}"}]
    assert len(set(replica.values())) >= 2  # the conversations themselves spread over the replicas
    hashed = [
        ask(gateway, "replicas", "\n".join(str(m["content"]) for m in messages))["candidate"]
        for messages in conversations
    ]
    assert sum(h != replica[i] for i, h in enumerate(hashed)) >= 4  # where the prefix alone sends them


async def test_policies_learn_from_a_request_once_it_is_sent_and_never_from_a_preview() -> None:
    affine = Route(
        name="r",
        policy="prefix_affinity",
        candidates=[Candidate(model="a"), Candidate(model="b")],
    )
    calibrated = Route(name="d", policy="difficulty", strong_share=0.5, candidates=affine.candidates)
    ctx = PolicyContext(RoutingStats(), scorer=lambda prompt: 0.7)
    feats = features(
        ChatRequest(model="r", messages=[Message(role="user", content="hi")]), tenant=None, key_id=None
    )
    for lessons in (None, []):  # a preview, then a request
        choices = [Choice(None, c) for c in affine.candidates]  # type: ignore[arg-type]
        ordered, _, outcome = await order(affine, choices, feats, ctx, lessons)
        choices = [Choice(None, c) for c in calibrated.candidates]  # type: ignore[arg-type]
        await order(calibrated, choices, feats, ctx, lessons)
        # Planned, it has taught nothing yet: the gateway may still refuse it (its own 429s).
        assert ctx.affinity == {} and not ctx.prefixes.recent
        assert sum(len(c) for c in ctx.calibrators.values()) == 0
        plan = Plan(affine, ordered, lessons=lessons or [], outcome=outcome)
        plan.commit()  # its first attempt admitted and sent
        plan.serve(ordered[0])  # and answered
    assert ctx.affinity == {"r": [1, 1]} and len(ctx.prefixes.recent) == 1
    assert sum(len(c) for c in ctx.calibrators.values()) == 1  # the strong-share window


async def place(route: Route, ctx: PolicyContext, *messages: tuple[str, str]) -> tuple[str, str]:
    """Where `prefix_affinity` sends a request (as the gateway would, learning from it), and its note."""
    request = ChatRequest(model=route.name, messages=[Message(role=r, content=c) for r, c in messages])
    choices = [Choice(None, c) for c in route.candidates]  # type: ignore[arg-type]
    lessons: list[Lesson] = []
    ordered, _, outcome = await order(
        route, choices, features(request, tenant=None, key_id=None), ctx, lessons
    )
    plan = Plan(route, ordered, lessons=lessons, outcome=outcome)
    plan.commit()
    plan.serve(ordered[0])
    return ordered[0].candidate.model, outcome.describe(ordered[0], pending=False) if outcome else ""


def affinity_route(**fields: object) -> Route:
    return Route(
        name="docs",
        policy="prefix_affinity",
        candidates=[Candidate(model=m) for m in ("r1", "r2", "r3")],
        **fields,  # type: ignore[arg-type]
    )


async def test_questions_about_a_short_document_share_its_replica() -> None:
    """Documents shorter than `prefix_chars`: the question is inside the hashed prefix, so hashing
    alone spreads a document's questions (each replica then computes the document); the prefix index
    finds the document's prefixes and sends them where its first question went."""
    rng = random.Random(3)
    documents = [
        f"Document {d}. " + " ".join(rng.choice("abcdefgh") * 5 for _ in range(200)) for d in range(8)
    ]
    questions = [f"Question {q}: what does paragraph {rng.randrange(99)} say about {q}?" for q in range(5)]

    async def replicas(route: Route) -> list[set[str]]:
        ctx = PolicyContext(RoutingStats())
        went: list[set[str]] = [set() for _ in documents]
        for q, question in enumerate(questions):
            for d, document in enumerate(documents):
                model, note = await place(route, ctx, ("system", document), ("user", question))
                went[d].add(model)
                assert ("affinity_by=shared" in note) == (q > 0 and route.prefix_share < 1), note
        return went

    assert all(len(d) < 1300 for d in documents)  # shorter than prefix_chars: 2048
    together = await replicas(affinity_route())
    assert all(len(w) == 1 for w in together)
    assert len(set.union(*together)) >= 2  # the documents themselves spread over the replicas
    hashed = await replicas(affinity_route(prefix_share=1.0))  # only a whole prompt seen before
    assert sum(len(w) > 1 for w in hashed) >= 6


async def test_a_short_common_preamble_does_not_pull_every_request_to_one_replica() -> None:
    """Prompts that share a 600-character system prompt and then differ for 3,000 characters: what a
    replica has cached of them is a sixth, under `prefix_share`, so they spread by their own prefix."""
    rng = random.Random(5)
    preamble = "You are a careful assistant. " * 21
    bodies = ["".join(rng.choice("abcdefghij ") for _ in range(3000)) for _ in range(12)]
    for share, spread in ((0.3, True), (0.1, False)):
        ctx = PolicyContext(RoutingStats())
        went = {
            (await place(affinity_route(prefix_share=share), ctx, ("system", preamble), ("user", b)))[0]
            for b in bodies
        }
        assert (len(went) >= 2) == spread, (share, went)


def test_prefix_affinity_reports_what_the_replicas_caches_served(gateway: RunningGateway) -> None:
    """The hit rate the policy achieves is the replicas' own cached-token counts (the fake caches
    prompts of 1,024 tokens or more, in 128-token steps), summed per route, in /metrics too."""
    stats = runtime(gateway).router.stats
    before = stats.affinity_cache("replicas")
    client = gateway.openai("sk-weir-demo-0123456789")
    document = " ".join(f"fact{i}" for i in range(1300))
    usages = []
    for question in ("first question", "second question"):
        reply = client.chat.completions.create(
            model="replicas",
            messages=[{"role": "system", "content": document}, {"role": "user", "content": question}],
        )
        assert reply.usage is not None
        usages.append(reply.usage)
    cached = [u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in usages]
    assert cached[0] == 0 and cached[1] >= 1024  # the same replica: its cache held the document
    after = stats.affinity_cache("replicas")
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(u.prompt_tokens for u in usages)  # type: ignore[operator]
    assert after["cached_tokens"] - before["cached_tokens"] == sum(cached)  # type: ignore[operator]
    metrics = httpx.get(f"{gateway.url}/metrics").text
    line = f'weir_prefix_affinity_prompt_tokens_total{{route="replicas",source="cached"}} {float(after["cached_tokens"])}'
    assert line in metrics, metrics


def test_prefix_affinity_skips_an_overloaded_replica(gateway: RunningGateway) -> None:
    router = runtime(gateway).router
    prompt = "Shared system prompt for the overload test. question"
    preferred = ask(gateway, "replicas", prompt)["candidate"]
    router.context.in_flight[preferred] = 1000  # as if it had 1000 requests running
    try:
        route = ask(gateway, "replicas", prompt)
    finally:
        router.context.in_flight[preferred] = 0
    assert route["candidate"] != preferred and route["affinity"] == "miss"


def test_conditions_select_the_route(gateway: RunningGateway) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    assert ask(gateway, "tiered", tools=[tool])["candidate"] == "claude-sonnet"
    assert ask(gateway, "tiered", metadata={"tier": "gold"})["candidate"] == "gpt-5"
    assert ask(gateway, "tiered", metadata={"tags": "x,batch"})["candidate"] == "deepseek-chat"
    assert ask(gateway, "tiered", "long " * 300)["candidate"] == "gemini-flash"
    assert ask(gateway, "tiered")["candidate"] == "gpt-4o-mini"


def test_a_route_limited_to_a_tenant_is_invisible_to_others(gateway: RunningGateway) -> None:
    import openai

    assert ask(gateway, "demo-only")["candidate"] == "gpt-4o-mini"
    with pytest.raises(openai.NotFoundError):
        ask(gateway, "demo-only", api_key=LIMITED_KEY)


def test_embeddings_and_completions_carry_the_route_header_too(gateway: RunningGateway) -> None:
    raw = gateway.openai().embeddings.with_raw_response.create(model="text-embedding-3-small", input="hi")
    assert route_header(raw)["candidate"] == "text-embedding-3-small"
    raw = gateway.openai().completions.with_raw_response.create(model="tiered", prompt="hi")
    header = route_header(raw)
    assert (header["route"], header["candidate"], header["policy"]) == ("tiered", "gpt-4o-mini", "fixed")


def test_completions_follow_route_conditions(gateway: RunningGateway) -> None:
    # A long prompt selects the gemini-flash route: no completions endpoint there, so the prompt goes
    # as a chat and comes back in the completions shape.
    raw = gateway.openai().completions.with_raw_response.create(model="tiered", prompt="long " * 300)
    assert route_header(raw)["candidate"] == "gemini-flash"
    completion = raw.parse()
    assert completion.object == "text_completion" and completion.choices[0].text


def test_difficulty_with_the_shipped_classifier(
    gateway: RunningGateway, classifier: DifficultyClassifier
) -> None:
    router = runtime(gateway).router
    stand_in = router.context.scorer
    router.context.scorer = None  # a shipped head, loaded on first use
    router.context.head = "encoder"  # named: "auto" would pick by this machine's speed
    try:
        route = ask(gateway, "smart", HARD)
    finally:
        router.context.scorer, router.context.head, router.context.serving = stand_in, "auto", None
    p_strong = classifier.score(HARD)
    assert float(route["score"]) == pytest.approx(p_strong, rel=1e-4)
    assert route["head"] == "encoder"  # the header (and the ledger) name the head that scored
    assert route["candidate"] == ("claude-sonnet" if p_strong > 0.5 else "gpt-4o-mini")


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ("routes:\n  - {name: r, candidates: [{model: nope}]}\n", "routes[0] (r): no model named 'nope'"),
        ("routes:\n  - {name: r, policy: difficulty, candidates: [{model: gpt-5}]}\n", "weak and a strong"),
        ("routes:\n  - {name: r, candidates: []}\n", "at least one candidate"),
        ("routes:\n  - {name: r, policy: fastest, candidates: [{model: gpt-5}]}\n", "routes[0].policy"),
    ],
)
def test_bad_routes_in_the_config_name_the_problem(routes: str, message: str) -> None:
    from gateway.config import ConfigError, parse_config
    from tests.fixtures.vendor_gateway import full_config_text

    names = ("OPENAI", "ANTHROPIC", "GEMINI", "DEEPSEEK")
    env = {f"{n}_BASE_URL": "http://127.0.0.1:9" for n in names} | {f"{n}_API_KEY": "k" for n in names}
    env |= {"DEAD_PORT": "9", "WEIR_DEMO_KEY": "a", "WEIR_LIMITED_KEY": "b"}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(full_config_text() + routes, env)
