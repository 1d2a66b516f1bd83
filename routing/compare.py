"""Paired outcomes for the difficulty router: a share of a `difficulty` route's requests is also
answered by the candidate that did not serve it, and a judge model grades both answers.

Feedback (`POST /v1/feedback`) scores the one answer a client got, so it labels only the model that
served it. benchmarks/routing_adapt.py found that a few hundred prompts answered by both models teach
a tenant's head more than thousands of one-sided scores (docs/benchmarks.md). A route's `compare`
option (routing.routes.Compare) buys those labels on live traffic:

- once the client has its answer (a stream: once it ended cleanly), the same request goes in the
  background, not streamed, to the other candidate; the judge then grades both answers from 1 to 10,
  seeing them in a random order, since judges favour one position;
- each of these calls is a usage event of the tenant's own (its `purpose`, `compare` or `judge`, and
  `purpose=...; for=<request id>` in its routing column): the usage report counts it in attempts and
  cost, not as a client request; admitted like any request (rate limits, budgets), and
  capped per tenant and route by `max_spend_usd_per_hour` (estimated before the calls, as hedging is) and per
  route and replica by `max_in_flight`;
- the grades go to the `comparisons` table. `weir router train --tenant` joins them with the stored
  prompt as it does feedback, so only tenants with `store_prompts` on are compared: the prompt is what
  a head learns from, and only those tenants agreed to have it kept.

Only one text answer is compared: not a request that offers tools, carries images or asks for n > 1,
nor one whose answer came from a fallback or was resumed on another candidate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import msgspec
import structlog
from prometheus_client import CollectorRegistry, Counter, Metric
from prometheus_client.core import GaugeMetricFamily

from gateway.accounting.events import UsageEvent
from gateway.aio import detached
from gateway.errors import GatewayError
from gateway.estimate import BYTES_PER_TOKEN
from gateway.ids import ordered_id
from gateway.logging import logging_for
from gateway.metrics import drop_series
from gateway.pipeline import Call, Pipeline, RequestInfo
from gateway.providers.base import chat_response_reader
from gateway.types import ChatChunk, ChatRequest, ChatResponse, Message
from routing.breaker import route_label
from routing.execute import SpendCap, within_output_limit
from routing.plan import Choice, Features, Plan
from routing.policies import PolicyContext, expected_cost, head_name, output_room
from routing.ranking import head_ranking
from routing.routes import Candidate

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    from gateway.auth import Principal
    from gateway.router_basic import ModelTable, Target
    from gateway.state import SharedState
    from routing.router import InForce
    from routing.routes import Route

log = structlog.get_logger("weir.routing.compare")

Role = Literal["weak", "strong"]
Batches = AsyncIterator[list[ChatChunk]]

JUDGE_SYSTEM = """You grade two answers, A and B, to the same request.
Grade each answer from 1 to 10 for how well it does what the request asks: correctness first, then
completeness and clarity. 6 or more means the answer is acceptable as it is; 5 or less means it is
wrong, misleading or misses what was asked. Judge each answer on its own merits: its position and its
length say nothing about its quality.
Reply with only a JSON object, for example {"A": 7, "B": 3}."""
# Room for a reasoning judge's thinking (counted in these tokens) and the short preamble some judges
# write before the JSON; a plain judge stops after about 20 tokens, and only what it writes is billed.
JUDGE_MAX_TOKENS = 1024
JUDGE_EXPECTED_OUTPUT = 64  # tokens, for the estimate the spend cap checks before the calls
MAX_SECTION_CHARS = 24_000  # of the conversation and of each answer shown to the judge
_SCORE = re.compile(r"""["']?\b([AB])\b["']?\s*[:=]\s*(\d+(?:\.\d+)?)""")
_JSON = json.JSONDecoder()


def _grade(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1.0 <= value <= 10.0:
        return None
    return float(value)


def parse_verdict(text: str) -> tuple[float, float] | None:
    """The judge's grades of A and B (1..10); None unless both are there. The verdict is the last JSON
    object with both, as asked for: what a judge writes after it ("B: 7 steps are missing") is no
    grade. Without such an object, the last `A: n` and `B: n` written."""
    verdict = None
    for brace in re.finditer(r"\{", text):
        try:
            value, _ = _JSON.raw_decode(text, brace.start())
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict) and "A" in value and "B" in value:
            verdict = value
    if verdict is not None:
        a, b = _grade(verdict["A"]), _grade(verdict["B"])
        return None if a is None or b is None else (a, b)
    found = {label: float(value) for label, value in _SCORE.findall(text)}
    if set(found) != {"A", "B"} or not all(1.0 <= v <= 10.0 for v in found.values()):
        return None
    return found["A"], found["B"]


ACCEPTABLE = 0.5  # on the 0..1 scale: a grade of 6 or more out of 10, as `--correct-at` defaults
RECENT_RANKED = 1000  # comparisons per route and head that /metrics ranks, on each replica


def needs_strong(weak_score: float, strong_score: float) -> bool:
    """Whether only the strong model's answer was acceptable: what a difficulty head should rank high."""
    return weak_score < ACCEPTABLE <= strong_score


def ranks(route: Route, head: str | None) -> bool:
    """Whether `route` keeps rankings of `head`'s scores: it compares, and the head is a shipped one
    or the trained head it names."""
    trained = head_name(head)
    return route.policy == "difficulty" and route.compare is not None and trained in (None, route.head)


def scaled(grade: float) -> float:
    """A 1..10 grade on feedback's 0..1 scale, where 0.5 (a grade of 5.5) separates right from wrong."""
    return (grade - 1.0) / 9.0


def _clip(text: str) -> str:
    if len(text) <= MAX_SECTION_CHARS:
        return text
    half = MAX_SECTION_CHARS // 2  # the start says what was asked, the end what came last
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"


def conversation(request: ChatRequest) -> str:
    """The request as the judge reads it: each message's text under its role."""
    return _clip("\n\n".join(f"{m.role}: {m.text()}" for m in request.messages if m.text()))


def judge_request(judge: str, request: ChatRequest, first: str, second: str) -> ChatRequest:
    user = (
        f"<request>\n{conversation(request)}\n</request>\n\n"
        f"<answer_A>\n{_clip(first)}\n</answer_A>\n\n<answer_B>\n{_clip(second)}\n</answer_B>"
    )
    return ChatRequest(
        model=judge,
        messages=[Message(role="system", content=JUDGE_SYSTEM), Message(role="user", content=user)],
        # No temperature: reasoning models refuse any but their default.
        max_completion_tokens=JUDGE_MAX_TOKENS,
    )


def answer_text(response: ChatResponse) -> str:
    if len(response.choices) != 1 or response.choices[0].message.tool_calls:
        return ""
    return response.choices[0].message.content or ""


def comparable(request: ChatRequest, feats: Features) -> bool:
    """One text answer that a judge can grade from the request's text alone."""
    return not request.tools and not feats.images and (request.n or 1) == 1


class RecentRanking:
    """How well each head ranked the comparisons this replica graded lately, for /metrics (the admin
    API ranks every replica's from the DB): `weir_route_head_ranking_comparisons{route, head, kind}`
    and, once ten of each kind are in, `weir_route_head_ranking_auc{route, head, bound}` with bound
    point, low or high (95%). The alert WeirDifficultyHeadWorseThanChance reads the high bound."""

    def __init__(self, size: int = RECENT_RANKED) -> None:
        self.size = size
        self.rows: dict[tuple[str, str], deque[tuple[float, bool]]] = {}

    def add(self, route: str, head: str | None, p_strong: float, needs_strong: bool) -> None:
        key = (route, head or "")
        rows = self.rows.get(key)
        if rows is None:
            if (name := head_name(head)) is not None:
                # A new version of a trained head replaces the route's last one. Its rows stayed on
                # /metrics for ever, and an AUC below chance kept the alert
                # WeirDifficultyHeadWorseThanChance firing after the head was retrained as it advises.
                for old in [k for k in self.rows if k[0] == route and head_name(k[1]) == name]:
                    del self.rows[old]
            rows = self.rows[key] = deque(maxlen=self.size)
        rows.append((p_strong, needs_strong))

    def forget(self, routes: Sequence[Route]) -> None:
        """Keep the rows of routes in force that compare, and of the heads they can score with
        (`ranks`): a deleted route's rows, or those of a head it no longer names, are never added to
        again, and an AUC below chance among them kept WeirDifficultyHeadWorseThanChance firing."""
        by_name: dict[str, list[Route]] = {}
        for route in routes:
            by_name.setdefault(route.name, []).append(route)
        for name, head in list(self.rows):
            if not any(ranks(route, head) for route in by_name.get(name, ())):
                del self.rows[(name, head)]

    def collect(self) -> Iterator[Metric]:
        counts = GaugeMetricFamily(
            "weir_route_head_ranking_comparisons",
            "Recent comparisons per route and difficulty head on this replica: kind needs_strong (only "
            "the strong model's answer acceptable) or other",
            labels=("route", "head", "kind"),
        )
        aucs = GaugeMetricFamily(
            "weir_route_head_ranking_auc",
            "AUC of the head's scores for requests that needed the strong model, over its recent "
            "comparisons on this replica (0.5: chance); bound point, low or high (95%); only with ten "
            "of each kind",
            labels=("route", "head", "bound"),
        )
        for (route, head), window in list(self.rows.items()):
            pairs = list(window)
            found = head_ranking([p for p, _ in pairs], [y for _, y in pairs])
            counts.add_metric((route, head, "needs_strong"), found.needs_strong)
            counts.add_metric((route, head, "other"), found.comparisons - found.needs_strong)
            if found.enough:
                assert found.auc is not None and found.low is not None and found.high is not None
                for bound, value in (("point", found.auc), ("low", found.low), ("high", found.high)):
                    aucs.add_metric((route, head, bound), value)
        yield counts
        yield aucs

    def describe(self) -> list[Metric]:
        return []  # collected lazily


@dataclass(frozen=True, slots=True)
class Job:
    principal: Principal
    request_id: str
    route: Route
    request: ChatRequest
    feats: Features
    served: Role
    answer: str
    shown_first: Role  # which answer the judge reads as A
    p_strong: float | None  # the route's head's score of the request, and which head gave it
    head: str | None


class Comparer:
    """Schedules and runs comparisons; one per gateway. Needs the admin DB (`use_control_plane`):
    without it no request is compared."""

    def __init__(
        self,
        pipeline: Pipeline,
        models: ModelTable,
        context: PolicyContext,
        stores_prompts: Callable[[Principal], bool],
        registry: CollectorRegistry | None = None,
        in_force: InForce = lambda name, does=None: True,
    ) -> None:
        self.pipeline = pipeline
        self.models = models
        self.context = context  # observed cache hits and the price catalog, for cost estimates
        self.stores_prompts = stores_prompts
        self.sessions: async_sessionmaker[AsyncSession] | None = None
        self.on_finish: Callable[[str], None] | None = None
        self.spend = SpendCap("compare")
        self.rng = random.Random()
        self.tasks: set[asyncio.Task[None]] = set()
        self.in_flight: dict[str, int] = {}  # comparisons running, per route name (`max_in_flight`)
        self.outcomes = Counter(
            "weir_route_comparisons",
            "Comparisons of a difficulty route's candidates by outcome: judged; not started (busy, "
            "capped, skipped); failed (an upstream call failed), unparsed (no grades in the verdict), "
            "inconsistent (both_orders: the two verdicts disagreed)",
            ("route", "outcome"),
            registry=registry,
        )
        self.recent = RecentRanking()
        if registry is not None:
            registry.register(self.recent)
        # Router.in_force: a comparison still running when its route was deleted counts nothing
        # (its series and rankings went with the route, in `forget`), nor, when its route stopped
        # comparing (or naming its head), in the rankings let go of then.
        self.in_force = in_force

    def forget(self, routes: Sequence[Route], gone: Collection[str]) -> None:
        """The route table changed (`Router.listeners`): drop what is kept for routes no longer in
        force (their outcome series, their rankings)."""
        drop_series(self.outcomes, ("route", "outcome"), "route", gone)
        self.recent.forget(routes)

    def _count(self, route: str, outcome: str) -> None:
        if self.in_force(route):
            self.outcomes.labels(route, outcome).inc()

    def use_control_plane(
        self,
        sessions: async_sessionmaker[AsyncSession],
        on_finish: Callable[[str], None] | None,
        state: SharedState | None = None,
    ) -> None:
        """Where grades are stored; `on_finish(request_id)` runs after each background call, as the
        HTTP middleware does after a client's request (admission forgets the request then); `state`
        counts the spend cap across replicas."""
        self.sessions, self.on_finish = sessions, on_finish
        if state is not None:
            self.spend.state = state

    def wants(self, plan: Plan, request: ChatRequest, feats: Features, principal: Principal) -> bool:
        """Whether this request is compared once answered (sampled at the route's `share`)."""
        compare = plan.route.compare
        if compare is None or self.sessions is None or not comparable(request, feats):
            return False
        if not self.stores_prompts(principal) or (compare.share < 1.0 and self.rng.random() >= compare.share):
            return False
        plan.note = (plan.note + "; " if plan.note else "") + "compare=sampled"
        return True

    def follow(
        self, call: Call, plan: Plan, request: ChatRequest, feats: Features, result: ChatResponse | Batches
    ) -> ChatResponse | Batches:
        """The client's result, unchanged; the comparison starts once the answer is complete."""
        if isinstance(result, ChatResponse):
            self._submit(call, plan, request, feats, answer_text(result))
            return result
        return self._collect(call, plan, request, feats, result)

    async def _collect(
        self, call: Call, plan: Plan, request: ChatRequest, feats: Features, batches: Batches
    ) -> Batches:
        parts: list[str] = []
        tool_calls = False
        try:
            async for batch in batches:
                for chunk in batch:
                    for choice in chunk.choices:
                        if choice.delta.content:
                            parts.append(choice.delta.content)
                        tool_calls = tool_calls or bool(choice.delta.tool_calls)
                yield batch
        finally:
            await batches.aclose()  # type: ignore[attr-defined]
        # Only a stream that ended cleanly gets here: a broken one raised, a client that left closed us.
        self._submit(call, plan, request, feats, "" if tool_calls else "".join(parts))

    def _submit(self, call: Call, plan: Plan, request: ChatRequest, feats: Features, answer: str) -> None:
        route = plan.route
        chosen = plan.chosen.candidate.model if plan.chosen is not None else None
        roles: dict[str, Role] = {route.candidates[0].model: "weak", route.candidates[1].model: "strong"}
        served = roles.get(chosen) if chosen is not None else None
        resumed = any(t.endswith(":cut") for t in plan.tried)
        if served is None or resumed or not answer.strip():
            self._count(route.name, "skipped")
            return
        assert route.compare is not None  # wants() sampled it
        # Per route: another route's comparisons must not starve this one's.
        running = self.in_flight.get(route.name, 0)
        if running >= route.compare.max_in_flight:
            self._count(route.name, "busy")
            return
        first: Role = "weak" if self.rng.random() < 0.5 else "strong"
        scored = plan.chosen
        job = Job(
            call.principal,
            call.info.request_id,
            route,
            request,
            feats,
            served,
            answer,
            first,
            scored.score if scored is not None else None,
            scored.scored_by if scored is not None else None,
        )
        # Not the client's exchange (stream leases, prompt capture): this work's own.
        task = detached(self._compare(job))
        self.tasks.add(task)
        self.in_flight[route.name] = running + 1
        task.add_done_callback(lambda done: self._finished(done, route.name))

    def _finished(self, task: asyncio.Task[None], route: str) -> None:
        self.tasks.discard(task)
        if (left := self.in_flight.pop(route, 1) - 1) > 0:
            self.in_flight[route] = left

    async def _compare(self, job: Job) -> None:
        route = job.route
        compare = route.compare
        assert compare is not None
        weak, strong = route.candidates[0], route.candidates[1]
        other = strong if job.served == "weak" else weak
        other_choice = Choice(self.models.targets[other.model], other)
        # The judge is no candidate: it writes within its model's own limit (`models[]`).
        judge = Choice(self.models.targets[compare.judge], Candidate(model=compare.judge))
        tenant = job.principal.tenant_id or "anonymous"
        estimate = self._estimate(job, other_choice, judge)
        charge = await self.spend.charge(tenant, route_label(route), estimate, compare.max_spend_usd_per_hour)
        if charge is None:
            self._count(route.name, "capped")
            return
        spent: list[int] = []  # pico-USD of each call made, as the ledger bills it
        try:
            # One answer's text is what the judge reads: not the client's stream, nor its log
            # probabilities, which the other model's API may not offer (Anthropic's does not).
            alone = msgspec.structs.replace(
                job.request, stream=None, stream_options=None, logprobs=None, top_logprobs=None
            )
            alone = within_output_limit(alone, other_choice)
            response = await self._ask(job, other_choice.target, other.model, alone, "compare", spent)
            other_answer = answer_text(response)
            if not other_answer.strip():
                self._count(route.name, "failed")
                return
            other_role: Role = "strong" if job.served == "weak" else "weak"
            answers: dict[Role, str] = {job.served: job.answer, other_role: other_answer}
            first: tuple[Role, Role] = ("weak", "strong") if job.shown_first == "weak" else ("strong", "weak")
            orders = [first, (first[1], first[0])] if compare.both_orders else [first]
            graded: list[dict[Role, float]] = []
            for order in orders:  # one after the other: a failed first call stops the second
                asked = judge_request(compare.judge, job.request, answers[order[0]], answers[order[1]])
                asked = within_output_limit(asked, judge)
                text = answer_text(await self._ask(job, judge.target, compare.judge, asked, "judge", spent))
                grades = parse_verdict(text)
                if grades is None:
                    log.warning(
                        "comparison_unparsed", route=route.name, judge=compare.judge, verdict=text[:200]
                    )
                    self._count(route.name, "unparsed")
                    return
                graded.append({role: scaled(grade) for role, grade in zip(order, grades, strict=True)})
            if any(
                (g[role] >= ACCEPTABLE) != (graded[0][role] >= ACCEPTABLE) for g in graded for role in answers
            ):
                self._count(route.name, "inconsistent")
                return
            weak_score = sum(g["weak"] for g in graded) / len(graded)
            strong_score = sum(g["strong"] for g in graded) / len(graded)
            await self._store(job, tenant, weak_score, strong_score)
            self._count(route.name, "judged")
            if job.p_strong is not None and self.in_force(route.name, lambda now: ranks(now, job.head)):
                self.recent.add(route.name, job.head, job.p_strong, needs_strong(weak_score, strong_score))
        except GatewayError as exc:  # refused (rate limit, budget) or failed upstream: no label
            log.info("comparison_failed", route=route.name, request_id=job.request_id, error=exc.type)
            self._count(route.name, "failed")
        except Exception:
            log.exception("comparison_failed", route=route.name, request_id=job.request_id)
            self._count(route.name, "failed")
        finally:
            # The cap counts what the calls cost, not what was guessed (a reasoning judge costs more);
            # what the guess was over by is given back in the bucket it was counted in.
            await charge.settle(sum(spent))

    def _estimate(self, job: Job, other: Choice, judge: Choice) -> float:
        output = output_room(other, job.route, job.feats)
        answer = expected_cost(other, job.feats, output, self.context)
        judge_in = job.feats.prompt_tokens + 2 * max(len(job.answer.encode()) // BYTES_PER_TOKEN, output)
        judge_feats = dataclasses.replace(job.feats, prompt_tokens=judge_in)
        judged = expected_cost(judge, judge_feats, JUDGE_EXPECTED_OUTPUT, self.context)
        assert job.route.compare is not None
        return answer + judged * (2 if job.route.compare.both_orders else 1)

    async def _ask(
        self, job: Job, target: Target, model: str, request: ChatRequest, purpose: str, spent: list[int]
    ) -> ChatResponse:
        """One background call, its own request in the ledger, tied to the client's by `for=`."""
        route = job.route
        info = RequestInfo(
            request_id=ordered_id(),
            endpoint="compare",
            model=route.name,
            tenant=job.principal.tenant_name,
            route=f"route={route.name}; policy={route.policy}; candidate={model}; "
            f"purpose={purpose}; for={job.request_id}",
        )
        call = Call(info, job.principal, "compare", purpose=purpose)

        async def billed(event: UsageEvent) -> None:  # what the ledger bills it
            spent.append(event.cost_pico_usd)

        call.on_cost[1] = billed
        upstream = target.provider.chat_request(target.backend, request, target.upstream_model)
        # Read as the client's answer is (its `parallel_tool_calls: false` kept where the vendor has no
        # such switch): the two answers are graded as the client would have got each.
        reader = chat_response_reader(target.provider, request)
        try:
            # Its lines (an upstream that broke) name this call, as its ledger row does, not the client's.
            with logging_for(info):
                return await self.pipeline.exchange(call, target, upstream, reader)
        finally:
            if self.on_finish is not None:
                self.on_finish(info.request_id)

    async def _store(self, job: Job, tenant: str, weak_score: float, strong_score: float) -> None:
        from sqlalchemy import select

        from gateway.db.models import Comparison, utcnow

        route, compare = job.route, job.route.compare
        assert self.sessions is not None and compare is not None
        async with self.sessions() as session, session.begin():
            row = await session.scalar(
                select(Comparison).where(
                    Comparison.tenant_id == tenant, Comparison.request_id == job.request_id
                )
            )
            now = utcnow()
            if row is None:  # a client that sent one request id twice: the later grades win
                row = Comparison(tenant_id=tenant, request_id=job.request_id, created_at=now)
                session.add(row)
            row.route, row.served, row.judge = route.name, job.served, compare.judge
            row.weak_model, row.strong_model = route.candidates[0].model, route.candidates[1].model
            if (row.weak_score, row.strong_score) != (weak_score, strong_score):
                row.weak_score, row.strong_score, row.updated_at = weak_score, strong_score, now
            row.p_strong, row.head = job.p_strong, job.head

    async def stop(self) -> None:
        """Cancel comparisons still running (shutdown): grades are not worth holding a replica for."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
