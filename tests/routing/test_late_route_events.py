"""A request planned, sent or answered under an older route table, finishing after an admin changed it, adds
back no per-route row the change let go of: not under a name deleted, nor under a route still in force
that no longer does what the row is about (uses prefix affinity, has a target strong share). The
comparisons' rankings are tested the same way, through a gateway, in test_compare.py."""

from __future__ import annotations

import msgspec
import pytest

from routing.plan import Features
from routing.routes import Candidate, Route
from tests.routing.in_process_router import ACME, affinity, ask, difficulty, routed_event, router
from tests.routing.routed import sent

FIXED = Route(name="r", candidates=[Candidate(model="small")], probe_interval=None)
UNCALIBRATED = msgspec.structs.replace(difficulty("r"), strong_share=None)
RESHARED = msgspec.structs.replace(difficulty("r"), strong_share=0.5)


@pytest.mark.parametrize("table", [[FIXED], []], ids=["edited", "deleted"])
async def test_late_affinity_events_bring_back_no_counts(table: list[Route]) -> None:
    """A prefix_affinity request planned before its route was switched to another policy, or
    deleted, and sent after (its prefix look-up in Redis, or the gateway's admission, took that long)
    counted its hit or miss there; one still being answered counted its cached prompt tokens. Both
    rows (routes/status `prefix_affinity_*`, /metrics `weir_prefix_affinity_*`) came back after the
    table change had let them go, until the next one. They count nothing now, and its prefixes are
    not remembered; once the route uses prefix affinity again it counts afresh."""
    r = router(affinity("r"))
    prompt: Features = ask("a prompt " * 40)
    plan = await r.plan("r", ACME, prompt)
    r.set_routes(table)
    plan.commit()  # its first attempt admitted and sent after the change
    plan.serve(plan.choices[0])  # and answered
    r.stats.record(routed_event("r", plan.header()))  # its answer's usage, reported after the change
    assert (r.context.affinity, r.stats.affinity_tokens) == ({}, {})
    assert not r.context.prefixes.recent
    r.set_routes([affinity("r")])
    plan = await sent(r.plan("r", ACME, prompt))
    r.stats.record(routed_event("r", plan.header()))
    assert (r.context.affinity, r.stats.affinity_tokens) == ({"r": [1, 1]}, {"r": [100, 20]})


@pytest.mark.parametrize(
    "table", [[UNCALIBRATED], [RESHARED], []], ids=["uncalibrated", "another-share", "deleted"]
)
async def test_a_late_difficulty_request_brings_back_no_strong_share_window(table: list[Route]) -> None:
    """A difficulty request planned before its route lost its target strong share (or was deleted)
    and sent after started a strong-share window (up to 2,000 scores) that no route reads, kept
    until the next table change. It starts none now, nor one at its old target beside the route's
    new one."""
    r = router(difficulty("r"))
    plan = await r.plan("r", ACME, ask("a question"))
    r.set_routes(table)
    plan.commit()  # its first attempt admitted and sent after the change
    plan.serve(plan.choices[0])  # and answered
    # No score of it anywhere; under another share the route's one window, kept from its decision,
    # stays (read at the new share), empty.
    assert [len(c) for c in r.context.calibrators.values()] == ([0] if table == [RESHARED] else [])
    r.set_routes([difficulty("r")])
    await sent(r.plan("r", ACME, ask("a question")))
    assert list(r.context.calibrators) == [("r", "static")]
