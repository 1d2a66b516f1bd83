"""The failover executor: attempts, retries with backoff, fallbacks, breakers, hedging, TTFT timeouts
and mid-stream resumption, over `gateway.pipeline.Pipeline` (one attempt, one usage event each).

What an attempt sends is an `Operation`: a chat (`chat_op`), or any other call the API builds per
candidate (completions, embeddings), so every endpoint gets the same retries, fallbacks, breakers and
hedging. Non-streaming calls return the parsed response; streams return an iterator of chunk batches
whose first output (not just a role announcement) has already arrived, so a failure before the first
token fails over invisibly.
Only chat streams resume mid-way on another candidate (`Executor.chat`); other streams (`Executor.run`)
end with the error when they break after their first token.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import structlog

from gateway.accounting.events import UsageEvent
from gateway.errors import (
    BackendUnavailable,
    BadGateway,
    GatewayError,
    GatewayTimeout,
    InvalidRequest,
    Unreachable,
    UpstreamError,
)
from gateway.estimate import BYTES_PER_TOKEN
from gateway.pipeline import Call, Pipeline
from gateway.providers import openai as openai_provider
from gateway.providers import openai_responses
from gateway.providers.base import (
    CONTEXT_LENGTH_EXCEEDED,
    CONTINUE_INSTRUCTION,
    OUTPUT_LIMIT_TOO_LARGE,
    TOO_LARGE_FOR_LIMIT,
    UpstreamRequest,
    chat_response_reader,
    context_report,
)
from gateway.router_basic import Target
from gateway.state import Adjustment, Limit, MemoryState, SharedState, correction_bucket
from gateway.types import (
    ChatChunk,
    ChatRequest,
    ChatResponse,
    ChunkChoice,
    Delta,
    FinishReason,
    Message,
    edited,
    is_answer,
    is_output,
)
from gateway.usage import Usage
from routing.breaker import Breakers, State, route_label
from routing.metrics import RoutingMetrics
from routing.plan import Choice, Features, Plan
from routing.policies import PolicyContext, expected_cost, output_room
from routing.routes import Route
from routing.stitch import Stitcher

Batches = AsyncIterator[list[ChatChunk]]
_BACKEND_ERRORS = (UpstreamError, BadGateway, BackendUnavailable, GatewayTimeout)
HOUR = 3600.0
log = structlog.get_logger("weir.routing.execute")


def fails_over(route: Route, exc: BaseException) -> bool:
    """Whether this failure moves on (retry or next candidate). Only failures a backend caused, as
    `failover_on` names them, and the route's own `ttft_timeout`: a gateway-side refusal (rate limit,
    budget) or a 4xx the request caused never does."""
    if isinstance(exc, FirstTokenTimeout):
        return True  # the route's own instruction to move on, whatever `failover_on` lists
    if not isinstance(exc, _BACKEND_ERRORS):
        return False
    return any(
        (rule == "5xx" and exc.status >= 500) or rule == exc.status or rule == exc.code
        for rule in route.failover_on
    )


def _too_large_for_limit(exc: GatewayError) -> bool:
    """A 429 for a request too large for the backend's rate limit itself (`TOO_LARGE_FOR_LIMIT`):
    the request's own size, not the backend's load or health."""
    return exc.status == 429 and TOO_LARGE_FOR_LIMIT.search(exc.message) is not None


def _unhealthy(exc: GatewayError) -> bool:
    """A failure that says the backend is unwell (what breakers count), not the request's fault. The
    bundled engine's `engine_overloaded` 429 is not one: it is busy with other requests, and an open
    breaker would keep the next ones off it for a whole cooldown once its batch has room again. Nor
    is a 429 for a request too large for the rate limit itself (`_too_large_for_limit`): a few such
    requests opened the breaker for every other request there."""
    if exc.code == "engine_overloaded" or _too_large_for_limit(exc):
        return False
    return isinstance(exc, _BACKEND_ERRORS) and (exc.status >= 500 or exc.status == 429)


def _declared_fit(choice: Choice, feats: Features) -> None:
    """A 400 when the route declares that this candidate cannot take the request's tools or images."""
    candidate = choice.candidate
    lacks = [
        what
        for what, needs, has in (
            ("tools", feats.tools, candidate.tools),
            ("images", feats.images, candidate.vision),
        )
        if needs and not has
    ]
    if lacks:
        raise InvalidRequest(
            f"`{candidate.model}` cannot take {' or '.join(lacks)} (its route says so), and no other "
            "candidate of the route could take this request.",
            param="tools" if lacks[0] == "tools" else "messages",
        )


def refuses_parameter(exc: BaseException) -> bool:
    """OpenAI's 400 for a parameter or value the model does not take (a reasoning model refuses
    `temperature`, `top_p`, `logprobs`...), or any vendor's for an output limit above the most the
    model writes (a candidate without its `max_output_tokens` declared, or declared too high): the
    candidate cannot take the request, which is not at fault, so it is passed over as one that
    cannot express it is, and that 400 reaches the client only when no other candidate could take
    the request either."""
    return (
        isinstance(exc, UpstreamError)
        and exc.status == 400
        and exc.code != CONTEXT_LENGTH_EXCEEDED  # `failover_on` decides that one
        and (
            exc.code in ("unsupported_parameter", "unsupported_value")
            or OUTPUT_LIMIT_TOO_LARGE.search(exc.message) is not None
        )
    )


_NOT_RETRIED = frozenset(
    {
        "insufficient_quota",
        "upstream_auth_failed",
        "upstream_billing_failed",
        "engine_overloaded",
        CONTEXT_LENGTH_EXCEEDED,
    }
)


# The 4xx statuses a wait may lift (as the OpenAI and Anthropic SDKs retry them): a rate limit, a
# request timeout, a conflict (OpenAI's lock), "too early". Any other 4xx a route's `failover_on`
# lists is the backend's answer to this very request, the same after any wait.
_TRANSIENT_4XX = frozenset({408, 409, 425, 429})


def retries_in_place(exc: GatewayError) -> bool:
    """Whether asking the same backend again may help. Not after OpenAI's 429 `insufficient_quota`
    (the account is out of credit, which no wait lifts, unlike a rate limit's 429) or its 429 for a
    request too large for the rate limit itself (`_too_large_for_limit`), nor after the backend refused the gateway's credentials or account, nor when the bundled engine's queue is full
    (`engine_overloaded`, from `--max-queued`: the point of the limit is to answer elsewhere now),
    nor when the prompt does not fit its context window, nor after a 4xx other than a rate limit, a
    request timeout or a conflict (`_TRANSIENT_4XX`) where `failover_on` lists it: a 404 (a model
    the backend does not have, retired or misnamed), Anthropic's 413 `request_too_large` (a body
    over its 32 MB), a 422, which the same request gets again after any wait. Nor when the bundled
    engine said it is still loading its model or its loop died (503 `model_not_ready`,
    `engine_dead`: seconds to minutes until it loads or its supervisor restarts it; the client sees
    the gateway's 503 either way): the next candidate is asked at once."""
    return (
        not (400 <= exc.status < 500 and exc.status not in _TRANSIENT_4XX)
        and not _too_large_for_limit(exc)
        and exc.code not in _NOT_RETRIED
        and exc.upstream_code not in ("model_not_ready", "engine_dead")
    )


def retry_after(exc: GatewayError) -> float | None:
    """Seconds the backend asked us to wait: `retry-after-ms` (OpenAI), else `retry-after` in seconds
    or as an HTTP date. None when it sent neither or nothing usable (not a number, negative, NaN):
    then our own backoff applies."""
    headers = {k.lower(): v.strip() for k, v in exc.headers.items()}
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        if name not in headers:
            continue
        try:
            wait = float(headers[name]) / scale
        except ValueError:
            if name == "retry-after-ms":
                continue
            try:
                when = email.utils.parsedate_to_datetime(headers[name])
            except (TypeError, ValueError, IndexError):
                continue
            if when.tzinfo is None:  # an HTTP date is always GMT
                when = when.replace(tzinfo=dt.UTC)
            wait = max(0.0, (when - dt.datetime.now(dt.UTC)).total_seconds())
        if math.isnan(wait) or wait < 0:
            continue
        return wait
    return None


def backoff(route: Route, retry: int, rng: random.Random) -> float:
    settings = route.retry
    wait = min(settings.max_backoff, settings.backoff * 2**retry)
    return wait * (1 - settings.jitter * rng.random())


class FirstTokenTimeout(GatewayTimeout):
    """A stream with no first token within its route's `ttft_timeout` (`_FirstTokenDeadline`)."""

    code = "ttft_timeout"


