"""Randomized fault injection through a routed gateway, with invariants checked per request and at the end.

A seeded run sends requests one after another through a real gateway with its control plane (SQLite
admin DB, a tenant with a budget), each to a route drawn at random (fixed with fallbacks, resuming or
not, a TTFT timeout, hedged), streamed or not, with the official OpenAI or Anthropic SDK, while the
fake vendors fail at random (429 with retry-after, 500, 529, slow first byte, reset, a stream cut or
an in-stream error after some chunks, a backend down for a while). Timing may change which attempt
goes where (a hedge starts when the primary is slow on this machine); what must hold does not:

- the client gets the whole answer, or an explicit error (an HTTP error in its API's shape, or the
  SSE error event), never a silent truncation; what it got is never duplicated or missing text, even
  when a stream was continued on another candidate (whose answer may end at the output limit sooner:
  the gateway counts the cut attempts' output as it bills them, where the fakes count a word a token);
- `x-weir-route` (and the request's log line, for a stream that resumed after its headers) counts
  as many attempts as the ledger holds events for the request, per candidate; exactly one attempt
  answered a request that succeeded, none one that failed;
- a route's own latency breakers (its TTFT timeouts on a model that routes waiting longer still use)
  are as the last attempts there of a request sent alone left them: closed (or their count of
  timeouts reset) by a first token in time, counting after a timeout, not closed where the model was
  skipped as slow; a model made to hang opens one, deterministically, and its route skips the model
  until the cooldown, while other routes still get their answers there;
- afterwards: no breaker holds a trial, no budget reservation or in-flight count is left, no attempt
  task runs on, the ledger and the metrics agree, and once the faults stop every breaker recovers (a
  latency breaker unless its route's calm streams timed out there on a paused process).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import random
import time
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest
from structlog.testing import capture_logs

from gateway.accounting.events import UsageEvent
from gateway.app import create_app
from gateway.config import parse_config
from gateway.usage_sink import ListSink
from routing.breaker import Breakers, LatencyKey, State, route_label
from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fakes.plugin import FakeVendors
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.vendor_gateway import fakes_env, full_config_text

ADMIN = "admin-token-for-chaos"
FAILURES, COOLDOWN = 3, 0.2  # every route's breaker settings, and so its latency breakers'
FAST = "retry: {attempts: 2, backoff: 0.02, max_backoff: 0.05, max_retry_after: 0.5}, "
FAST += f"breaker: {{failures: {FAILURES}, cooldown: {COOLDOWN}}}, probe_interval: null"
ROUTES = f"""\
database_url: "${{DB_URL}}"
routes:
  - {{name: fixed, candidates: [{{model: gpt-4o-mini}}, {{model: claude-sonnet}}], fallbacks: [gemini-flash], {FAST}}}
  - {{name: no-resume, resume: false, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], {FAST}}}
  - {{name: ttft, ttft_timeout: 0.25, candidates: [{{model: deepseek-chat}}, {{model: claude-sonnet}}], fallbacks: [gpt-4o-mini], {FAST}}}
  - {{name: hedged, hedge: {{delay: 0.12}}, candidates: [{{model: gpt-4o-mini}}, {{model: deepseek-chat}}], fallbacks: [claude-sonnet], {FAST}}}
  - {{name: hedged-ttft, hedge: {{delay: 0.12}}, ttft_timeout: 0.3, candidates: [{{model: claude-sonnet}}, {{model: gpt-4o-mini}}], fallbacks: [gemini-flash], {FAST}}}
