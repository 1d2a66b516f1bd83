"""A request planned or answered under an older route table, finishing after an admin changed it, adds
back no per-route row the change let go of: not under a name deleted, nor under a route still in force
that no longer does what the row is about (uses prefix affinity, has a target strong share). The
comparisons' rankings are tested the same way, through a gateway, in test_compare.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import msgspec
import pytest

from routing.plan import Features
from routing.prefixes import PrefixIndex
from routing.routes import Candidate, Route
from tests.routing.test_routing_state_bounded import ACME, affinity, ask, difficulty, router, usage_event

FIXED = Route(name="r", candidates=[Candidate(model="small")], probe_interval=None)
UNCALIBRATED = msgspec.structs.replace(difficulty("r"), strong_share=None)


def _looked_up_slowly(
    monkeypatch: pytest.MonkeyPatch, prefixes: PrefixIndex
) -> tuple[asyncio.Event, asyncio.Event]:
    """Make prefix look-ups wait, as one in Redis does: (the look-up began, let it finish)."""
    began, finish = asyncio.Event(), asyncio.Event()
    longest = prefixes.longest

    async def slow(keys: Sequence[bytes], touch: bool = True) -> tuple[int, str] | None:
        began.set()
        await finish.wait()
        return await longest(keys, touch)

    monkeypatch.setattr(prefixes, "longest", slow)
    return began, finish


@pytest.mark.parametrize("table", [[FIXED], []], ids=["edited", "deleted"])
async def test_late_affinity_events_bring_back_no_counts(
    table: list[Route], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix_affinity request still looking its prefixes up (in Redis) when its route was switched
    to another policy, or deleted, counted its hit or miss there; one still being answered counted
    its cached prompt tokens. Both rows (routes/status `prefix_affinity_*`, /metrics
    `weir_prefix_affinity_*`) came back after the table change had let them go, until the next one.
    They count nothing now; once the route uses prefix affinity again it counts afresh."""
    r = router(affinity("r"))
    began, finish = _looked_up_slowly(monkeypatch, r.context.prefixes)
    prompt: Features = ask("a prompt " * 40)
    planning = asyncio.create_task(r.plan("r", ACME, prompt))
    await began.wait()
    r.set_routes(table)
    finish.set()
    plan = await planning
    r.stats.record(usage_event("r", plan.header()))  # its answer's usage, reported after the change
    assert (r.context.affinity, r.stats.affinity_tokens) == ({}, {})
    r.set_routes([affinity("r")])
    plan = await r.plan("r", ACME, prompt)
    r.stats.record(usage_event("r", plan.header()))
    assert (r.context.affinity, r.stats.affinity_tokens) == ({"r": [1, 1]}, {"r": [100, 20]})


@pytest.mark.parametrize("table", [[UNCALIBRATED], []], ids=["edited", "deleted"])
async def test_a_late_difficulty_plan_brings_back_no_strong_share_window(table: list[Route]) -> None:
    """A difficulty request still being scored when its route lost its target strong share (or was
    deleted) started a strong-share window (up to 2,000 scores) that no route reads, kept until
    the next table change. It starts none now."""
    scoring, finish = threading.Event(), threading.Event()

    def slow(prompt: str) -> float:
        scoring.set()
        finish.wait(5)
        return 0.5

    r = router(difficulty("r"))
    r.context.scorer = slow
    planning = asyncio.create_task(r.plan("r", ACME, ask("a question")))
    await asyncio.to_thread(scoring.wait, 5)
    r.set_routes(table)
    finish.set()
    await planning
    assert r.context.calibrators == {}
    r.set_routes([difficulty("r")])
    await r.plan("r", ACME, ask("a question"))
    assert list(r.context.calibrators) == [("r", "static")]
