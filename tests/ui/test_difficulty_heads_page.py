"""Difficulty heads in the browser: upload a trained head, route by it from the route form and see the
next request scored by it; a head a route names cannot be deleted, and a file that is not a head is
refused with the API's reason, storing nothing."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import openai

from routing.heads import bundle, digest
from tests.routing.forced_heads import forced
from tests.ui.helpers import ADMIN, Weir

HOLDOUT = {
    "share": 0.2,
    "rows": 120,
    "baseline": "the route's head acme-v0@3f2a9c41d0e7",  # what `--install` compared it with
    "results": [
        {
            "outcome": "weak model wrong",
            "positives": 40,
            "negatives": 80,
            "trained": 0.7312,
            "baseline": 0.6045,
            "difference": [0.05, 0.2],
            "routed": None,
        },
        {
            "outcome": "needs the strong model",
            "positives": 20,
            "negatives": 60,
            "trained": 0.7021,
            "baseline": 0.4553,
            "difference": [0.1, 0.39],
            "routed": [41, 0.455, 0.702],
        },
    ],
}


def test_upload_a_head_route_by_it_and_it_cannot_be_deleted_in_use(
    routed: Weir, browser: Any, shots: Path
) -> None:
    head = forced(8.0)  # every prompt scores ~1: the strong model, whatever the prompt
    head.meta["holdout"] = HOLDOUT
    data = bundle(head)
    label = f"acme-v1@{digest(data)[:12]}"

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{routed.url}/admin/#/routes")
    page.get_by_label("Admin token", exact=True).fill(ADMIN)
    page.get_by_role("button", name="Sign in with token").click()
    page.get_by_role("heading", name="Difficulty heads").wait_for()
    assert "No difficulty heads stored" in page.locator("#heads").inner_text()

    upload = page.get_by_role("form", name="Upload a difficulty head")
    upload.get_by_label("Head name", exact=True).fill("acme-v1")
    upload.get_by_label("Head file", exact=True).set_input_files(
        files=[{"name": "acme-v1.safetensors", "mimeType": "application/octet-stream", "buffer": data}]
    )
    upload.get_by_role("button", name="Upload head").click()
    page.get_by_text(f"Stored difficulty head acme-v1 ({digest(data)[:12]}).").wait_for()
    rows = page.locator("#heads tbody tr")
    assert rows.count() == 1
    row = rows.first.inner_text()
    assert "acme-v1" in row and digest(data)[:12] in row and head.embedder in row, row
    assert "test head, bias 8.0" in row and "14,037" in row, row
    # The outcome a difficulty route acts on, against the head the route served when it was trained.
    assert "this head 0.702 vs in use 0.455" in row and "not used by a route" in row, row
    title = rows.first.locator("td").nth(5).locator("span").get_attribute("title") or ""
    assert "against the route's head acme-v0@3f2a9c41d0e7" in title, title
    assert "on the 41 routed with a stored score: 0.702 this head, 0.455 as routed" in title, title
    # A head trained before version 5 blends its components only.
    assert rows.first.locator("td").nth(6).inner_text() == "components", row
    stored = routed.admin.get("/difficulty-heads").json()["data"]
    assert [(h["name"], h["digest"]) for h in stored] == [("acme-v1", digest(data))]

    # The route form offers the stored head; choosing it puts `head` in the route.
    form = page.get_by_role("form", name="Create a route")
    choices = form.get_by_label("Difficulty head", exact=True).locator("option").all_inner_texts()
    assert choices == ["shipped (default)", "acme-v1"]
    form.get_by_label("Public model name", exact=True).fill("smart")
    form.get_by_label("Policy", exact=True).select_option("difficulty")
    form.get_by_label("Candidates", exact=True).fill("gpt-4o-mini\ngpt-4o")
    form.get_by_label("Difficulty head", exact=True).select_option("acme-v1")
    form.get_by_role("button", name="Create route").click()
    page.get_by_role("link", name="Edit route smart #1").wait_for()
    (created,) = routed.admin.get("/routes").json()["data"]
    assert created["policy"] == "difficulty" and created["head"] == "acme-v1", created

    # The next request is scored by the uploaded head (once this replica has loaded it).
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="sk-team-key", max_retries=0, timeout=30)
    deadline = time.monotonic() + 30
    while True:
        raw = client.chat.completions.with_raw_response.create(
            model="smart", messages=[{"role": "user", "content": "hello"}], max_tokens=10
        )
        header, model = raw.headers.get("x-weir-route") or "", raw.parse().model
        if f"head={label}" in header or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert f"head={label}" in header, header
    assert model.startswith("gpt-4o") and not model.startswith("gpt-4o-mini"), (model, header)

    # The table says what this replica serves for it.
    page.reload()
    page.get_by_role("heading", name="Difficulty heads").wait_for()
    assert label in page.locator("#heads tbody tr").first.inner_text()
    assert "difficulty (head acme-v1)" in page.locator("main > .table-wrap").first.inner_text()
    # Editing the route shows its head in the field, not in the advanced JSON.
    page.get_by_role("link", name="Edit route smart #1").click()
    edit = page.get_by_role("form", name="Edit route smart")
    assert edit.get_by_label("Difficulty head", exact=True).input_value() == "acme-v1"
    assert "head" not in edit.get_by_label("Advanced (JSON)", exact=True).input_value()

    # In use by the route: deleting it is refused, with the API's reason; the head stays.
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Delete difficulty head acme-v1").click()
    refused = page.locator("#heads-message .notice.error")
    refused.wait_for()
    assert re.search(r"in use by routes 1\b", refused.inner_text()), refused.inner_text()
    assert [h["name"] for h in routed.admin.get("/difficulty-heads").json()["data"]] == ["acme-v1"]
    assert page.locator("#heads tbody tr").count() == 1

    # A file that is not a head: the API's reason beside the form, nothing stored.
    upload = page.get_by_role("form", name="Upload a difficulty head")
    upload.get_by_label("Head name", exact=True).fill("junk")
    upload.get_by_label("Head file", exact=True).set_input_files(
        files=[
            {"name": "junk.safetensors", "mimeType": "application/octet-stream", "buffer": b"GIF89a" * 100}
        ]
    )
    upload.get_by_role("button", name="Upload head").click()
    error = upload.locator(".form-error")
    error.wait_for()
    assert "not a difficulty head bundle" in error.inner_text(), error.inner_text()
    assert upload.get_by_label("Head file", exact=True).get_attribute("aria-invalid") == "true"
    assert page.locator("#heads tbody tr").count() == 1
    assert [h["name"] for h in routed.admin.get("/difficulty-heads").json()["data"]] == ["acme-v1"]
    page.screenshot(path=shots / "11-difficulty-heads.png", full_page=True)
    page.close()
