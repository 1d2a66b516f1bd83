"""Hot shared state behind one small interface: `SharedState`.

`MemoryState` keeps it in this process; `RedisState` keeps it in Redis with atomic Lua scripts, so
limits and budgets hold exactly across every gateway replica. `open_state(redis_url)` picks one.
"""

from __future__ import annotations

from gateway.state.base import (
    Adjustment,
    Admission,
    Budget,
    BudgetDecision,
    Lease,
    Limit,
    Settlement,
    SharedState,
    correction_bucket,
)
from gateway.state.memory import MemoryState


def open_state(redis_url: str | None, prefix: str = "weir:", replicas: int | None = None) -> SharedState:
    """`replicas`: how many replicas to share limits among while Redis is away, until counted there."""
    if not redis_url:
        return MemoryState()
    from gateway.state.degradable import DegradableState
    from gateway.state.redis import RedisState

    # Redis down must not take the gateway down: limits fall back to this process meanwhile.
    return DegradableState(RedisState.from_url(redis_url, prefix=prefix), replicas=replicas)


__all__ = [
    "Adjustment",
    "Admission",
    "Budget",
    "BudgetDecision",
    "Lease",
    "Limit",
    "MemoryState",
    "Settlement",
    "SharedState",
    "correction_bucket",
    "open_state",
]
