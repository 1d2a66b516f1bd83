"""Training rows from a tenant's own traffic: `POST /v1/feedback` scores and a judge's comparisons
(routing.compare) joined with what was asked (the opted-in stored prompt) and, for feedback, who
answered (the usage ledger), for `weir router train --tenant`.

Feedback scores one answer, so each row labels only the model that served the request: a request the
weak candidate answered says whether the weak model was right, and nothing about the strong one (and
the other way round). `routing.train` fits the head on such partially labelled rows (each output of
the network learns from the rows that label it). A comparison grades both answers: a full row.

What is needed from the admin DB, all for the one tenant:
- `feedback`: request_id, score (>= `correct_at` counts as a correct answer);
- `comparisons` of the route's two candidates: both grades, on the same 0..1 scale;
- `stored_prompts`: the request body, kept only for tenants with `store_prompts` on (decrypted with
  WEIR_MASTER_KEY when the gateway encrypted it);
- `usage_events`: the attempt that answered (status 200), whose `routing` names the candidate.
Requests answered by neither model, or without a stored prompt, are counted and skipped.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway import anthropic_inbound, responses_inbound
from gateway.db.models import Comparison, Feedback, RouteRow, StoredPrompt, Tenant, UsageEventRow
from gateway.errors import GatewayError, decode_body
from gateway.prompts import read_body
from gateway.types import ChatRequest, CompletionRequest
from gateway.vault import Vault, VaultError
from routing.plan import features, prompt_request
from routing.train import Outcomes

_CANDIDATE = re.compile(r"(?:^|; )candidate=([^;]+)")


@dataclass
class FeedbackReport:
    """What the join found: rows used, and why the others were skipped."""

    feedback: int = 0
    compared: int = 0  # comparisons of this route's two candidates
    # rows used: judged both answers; feedback on an answer of the weak, of the strong model
    used: dict[str, int] = field(default_factory=lambda: {"both": 0, "weak": 0, "strong": 0})
    skipped: dict[str, int] = field(default_factory=dict)
    # Per row of the outcomes: the score the route's head gave the request when it was routed (NaN
    # where not stored: feedback rows, comparisons from before migration 0007), and which head.
    routed: np.ndarray = field(default_factory=lambda: np.zeros(0))
    routed_by: list[str | None] = field(default_factory=list)
    # Per row: when its label was last set (the grades or the score, Unix seconds), so a later run can
    # tell which rows a head trained now could not have seen; and the tenant's id.
    recorded: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tenant_id: str = ""

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        return (
            f"{self.compared} comparisons: {self.used['both']} used; "
            f"{self.feedback} feedback rows: {self.used['weak']} answered by the weak model, "
            f"{self.used['strong']} by the strong one; skipped: {skipped}"
        )


def _completions(body: str) -> ChatRequest:
    request = decode_body(body, CompletionRequest)
    return prompt_request(request.model, request.prompt)


# How each endpoint's stored body becomes the canonical chat the route read: the gateway's own parsers.
_CANONICAL: dict[str, Callable[[str], ChatRequest]] = {
    "chat": lambda body: decode_body(body, ChatRequest),
    "messages": lambda body: anthropic_inbound.to_canonical(
        decode_body(body, anthropic_inbound.MessagesRequest)
    ),
    "responses": lambda body: responses_inbound.to_canonical(
        decode_body(body, responses_inbound.ResponsesRequest)
    ),
    "completions": _completions,
}


def request_prompt(body: str, endpoint: str) -> str | None:
    """The text the difficulty policy scored for a stored request: its body read by the endpoint's
    own parser, then the last user turn as `routing.plan.features` takes it, so a head trains on
    exactly what it will be served (a parallel reading of each API's shapes had drifted from it:
    Responses API requests and Anthropic tool loops were skipped, text parts joined differently).
    None when there is no text, or the body no longer parses."""
    read = _CANONICAL.get(endpoint)
    if read is None:
        return None
    try:
        chat = read(body)
    except GatewayError:
        return None
    return features(chat, None, None).last_user or None


def answered_by(row: UsageEventRow) -> str:
    """The public model name of the candidate that answered (the ledger's `model` is the upstream id)."""
    found = _CANDIDATE.search(row.routing or "")
    return found.group(1).strip() if found else row.model


async def tenant_names(sessions: async_sessionmaker[AsyncSession], tenant: str) -> tuple[str, str]:
    """A tenant's id and name from either; ValueError when there is no such tenant. An id wins over a
    name: a tenant may be named like another's id, and every tenant can still be named by its id."""
    async with sessions() as session:
        found = (
            await session.execute(
                select(Tenant.id, Tenant.name).where((Tenant.name == tenant) | (Tenant.id == tenant))
            )
        ).all()
    if not found:
        raise ValueError(f"no tenant named {tenant!r}")
    by_id = [row for row in found if row.id == tenant]
    row = (by_id or found)[0]
    return row.id, row.name


@dataclass(frozen=True)
class TenantRoute:
    """The difficulty route a tenant's requests of one public name reach."""

    id: int
    weak: str  # candidates[0]
    strong: str  # candidates[1]
    head: str | None  # the trained head it names; None: the shipped head
    # Its conditions name this tenant alone, so a head trained on the tenant's traffic may serve it
    # without deciding for anyone else.
    exclusive: bool
    # The route as read: `--install` re-points it only if it is still this when it writes.
    spec: dict[str, Any] | None = None


async def tenant_route(
    sessions: async_sessionmaker[AsyncSession], route: str, tenant: str | None = None
) -> TenantRoute:
    """The first `difficulty` route of that name (by position) whose `when.tenants` admits `tenant`
    (a name or id; None: the first of any). Other conditions (keys, metadata, lengths) are per request,
    so a route that passes this is the one the tenant's traffic reaches unless those say otherwise."""
    names = set(await tenant_names(sessions, tenant)) if tenant is not None else set()
    async with sessions() as session:
        rows = (
            await session.scalars(
                select(RouteRow).where(RouteRow.name == route).order_by(RouteRow.position, RouteRow.id)
            )
        ).all()
    for row in rows:
        spec = row.spec or {}
        candidates = spec.get("candidates") or []
        tenants = (spec.get("when") or {}).get("tenants")
        if spec.get("policy") != "difficulty" or len(candidates) < 2:
            continue
        if tenant is not None and tenants is not None and not names & set(tenants):
            continue
        return TenantRoute(
            id=row.id,
            weak=candidates[0]["model"],
            strong=candidates[1]["model"],
            head=spec.get("head"),
            exclusive=tenants is not None and len(tenants) == 1 and tenants[0] in names,
            spec=spec,
        )
    whose = f" that tenant {tenant!r} reaches" if tenant is not None else ""
    raise ValueError(f"no difficulty route named {route!r}{whose} in the admin DB")


async def load_feedback(
    sessions: async_sessionmaker[AsyncSession],
    tenant: str,
    weak: str,
    strong: str,
    vault: Vault | None = None,
    correct_at: float = 0.5,
) -> tuple[Outcomes, FeedbackReport]:
    """Outcomes from one tenant's feedback and comparisons. `weak` and `strong` are the public model
    names of the route's candidates. A request the judge compared gives both outcomes; feedback on
    it adds nothing then (the judge graded the same answer the feedback scores, and the other one)."""
    tid, _ = await tenant_names(sessions, tenant)
    report = FeedbackReport(tenant_id=tid)
    async with sessions() as session:
        feedback = (await session.execute(select(Feedback).where(Feedback.tenant_id == tid))).scalars().all()
        compared = (
            (
                await session.execute(
                    select(Comparison).where(
                        Comparison.tenant_id == tid,
                        Comparison.weak_model == weak,
                        Comparison.strong_model == strong,
                    )
                )
            )
            .scalars()
            .all()
        )
        report.feedback, report.compared = len(feedback), len(compared)
        by_judge = {c.request_id for c in compared}
        feedback = [f for f in feedback if f.request_id not in by_judge]
        feedback_ids = [f.request_id for f in feedback]
        stored = await _by_request(
            session, StoredPrompt, tid, [c.request_id for c in compared] + feedback_ids
        )
        # Who answered matters only for feedback: a comparison already says which grade is whose.
        answered = await _by_request(session, UsageEventRow, tid, feedback_ids, UsageEventRow.status == 200)
    rows: list[tuple[str, Label]] = []
    routed: list[float] = []
    recorded: list[float] = []
    for c in compared:
        prompt = _prompt(stored.get(c.request_id), vault, report)
        if prompt is not None:
            rows.append((prompt, (c.weak_score >= correct_at, c.strong_score >= correct_at)))
            routed.append(c.p_strong if c.p_strong is not None else np.nan)
            recorded.append(c.updated_at.timestamp())
            report.routed_by.append(c.head)
            report.used["both"] += 1
    for f in feedback:
        events = answered.get(f.request_id)
        if not events:
            report.skip("with no answered attempt in the ledger")
            continue
        models = {answered_by(event) for event in events}
        if len(models) > 1:  # a client that sent one request id twice: whose answer was scored?
            report.skip("answered by different models under one request id")
            continue
        model = models.pop()
        role = "weak" if model == weak else "strong" if model == strong else None
        if role is None:
            report.skip("answered by another model")
            continue
        prompt = _prompt(stored.get(f.request_id), vault, report)
        if prompt is None:
            continue
        right = f.score >= correct_at
        rows.append((prompt, (right, None) if role == "weak" else (None, right)))
        routed.append(np.nan)
        recorded.append(f.updated_at.timestamp())
        report.routed_by.append(None)
        report.used[role] += 1
    report.routed = np.array(routed, dtype=float)
    report.recorded = np.array(recorded, dtype=float)
    return _outcomes(rows), report


async def _by_request(
    session: AsyncSession, entity: Any, tid: str, ids: list[str], *where: Any
) -> dict[str, Any]:
    """The tenant's rows of `entity` (a table with tenant_id and request_id) for these request ids:
    a list per id, as a client may send one request id (`x-request-id`) with several requests."""
    found: dict[str, list[Any]] = {}
    for start in range(0, len(ids), 500):  # bounded IN lists
        chunk = ids[start : start + 500]
        query = select(entity).where(entity.tenant_id == tid, entity.request_id.in_(chunk), *where)
        for row in (await session.execute(query)).scalars():
            found.setdefault(row.request_id, []).append(row)
    return found


# (weak right, strong right); None where that outcome is unknown
Label = tuple[bool | None, bool | None]


def _prompt(rows: list[StoredPrompt] | None, vault: Vault | None, report: FeedbackReport) -> str | None:
    """The prompt text of a stored request; None (counted in the report) when there is none to read,
    or when several requests sent under its id asked different things (which one was graded?)."""
    if not rows:
        report.skip("without a stored prompt (store_prompts off, or past retention)")
        return None
    prompts = set()
    for row in rows:
        try:
            body, _ = read_body(row, vault)
        except VaultError:
            report.skip("encrypted under a key this machine lacks (set WEIR_MASTER_KEY)")
            return None
        prompts.add(request_prompt(body, row.endpoint))
    if len(prompts) > 1:
        report.skip("sent under a request id that requests with other prompts used too")
        return None
    prompt = prompts.pop()
    if prompt is None:
        report.skip("with no text prompt in the stored request")
    return prompt


def _outcomes(rows: list[tuple[str, Label]]) -> Outcomes:
    weak = np.array([w is True for _, (w, _) in rows], dtype=bool)
    strong = np.array([s is True for _, (_, s) in rows], dtype=bool)
    return Outcomes(
        [prompt for prompt, _ in rows],
        weak=weak,
        strong=strong,
        weak_known=np.array([w is not None for _, (w, _) in rows], dtype=bool),
        strong_known=np.array([s is not None for _, (_, s) in rows], dtype=bool),
    )
