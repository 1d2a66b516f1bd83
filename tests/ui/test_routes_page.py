"""Routes in the browser: create a route, send a request that follows it, edit the route and see the
next request follow the change; validation errors say what to fix; history records both changes."""

from __future__ import annotations

import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai

from tests.ui.helpers import ADMIN, Weir


def upstream_model(client: openai.OpenAI) -> tuple[str, str | None]:
    raw = client.chat.completions.with_raw_response.create(
        model="assistant", messages=[{"role": "user", "content": "hello"}], max_tokens=10
    )
    return raw.parse().model, raw.headers.get("x-weir-route")


def test_edit_a_route_and_the_next_request_follows(routed: Weir, browser: Any, shots: Path) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{routed.url}/admin/#/routes")
    page.get_by_label("Admin token", exact=True).fill(ADMIN)
    page.get_by_role("button", name="Sign in with token").click()
    page.get_by_role("heading", name="New route").wait_for()
    assert "No routes yet" in page.locator("main").inner_text()

    form = page.get_by_role("form", name="Create a route")
    form.get_by_label("Public model name", exact=True).fill("assistant")
    form.get_by_label("Candidates", exact=True).fill("gpt-4o-mini\nno-such-model")
    form.get_by_role("button", name="Create route").click()
    error = form.locator(".form-error")
    error.wait_for()
    assert "no-such-model" in error.inner_text()  # the API's reason, shown beside the form
    form.get_by_label("Candidates", exact=True).fill("gpt-4o-mini")
    form.get_by_role("button", name="Create route").click()
    page.get_by_role("link", name="Edit route assistant #1").wait_for()

    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)
    model, header = upstream_model(client)
    assert model.startswith("gpt-4o-mini"), (model, header)

    page.get_by_role("link", name="Edit route assistant #1").click()
    edit = page.get_by_role("form", name="Edit route assistant")
    edit.get_by_label("Candidates", exact=True).fill("gpt-4o")
    edit.get_by_role("button", name="Save route").click()
    page.get_by_role("heading", name="New route").wait_for()
    model, header = upstream_model(client)
    assert model.startswith("gpt-4o") and not model.startswith("gpt-4o-mini"), (model, header)

    preview = page.get_by_role("form", name="Preview a prompt")
    preview.get_by_label("Sample prompt", exact=True).fill("Prove that there are infinitely many primes.")
    preview.get_by_role("button", name="Preview").click()
    page.locator("#preview-result ol").wait_for()
    result = page.locator("#preview-result").inner_text()
    assert "Route assistant (policy fixed) matches" in result and "gpt-4o on openai" in result
    preview.get_by_label("Model name", exact=True).fill("gpt-4o-mini")
    preview.get_by_role("button", name="Preview").click()
    page.get_by_text("No route matches").wait_for()

    history = page.locator("main > .table-wrap").last.inner_text()
    assert "update" in history and "create" in history and "ui:admin-token" in history
    page.screenshot(path=shots / "09-routes.png", full_page=True)

    # Routing savings: with gpt-4o-mini first and gpt-4o second, a request served by gpt-4o-mini saved
    # the price difference against sending it to gpt-4o; the overview shows the API's number.
    page.get_by_role("link", name="Edit route assistant #1").click()
    edit = page.get_by_role("form", name="Edit route assistant")
    edit.get_by_label("Candidates", exact=True).fill("gpt-4o-mini\ngpt-4o")
    edit.get_by_role("button", name="Save route").click()
    page.get_by_role("heading", name="New route").wait_for()
    assert upstream_model(client)[0].startswith("gpt-4o-mini")
    deadline = time.monotonic() + 15
    while len(log := routed.admin.get("/requests").json()["data"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    expected = (
        sum(
            Decimal(a["input_tokens"]) * (Decimal("2.50") - Decimal("0.15"))
            + Decimal(a["output_tokens"]) * (Decimal("10.00") - Decimal("0.60"))
            for r in log
            for a in r["attempts"]
            if a["model"] == "gpt-4o-mini"
        )
        / 10**6
    )
    savings = routed.admin.get("/reports/routing-savings").json()["totals"]
    assert Decimal(savings["saved_usd"]) == expected > 0
    page.get_by_role("link", name="Overview").click()
    card = page.locator(".stat", has_text="Routing savings").locator(".stat-value")
    card.wait_for()
    assert card.get_attribute("data-value") == savings["saved_usd"]
    assert card.inner_text().startswith("$0.0000")
    page.screenshot(path=shots / "10-overview-routing.png", full_page=True)
    page.close()


def test_the_routes_page_shows_what_prefix_affinity_achieves(routed: Weir, browser: Any, shots: Path) -> None:
    """Two questions about one long document on a prefix_affinity route: the second goes where the
    first did and the upstream reads the document from its prompt cache; the page shows the hit rate
    the route achieved and each model's observed speed, as routes/status reports them."""
    created = routed.admin.post(
        "/routes",
        json={
            "name": "docs",
            "policy": "prefix_affinity",
            "candidates": [{"model": "gpt-4o-mini"}, {"model": "gpt-4o"}],
        },
    )
    assert created.status_code == 201, created.text
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)
    document = " ".join(f"fact{i}" for i in range(1300))
    for question in ("What is fact 7?", "What is fact 1200?"):
        client.chat.completions.create(
            model="docs",
            messages=[{"role": "system", "content": document}, {"role": "user", "content": question}],
            max_tokens=10,
        )
    deadline = time.monotonic() + 10  # the usage events reach the routing stats off the request's path
    while (status := routed.admin.get("/routes/status").json())["prefix_affinity_cache"].get("docs", {}).get(
        "cached_tokens", 0
    ) == 0:
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    cache = status["prefix_affinity_cache"]["docs"]
    assert cache["cached_tokens"] >= 1024 and status["prefix_affinity_hit_rate"]["docs"] == 1.0

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{routed.url}/admin/#/routes")
    page.get_by_label("Admin token", exact=True).fill(ADMIN)
    page.get_by_role("button", name="Sign in with token").click()
    affinity = page.locator("table", has=page.locator("caption", has_text="prefix caches"))
    affinity.wait_for()
    cells = affinity.locator("tbody tr", has_text="docs").locator("td").all_inner_texts()
    assert cells == [
        "docs",
        "100.0%",
        f"{cache['prompt_tokens']:,}",
        f"{cache['cached_tokens']:,}",
        f"{cache['hit_rate'] * 100:.1f}%",
    ]
    models = page.locator(
        "table", has=page.locator("caption", has_text="what lowest_latency and cheapest read")
    )
    served = [m for m in status["models"] if status["models"][m]["samples"] == 2]
    assert len(served) == 1  # both questions went to one model
    row = models.locator("tbody tr", has_text=served[0]).locator("td").all_inner_texts()
    assert row[0] == served[0] and row[1] == "2"
    page.screenshot(path=shots / "11-routes-affinity.png", full_page=True)
    page.close()