"""
# Outcomes of a candidate that was not sent the request (its breaker or the route's latency breaker
# open), or of an attempt counted already (a cut stream answered, then was continued elsewhere).
NOT_SENT = ("open", "slow", "cut")
ROUTE_NAMES = ["fixed", "no-resume", "ttft", "hedged", "hedged-ttft"]
BACKEND_OF = {
    "gpt-4o-mini": "openai",
    "claude-sonnet": "anthropic",
    "deepseek-chat": "deepseek",
    "gemini-flash": "gemini",
}
WORDS = "alpha bravo charlie delta echo foxtrot"
# The run's seed; WEIR_CHAOS_SEED and WEIR_CHAOS_REQUESTS explore others (a seed that breaks an
# invariant becomes a focused test below).
SEED = int(os.environ.get("WEIR_CHAOS_SEED", "20261205"))
REQUESTS = int(os.environ.get("WEIR_CHAOS_REQUESTS", "150"))
BURSTS, BURST = 6, 8  # then this many bursts of this many concurrent requests
FAULT_SHARE = 0.35  # the chance that a fake has faults queued for a request

Fakes = dict[str, FakeOpenAI | FakeAnthropic | FakeGemini]


def random_fault(rng: random.Random, stream: bool, hangable: bool) -> Fault:
    """One fault a vendor may suffer; the stream faults only where they mean something, a hang only
    where a TTFT timeout ends it."""
    kinds = ["429", "429-long", "quota", "500", "529", "401", "slow", "slow", "reset", "garbage", "html"]
    kinds += ["cut", "cut", "cut", "error", "error", "trickle"] if stream else ["cut"]
    kinds += ["hang"] if hangable else []
    kind = rng.choice(kinds)
    if rng.random() < 0.01:
        kind = "400"  # the request's own fault: never fails over
    if kind == "429":
        return Fault.status(429, retry_after=0.05)
    if kind == "429-long":
        return Fault.status(429, retry_after=5)  # beyond max_retry_after: the next candidate at once
    if kind == "quota":
        return Fault.status(429, error_code="insufficient_quota")
    if kind in ("500", "529", "401", "400"):
        return Fault.status(int(kind))
    if kind == "slow":
        return Fault.delay(rng.choice([0.2, 0.4]))
    if kind == "reset":
        return Fault.reset()
    if kind == "garbage":
        return Fault.garbage()
    if kind == "html":
        return Fault.wrong_content_type()
    if kind == "hang":
        return Fault.hang()
    if kind == "trickle":
        return Fault.slow_stream(0.03)
    if kind == "error":
        return Fault.stream_error(after=rng.randint(1, 6), code=rng.choice([500, 529]))
    return Fault.cut_stream(after=rng.randint(1, 8))


@dataclass
class Outcome:
    """What one request's client saw."""

    index: int
    route: str
    sdk: str
    stream: bool
    expected: str
    request_id: str = ""
    limit: int = 100  # the request's max_tokens
    header: dict[str, str] = field(default_factory=dict)
    status: int = 200
    text: str = ""
    error: str | None = None  # the error the client was told, if any
    finished: bool = False  # a finish reason / message_stop arrived
    output_tokens: int | None = None  # the usage the client was told
    leave_after: int | None = None  # the client closes the stream after this many events
    left: bool = False  # ... and it did, before the stream ended
    faults: dict[str, list[Fault]] = field(default_factory=dict)  # queued before it, per fake
    final: dict[str, str] = field(default_factory=dict)  # the request log line's route

    def describe(self) -> str:
        return (
            f"#{self.index} {self.sdk} {self.route} stream={self.stream} status={self.status} "
            f"error={self.error!r} text={self.text!r} route={self.header} final={self.final} "
            f"faults={self.faults}"
        )


def parse_route(value: str | None) -> dict[str, str]:
    if not value:
        return {}
    return dict(part.split("=", 1) for part in value.split("; "))


def ask_openai(client: openai.OpenAI, out: Outcome, prompt: str, max_tokens: int) -> None:
    messages: Any = [{"role": "user", "content": prompt}]
    create: Any = client.chat.completions.with_raw_response.create  # `stream` is a bool here, not a literal
    try:
        raw = create(
            model=out.route,
            messages=messages,
            max_tokens=max_tokens,
            stream=out.stream,
            stream_options={"include_usage": True} if out.stream else openai.NOT_GIVEN,
        )
    except openai.APIStatusError as exc:
        out.status, out.request_id = exc.status_code, exc.response.headers.get("x-request-id", "")
        out.header = parse_route(exc.response.headers.get("x-weir-route"))
        body = exc.body
        assert isinstance(body, dict) and body.get("message"), out.describe()  # the OpenAI error object
        out.error = str(body["message"])
        return
    out.request_id, out.header = raw.headers["x-request-id"], parse_route(raw.headers.get("x-weir-route"))
    if not out.stream:
        completion = raw.parse()
        out.text = completion.choices[0].message.content or ""
        out.finished = completion.choices[0].finish_reason is not None
        out.output_tokens = completion.usage.completion_tokens if completion.usage else None
        return
    ids, roles = set(), 0
    stream = raw.parse()
    try:
        for n, chunk in enumerate(stream):
            if n == out.leave_after:
                stream.close()
                out.left = True
                break
            ids.add(chunk.id)
            if chunk.usage is not None:
                out.output_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                out.text += choice.delta.content or ""
                roles += choice.delta.role is not None
                out.finished = out.finished or choice.finish_reason is not None
    except openai.APIError as exc:
        out.error = exc.message
    assert len(ids) <= 1 and roles <= 1, out.describe()  # one stream, whatever answered it