class Unsupported(InvalidRequest):
    """A candidate's adapter cannot express the request for its vendor (`n` > 1 for an Anthropic
    model, a content part its API lacks): raised before anything is sent, so the executor skips that
    candidate (`tried=model:unsupported`) as it skips one `Operation.check` refuses, and answers
    with `refusal` only when no candidate could take the request."""

    def __init__(self, refusal: InvalidRequest) -> None:
        super().__init__(refusal.message, param=refusal.param, code=refusal.code)
        self.refusal = refusal


@dataclass(frozen=True)
class Operation:
    """What one attempt sends, built for whichever candidate is tried.

    `prepare(choice)` gives the upstream request for that candidate and its reader: the response
    parser, or for a stream a fresh decoder (decoders hold state, so one per attempt); a chat's
    output limit above the choice's `max_output_tokens` is sent as that (`within_output_limit`).
    `check(target)` raises InvalidRequest when that candidate cannot serve this call at all (an
    Anthropic model asked for embeddings): such candidates are skipped, and the request fails with
    that 400 only when no candidate can serve it.
    """

    stream: bool
    prepare: Callable[[Choice], tuple[UpstreamRequest, Any]]
    check: Callable[[Target], None] | None = None


def chat_op(request: ChatRequest) -> Operation:
    def prepare(choice: Choice) -> tuple[UpstreamRequest, Any]:
        target = choice.target
        provider, model = target.provider, target.upstream_model
        sent = within_output_limit(request, choice)
        upstream = provider.chat_request(target.backend, sent, model)
        if request.stream:
            return upstream, provider.chat_stream(sent, model)
        return upstream, chat_response_reader(provider, sent)

    return Operation(bool(request.stream), prepare)


# A `delay: p95` stream's hedge starts by this share of the route's `ttft_timeout` at the latest.
HEDGE_BEFORE_TIMEOUT = 0.8


class SpendCap:
    """Estimated USD each tenant spent on one route's optional calls (hedged attempts, comparisons)
    over the last hour, as a sliding window in the shared state: with Redis every replica draws on
    one allowance (without it, or while it is unreachable, each replica counts its own). Per route,
    since each route sets its own cap (`max_spend_usd_per_hour`): counted per tenant alone, a
    tenant's hedges on one route spent another route's allowance, which then hedged nothing. A route
    is named by `route_label` (routes sharing a name with other conditions have caps of their own)."""

    def __init__(self, purpose: str, state: SharedState | None = None) -> None:
        self.purpose = purpose
        self.state: SharedState = state if state is not None else MemoryState()

    def key(self, tenant: str, route: str) -> str:
        return f"spend:{self.purpose}:tenant:{tenant}:route:{route}"

    async def charge(self, tenant: str, route: str, usd: float, cap: float) -> Charge | None:
        """Count `usd` if the last hour's spend stays within `cap` with it: what it counted, to be
        replaced by what the call cost (`Charge.settle`); None counts nothing."""
        if cap <= 0:
            return None
        # Rounded up: a call too cheap to count in micro-dollars still counts one.
        counted = math.ceil(usd * 1e6)
        key = self.key(tenant, route)
        admission = await self.state.admit([Limit(key, int(cap * 1e6), counted, window_s=HOUR)])
        if not admission.allowed:
            return None
        return Charge(self, key, counted, admission.buckets[0] if admission.buckets else None)


