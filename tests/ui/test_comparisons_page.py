"""Comparisons in the browser: a tenant's judge grades (a difficulty route's `compare`), seeded into
the admin DB, appear in its tenant view as a summary per route and candidate pair, how well the
route's head ranked them, and as recent rows;
a tenant without any shows the empty state that says what produces them."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from gateway.db.models import Comparison
from tests.ui.helpers import ADMIN, Weir

T0 = dt.datetime(2025, 3, 4, 12, 0, tzinfo=dt.UTC)


def _seed(db_url: str, tenant_id: str) -> None:
    # (request id, served, weak score, strong score, the head's p_strong): grades 8/10 and 9/10, 3/10
    # and 7/10, 2/10 and 10/10. The head scored the two that needed the strong model highest.
    rows = [
        ("req-a", "weak", 7 / 9, 8 / 9, 0.2),
        ("req-b", "strong", 2 / 9, 6 / 9, 0.7),
        ("req-c", "weak", 1 / 9, 1.0, 0.6),
    ]
    engine = create_engine(db_url.replace("+aiosqlite", ""))
    try:
        with Session(engine) as session, session.begin():
            for i, (request_id, served, weak, strong, p_strong) in enumerate(rows):
                session.add(
                    Comparison(
                        tenant_id=tenant_id,
                        request_id=request_id,
                        route="auto",
                        weak_model="gpt-4o-mini",
                        strong_model="gpt-4o",
                        served=served,
                        weak_score=weak,
                        strong_score=strong,
                        judge="judge-model",
                        created_at=T0 + dt.timedelta(minutes=i),
                        p_strong=p_strong,
                        head="static",
                    )
                )
    finally:
        engine.dispose()


def test_tenant_view_shows_comparisons_summary_and_rows(weir: Weir, browser: Any, shots: Path) -> None:
    with weir.admin as admin:
        acme = admin.post("/tenants", json={"name": "acme", "store_prompts": True}).json()
        other = admin.post("/tenants", json={"name": "other"}).json()
    _seed(weir.db_url, acme["id"])

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{weir.url}/admin/#/tenants/{acme['id']}")
    page.get_by_label("Admin token", exact=True).fill(ADMIN)
    page.get_by_role("button", name="Sign in with token").click()
    page.get_by_role("heading", name="Comparisons of acme").wait_for()
    section = page.locator("#comparisons")

    summary = section.locator("table").nth(0)
    assert summary.locator("th").all_inner_texts() == [
        "Route",
        "Weak vs strong",
        "Comparisons",
        "Weak acceptable",
        "Strong acceptable",
        "Only strong acceptable",
    ]
    assert summary.locator("tbody tr td").all_inner_texts() == [
        "auto",
        "gpt-4o-mini vs gpt-4o",
        "3",
        "33%",
        "100%",
        "67%",
    ]

    # How the head ranked them: both that needed the strong model above the one that did not, but
    # two and one are too few for a verdict.
    ranking = section.locator("table").nth(1)
    assert ranking.locator("th").all_inner_texts() == [
        "Route",
        "Head",
        "Comparisons",
        "Needed strong",
        "Ranking (AUC)",
    ]
    assert ranking.locator("tbody tr td").all_inner_texts() == [
        "auto",
        "static",
        "3",
        "2",
        "1.000 (not yet clear)",
    ]

    recent = section.locator("table").nth(2).locator("tbody tr")
    assert recent.count() == 3
    # Newest first: request id, route, served, weak grade, strong grade, judge, time.
    assert recent.nth(0).locator("td").all_inner_texts() == [
        "req-c",
        "auto (gpt-4o-mini vs gpt-4o)",
        "weak",
        "2/10",
        "10/10",
        "judge-model",
        "2025-03-04 12:02:00",
    ]
    assert recent.nth(1).locator("td").all_inner_texts()[2:5] == ["strong", "3/10", "7/10"]
    assert recent.nth(2).locator("td").all_inner_texts()[0] == "req-a"
    assert recent.nth(2).locator("td").all_inner_texts()[3:5] == ["8/10", "9/10"]
    assert "No comparisons yet" not in section.inner_text()
    page.screenshot(path=shots / "12-comparisons.png", full_page=True)

    # Another tenant has none: the empty state says what produces them, and that its prompts are not kept.
    page.goto(f"{weir.url}/admin/#/tenants/{other['id']}")
    page.get_by_role("heading", name="Comparisons of other").wait_for()
    text = page.locator("#comparisons").inner_text()
    assert "No comparisons yet" in text and "compare" in text and "store_prompts" in text, text
    assert "this tenant's store_prompts is off" in text, text
    assert page.locator("#comparisons table").count() == 0
    page.close()