def ask_anthropic(client: anthropic.Anthropic, out: Outcome, prompt: str, max_tokens: int) -> None:
    messages: Any = [{"role": "user", "content": prompt}]
    create: Any = client.messages.with_raw_response.create  # `stream` is a bool here, not a literal
    try:
        raw = create(model=out.route, messages=messages, max_tokens=max_tokens, stream=out.stream)
    except anthropic.APIStatusError as exc:
        out.status, out.request_id = exc.status_code, exc.response.headers.get("x-request-id", "")
        out.header = parse_route(exc.response.headers.get("x-weir-route"))
        body = exc.body
        assert isinstance(body, dict) and body.get("type") == "error", out.describe()  # Anthropic's shape
        out.error = str(body["error"]["message"])
        return
    out.request_id, out.header = raw.headers["x-request-id"], parse_route(raw.headers.get("x-weir-route"))
    if not out.stream:
        message = raw.parse()
        out.text = "".join(b.text for b in message.content if b.type == "text")
        out.finished = message.stop_reason is not None
        out.output_tokens = message.usage.output_tokens
        return
    starts = 0
    stream = raw.parse()
    try:
        for n, event in enumerate(stream):
            if n == out.leave_after:
                stream.close()
                out.left = True
                break
            starts += event.type == "message_start"
            if event.type == "message_delta":
                out.output_tokens = event.usage.output_tokens
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                out.text += event.delta.text
            out.finished = out.finished or event.type == "message_stop"
    except anthropic.APIError as exc:
        out.error = exc.message
    assert starts == 1, out.describe()


class Chaos:
    def __init__(self, url: str, sink: ListSink, app: Any, key: str) -> None:
        self.url, self.sink, self.app, self.key = url, sink, app, key

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway

    @property
    def control(self) -> Any:
        return self.app.state.control

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, timeout=20)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=self.key, max_retries=0, timeout=20)

    def events(self, request_id: str) -> list[UsageEvent]:
        return sorted((e for e in self.sink.events if e.request_id == request_id), key=lambda e: e.attempt)

    def on_loop(self, coro: Any) -> Any:
        """Run `coro` on the gateway's event loop (the prober's task lives there)."""
        loop = self.gateway.router.prober._task.get_loop()
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=10)


@pytest.fixture(scope="module")
def chaos(
    fake_vendors: FakeVendors,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Chaos]:
    tmp = tmp_path_factory.mktemp("chaos")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEIR_ADMIN_TOKEN", ADMIN)
        mp.setenv("WEIR_USAGE_SPOOL", str(tmp / "spool"))
        mp.delenv("WEIR_REDIS_URL", raising=False)
        env = {**fakes_env(*fake_vendors), "DB_URL": f"sqlite+aiosqlite:///{tmp}/weir.db"}
        sink = ListSink()
        app = create_app(parse_config(full_config_text() + ROUTES, env), usage_sink=sink)
        with serve(app, free_port()) as url:
            limits = {"budget_usd_monthly": "100", "max_concurrent_streams": 50, "rpm": 10**6, "tpm": 10**9}
            with httpx.Client(
                base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"}
            ) as admin:
                tenant = admin.post("/tenants", json={"name": "chaos", **limits})
                assert tenant.status_code == 201, tenant.text
                key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "app"})
                assert key.status_code == 201, key.text
            yield Chaos(url, sink, app, str(key.json()["key"]))


def fakes_of(oa: FakeOpenAI, an: FakeAnthropic, ge: FakeGemini, ds: FakeOpenAI) -> Fakes:
    return {"openai": oa, "anthropic": an, "gemini": ge, "deepseek": ds}


def wait_for_events(chaos: Chaos, request_id: str, count: int) -> list[UsageEvent]:
    deadline = time.monotonic() + 5
    while len(events := chaos.events(request_id)) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    return events


def tried(header: dict[str, str]) -> list[tuple[str, str]]:
    return [tuple(t.rsplit(":", 1)) for t in header.get("tried", "").split(",") if t]  # type: ignore[misc]


def latency_key(chaos: Chaos, route_name: str, model: str) -> LatencyKey | None:
    """The key of `route_name`'s own latency breaker on `model`, where the route has a TTFT timeout."""
    router = chaos.gateway.router
    (route,) = router.routes[route_name]
    if not route.ttft_timeout:
        return None
    target = router.models.targets[model]
    return route_label(route), route.ttft_timeout, Breakers.key(target.backend.name, target.upstream_model)


def latency_verdicts(chaos: Chaos, out: Outcome) -> list[tuple[LatencyKey, str]]:
    """What a stream's attempts said to its route's latency breakers, in order: `ok` (a first token in
    time), `504` (the TTFT timeout) or `slow` (the model skipped for that breaker)."""
    verdicts = []
    for model, outcome in tried(out.final) if out.stream else []:
        if outcome in ("ok", "504", "slow") and (key := latency_key(chaos, out.route, model)) is not None:
            verdicts.append((key, outcome))
    return verdicts


def check_latency(chaos: Chaos, out: Outcome) -> None:
    """A request that ran alone left its route's latency breakers as its attempts' last word on them
    says: a first token in time closed the breaker there (the half-open trial's) or reset its count
    of timeouts, a timeout counted, a model skipped as slow had its breaker not closed; and no trial
    is held once the request is over."""
    latency = chaos.gateway.router.breakers.latency
    for key, verdict in dict(latency_verdicts(chaos, out)).items():  # the last per breaker
        breaker = latency.get(key)
        if verdict == "ok":
            assert breaker is None or (breaker.state is State.CLOSED and not breaker.failures), (key, breaker)
        else:
            assert breaker is not None and breaker.failures > 0, (key, breaker, out.describe())
            assert verdict == "504" or breaker.state is not State.CLOSED, (key, breaker, out.describe())
    for key, breaker in latency.items():
        assert breaker.trial() is None, (key, breaker, out.describe())