@dataclass(slots=True)
class Charge:
    """An estimate `SpendCap.charge` counted, replaced by what the call cost once, when that is known:
    what the estimate was over by is given back in the bucket it was counted in (`bucket`; None: the
    state did not say), as a token limit's is (`correction_bucket`): a hedge priced after its estimate
    left the hour (a long stream) must not free room the window never held."""

    cap: SpendCap
    key: str  # the window it was counted in (`SpendCap.key`)
    counted: int  # micro-USD
    bucket: int | None = None
    settled: bool = False

    async def settle(self, cost_pico_usd: int) -> None:
        if self.settled:
            return
        self.settled = True
        if delta := -(-cost_pico_usd // 10**6) - self.counted:  # micro-USD, rounded up as counted
            bucket = correction_bucket(delta, self.bucket)
            await self.cap.state.settle([Adjustment(self.key, delta, HOUR, bucket)])


@dataclass(frozen=True, slots=True)
class Trial:
    """The breakers that let an attempt through as their half-open trial (`Executor._admit`), whose
    success alone closes one that is not closed (`CircuitBreaker.success`): its backend's
    (`backend`: its answer, a stream's first token) and its route's own latency breaker there
    (`latency`: a stream's first token in time). Each is that trial's identity (`CircuitBreaker.trial`;
    None: no trial there), so that its success closes that breaker only if it has not opened again
    since this trial was let through (a trial let through after it, once this one had been silent for
    a cooldown, failed), and its end without a verdict frees it only while this trial still holds it
    (`CircuitBreaker.release`), not the trial let through once it had been silent for a cooldown."""

    backend: float | None = None
    latency: float | None = None


NO_TRIAL = Trial()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Terms:
    """How one attempt runs beside others, the same for each try of it (`Executor._attempt`): a hedge's
    `charge` on the hedge cap, settled with the attempt's cost once its usage event prices it. Run as
    a task of its own (a hedge race), it enters its attempt number in `numbers` under that task,
    resolves `sent` once it is admitted and goes upstream, and a whole answer it reads must take
    `race` (else it ends cancelled, as the race's loser). `trial`: the breakers that let it through as
    their half-open trial, whose success alone closes them (`Trial`)."""

    charge: Charge | None = None
    numbers: dict[asyncio.Future[Any], int] | None = None
    sent: asyncio.Future[None] | None = None
    race: _Race | None = None
    trial: Trial = NO_TRIAL


class Executor:
    def __init__(
        self,
        pipeline: Pipeline,
        breakers: Breakers,
        context: PolicyContext,
        metrics: RoutingMetrics | None = None,
    ) -> None:
        self.metrics = metrics
        self.pipeline = pipeline
        self.breakers = breakers
        self.context = context
        self.hedges = SpendCap("hedge")  # the control plane's shared state replaces its own
        self.rng = random.Random()
        # OpenAI models (`_key`) without `api: responses` that OpenAI turned out to serve on the
        # Responses API alone: asked there from then on, in this process (`_asked_on`).
        self.on_responses: set[str] = set()
        # The context window of each backend's models (`_fit_context`): what their servers' model lists
        # say (the health probes, the engine supervisor), what their 400s report, what routes declare.
        # A bundled engine's is set by its model and its KV cache, which the config need not repeat.
        # The policies' own (`PolicyContext.windows`): a candidate is fitted and sent in one window.
        self.windows = context.windows

    # --- one attempt ---------------------------------------------------------------------------

    def _note(self, plan: Plan, model: str, outcome: str) -> None:
        plan.tried.append(f"{model}:{outcome}")
        if self.metrics is not None:
            self.metrics.attempt(plan.route.name, model, outcome)

    def _hedge(self, plan: Plan, result: str) -> None:
        if self.metrics is not None:
            self.metrics.hedge(plan.route.name, result)

    def _no_hedge(self, plan: Plan, why: str) -> None:
        """A hedge that was not sent, and why: its breakers refused it when it would start (`open`,
        `slow`), the tenant's hedge cap did (`capped`), or its adapter cannot express the request
        (`unsupported`). The hedge's note (`hedge=why` in x-weir-route) and result, not an attempt:
        where the request moves on to that candidate, the chain notes it in `tried`, once."""
        plan.note = (plan.note + "; " if plan.note else "") + f"hedge={why}"
        self._hedge(plan, why)

    def _key(self, choice: Choice) -> str:
        return Breakers.key(choice.target.backend.name, choice.target.upstream_model)

    def _asked_on(self, choice: Choice) -> Choice:
        """`choice`, through the Responses API where its OpenAI model is served there alone."""
        target = choice.target
        if target.provider is openai_provider.PROVIDER and self._key(choice) in self.on_responses:
            return replace(choice, target=replace(target, provider=openai_responses.PROVIDER))
        return choice

    async def _attempt(self, call: Call, plan: Plan, choice: Choice, op: Operation, terms: _Terms) -> Any:
        """`_attempt_once` on `choice`, asking for no more output than its context window has room
        for where the gateway knows it (`_fit_context`); once more at once where the backend's 400
        says the prompt fits and how much room it leaves (`context_report`: the gateway's estimate of
        the prompt was low, or the window was not known), asking for that room, or where OpenAI
        answers that its model is served on the Responses API alone (a model configured without
        `api: responses`), through that API, as every later request to that model is (the operator
        is told to configure it so, which spares the first request its 404)."""
        self._fit_context(plan, choice)
        asked = self._asked_on(choice)
        try:
            return await self._attempt_once(call, plan, asked, op, terms)
        except UpstreamError as exc:
            report = context_report(exc.message) if exc.code == CONTEXT_LENGTH_EXCEEDED else None
            if report is not None:
                window, prompt = report
                self.windows.reported(choice.target.backend.name, choice.target.upstream_model, window)
                log.debug(
                    "context_window_reported", model=choice.candidate.model, window=window, prompt=prompt
                )
                choice.context_room = window - prompt
                return await self._attempt_once(call, plan, self._asked_on(choice), op, terms)
            chat = asked.target.provider is openai_provider.PROVIDER
            if not chat or not openai_provider.served_on_responses_only(exc):
                raise
            self.on_responses.add(self._key(choice))
            log.warning(
                "model_served_on_responses_api_only",
                model=choice.candidate.model,
                backend=choice.target.backend.name,
                hint="asked through the Responses API from now on; set `api: responses` on this model",
            )
            return await self._attempt_once(call, plan, self._asked_on(choice), op, terms)

    def _fit_context(self, plan: Plan, choice: Choice) -> None:
        """Where the gateway knows `choice`'s context window (`ContextWindows.of`: what its backend
        last said of it, in its model list or a 400, at most the candidate's `context_window`), the
        room for output that the request's prompt, as the gateway estimates it (`Plan.prompt_tokens`, a
        chat template's tokens included: `gateway.estimate.template_tokens`), leaves there: an output limit above it is sent as that room (`within_output_limit`) and said
        in `x-weir-route` (`output_capped`), as one above the model's own limit is. Otherwise an
        OpenAI-compatible server (the bundled engine, vLLM, OpenAI) refuses the request with a 400
        even though its prompt fits (Claude Code asks for 32,000 tokens; an 8,192-token engine has
        room for fewer). A prompt the estimate puts at the window or above is sent as it is: only the
        backend can say whether it fits. An estimate below the backend's count gets its 400, which
        says the exact room (`_attempt`). Kept once set: an attempt's exact room, and a retry in
        place, stand for the later attempts here."""
        if choice.context_room is not None or plan.prompt_tokens is None:
            return
        window = self.windows.of(choice)
        if window is not None and plan.prompt_tokens < window:
            choice.context_room = window - plan.prompt_tokens

    async def _attempt_once(
        self, call: Call, plan: Plan, choice: Choice, op: Operation, terms: _Terms
    ) -> Any:
        """One upstream attempt, run on `terms` (`_Terms`): the parsed response, or a stream iterator
        past its first output. Unsupported when its adapter cannot express the request: nothing
        sent, its trial freed and its charge settled at nothing, for a candidate of the chain as for a
        hedge; its caller notes it (a candidate of the chain in `tried`, a hedge as the hedge's)."""
        charge, numbers, sent, race, trial = terms.charge, terms.numbers, terms.sent, terms.race, terms.trial
        target = choice.target
        model = choice.candidate.model
        key = self._key(choice)
        try:
            upstream, reader = op.prepare(choice)
        except InvalidRequest as exc:
            # Nothing was sent: no verdict on the backend (a half-open trial it was is the next
            # request's), and a hedge's charge is nothing.
            if plan.route.breaker is not None:
                self._no_verdict(plan.route, key, trial)
            if charge is not None:
                await charge.settle(0)
            raise Unsupported(exc) from exc
        number = plan.attempt(choice)
        if numbers is not None and (task := asyncio.current_task()) is not None:
            numbers[task] = number
        if charge is not None:
            hedge = charge
            call.on_cost[number] = lambda event: hedge.settle(_hedge_cost(hedge, event))
        # The decision as it stands: this attempt's usage event (kept per attempt: a hedge runs beside
        # the primary) and the header if it fails.
        call.info.route = call.routes[number] = plan.header(choice)
        in_flight = self.context.in_flight
        in_flight[model] = in_flight.get(model, 0) + 1
        handed_over = False
        timeout = plan.route.ttft_timeout if op.stream else None
        deadline = _FirstTokenDeadline(call, number, timeout, target.backend.name) if timeout else None

        def sending() -> None:
            # Admitted (stream slots, rate limits, budgets: the gateway's own time, a Redis round
            # trip or the month's first budget seed from the ledger) and going upstream now: where
            # the backend's time to first token, and the hedge delay, start, and where the request
            # becomes traffic the policy learns from (once, whichever attempt is the first sent).
            plan.commit()
            if deadline is not None:
                deadline.start()
            if sent is not None and not sent.done():
                sent.set_result(None)

        try:
            if op.stream:
                opening = _first_output(
                    self.pipeline.stream(call, target, upstream, reader, attempt=number, sending=sending)
                )
                held, batches = await (opening if deadline is None else deadline.within(opening))
                if plan.route.breaker is not None and trial.backend is not None:
                    # Its first token shows the backend answers: a half-open trial's verdict, now, not
                    # when the stream ends (every other request was kept off the backend for the whole
                    # generation). A break after it counts as any stream's does (`_resuming`).
                    try:
                        await self.breakers.success(key, trial.backend)
                    except BaseException:
                        await batches.aclose()  # type: ignore[attr-defined]
                        raise
                handed_over = True
                self._note(plan, model, "ok")
                if deadline is not None and plan.route.breaker is not None:
                    self.breakers.in_time(plan.route, key, trial.latency)
                return self._track(batches, model, held)
            result = await self.pipeline.exchange(
                call,
                target,
                upstream,
                reader,
                attempt=number,
                sending=sending,
                answering=_taking(race, call, plan, choice, number) if race is not None else None,
            )
            self._note(plan, model, "ok")
            if plan.route.breaker is not None:
                await self.breakers.success(key, trial.backend)
            return result
        except GatewayError as exc:
            if _unsent(call, plan, number):
                if plan.route.breaker is not None:
                    self._no_verdict(plan.route, key, trial)
                raise
            self._note(plan, model, str(exc.status))
            if plan.route.breaker is not None:
                # The route's TTFT timeout: perhaps only its own preference (Breakers.too_slow).
                slow = deadline.timeout if deadline is not None and exc.code == "ttft_timeout" else None
                if slow is not None:
                    await self.breakers.too_slow(key, slow, plan.route, trial.backend)
                elif _unhealthy(exc):
                    await self.breakers.failure(key, unreachable=isinstance(exc, Unreachable))
                elif isinstance(exc, _BACKEND_ERRORS):
                    # It answered: the request's fault.
                    await self.breakers.success(key, trial.backend)
                else:  # no word on the backend
                    self._no_verdict(plan.route, key, Trial(backend=trial.backend))
                if slow is None:  # it failed before its first token was due: no word on its speed
                    self._no_verdict(plan.route, key, Trial(latency=trial.latency))
            raise
        except asyncio.CancelledError:
            # Cancelled before anything went upstream (its client left while the gateway refused it
            # at admission): no attempt, as any refusal by the gateway (above).
            if not _unsent(call, plan, number):
                self._note(plan, model, "cancelled")
            if plan.route.breaker is not None:
                self._no_verdict(plan.route, key, trial)
            raise
        finally:
            if not handed_over:
                in_flight[model] -= 1

    def _no_verdict(self, route: Route, key: str, trial: Trial) -> None:
        """An attempt that said nothing about its backend (refused by the gateway, cancelled): the
        breakers it was the half-open trial of (`trial`), the backend's or the route's latency
        breaker there, let the next request be the trial. Not the others: one that opened and
        half-opened while it ran is held by another request's trial, and freed by this attempt it
        let a second trial go beside that one. Nor one this attempt's trial no longer holds: silent
        for a cooldown, it let another request through as the trial (`CircuitBreaker.release`)."""
        if trial.backend is not None:
            self.breakers.get(key).release(trial.backend)
        if trial.latency is not None and (latency := self.breakers.latency_breaker(route, key)) is not None:
            latency.release(trial.latency)

    def _track(self, batches: Batches, model: str, held: list[list[Any]]) -> Tracked:
        return Tracked(batches, lambda: self._release(model), held)

    def _release(self, model: str) -> None:
        self.context.in_flight[model] -= 1

    # --- the first answer: retries, fallbacks, hedging -------------------------------------------

    async def first(
        self,
        call: Call,
        plan: Plan,
        op: Operation,
        feats: Features,
        skip: frozenset[str] = frozenset(),
    ) -> Any:
        """The first candidate to answer, trying them in plan order."""
        route = plan.route
        queue = self._able(plan, op, feats, [c for c in plan.choices if c.candidate.model not in skip])
        last: GatewayError | None = None
        refusal: GatewayError | None = None  # the first candidate's that cannot take the request
        opened = False
        soonest = math.inf  # seconds until a candidate skipped for a breaker takes requests again
        for index, choice in enumerate(queue):
            # Its settings are the route table's (Router.set_routes), not this route's: shared.
            breaker = self.breakers.get(self._key(choice)) if route.breaker else None
            refused, trial = await self._admit(route, choice, op) if breaker is not None else (None, NO_TRIAL)
            if breaker is not None and refused is not None:
                self._note(plan, choice.candidate.model, refused)
                opened = True
                latency = self.breakers.latency_breaker(route, self._key(choice))
                held = latency if refused == "slow" and latency is not None else breaker
                soonest = min(soonest, held.available_in())
                continue
            for retry in range(route.retry.attempts):
                try:
                    if retry == 0 and route.hedge is not None and not skip:
                        partner = self._hedge_partner(route, op, queue[index + 1 :])
                        if partner is not None:
                            result = await self._hedged(call, plan, choice, partner, op, feats, trial)
                            call.info.error = None
                            return result
                    result = await self._attempt(call, plan, choice, op, _Terms(trial=trial))
                    plan.serve(choice)
                    call.info.error = None  # earlier attempts failed; the request did not
                    return result
                except Unsupported as exc:
                    # Nothing was sent: the next candidate may take what this one's API cannot.
                    plan.tried.append(f"{choice.candidate.model}:unsupported")
                    refusal = refusal or exc.refusal
                    break
                except GatewayError as exc:
                    if refuses_parameter(exc):
                        # Its model does not take a parameter the request carries (a reasoning
                        # model's `temperature`): valid for the others, so the next one is asked.
                        refusal = refusal or exc
                        break
                    if not fails_over(route, exc):
                        raise
                    last = exc
                    if retry + 1 >= route.retry.attempts or not retries_in_place(exc):
                        break
                    wait = retry_after(exc)
                    if wait is not None and wait > route.retry.max_retry_after:
                        break  # not worth waiting for: the next candidate may answer now
                    pause = wait if wait is not None else backoff(route, retry, self.rng)
                    if pause >= call.time_left():
                        break  # the client would give up first: the next candidate may answer now
                    await asyncio.sleep(pause)
                    if breaker is not None:
                        refused, trial = await self._admit(route, choice, op)
                        if refused is not None:
                            break
        if last is None and refusal is not None and not opened:
            raise refusal  # no candidate could take the request: why the first could not
        if last is None:
            # When the first of them takes requests again (a shared breaker's cooldown is the longest
            # of the routes there, not this route's), in whole seconds rounded up: a sub-second wait
            # must not read "retry at once".
            wait = soonest if soonest < math.inf else (route.breaker.cooldown if route.breaker else 1)
            last = BackendUnavailable(
                f"Every backend of `{route.name}` is unavailable (circuit breakers open); retry later.",
                headers={"retry-after": str(max(1, math.ceil(wait)))},
            )
        raise last

    def _able(self, plan: Plan, op: Operation, feats: Features, queue: list[Choice]) -> list[Choice]:
        """The candidates that can serve `op`: what their vendor's API can express, and what the
        route says they take (`tools: false`, `vision: false`: sent anyway, the vendor's 400 would end
        the request, since a 400 never fails over). A 400 when none can (the first one's reason)."""
        able: list[Choice] = []
        refusal: InvalidRequest | None = None
        for choice in queue:
            try:
                _declared_fit(choice, feats)
                if op.check is not None:
                    op.check(choice.target)
            except InvalidRequest as exc:
                refusal = refusal or exc
                plan.tried.append(f"{choice.candidate.model}:unsupported")
                continue
            able.append(choice)
        if not able and refusal is not None:
            raise refusal
        return able

    async def _admit(self, route: Route, choice: Choice, op: Operation) -> tuple[str | None, Trial]:
        """Why `choice` is skipped now, if it is: `open` (its backend's breaker) or `slow` (a stream,
        and the route's own latency breaker there: its TTFT timeouts on that model, which routes that
        wait longer still use). None: it is tried, and the `Trial` says which of the two let it
        through as their half-open trial, with its identity there, each read as that breaker let it
        through: the backend's (`Breakers.allow`) awaits the shared state, where `sync` or other
        requests' verdicts may move it, and a trial read after that may be another request's."""
        key = self._key(choice)
        if not self.breakers.get(key).admits():
            return "open", NO_TRIAL
        latency = self.breakers.latency_breaker(route, key) if op.stream else None
        if latency is not None and not latency.allow():
            return "slow", NO_TRIAL
        held = latency.trial() if latency is not None else None  # this request, if it is the trial
        admitted = await self.breakers.allow(key)
        if admitted is None:
            if latency is not None and held is not None:
                latency.release(held)  # its trial is the next request's
            return "open", NO_TRIAL
        return None, Trial(backend=admitted.trial, latency=held)

    def _hedge_partner(self, route: Route, op: Operation, rest: list[Choice]) -> Choice | None:
        for choice in rest:
            key = self._key(choice)
            latency = self.breakers.latency_breaker(route, key) if op.stream else None
            slow = latency is not None and latency.current() is not State.CLOSED
            if self.breakers.state(key) is State.CLOSED and not slow:
                return choice
        return None

    def _hedge_delay(self, route: Route, choice: Choice, op: Operation) -> float:
        """Seconds `choice` has to answer (a stream: its first token; else its whole answer) before
        its hedge starts (`ModelStats.hedge_delay` for `p95`)."""
        assert route.hedge is not None
        if route.hedge.delay != "p95":
            return float(route.hedge.delay)
        stats = self.context.stats.get(choice.target.backend.name, choice.target.upstream_model)
        delay = stats.hedge_delay(op.stream, route.hedge.min_delay)
        if op.stream and route.ttft_timeout:
            # A stream the route's TTFT timeout gave up on enters the window as that slow, so where
            # more than one in twenty time out the p95 is the timeout itself: the hedge waited until
            # the primary was given up, never started where it is for (the slow tail), and each such
            # request waited for the primary's retries in place before the next candidate was asked.
            delay = min(delay, route.ttft_timeout * HEDGE_BEFORE_TIMEOUT)
        return delay

    async def _hedged(
        self,
        call: Call,
        plan: Plan,
        primary: Choice,
        partner: Choice,
        op: Operation,
        feats: Features,
        trial: Trial = NO_TRIAL,
    ) -> Any:
        """Start `primary`; if it has not answered (first token) within the hedge delay, also start
        `partner`; the first to answer wins, the other is cancelled. `trial`: the breakers that let
        `primary` through as their trial. `partner`, picked with its breakers closed
        (`_hedge_partner`), is admitted as any candidate is (`_admit`) when it would start: other
        requests' failures may have opened them during the delay, and then no hedge starts
        (`hedge=open`, or `slow`) and `primary` goes on alone."""
        route = plan.route
        assert route.hedge is not None
        numbers: dict[asyncio.Future[Any], int] = {}  # each attempt's number, by its task
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        race = _Race()
        refused: str | None = None  # why the partner's breakers turned it away when it would start
        partner_trial = NO_TRIAL  # the partner's `_trial`, once admitted
        charge: Charge | None = None  # its estimate on the hedge cap, once the cap let it through
        first = asyncio.ensure_future(
            self._attempt(call, plan, primary, op, _Terms(numbers=numbers, sent=sent, race=race, trial=trial))
        )
        try:
            # The delay counts from when the primary goes upstream, once admitted (with Redis a
            # round trip, and the month's spend read from the ledger the first time): the admission
            # is the gateway's own time, not the backend's slowness. And no hedge before the
            # admission said yes: one sent meanwhile could answer a request the tenant's own limits
            # or budget refuse, past them.
            await asyncio.wait({first, sent}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                await asyncio.wait({first}, timeout=self._hedge_delay(route, primary, op))
            if first.done():
                result = first.result()  # its failure (before the hedge delay) raises, serving nothing
                plan.serve(primary)
                return result
            if route.breaker is not None:  # before the cap: a hedge not sent spends nothing
                refused, partner_trial = await self._admit(route, partner, op)
            usd = expected_cost(partner, feats, output_room(partner, route, feats), self.context)
            tenant = call.principal.tenant_id or "anonymous"
            if refused is None:
                cap = route.hedge.max_spend_usd_per_hour
                charge = await self.hedges.charge(tenant, route_label(route), usd, cap)
        except BaseException:
            # Cancelled while waiting (the server shutting down, say): the attempt must not run on
            # with no owner, holding its in-flight slot and, once it answered, a stream nobody closes.
            await _abandon(first)
            raise
        finally:
            if charge is None:  # a trial that never went: the next request's
                self._no_verdict(route, self._key(partner), partner_trial)
        if charge is None:
            # No hedge: its breakers refused it (`open`, `slow`) or the cap did.
            self._no_hedge(plan, refused or "capped")
            result = await first
            plan.serve(primary)
            return result
        # The cap then counts what the hedge cost, not the estimate (`charge`): a hedge that lost and
        # was cancelled costs what it had streamed, one that won what its answer cost.
        went: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # sent upstream
        second = asyncio.ensure_future(
            self._attempt(
                call,
                plan,
                partner,
                op,
                _Terms(charge=charge, numbers=numbers, sent=went, race=race, trial=partner_trial),
            )
        )
        owners = {first: primary, second: partner}
        pending = {first, second}
        winner: asyncio.Future[Any] | None = None
        try:
            # It goes upstream, or ends Unsupported (its adapter cannot express the request), in its
            # first step: no request's first attempt, it has no admission to wait for.
            await asyncio.wait({second, went}, return_when=asyncio.FIRST_COMPLETED)
            # (Not gone upstream, `second` is done.)
            unsent = not went.done() and isinstance(second.exception(), Unsupported)
            if unsent:  # nothing was sent (`_attempt` freed its trial and settled its charge at nothing)
                self._no_hedge(plan, "unsupported")
            else:
                self._hedge(plan, "started")
                race.hedged = partner.candidate.model
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # A cancelled one read its whole answer after the other had taken the race (`_Race`).
                done = {task for task in done if not task.cancelled()}
                failure = first.exception() if first in done else None
                if failure is not None and not fails_over(route, failure) and not refuses_parameter(failure):
                    # A 4xx the request caused (or a gateway refusal) on the primary: without a hedge
                    # it ends the request, never failing over, so the hedge must not answer in its
                    # place. (The hedge's own 4xx does not: unhedged, it would never have been asked.)
                    # Not the primary's model refusing a parameter it does not take: unhedged, that
                    # passes the request on to the next candidate, which the hedge already asked.
                    raise failure
                # In the race's order, not the set's: both may be done in one turn of the loop.
                for task in (task for task in owners if task in done):
                    if task.exception() is None:
                        winner = task
                        plan.serve(owners[task])
                        if task is second:
                            self._hedge(plan, "won")
                        if not unsent:
                            _note_hedged(plan, partner.candidate.model)
                        if (number := numbers.get(task)) in call.routes:
                            # A stream records its event when it ends: with the decision as it is
                            # now (won, and hedged), not as it was when the attempt started.
                            call.routes[number] = plan.header(plan.chosen)
                        return task.result()
            raise _lost(first, second)
        finally:
            # Every attempt not taken is abandoned: one still running is cancelled, one that answered
            # anyway holds an open upstream stream and is closed (its usage event records what it
            # cost); a failed one already has its event. Both may have answered by the time the race
            # is looked at: the one not taken is a loser too.
            for loser in owners:
                if loser is not winner:
                    # A client that left ends both attempts: each is its 499 (`client_disconnected`).
                    if (number := numbers.get(loser)) is not None and not call.info.client_gone:
                        # Ended by the gateway, not by a client leaving: `cancelled` (499).
                        call.stopped.setdefault(number, ("cancelled", 499))
                    await _abandon(loser)
            if second.cancelled() and second not in numbers:
                # Cancelled before it started: it sent nothing and cost nothing. One that started
                # settles with its usage event, perhaps once the winner answered (`Pipeline.background`).
                await charge.settle(0)

    # --- the whole request --------------------------------------------------------------------

    async def chat(
        self, call: Call, plan: Plan, request: ChatRequest, feats: Features
    ) -> ChatResponse | Batches:
        result = await self.first(call, plan, chat_op(request), feats)
        stitch = _prefill_stitch(request, plan.chosen)
        if isinstance(result, ChatResponse):
            return result if stitch is None else _stitched_response(call, result, stitch)
        return self._resuming(call, plan, request, feats, result, stitch)

    async def run(self, call: Call, plan: Plan, op: Operation, feats: Features) -> Any:
        """Any other call (completions, embeddings) with the same retries, fallbacks, breakers and
        hedging as chat: the parsed response, or a stream whose break after the first batch ends
        it with the error (the API turns that into an SSE error event; no resumption)."""
        result = await self.first(call, plan, op, feats)
        return self._to_end(call, plan, result) if op.stream else result

    async def _to_end(self, call: Call, plan: Plan, batches: Batches) -> Batches:
        choice = plan.chosen
        breaker = plan.route.breaker is not None and choice is not None
        try:
            async for batch in batches:
                yield batch
            if breaker:  # no trial's verdict: its first token gave that (`_attempt`)
                await self.breakers.success(self._key(choice), trial=None)  # type: ignore[arg-type]
        except GatewayError as exc:
            if choice is not None:
                self._note(plan, choice.candidate.model, "cut")
                if breaker and _unhealthy(exc):
                    await self.breakers.failure(self._key(choice))
            raise
        finally:
            # A client that left mid-stream says nothing about the backend, and holds no half-open
            # trial: the stream's first token gave the trial's verdict (`_attempt`).
            await _ended(call, plan, batches)

    async def _resuming(
        self,
        call: Call,
        plan: Plan,
        request: ChatRequest,
        feats: Features,
        batches: Batches,
        stitch: Stitcher | None = None,
    ) -> Batches:
        """The client's one stream: when the upstream breaks after the first token, continue on the
        next candidate from the text already sent, or (route.resume false, tool calls or a refusal
        under way, the client's output limit spent, no candidate left) raise, which the API turns into
        an SSE error event. `stitch`: the first answer's, which goes on from the client's own prefill
        (`_prefill_stitch`)."""
        sent: list[str] = []
        failed: set[str] = set()
        head: ChatChunk | None = None  # the stream's first chunk, whose id, model and time it keeps
        # A tool call, or a block of Claude's server tools (a web search and its results), under way:
        # no text prefill can carry it, and a continuation would answer without the search it made.
        tool_calls = False
        # A refusal sent: no answer text a prefill could go on from, and a fresh answer after it
        # would follow half a refusal in the one message.
        refused = False
        finished = False  # the answer ended (a finish reason was sent): nothing is left to continue
        resumed = False
        # The continuation goes on from answer text the client has: reasoning it writes first (a
        # model that always reasons) would come after that text, splitting the one answer in two.
        answering = False
        # The next candidate answers afresh (no text was sent, so nothing is joined or cut from its
        # chunks): a Responses client gets its Responses events as they came, its OpenAI reasoning
        # and built-in tools' items whole. A continuation's text is joined onto the client's, which
        # its own events would not say: it reaches a Responses client translated.
        fresh = False
        # Reasoning text sent whose block nothing ended yet (no signature, no answer after it): a
        # continuation reasons afresh, and its reasoning must not run on into this block.
        thinking = False
        last: ChatChunk | None = None  # the last chunk the client got, whose id, model and time a
        # chunk the gateway adds takes
        owed = ""  # whitespace the client has that the continuation's prefill left out
        # A continuation asked for in a user turn, joined onto the text sent (`routing.stitch`): the
        # model may write its end again, start over, or leave out the space between the two. The
        # first answer has one when its vendor was asked so to go on from the client's own prefill.
        # What the usage a continuation reports must be told apart from (`_as_one_answer`): the
        # output the cut attempts wrote, as the ledger bills it, and the prefill's tokens.
        # A first answer going on from the client's own prefill was asked so in a turn of Weir's own,
        # which the client never sent: its prompt is told without it, as a continuation's is.
        written, prefilled_tokens = Usage(), _instruction_tokens(stitch)
        told: Usage | None = None  # the usage the client was told, once a stitched answer reported it
        try:
            while True:
                choice = plan.chosen
                try:
                    async for batch in batches:
                        if resumed:
                            batch = [_continued(chunk, head, fresh) for chunk in batch]
                            if answering:
                                batch = _without_reasoning(batch)
                        if stitch is not None:
                            batch = _stitched(batch, stitch)
                        elif owed:
                            batch, owed = _without_repeat(batch, owed)
                        if resumed or stitch is not None:
                            for i, chunk in enumerate(batch):
                                if chunk.usage is not None:
                                    told = _as_one_answer(
                                        chunk.usage, written, prefilled_tokens, _repeated_tokens(stitch)
                                    )
                                    batch[i] = edited(chunk, usage=told)
                                if chunk.prompt_usage is not None:
                                    # An Anthropic client's message_start: the prompt as the final
                                    # usage tells it, without the turn of Weir's own.
                                    prompt = _as_one_answer(chunk.prompt_usage, Usage(), prefilled_tokens, 0)
                                    batch[i] = edited(batch[i], prompt_usage=prompt)
                        for chunk in batch:
                            head, last = head or chunk, chunk
                            for c in chunk.choices:
                                if c.delta.content:
                                    sent.append(c.delta.content)
                                tool_calls = (
                                    tool_calls or bool(c.delta.tool_calls) or _server_tool_block(c.delta)
                                )
                                refused = refused or bool(c.delta.refusal)
                                finished = finished or c.finish_reason is not None
                                thinking = _thinking_after(thinking, c.delta)
                        yield batch
                    if stitch is not None and last is not None and (rest := stitch.end()):
                        yield [_text_chunk(last, rest)]  # the stream ended with no finish reason
                    if told is not None:
                        # The request's log line says what the client was told (the continuation's
                        # usage event, recorded as its stream ended, set the vendor's own report).
                        call.info.usage = told
                    if choice is not None and plan.route.breaker is not None:
                        # No trial's verdict: its first token gave that (`_attempt`).
                        await self.breakers.success(self._key(choice), trial=None)
                    return
                except GatewayError as exc:
                    if choice is not None:
                        failed.add(choice.candidate.model)
                        self._note(plan, choice.candidate.model, "cut")
                        if plan.route.breaker is not None and _unhealthy(exc):
                            await self.breakers.failure(self._key(choice))
                    # The cut attempt's usage event was recorded as its stream unwound, before the
                    # break reached here: what it is billed for the text (and reasoning) it wrote,
                    # which is also what it spent of the client's output limit.
                    cut = call.info.usage or Usage()
                    written = msgspec.structs.replace(
                        written,
                        # Less what a cut continuation wrote again of the text sent (the client never
                        # got it twice).
                        output_tokens=written.output_tokens
                        + max(0, cut.output_tokens - _repeated_tokens(stitch)),
                        reasoning_tokens=written.reasoning_tokens + cut.reasoning_tokens,
                        reasoning_estimated=written.reasoning_estimated or cut.reasoning_estimated,
                    )
                    if (
                        not plan.route.resume
                        or tool_calls
                        or refused
                        or finished
                        or not _resumable(request)
                        or not fails_over(plan.route, exc)
                    ):
                        raise
                    if last is not None and _limit_reached(request, written.output_tokens):
                        # The answer already filled the client's output limit: its vendor would have
                        # ended it at its length a moment later. It ends so here, as an unbroken
                        # stream would have, not with an error a client retries (paying again) for
                        # an answer it has whole; a continuation could only write past the limit.
                        if stitch is not None and (rest := stitch.end()):
                            yield [_text_chunk(last, rest)]
                        told = _as_one_answer(
                            msgspec.structs.replace(cut, output_tokens=0, reasoning_tokens=0),
                            written,
                            prefilled_tokens,
                            0,
                        )
                        yield [_finish_chunk(last, "length"), edited(last, choices=[], usage=told)]
                        call.info.usage = told
                        return
                    # The prefill without trailing whitespace: Anthropic refuses one that ends in
                    # whitespace, and other models tokenize it badly. Nothing sent yet (the break
                    # came during reasoning): ask again, without an empty assistant turn.
                    text = "".join(sent)
                    prefill = text.rstrip()
                    owed = text[len(prefill) :]
                    # The client's own prefill, which the answer goes on from: the text sent goes on
                    # from it too, and the continuation from both, as one assistant message.
                    given = request.messages[-1].text() if request.continue_final_message else ""
                    prefilled_tokens = _estimated_tokens(prefill, sum(1 for s in sent if s.strip()))
                    messages = request.messages
                    if prefill and given:
                        whole = msgspec.structs.replace(messages[-1], content=given + prefill)
                        messages = [*messages[:-1], whole]
                    elif prefill:
                        messages = [*messages, Message(role="assistant", content=prefill)]
                    continued = msgspec.structs.replace(request, messages=messages)
                    if prefill:
                        # The answer is continued, not thought out again: asked without reasoning
                        # (Anthropic refuses a text prefill while thinking is on). Each provider asks
                        # its vendor to continue it in the way that vendor can (`continued`).
                        continued = msgspec.structs.replace(
                            continued,
                            reasoning_effort=None,
                            reasoning_budget=None,
                            reasoning_adaptive=None,
                            continue_final_message=True,
                        )
                    continued = _shorter(continued, written.output_tokens)
                    try:
                        batches = await self.first(
                            call, plan, chat_op(continued), feats, skip=frozenset(failed)
                        )
                    except GatewayError:
                        raise exc from None  # nobody can continue: the client is told what broke
                    stitch = None
                    if (prefill or given) and _instructed(plan.chosen):
                        stitch = Stitcher(given + text)
                        prefilled_tokens += _instruction_tokens(stitch)  # the asking turn
                    resumed, answering = True, bool(prefill)
                    fresh = not text and stitch is None
                    if thinking and last is not None:
                        # The cut block ends here, unsigned: otherwise the continuation's reasoning
                        # runs on into it and an Anthropic client gets one thinking block holding
                        # both attempts' text under the second one's signature, which Anthropic
                        # refuses when the conversation is sent back.
                        thinking = False
                        yield [_reasoning_end(last)]
        finally:
            # The stream ended, broke for good, or the client left (which says nothing about the
            # backend, and holds no half-open trial: see `_to_end`).
            await _ended(call, plan, batches)


async def _ended(call: Call, plan: Plan, batches: Batches) -> None:
    """A stream past its first token is over (ended, broken for good, or its client left): the
    request's log line takes the decision as it now stands, every attempt there, the cut ones too
    (the `x-weir-route` header went out with the first token), and the current upstream is closed."""
    call.info.route = plan.header()
    await batches.aclose()  # type: ignore[attr-defined]


async def _first_output(opening: Awaitable[Batches]) -> tuple[list[list[Any]], Batches]:
    """Open a stream and read it up to its first output (text, a tool call, reasoning, a finish:
    `is_answer`), not only the role some vendors announce first: Anthropic's message_start, say,
    comes before the model generated anything. Until then a failure is one before the first token:
    the attempt fails, and the next one is tried as if this one had never started (the client has
    seen nothing yet, and gets an HTTP error if every candidate fails). The batches read, and the rest."""
    batches = await opening
    held: list[list[Any]] = []
    try:
        while not (held and any(is_answer(chunk) for chunk in held[-1])):
            try:
                held.append(await anext(batches))
            except StopAsyncIteration:
                break
    except BaseException:
        await batches.aclose()  # type: ignore[attr-defined]
        raise
    return held, batches


class _FirstTokenDeadline:
    """The route's TTFT timeout for one streamed attempt (number `number`), else a 504. The clock
    starts when the pipeline sends the attempt upstream (`start`), not before its admission: time the
    gateway spends admitting it is not the backend's, and must neither fail it over nor count against
    its breaker. The attempt is cancelled as the backend's failure, not as a client that left: the
    pipeline records what `call.stopped` says for it, so that is set before the cancellation (which
    `asyncio.wait_for` gives no hook for). Someone else's cancellation passes through, as in
    `asyncio.timeout`."""

    def __init__(self, call: Call, number: int, timeout: float, backend: str) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task, self.call, self.number = task, call, number
        self.timeout, self.backend = timeout, backend
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False

    def start(self) -> None:
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.timeout, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.call.stopped[self.number] = (GatewayTimeout.type, GatewayTimeout.status)
        self.task.cancel()

    async def within(
        self, opening: Awaitable[tuple[list[list[Any]], Batches]]
    ) -> tuple[list[list[Any]], Batches]:
        """`opening` (the attempt's stream up to its first output), in time."""
        cancelling = self.task.cancelling()
        try:
            return await opening
        except asyncio.CancelledError:
            if self.expired and self.task.uncancel() <= cancelling:
                raise FirstTokenTimeout(
                    f"{self.backend} sent no first token within {self.timeout:g} s"
                ) from None
            raise
        finally:
            if self.timer is not None:
                self.timer.cancel()


@dataclass(slots=True)
class _Race:
    """A hedge race's one answer. Not streamed, an attempt records its usage event as it reads its
    answer, and both may have read theirs by the time the race is looked at (a busy event loop), so
    the race is decided there: the first to read its answer takes it, and the other ends as the
    router's `cancelled` (499), billed what its vendor reported, not as a second answer (200) in the
    ledger, which the request's log line might have named. (A stream's answer is the first output
    it hands over; the race's loser is closed after it, and is recorded then.)"""

    taken: bool = False
    hedged: str | None = None  # the hedge's model, once it went upstream: the race is a hedged one

    def take(self) -> bool:
        """Whether the race was still to be taken; it is now."""
        taken, self.taken = self.taken, True
        return not taken


def _note_hedged(plan: Plan, model: str) -> None:
    """`hedged=model` in the decision, once: a whole answer notes it as it takes the race, and the
    race's end (`Executor._hedged`) for a stream."""
    note = f"hedged={model}"
    if note not in plan.note.split("; "):
        plan.note = (plan.note + "; " if plan.note else "") + note


def _taking(race: _Race, call: Call, plan: Plan, choice: Choice, number: int) -> Callable[[], bool]:
    """A whole answer's take of its hedge race (`Pipeline.exchange`'s `answering`). It records its
    usage event at once, before the race's end is looked at: as it takes a hedged race, its event
    gets the decision as it now stands (won, and `hedged=`), as a streamed winner's does."""

    def take() -> bool:
        if not race.take():
            return False
        if race.hedged is not None and number in call.routes:
            _note_hedged(plan, race.hedged)
            call.routes[number] = plan.header(choice)
        return True

    return take


def _hedge_cost(charge: Charge, event: UsageEvent) -> int:
    """What a hedge that went upstream counts on its tenant's cap (pico-USD): what its usage event
    bills, except where it was not streamed and was cancelled (a race it lost, a client that left)
    before anything of its answer came back. That event bills nothing, for the gateway cannot tell
    what the vendor, which had the request and generates a whole answer however soon it is left,
    bills for; the hedge keeps its estimate. Given back, nearly every lost hedge not streamed (its
    answer comes whole, so it is cancelled before any of it) spent nothing of the cap, which then
    bounded only the hedges that won. (A stream cancelled once its answer began bills its estimate.)"""
    if not event.stream and event.status == 499 and event.cost_pico_usd == 0:
        return charge.counted * 10**6
    return event.cost_pico_usd


def _lost(first: asyncio.Future[Any], second: asyncio.Future[Any]) -> BaseException:
    """The failure a hedge race that neither attempt won ends with: the primary's (`first`), whether
    the hedge (`second`) failed before it, after it or in the same turn of the event loop. `first`
    acts on it as on the primary's own attempt, as unhedged: it retries the primary in place or not
    by that failure's `retries_in_place` and `retry-after`, then moves on to the next candidate (the
    hedge's, asked again), unless the failure does not fail over. The hedge's failure must not decide
    that for the primary: its 4xx, which unhedged would not have ended the request before the
    primary's retries, ended it (the rule `first` keeps: a failure that fails over before a
    candidate's refusal); its 429's `retry-after` timed the primary's retry. A hedge its adapter
    could not express sent nothing either. The hedge's failure is the race's only where the primary
    has none: it lost the race to a hedge that took its answer and then failed."""
    if not first.cancelled() and (failure := first.exception()) is not None:
        return failure
    failure = second.exception()
    assert failure is not None
    return failure


async def _abandon(task: asyncio.Future[Any]) -> None:
    """Cancel an attempt nobody will take the answer of (a no-op once it is done), and close its
    stream if it has one."""
    task.cancel()
    result = (await asyncio.gather(task, return_exceptions=True))[0]
    if hasattr(result, "aclose"):
        await result.aclose()


class Tracked:
    """An attempt's stream of batches that frees its in-flight slot and closes the upstream exactly
    once: when it ends, fails, or is closed (even if it was never iterated, e.g. a losing hedge).
    `held`: the batches already read from it (up to its first output), given out first."""

    def __init__(
        self, batches: Batches, release: Callable[[], None], held: list[list[Any]] | None = None
    ) -> None:
        self.batches = batches
        self.release: Callable[[], None] | None = release
        self.held = list(held or ())

    def __aiter__(self) -> Tracked:
        return self

    async def __anext__(self) -> list[ChatChunk]:
        if self.held:
            return self.held.pop(0)
        try:
            return await anext(self.batches)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        self.held = []
        release, self.release = self.release, None
        if release is not None:
            release()
            await self.batches.aclose()  # type: ignore[attr-defined]


def _resumable(request: ChatRequest) -> bool:
    """Whether a cut stream can go on from its text on another candidate: one choice of free text. With
    `n` > 1 the text sent is several choices interleaved, and structured output cannot be continued as
    an assistant turn (the next model starts a new JSON value)."""
    fmt = request.response_format
    return (request.n or 1) == 1 and (fmt is None or fmt.type == "text")


def _server_tool_block(delta: Delta) -> bool:
    """Whether `delta` starts a block of Claude's server tools (`Delta.anthropic_block` other than
    the text of an answer that holds them)."""
    return delta.anthropic_block is not None and delta.anthropic_block.get("type") != "text"


def _thinking_after(thinking: bool, delta: Delta) -> bool:
    """Whether a reasoning block is still open after `delta`: reasoning text opens one; a signature,
    a redacted block, the answer's text, a refusal or a tool call ends it."""
    if delta.reasoning_signature is not None or delta.redacted_reasoning is not None:
        return False
    if delta.content or delta.refusal or delta.tool_calls:
        return False
    return thinking or bool(delta.reasoning_content)


def _reasoning_end(last: ChatChunk) -> ChatChunk:
    """A chunk that ends the reasoning block streamed so far without signing it (an empty signature):
    what the cut attempt reasoned stays the client's, as a block of its own."""
    choice = ChunkChoice(index=0, delta=Delta(reasoning_signature=""))
    return edited(last, choices=[choice], usage=None)


def _continued(chunk: ChatChunk, head: ChatChunk | None, fresh: bool) -> ChatChunk:
    """A chunk of the continuation, dressed as part of the stream the client already has: its first
    chunk's id, model and creation time (an unbroken stream's never change; which candidate wrote
    what is the ledger's and the request log's to say), and no second role. A `fresh` answer's
    keeps its Responses event, which says nothing of the stream's id or role."""
    choices = [
        msgspec.structs.replace(c, delta=msgspec.structs.replace(c.delta, role=None))
        if c.delta.role is not None
        else c
        for c in chunk.choices
    ]
    # With nothing sent before the break, there is no stream to dress it as.
    stream = {} if head is None else {"id": head.id, "model": head.model, "created": head.created}
    dressed = edited(chunk, choices=choices, **stream)
    return msgspec.structs.replace(dressed, responses_event=chunk.responses_event) if fresh else dressed


def _without_reasoning(batch: list[ChatChunk]) -> list[ChatChunk]:
    """A continuation's chunks without its reasoning (it is still billed): the client already has
    the answer's first text, and reasoning after it would open a new block or item mid-answer.
    Chunks that held only reasoning are left out."""
    out = []
    for chunk in batch:
        choices = [
            msgspec.structs.replace(
                c,
                delta=msgspec.structs.replace(
                    c.delta, reasoning_content=None, reasoning_signature=None, redacted_reasoning=None
                ),
            )
            for c in chunk.choices
        ]
        stripped = edited(chunk, choices=choices)
        reasoned = any(
            c.delta.reasoning_content
            or c.delta.reasoning_signature is not None
            or c.delta.redacted_reasoning is not None
            for c in chunk.choices
        )
        if is_output(stripped) or not reasoned:
            out.append(stripped)
    return out


def _without_repeat(batch: list[ChatChunk], owed: str) -> tuple[list[ChatChunk], str]:
    """The continuation's first text without the whitespace the client already has (left out of the
    prefill, so the model writes it again); what is still owed after this batch."""
    out = []
    for chunk in batch:
        choice = chunk.choices[0] if chunk.choices else None
        text = choice.delta.content if choice is not None else None
        if owed and choice is not None and text:
            n = 0  # the length of what the two start with alike
            while n < min(len(owed), len(text)) and owed[n] == text[n]:
                n += 1
            owed = owed[n:] if n == len(text) else ""
            delta = msgspec.structs.replace(choice.delta, content=text[n:] or None)
            chunk = edited(chunk, choices=[msgspec.structs.replace(choice, delta=delta), *chunk.choices[1:]])
        out.append(chunk)
    return out, owed


def _stitched(batch: list[ChatChunk], stitch: Stitcher) -> list[ChatChunk]:
    """A continuation's chunks with its text joined onto the client's (`routing.stitch`): a chunk
    whose text is all held back or dropped, and that carries nothing else, is left out; the chunk that
    ends the answer's text (a finish reason, a tool call, a refusal, the usage report) first gets
    what is still held. A chunk of none of these ends nothing: a Responses backend streams its
    items' and parts' opening events, which say no text, before the text a stitch still decides."""
    out = []
    for chunk in batch:
        choice = chunk.choices[0] if chunk.choices else None
        text = choice.delta.content if choice is not None else None
        given = stitch.push(text) if text else ""
        if (
            chunk.usage is not None
            if choice is None
            else choice.finish_reason or choice.delta.tool_calls or choice.delta.refusal
        ):
            given += stitch.end()
        if choice is None:
            if given:
                out.append(_text_chunk(chunk, given))
            out.append(chunk)
            continue
        delta = msgspec.structs.replace(choice.delta, content=given or None)
        stitched = edited(chunk, choices=[msgspec.structs.replace(choice, delta=delta), *chunk.choices[1:]])
        # A first answer's role announcement stays, though its text is held (Gemini sends both in one).
        if not text or is_output(stitched) or delta.role is not None:
            out.append(stitched)
    return out


def _prefill_stitch(request: ChatRequest, choice: Choice | None) -> Stitcher | None:
    """How the answer is joined onto the client's own prefill (an Anthropic client's trailing
    assistant message, `continue_final_message`), when the answering vendor was asked to go on from
    it in a user turn: as a resumed stream's continuation is onto the text sent. None when the vendor
    continues it literally, or for `n` > 1 (one text is joined, as `_resumable` resumes one)."""
    if not request.continue_final_message or (request.n or 1) != 1 or not _instructed(choice):
        return None
    return Stitcher(request.messages[-1].text())


def _stitched_response(call: Call, response: ChatResponse, stitch: Stitcher) -> ChatResponse:
    """A whole answer joined onto the client's prefill (`routing.stitch`), its output told less what
    was dropped (estimated, as a resumed stream's); the ledger bills what its vendor reported."""
    if not response.choices:
        return response
    first = response.choices[0]
    text = first.message.content
    given = stitch.push(text) + stitch.end() if text else None
    message = msgspec.structs.replace(first.message, content=given)
    told = _as_one_answer(response.usage, Usage(), _instruction_tokens(stitch), _repeated_tokens(stitch))
    call.info.usage = told  # the request's log line says what the client was told
    return msgspec.structs.replace(
        response, choices=[msgspec.structs.replace(first, message=message), *response.choices[1:]], usage=told
    )


def _text_chunk(like: ChatChunk, text: str) -> ChatChunk:
    """A chunk of answer text alone, with the id, model and time of `like`."""
    choice = ChunkChoice(index=0, delta=Delta(content=text))
    return edited(like, choices=[choice], usage=None)


def _finish_chunk(like: ChatChunk, reason: FinishReason) -> ChatChunk:
    """A chunk that ends the answer with `reason` and says nothing else, with the id, model and time
    of `like`."""
    return edited(like, choices=[ChunkChoice(index=0, delta=Delta(), finish_reason=reason)], usage=None)


def _unsent(call: Call, plan: Plan, number: int) -> bool:
    """Whether attempt `number` ended before anything went upstream, and if so take it back. The
    pipeline notes every attempt it admits (`Call.admitted`), each of which has a usage event: one it
    did not was refused by the gateway itself (rate limit, budget, stream slots). It is no attempt,
    in `x-weir-route` (attempts=0) or the metrics (a `429` there reads as the vendor's). Not whether
    its event is recorded yet: a whole answer's, cancelled while its body was awaited (a hedge race's
    loser), is recorded later in the background, and was taken back here, the header one attempt
    short of the ledger and the event without its own decision (`Call.routes`)."""
    if number in call.admitted:
        return False
    call.routes.pop(number, None)
    plan.attempts -= 1  # the next try is the first again, and is admitted first
    call.stopped.pop(number, None)
    return True


def _instruction_tokens(stitch: Stitcher | None) -> int:
    """The estimated tokens of the turn asking for the rest, which a stitched continuation was asked
    in (`continued`) and the client never sent."""
    return _estimated_tokens(CONTINUE_INSTRUCTION, 1) if stitch is not None else 0


def _repeated_tokens(stitch: Stitcher | None) -> int:
    """The estimated tokens of what a continuation wrote again of the text sent, and was dropped."""
    return _estimated_tokens(stitch.repeated, 1) if stitch is not None else 0


def _instructed(choice: Choice | None) -> bool:
    """Whether the continuation's vendor was asked for the rest in a user turn of Weir's own (whose
    tokens, like the prefill's, the client never sent)."""
    if choice is None:
        return False
    target = choice.target
    return target.provider.continuation(target.backend, target.upstream_model) == "instruction"


def _estimated_tokens(text: str, chunks: int) -> int:
    """Tokens of text some model wrote in `chunks` chunks, by the rule that estimates a cut stream's
    output (`gateway.estimate.Produced`): each chunk at least one, and 4 bytes a token."""
    return max(chunks, -(-len(text.encode()) // BYTES_PER_TOKEN)) if text else 0


# The prompt's token classes from its end back: the uncached tail, then cache writes (a 1h breakpoint
# must come before a 5m one), then the cached prefix.
_FROM_PROMPT_END = ("input_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens", "cached_input_tokens")


def _without_prompt_end(usage: Usage, tokens: int) -> Usage:
    """`usage` less `tokens` at the end of its prompt, taken from the class each was billed as. The
    end is mostly uncached, but a cache can cover it: OpenAI's reads the same request again to its
    end (in 128-token steps), and Anthropic's automatic caching writes up to the last block."""
    left, less = tokens, {}
    for name in _FROM_PROMPT_END:
        taken = min(left, getattr(usage, name))
        less[name], left = getattr(usage, name) - taken, left - taken
    return msgspec.structs.replace(usage, **less)


def _as_one_answer(reported: Usage, written: Usage, prefilled_tokens: int, repeated_tokens: int) -> Usage:
    """The usage of a resumed stream as the client is told it: its own prompt and the whole answer,
    as an unbroken stream reports them, not the continuation's report alone (whose prompt counts the
    prefill, text the client never sent, and whose output is only the rest of the answer). The prompt
    is the continuation's less the prefill's tokens (estimated), which end it (`_without_prompt_end`);
    the output is the continuation's less what it wrote again of the text sent (`repeated_tokens`,
    estimated: the client got it once), and it and the reasoning add what the cut attempts are
    billed for (`written`). The ledger still bills each attempt as it ran. The reasoning is an
    estimate if any part of it was (`Usage.reasoning_estimated`): an Anthropic client is never told
    Weir's estimate as Anthropic's count."""
    return msgspec.structs.replace(
        _without_prompt_end(reported, prefilled_tokens),
        output_tokens=max(0, reported.output_tokens - repeated_tokens) + written.output_tokens,
        reasoning_tokens=reported.reasoning_tokens + written.reasoning_tokens,
        reasoning_estimated=reported.reasoning_estimated or written.reasoning_estimated,
    )


def _limit_reached(request: ChatRequest, spent: int) -> bool:
    """Whether the cut attempts' output (`spent`: what they are billed for, reasoning included, as
    `_as_one_answer` tells the client) already fills the client's output limit: the answer ended at
    its length, and a continuation could only add output past the limit the client set."""
    limit = request.output_limit
    return limit is not None and spent >= limit


def within_output_limit(request: ChatRequest, choice: Choice) -> ChatRequest:
    """The request as an attempt on `choice` sends it: an output limit above the model's own
    (`Choice.max_output_tokens`: the candidate's, else the model's) lowered to it. The model cannot
    write more anyway, and its vendor refuses the larger limit with a 400 (Claude Code's 32,000 to
    gpt-4o, which writes 16,384 at most), which ended the request where this candidate could answer it. A thinking budget the lowered limit no
    longer holds is kept below it (thinking counts toward the limit: Anthropic refuses a budget that
    is not below `max_tokens`, and Claude Code's is 31,999)."""
    most = choice.max_output_tokens
    limit = request.output_limit
    if limit is None or most is None or limit <= most:
        return request
    log.debug("output_limit_lowered", model=choice.candidate.model, asked=limit, sent=most)
    budget = request.reasoning_budget
    return msgspec.structs.replace(
        request,
        max_tokens=None if request.max_tokens is None else min(request.max_tokens, most),
        max_completion_tokens=(
            None if request.max_completion_tokens is None else min(request.max_completion_tokens, most)
        ),
        reasoning_budget=budget if budget is None or budget < most else max(most - 1, 1),
    )


def _shorter(request: ChatRequest, spent: int) -> ChatRequest:
    """The continuation may only produce what the client's output limit has left after the cut
    attempts' output (`spent`, as `_limit_reached` counts it). A chunk is no token: Anthropic's and
    Gemini's streams carry several a chunk. The vendor still enforces its own count."""
    if request.max_completion_tokens is not None:
        left = max(1, request.max_completion_tokens - spent)
        return msgspec.structs.replace(request, max_completion_tokens=left)
    if request.max_tokens is not None:
        return msgspec.structs.replace(request, max_tokens=max(1, request.max_tokens - spent))
    return request
