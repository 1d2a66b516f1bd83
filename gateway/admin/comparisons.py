"""Admin API for a tenant's comparisons (routing.compare): `GET /tenants/{id}/comparisons`.

What the judge said about both candidates' answers, newest first, and per route and candidate pair
how often each model was acceptable: the share where the weak model fails and the strong one
succeeds is what a difficulty head is trained to find, and the traffic a route should send strong.

Per route and head, how well the head's scores ranked those requests (AUC): the shipped heads are
fitted on MMLU, and on other traffic they can rank worse than chance (on AlpacaEval's chat
instructions they do, docs/benchmarks.md), so a tenant's own comparisons are where to check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from litestar import get
from sqlalchemy import Integer, and_, case, func, select

from gateway.admin.router import AdminContext, checked_limit, tenant_or_404
from gateway.db.models import Comparison
from routing.compare import ACCEPTABLE, needs_strong
from routing.ranking import head_ranking

# The most recent comparisons a head's ranking is measured on: recent traffic is what the head
# routes now, and a few thousand rows pin an AUC to about +-0.02.
RANKING_ROWS = 5000


def _passes(condition: Any) -> Any:
    return func.sum(case((condition, 1), else_=0).cast(Integer))


@get("/tenants/{tenant_id:str}/comparisons")
async def list_comparisons(
    tenant_id: str, ctx: AdminContext, route: str | None = None, limit: int = 100
) -> dict[str, Any]:
    checked_limit(limit, 1000)
    where = [Comparison.tenant_id == tenant_id]
    if route is not None:
        where.append(Comparison.route == route)
    weak_ok, strong_ok = Comparison.weak_score >= ACCEPTABLE, Comparison.strong_score >= ACCEPTABLE
    async with ctx.sessions() as session:
        await tenant_or_404(session, tenant_id)
        rows = (
            await session.scalars(
                select(Comparison)
                .where(*where)
                .order_by(Comparison.created_at.desc(), Comparison.id.desc())
                .limit(limit)
            )
        ).all()
        totals = (
            await session.execute(
                select(
                    Comparison.route,
                    Comparison.weak_model,
                    Comparison.strong_model,
                    func.count(),
                    _passes(weak_ok),
                    _passes(strong_ok),
                    _passes(and_(~weak_ok, strong_ok)),
                )
                .where(*where)
                .group_by(Comparison.route, Comparison.weak_model, Comparison.strong_model)
                .order_by(Comparison.route, Comparison.weak_model, Comparison.strong_model)
            )
        ).all()
        scored = (
            await session.execute(
                select(
                    Comparison.route,
                    Comparison.head,
                    Comparison.p_strong,
                    Comparison.weak_score,
                    Comparison.strong_score,
                )
                .where(*where, Comparison.p_strong.is_not(None))
                .order_by(Comparison.created_at.desc(), Comparison.id.desc())
                .limit(RANKING_ROWS)
            )
        ).all()
    return {
        "data": [
            {
                "request_id": r.request_id,
                "route": r.route,
                "weak_model": r.weak_model,
                "strong_model": r.strong_model,
                "served": r.served,
                "weak_score": r.weak_score,
                "strong_score": r.strong_score,
                "judge": r.judge,
                "p_strong": r.p_strong,
                "head": r.head,
                "created_at": r.created_at.isoformat(),
                "updated_at": r.updated_at.isoformat(),  # when the grades last changed
            }
            for r in rows
        ],
        "summary": [
            {
                "route": name,
                "weak_model": weak,
                "strong_model": strong,
                "comparisons": count,
                "weak_acceptable": weak_n / count,
                "strong_acceptable": strong_n / count,
                "only_strong_acceptable": gain_n / count,
            }
            for name, weak, strong, count, weak_n, strong_n, gain_n in totals
        ],
        "ranking": _ranking(scored),
    }


def _ranking(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """Per route and head: how well its scores ranked the compared requests (routing.ranking)."""
    groups: dict[tuple[str, str | None], list[tuple[float, bool]]] = {}
    for route, head, p_strong, weak_score, strong_score in rows:
        groups.setdefault((route, head), []).append((p_strong, needs_strong(weak_score, strong_score)))
    out = []
    for (route, head), pairs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        found = head_ranking([p for p, _ in pairs], [y for _, y in pairs])
        out.append(
            {
                "route": route,
                "head": head,
                "comparisons": found.comparisons,
                "needs_strong": found.needs_strong,
                "auc": found.auc,
                "auc_low": found.low,
                "auc_high": found.high,
                "verdict": found.verdict,
            }
        )
    return out


COMPARISON_HANDLERS = [list_comparisons]