def check_request(chaos: Chaos, out: Outcome, line: Mapping[str, Any] | None) -> None:
    """The per-request invariants (module docstring); `line` is the request's log line."""
    final = out.final = parse_route(line["route"]) if line else {}
    what = out.describe()
    # A complete answer or an explicit error, and never text twice or text missing.
    assert out.expected.startswith(out.text), what
    if out.error is None and not out.left:
        assert out.status == 200 and out.finished, what
    assert out.request_id and final, what
    attempts = int(final["attempts"])
    events = wait_for_events(chaos, out.request_id, attempts)
    ledger = [(e.attempt, e.backend, e.status) for e in events]
    assert [e.attempt for e in events] == list(range(1, attempts + 1)), (what, final, ledger)
    # The header counts what had happened when the response started: all of it unless a stream
    # continued afterwards (the log line has those too).
    assert int(out.header["attempts"]) <= attempts, (what, ledger)
    if not out.stream or out.status != 200:
        assert out.header == final, (what, final)
    # Each attempt named once in `tried`, on the backend the ledger says.
    named = tried(final) or [(final["candidate"], "ok")]  # one attempt that answered: no `tried`
    sent = collections.Counter(
        BACKEND_OF[model] for model, outcome in named if outcome not in (*NOT_SENT, "unsupported")
    )
    assert sent == collections.Counter(e.backend for e in events), (what, final, ledger)
    # One attempt answered a request that succeeded (its usage is the bill), none one that failed.
    answered = [e for e in events if e.ok]
    if out.left:
        assert len(answered) <= 1, (what, final, ledger)
    elif out.error is None:
        # What the client is told it used is what the attempts that wrote its answer are billed: the
        # answering one, and the cut ones a resumed stream went on from (`cut` in `tried`; each the
        # last attempt on its backend, since no continuation goes back to a model that broke). Not
        # a hedge's cancelled loser, nor an attempt that failed before its first token, though
        # either may be billed an estimate (a TTFT timeout after Anthropic's message_start, which
        # reports an output token): neither wrote anything the client saw.
        cut = {BACKEND_OF[model] for model, outcome in named if outcome == "cut"}
        wrote = [[e for e in events if e.backend == backend][-1] for backend in cut]
        if answered or not cut:
            assert len(answered) == 1 and not answered[0].estimated, (what, final, ledger)
            assert BACKEND_OF[final["candidate"]] == answered[0].backend, (what, final, ledger)
        else:  # the cut attempts' output filled the limit: the stream ended at its length
            assert out.output_tokens is not None and out.output_tokens >= out.limit, (what, ledger)
        billed = sum(e.usage.output_tokens for e in [*answered, *wrote])
        assert out.output_tokens == billed, (what, ledger)
        if out.text != out.expected:
            # A continuation may only write what the output limit has left of the cut attempts'
            # output as billed (estimated at 4 bytes a token for a cut stream, where the fakes count
            # a word a token): the answer ends at the limit, before the fakes' count would end it;
            # where the cut attempts' estimate alone fills it, at their text (no attempt answered).
            assert cut and out.output_tokens >= out.limit, (what, ledger)
    else:
        assert not answered, (what, final, ledger)


def prefills(fakes: Fakes, prompt: str) -> list[str]:
    """The text each continuation of `prompt`'s request was asked to go on from."""
    found = []
    for fake in fakes.values():
        for request in fake.requests:
            body = request.json
            if not isinstance(body, dict) or prompt not in str(body):
                continue
            if "contents" in body:  # Gemini
                last = body["contents"][-1]
                if last.get("role") == "model":
                    found.append(" ".join(p["text"] for p in last["parts"] if "text" in p))
                continue
            last = body["messages"][-1]
            if last["role"] == "assistant":
                content = last["content"]
                found.append(
                    content if isinstance(content, str) else "".join(b.get("text", "") for b in content)
                )
    return found


