"""Training rows from a tenant's own traffic: `POST /v1/feedback` scores joined with what was asked
(the opted-in stored prompt) and who answered (the usage ledger), for `weir router train --tenant`.

Feedback scores one answer, so each row labels only the model that served the request: a request the
weak candidate answered says whether the weak model was right, and nothing about the strong one (and
the other way round). `routing.train` fits the head on such partially labelled rows (each output of
the network learns from the rows that label it).

What is needed from the admin DB, all for the one tenant:
- `feedback`: request_id, score (>= `correct_at` counts as a correct answer);
- `stored_prompts`: the request body, kept only for tenants with `store_prompts` on (decrypted with
  WEIR_MASTER_KEY when the gateway encrypted it);
- `usage_events`: the attempt that answered (status 200), whose `routing` names the candidate.
Requests answered by neither model, or without a stored prompt, are counted and skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import Feedback, RouteRow, StoredPrompt, Tenant, UsageEventRow
from gateway.prompts import read_body
from gateway.vault import Vault, VaultError
from routing.difficulty import prompt_text
from routing.train import Outcomes

_CANDIDATE = re.compile(r"(?:^|; )candidate=([^;]+)")


@dataclass
class FeedbackReport:
    """What the join found: rows used, and why the others were skipped."""

    feedback: int = 0
    used: dict[str, int] = field(default_factory=lambda: {"weak": 0, "strong": 0})
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        return (
            f"{self.feedback} feedback rows: {self.used['weak']} answered by the weak model, "
            f"{self.used['strong']} by the strong one; skipped: {skipped}"
        )


def request_prompt(body: str) -> str | None:
    """The text a difficulty score reads from a stored request body (chat, Anthropic messages or
    completions); None when it holds none."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("messages"), list):
        text = prompt_text([m for m in data["messages"] if isinstance(m, dict)])
        return text or None
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) and prompt else None


def answered_by(row: UsageEventRow) -> str:
    """The public model name of the candidate that answered (the ledger's `model` is the upstream id)."""
    found = _CANDIDATE.search(row.routing or "")
    return found.group(1).strip() if found else row.model


async def tenant_id(sessions: async_sessionmaker[AsyncSession], tenant: str) -> str:
    """A tenant's id from its name (or its id); ValueError when there is no such tenant."""
    async with sessions() as session:
        found = await session.scalar(select(Tenant.id).where((Tenant.name == tenant) | (Tenant.id == tenant)))
    if found is None:
        raise ValueError(f"no tenant named {tenant!r}")
    return found


async def route_models(sessions: async_sessionmaker[AsyncSession], route: str) -> tuple[str, str]:
    """The weak and strong candidates (the first two) of the first `difficulty` route of that name."""
    async with sessions() as session:
        rows = (
            await session.execute(
                select(RouteRow).where(RouteRow.name == route).order_by(RouteRow.position, RouteRow.id)
            )
        ).scalars()
        for row in rows:
            spec = row.spec
            candidates = spec.get("candidates") or []
            if spec.get("policy") == "difficulty" and len(candidates) >= 2:
                return candidates[0]["model"], candidates[1]["model"]
    raise ValueError(f"no difficulty route named {route!r} in the admin DB")


async def load_feedback(
    sessions: async_sessionmaker[AsyncSession],
    tenant: str,
    weak: str,
    strong: str,
    vault: Vault | None = None,
    correct_at: float = 0.5,
) -> tuple[Outcomes, FeedbackReport]:
    """Partially labelled outcomes from one tenant's feedback. `weak` and `strong` are the public
    model names of the route's candidates."""
    tid = await tenant_id(sessions, tenant)
    report = FeedbackReport()
    prompts: list[str] = []
    labels: list[tuple[str, bool]] = []  # (which model answered, was it right)
    async with sessions() as session:
        feedback = (await session.execute(select(Feedback).where(Feedback.tenant_id == tid))).scalars().all()
        report.feedback = len(feedback)
        ids = [f.request_id for f in feedback]
        stored: dict[str, StoredPrompt] = {}
        answered: dict[str, UsageEventRow] = {}
        for start in range(0, len(ids), 500):  # bounded IN lists
            chunk = ids[start : start + 500]
            for prompt_row in (
                await session.execute(
                    select(StoredPrompt).where(
                        StoredPrompt.tenant_id == tid, StoredPrompt.request_id.in_(chunk)
                    )
                )
            ).scalars():
                stored[prompt_row.request_id] = prompt_row
            for event_row in (
                await session.execute(
                    select(UsageEventRow).where(
                        UsageEventRow.tenant_id == tid,
                        UsageEventRow.request_id.in_(chunk),
                        UsageEventRow.status == 200,
                    )
                )
            ).scalars():
                answered[event_row.request_id] = event_row
    for f in feedback:
        event = answered.get(f.request_id)
        if event is None:
            report.skip("with no answered attempt in the ledger")
            continue
        model = answered_by(event)
        role = "weak" if model == weak else "strong" if model == strong else None
        if role is None:
            report.skip("answered by another model")
            continue
        row = stored.get(f.request_id)
        if row is None:
            report.skip("without a stored prompt (store_prompts off, or past retention)")
            continue
        try:
            body, _ = read_body(row, vault)
        except VaultError:
            report.skip("encrypted under a key this machine lacks (set WEIR_MASTER_KEY)")
            continue
        prompt = request_prompt(body)
        if prompt is None:
            report.skip("with no text prompt in the stored request")
            continue
        prompts.append(prompt)
        labels.append((role, f.score >= correct_at))
        report.used[role] += 1
    return _partial(prompts, labels), report


def _partial(prompts: list[str], labels: list[tuple[str, bool]]) -> Outcomes:
    is_weak = np.array([role == "weak" for role, _ in labels], dtype=bool)
    right = np.array([ok for _, ok in labels], dtype=bool)
    return Outcomes(
        prompts,
        weak=is_weak & right,
        strong=~is_weak & right,
        weak_known=is_weak,
        strong_known=~is_weak,
    )
