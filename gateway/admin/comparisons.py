"""Admin API for a tenant's comparisons (routing.compare): `GET /tenants/{id}/comparisons`.

What the judge said about both candidates' answers, newest first, and per route and candidate pair
how often each model was acceptable: the share where the weak model fails and the strong one
succeeds is what a difficulty head is trained to find, and the traffic a route should send strong.
"""

from __future__ import annotations

from typing import Any

from litestar import get
from sqlalchemy import Integer, and_, case, func, select

from gateway.admin.router import AdminContext, AdminError, tenant_or_404
from gateway.db.models import Comparison
from routing.compare import ACCEPTABLE


def _passes(condition: Any) -> Any:
    return func.sum(case((condition, 1), else_=0).cast(Integer))


@get("/tenants/{tenant_id:str}/comparisons")
async def list_comparisons(
    tenant_id: str, ctx: AdminContext, route: str | None = None, limit: int = 100
) -> dict[str, Any]:
    if not 1 <= limit <= 1000:
        raise AdminError(400, "limit must be within [1, 1000]", "invalid_value", "limit")
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
                "created_at": r.created_at.isoformat(),
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
    }


COMPARISON_HANDLERS = [list_comparisons]