def samples(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


def grew(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    """How much the samples called `name` whose labels include `labels` grew."""
    return sum(
        value - before.get(key, 0.0)
        for key, value in after.items()
        if key[0] == name and set(labels.items()) <= set(key[1])
    )


async def attempt_tasks() -> list[str]:
    """Tasks still running an executor attempt or hedge race on the gateway's loop."""
    names = []
    for task in asyncio.all_tasks():
        code = getattr(task.get_coro(), "__qualname__", "")
        if code.startswith("Executor.") or "_abandon" in code:
            names.append(code)
    return names


def run_one(
    chaos: Chaos,
    clients: tuple[openai.OpenAI, anthropic.Anthropic],
    out: Outcome,
    prompt: str,
    max_tokens: int,
) -> None:
    if out.sdk == "openai":
        ask_openai(clients[0], out, prompt, max_tokens)
    else:
        ask_anthropic(clients[1], out, prompt, max_tokens)


def draw(rng: random.Random, index: int, fakes: Fakes, alone: bool = True) -> tuple[Outcome, str, int]:
    """A request drawn at random (route, API, stream or not, output limit, a client that leaves), and
    the faults queued for it on the fakes that are up. Not `alone`, its faults may meet a concurrent
    request instead: none that hangs, which only a TTFT timeout would end."""
    route, stream, sdk = rng.choice(ROUTE_NAMES), rng.random() < 0.6, rng.choice(["openai", "anthropic"])
    max_tokens = rng.choice([100, 100, 100, 5])
    prompt = f"r{index} {WORDS}"
    out = Outcome(index, route, sdk, stream, " ".join(prompt.split()[:max_tokens]), limit=max_tokens)
    if stream and rng.random() < 0.1:
        out.leave_after = rng.randint(1, 8)
    hangable = alone and stream and route in ("ttft", "hedged-ttft")
    for name, fake in fakes.items():
        if fake.running and rng.random() < 0.08:
            fake.set_latency(first_token=rng.choice([0.15, 0.3]))  # a slow model, for this request
        if fake.running and rng.random() < FAULT_SHARE:
            for _ in range(rng.randint(1, 3)):
                fault = random_fault(rng, stream, hangable)
                out.faults.setdefault(name, []).append(fault)
                fake.fail_next(fault)
    return out, prompt, max_tokens


def settle_and_check(
    chaos: Chaos, logs: list[MutableMapping[str, Any]], out: Outcome, prompt: str, fakes: Fakes
) -> None:
    deadline = time.monotonic() + 5
    line = None
    while line is None and time.monotonic() < deadline:
        line = next(
            (e for e in list(logs) if e.get("event") == "request" and e.get("request_id") == out.request_id),
            None,
        )
        if line is None:
            time.sleep(0.005)
    check_request(chaos, out, line)
    for text in [] if out.left else prefills(fakes, prompt):
        assert out.text.startswith(text), (out.describe(), prefills(fakes, prompt))


def slow_model(
    chaos: Chaos,
    clients: tuple[openai.OpenAI, anthropic.Anthropic],
    logs: list[MutableMapping[str, Any]],
    fakes: Fakes,
) -> list[Outcome]:
    """The `ttft` route's first candidate hangs, so that each stream there misses the route's TTFT
    timeout however the process is paused, until the route's own latency breaker there opens. The
    route's next stream skips the model, unless the breaker's cooldown had passed by then (a paused
    process), when it went as the breaker's half-open trial; another route still gets its answer
    there (a latency preference is no verdict on the backend). After the cooldown, trials that fail
    before their first token was due (a 500) say nothing of the model's speed: each lets the next
    stream be the trial, and the one that gets its first token in time closes the breaker. The
    requests, each checked (`check_latency`)."""
    key = latency_key(chaos, "ttft", "deepseek-chat")
    assert key is not None
    latency = chaos.gateway.router.breakers.latency
    sent: list[Outcome] = []

    def stream(route: str) -> Outcome:
        out = Outcome(-1, route, "openai", True, f"slow{len(sent)} {WORDS}")
        run_one(chaos, clients, out, out.expected, 100)
        settle_and_check(chaos, logs, out, out.expected, fakes)
        check_latency(chaos, out)
        sent.append(out)
        return out

    def openings() -> int:
        return sum(
            e.get("event") == "latency_breaker_opened"
            and e.get("route") == "ttft"
            and e.get("breaker") == key[2]
            for e in list(logs)
        )

    for fake in fakes.values():
        fake.reset()
    time.sleep(COOLDOWN + 0.05)  # no backend breaker keeps a request off the model
    before = openings()
    fakes["deepseek"].fail_next(Fault.hang(), times=FAILURES)
    # Each stream meets a hang at least once (the model is tried first, as the latency breaker's trial
    # if it is half-open), and FAILURES timeouts in a row open the breaker.
    while openings() == before and len(sent) < FAILURES:
        stream("ttft")
    assert openings() > before, [out.describe() for out in sent]
    fakes["deepseek"].reset()
    opened_at = latency[key].opened_at
    out = stream("ttft")
    skipped = ("deepseek-chat", "slow") in tried(out.final)
    assert skipped or time.monotonic() - opened_at >= COOLDOWN, (out.describe(), latency[key])
    fakes["openai"].fail_next(Fault.status(500), times=FAILURES)  # `hedged`'s first candidate
    out = stream("hedged")
    assert out.text == out.expected and out.final["candidate"] == "deepseek-chat", out.describe()
    fakes["openai"].reset()
    time.sleep(COOLDOWN + 0.05)
    fakes["deepseek"].fail_next(Fault.status(500), times=2)  # the first try and its retry
    out = stream("ttft")
    assert ("deepseek-chat", "502") in tried(out.final), out.describe()  # (the vendor's 500)
    fakes["deepseek"].reset()
    stream("ttft")
    return sent


def check_latency_breakers(chaos: Chaos, run: list[Outcome], calm: list[Outcome]) -> None:
    """The routes' own latency breakers at the end: only those the routes in force may have, with their
    settings; none holds a trial; none counts more timeouts in a row than its route's streams had
    there; and, the faults over, none is open but where its route's calm streams timed out there
    (any other is closed, or half-open since its cooldown passed)."""
    breakers = chaos.gateway.router.breakers
    timeouts = collections.Counter(
        key for out in run + calm for key, verdict in latency_verdicts(chaos, out) if verdict == "504"
    )
    lately = {key for out in calm for key, verdict in latency_verdicts(chaos, out) if verdict == "504"}
    assert set(breakers.latency) <= set(breakers.latency_settings), breakers.latency
    for key, breaker in breakers.latency.items():
        assert breaker.settings == breakers.latency_settings[key], (key, breaker)
        assert breaker.trial() is None and breaker.failures <= timeouts[key], (key, breaker, timeouts)
        assert key in lately or (breaker.current() is not State.OPEN and breaker.admits()), (key, breaker)


def test_random_faults_keep_every_invariant(
    chaos: Chaos,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    fake_deepseek: FakeOpenAI,
) -> None:
    fakes = fakes_of(fake_openai, fake_anthropic, fake_gemini, fake_deepseek)
    rng = random.Random(SEED)
    registry = chaos.gateway.metrics.registry
    before = samples(registry)
    chaos.sink.events.clear()
    clients = (chaos.openai(), chaos.anthropic())
    outcomes: list[Outcome] = []
    slow: list[Outcome] = []  # while a model hangs (`slow_model`)
    calm: list[Outcome] = []  # once the faults stopped
    down: str | None = None
    started = time.monotonic()
    with capture_logs() as logs:
        try:
            # One request at a time: each meets the faults drawn for it.
            for i in range(REQUESTS):
                if down is None and rng.random() < 0.03:
                    down = rng.choice(["deepseek", "gemini"])
                    fakes[down].stop()
                elif down is not None and rng.random() < 0.2:
                    fakes[down].start()
                    down = None
                out, prompt, max_tokens = draw(rng, i, fakes)
                run_one(chaos, clients, out, prompt, max_tokens)
                outcomes.append(out)
                settle_and_check(chaos, logs, out, prompt, fakes)
                check_latency(chaos, out)
                for fake in fakes.values():
                    if fake.running:
                        fake.reset()
        finally:
            if down is not None:
                fakes[down].start()
        # Then bursts of concurrent requests, which meet each other's faults (and breakers).
        with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
            for burst in range(BURSTS):
                drawn = [draw(rng, REQUESTS + burst * BURST + j, fakes, alone=False) for j in range(BURST)]
                futures = [
                    pool.submit(run_one, chaos, clients, out, prompt, limit) for out, prompt, limit in drawn
                ]
                for future in futures:
                    future.result()
                for out, prompt, _ in drawn:
                    outcomes.append(out)
                    settle_and_check(chaos, logs, out, prompt, fakes)
                for fake in fakes.values():
                    fake.reset()
        elapsed = time.monotonic() - started
        slow = slow_model(chaos, clients, logs, fakes)

        # The faults stop: after a cooldown every route answers, and every breaker recovers.
        for fake in fakes.values():
            fake.reset()
        time.sleep(COOLDOWN + 0.05)
        for n, route in enumerate(ROUTE_NAMES * 2):
            out = Outcome(-1, route, "openai", False, f"calm{n} {WORDS}")
            run_one(chaos, clients, out, out.expected, 100)
            assert out.error is None and out.text == out.expected, out.describe()
            settle_and_check(chaos, logs, out, out.expected, fakes)
            calm.append(out)
        # Streamed too, after a latency breaker's cooldown: each route's first stream to a model whose
        # latency breaker is not closed is its half-open trial there. On a paused process a stream may
        # miss its route's TTFT timeout though no fault was queued: an error then is one where every
        # attempt sent timed out, and the breakers are checked against what the attempts said.
        time.sleep(COOLDOWN + 0.05)
        for n, route in enumerate(ROUTE_NAMES):
            out = Outcome(-1, route, ["openai", "anthropic"][n % 2], True, f"calm-stream{n} {WORDS}")
            run_one(chaos, clients, out, out.expected, 100)
            settle_and_check(chaos, logs, out, out.expected, fakes)
            check_latency(chaos, out)
            attempted = {outcome for _, outcome in tried(out.final) if outcome not in NOT_SENT}
            assert out.text == out.expected or attempted == {"504"}, out.describe()
            calm.append(out)
        openings = [e for e in logs if e.get("event") == "latency_breaker_opened"]
    runtime = chaos.gateway
    router = runtime.router
    for key, breaker in router.breakers.breakers.items():
        assert breaker.current() is not State.OPEN and breaker.admits(), (key, breaker)
        assert breaker.trial() is None, (key, breaker)  # every trial ended with its request
    check_latency_breakers(chaos, outcomes + slow, calm)
    first_choices = {BACKEND_OF[route.candidates[0].model] for rs in router.routes.values() for route in rs}
    for key, breaker in router.breakers.breakers.items():
        if key.split("/")[0] in first_choices:
            assert breaker.current() is State.CLOSED, (key, breaker)

    # Nothing is left behind: in-flight counts, stream slots, attempt tasks, budget reservations.
    assert all(n == 0 for n in router.context.in_flight.values()), router.context.in_flight
    assert all(n == 0 for n in runtime.limits.streams.values()), runtime.limits.streams
    assert chaos.on_loop(attempt_tasks()) == []
    admission = chaos.control.admission
    events = list(chaos.sink.events)
    budgets = [key for key in admission._tenant_budgets]
    assert len(budgets) == 1
    spent, reserved = admission.state.budget_usage_now(budgets[0])
    assert reserved == 0, (spent, reserved)
    assert not [p for p in admission._pending.values() if not isinstance(p, tuple)]
    assert spent == sum(e.cost_pico_usd for e in events), spent
    # Rate limits: one request counted per request admitted, its estimate corrected to the tokens
    # its attempts used (the run fits in the limits' minute).
    tenant_id = events[0].tenant_id
    if time.monotonic() - started < 50:
        windows = admission.state._windows
        assert windows[f"rpm:tenant:{tenant_id}"].total == len({e.request_id for e in events})
        assert windows[f"tpm:tenant:{tenant_id}"].total == sum(e.usage.total_tokens for e in events)

    # The ledger and the metrics agree.
    after = samples(registry)
    assert grew(before, after, "weir_requests_total") == len(outcomes) + len(slow) + len(calm)
    # The HTTP layer counts a request out once its response is sent, a moment after the client has it.
    deadline = time.monotonic() + 5
    while grew(before, after, "weir_requests_in_flight") and after.get(("weir_requests_in_flight", ())):
        assert time.monotonic() < deadline, "a request still in flight"
        time.sleep(0.01)
        after = samples(registry)
    sent = sum(
        grew(before, after, "weir_route_attempts_total", outcome=outcome)
        for outcome in {key[1][1][1] for key in after if key[0] == "weir_route_attempts_total"}
        if outcome not in NOT_SENT
    )
    assert sent == len(events)
    for route in ROUTE_NAMES:
        for model, backend in BACKEND_OF.items():
            counted = sum(
                grew(
                    before, after, "weir_route_attempts_total", route=route, candidate=model, outcome=outcome
                )
                for outcome in {key[1][1][1] for key in after if key[0] == "weir_route_attempts_total"}
                if outcome not in NOT_SENT
            )
            assert counted == sum(e.route == route and e.backend == backend for e in events), (route, model)
    hedged = sum("hedged" in o.final for o in outcomes + slow + calm)
    won, started_hedges = (
        grew(before, after, "weir_route_hedges_total", result=r) for r in ("won", "started")
    )
    assert won <= hedged <= started_hedges, (won, hedged, started_hedges)
    assert grew(before, after, "weir_errors_total") == sum(not e.ok for e in events)
    assert grew(before, after, "weir_tokens_total", **{"class": "output"}) == sum(
        e.usage.output_tokens for e in events
    )

    statuses = collections.Counter((o.status, o.error is None) for o in outcomes)
    resumed = sum(int(o.final.get("attempts", 0)) > int(o.header.get("attempts", 0)) for o in outcomes)
    print(
        f"{len(outcomes)} requests in {elapsed:.1f}s: {statuses}; resumed {resumed}; hedges "
        f"{grew(before, after, 'weir_route_hedges_total', result='started')} started, "
        f"{grew(before, after, 'weir_route_hedges_total', result='won')} won; "
        f"ttft timeouts {sum(':504' in o.final.get('tried', '') for o in outcomes)}; latency breakers "
        f"opened {len(openings)}, skipped {sum(':slow' in o.final.get('tried', '') for o in outcomes + slow)}"
    )


# --- what seeds found, kept as focused tests -------------------------------------------------------


@pytest.fixture
def calm(chaos: Chaos, fresh_fakes: None) -> Chaos:
    """The chaos gateway with fresh fakes and closed breakers (routes' latency breakers too)."""
    chaos.gateway.router.breakers.breakers.clear()
    chaos.gateway.router.breakers.latency.clear()
    return chaos


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_stream_cut_once_it_filled_the_output_limit_is_not_continued_past_it(
    calm: Chaos, fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, sdk: str
) -> None:
    """The first candidate streamed all the 5 tokens `max_tokens` allowed and broke before its finish
    reason. The continuation was asked for max(1, 5 - 5) tokens, so the client got a sixth word past
    its own limit. Nothing is left to continue: the client gets its 5 words, ended at their length
    as the vendor would have ended them (not an error it would retry, paying again, for an answer it
    has whole), and is told the output the cut attempt is billed for."""
    fake_openai.fail_next(Fault.stream_error(after=6))  # the role, five words, then the error
    out = Outcome(0, "fixed", sdk, True, "r alpha bravo charlie delta")
    run_one(calm, (calm.openai(), calm.anthropic()), out, f"r {WORDS}", 5)
    assert out.text == "r alpha bravo charlie delta" and out.error is None and out.finished, out.describe()
    assert not fake_anthropic.posts  # none asked to write past the limit
    events = wait_for_events(calm, out.request_id, 1)
    assert [(e.backend, e.ok) for e in events] == [("openai", False)]
    assert out.output_tokens == events[0].usage.output_tokens >= 5


def test_a_hedge_race_whose_attempts_both_answered_before_it_was_looked_at_has_one_answer(
    calm: Chaos,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    fake_deepseek: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not streamed, the slow primary and its hedge both had their whole answer by the time the race
    was looked at (the gateway's loop was busy while both arrived: a loaded machine). Each attempt had
    recorded its usage event as it read its answer, so the ledger held two answered attempts (200)
    for one request, and the request's log line named whichever was recorded last, perhaps the one
    whose answer the client never got. The first attempt to read its answer takes the race; the other
    is the router's `cancelled` (499), billed what its vendor reported."""
    fakes = fakes_of(fake_openai, fake_anthropic, fake_gemini, fake_deepseek)
    # The primary past the hedge delay (0.12 s). The first answer read waits for the second: both
    # are read before either attempt looks at the race, whatever the scheduler does (blocking the
    # gateway's loop for a while, as a loaded machine does, only made that likely).
    fake_openai.fail_next(Fault.delay(0.3))
    transport = calm.gateway.pipeline.transport
    read, bodies, both = transport.read, [], asyncio.Event()  # (bound to the gateway's loop on use)

    async def read_both(*args: Any, **kwargs: Any) -> bytes:
        body = await read(*args, **kwargs)
        bodies.append(body)
        if len(bodies) < 2:
            async with asyncio.timeout(5):
                await both.wait()
        both.set()  # the first wakes to find the race taken by the second
        return body

    monkeypatch.setattr(transport, "read", read_both)
    out = Outcome(0, "hedged", "openai", False, f"r {WORDS}")
    with capture_logs() as logs:
        run_one(calm, (calm.openai(), calm.anthropic()), out, out.expected, 100)
        settle_and_check(calm, logs, out, out.expected, fakes)
    line = next(e for e in logs if e.get("event") == "request" and e.get("request_id") == out.request_id)
    events = wait_for_events(calm, out.request_id, 2)
    assert sorted((e.backend, e.status) for e in events) in (
        [("deepseek", 200), ("openai", 499)],
        [("deepseek", 499), ("openai", 200)],
    ), events
    taken = next(e for e in events if e.ok)
    assert line["backend"] == taken.backend and line["output_tokens"] == taken.usage.output_tokens, line
    dropped = next(e for e in events if not e.ok)
    assert not dropped.estimated and dropped.usage.output_tokens > 0  # what its vendor reported


def test_an_attempt_that_timed_out_after_its_stream_opened_wrote_nothing_the_client_is_told_of(
    calm: Chaos,
    fake_openai: FakeOpenAI,
    fake_anthropic: FakeAnthropic,
    fake_gemini: FakeGemini,
    fake_deepseek: FakeOpenAI,
) -> None:
    """Claude's stream opened (its message_start reports an output token) and then sent nothing
    within the route's TTFT timeout: the backend's 504, billed an estimate (that token), before the
    first token, so its retry answered as if it had never started. The client is told the retry's
    usage alone, which is right; the check counted the timed-out attempt as one a resumed stream went
    on from (when a paused process made a trickling stream miss the timeout)."""
    fakes = fakes_of(fake_openai, fake_anthropic, fake_gemini, fake_deepseek)
    fake_deepseek.fail_next(Fault.status(500), times=2)  # the route's first candidate, both tries
    fake_anthropic.fail_next(Fault.slow_stream(0.6))  # message_start, then 0.6 s before each event
    out = Outcome(0, "ttft", "openai", True, f"r {WORDS}")
    with capture_logs() as logs:
        run_one(calm, (calm.openai(), calm.anthropic()), out, out.expected, 100)
        settle_and_check(calm, logs, out, out.expected, fakes)
    events = calm.events(out.request_id)
    assert [(e.backend, e.status, e.estimated) for e in events] == [
        ("deepseek", 500, False),
        ("deepseek", 500, False),
        ("anthropic", 504, True),
        ("anthropic", 200, False),
    ], events
    assert events[2].usage.output_tokens > 0 and out.output_tokens == events[3].usage.output_tokens
