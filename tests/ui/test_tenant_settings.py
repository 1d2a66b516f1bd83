"""A tenant's own page edits its budget and limits and deletes it (PATCH and DELETE /tenants/{id}),
the API's refusals shown at the field; a key naming a model nothing serves is refused at its field;
a config file's tenant offers neither, only where to change it. One gateway for the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes import FakeOpenAI
from tests.ui.helpers import ROUTED_CONFIG, Weir, serve_ui, signed_in


@pytest.fixture(scope="module")
def weir(_fake_openai_server: FakeOpenAI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Weir]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        tmp: Path = tmp_path_factory.mktemp("tenant-settings")
        yield from serve_ui(ROUTED_CONFIG, _fake_openai_server, tmp, monkeypatch)


def test_a_tenant_is_edited_refused_at_the_field_and_deleted_after_a_warning(
    weir: Weir, browser: Any, shots: Path
) -> None:
    tenant = weir.admin.post("/tenants", json={"name": "acme", "budget_usd_monthly": "5", "rpm": 60}).json()
    key = weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "app"}).json()["key"]
    page = signed_in(weir, browser, f"#/tenants/{tenant['id']}", accept_dialogs=False)
    form = page.get_by_role("form", name="Edit tenant acme")
    budget, rpm = (
        form.get_by_label("Monthly budget (USD)", exact=True),
        form.get_by_label("Requests per minute", exact=True),
    )
    assert (budget.input_value(), rpm.input_value()) == ("5", "60")  # filled from the API

    budget.fill("abc")
    form.get_by_role("button", name="Save tenant").click()
    form.locator(".form-error").wait_for()
    assert form.locator(".form-error").inner_text().startswith("Enter a monthly budget in USD")
    assert budget.get_attribute("aria-invalid") == "true"
    form.get_by_label("Name", exact=True).fill("team")  # the config file's tenant's name
    budget.fill("12.5")
    form.get_by_role("button", name="Save tenant").click()
    form.locator(".form-error", has_text="defined in the config file").wait_for()
    assert form.get_by_label("Name", exact=True).get_attribute("aria-invalid") == "true"

    form.get_by_label("Name", exact=True).fill("acme")
    rpm.fill("")  # cleared: no limit
    form.get_by_label("Tokens per minute", exact=True).fill("9000")
    form.get_by_label("Max messages per request", exact=True).fill("8")
    form.get_by_role("button", name="Save tenant").click()
    page.locator("#tenant-message", has_text="Saved acme.").wait_for()
    saved = weir.admin.get(f"/tenants/{tenant['id']}").json()
    assert (saved["budget_usd_monthly"], saved["rpm"], saved["tpm"], saved["max_messages"]) == (
        "12.5",
        None,
        9000,
        8,
    )
    row = page.locator("main table tbody tr", has_text="acme").locator("td").all_inner_texts()
    assert [cell.strip() for cell in row[1:]] == ["$0.00 of $12.50", "—", "9,000"]
    page.screenshot(path=shots / "tenant-settings.png", full_page=True)

    # Delete: the confirmation says what becomes of its keys and usage; dismissed, nothing happens.
    said: list[str] = []
    answers = iter([False, True])

    def answer(dialog: Any) -> None:
        said.append(dialog.message)
        dialog.accept() if next(answers) else dialog.dismiss()

    page.on("dialog", answer)
    delete = page.get_by_role("button", name="Delete tenant acme")
    delete.click()
    for _ in range(250):  # the dialog comes once the page has read the tenant's keys
        if said:
            break
        page.wait_for_timeout(20)
    assert weir.admin.get(f"/tenants/{tenant['id']}").status_code == 200
    delete.click()
    page.locator("#tenants-message", has_text="Deleted tenant acme and its keys.").wait_for()
    assert "1 active key" in said[0] and "refused at once" in said[0] and "stays in the ledger" in said[0]
    assert "a route for it alone is deleted" in said[0]
    assert said[0] == said[1]
    assert page.url.endswith("#/tenants")
    assert page.locator("main table tbody tr", has_text="acme").count() == 0
    assert weir.admin.get(f"/tenants/{tenant['id']}").status_code == 404
    refused = httpx.get(f"{weir.url}/v1/models", headers={"authorization": f"Bearer {key}"})
    assert refused.status_code == 401
    page.close()


def test_a_key_for_a_model_nothing_serves_is_refused_at_its_field(weir: Weir, browser: Any) -> None:
    tenant = weir.admin.post("/tenants", json={"name": "typo"}).json()
    page = signed_in(weir, browser, f"#/tenants/{tenant['id']}")
    keys = page.locator("#keys")
    models = keys.get_by_label("Models", exact=True)
    models.fill("gpt-4o-mini, gtp-4o")
    keys.get_by_role("button", name="Issue key").click()
    error = keys.locator(".form-error")
    error.wait_for()
    assert "'gtp-4o'" in error.inner_text() and "'gpt-4o-mini'" not in error.inner_text()
    assert models.get_attribute("aria-invalid") == "true"
    models.fill("gpt-4o-mini, gpt-4o")
    keys.get_by_role("button", name="Issue key").click()
    assert page.locator("#new-key-value").inner_text().startswith("wk-")
    assert [k["models"] for k in weir.admin.get(f"/tenants/{tenant['id']}/keys").json()["data"]] == [
        ["gpt-4o-mini", "gpt-4o"]
    ]
    page.close()


def test_a_config_tenant_has_no_edit_or_delete_only_where_to_change_it(weir: Weir, browser: Any) -> None:
    page = signed_in(weir, browser, "#/tenants/team")
    note = page.locator("main .notice.info")
    assert "cannot be edited or deleted here; edit the config" in note.inner_text()
    assert page.get_by_role("button", name="Save tenant").count() == 0
    assert page.get_by_role("button", name="Delete tenant team").count() == 0
    page.close()


def test_a_rate_limit_of_zero_is_saved_from_the_forms(weir: Weir, browser: Any) -> None:
    """The API takes rpm and tpm 0 (refuse everything), so the forms must too: a tenant stored with
    rpm 0 could not be re-saved, the browser refusing the form's own value below its minimum."""
    tenant = weir.admin.post("/tenants", json={"name": "paused", "rpm": 0, "tpm": 0}).json()
    page = signed_in(weir, browser, f"#/tenants/{tenant['id']}")
    form = page.get_by_role("form", name="Edit tenant paused")
    assert form.get_by_label("Requests per minute", exact=True).input_value() == "0"
    form.get_by_label("Monthly budget (USD)", exact=True).fill("3")
    form.get_by_role("button", name="Save tenant").click()
    page.locator("#tenant-message", has_text="Saved paused.").wait_for()
    saved = weir.admin.get(f"/tenants/{tenant['id']}").json()
    assert (saved["budget_usd_monthly"], saved["rpm"], saved["tpm"]) == ("3", 0, 0)

    keys = page.locator("#keys")
    keys.get_by_label("Key name", exact=True).fill("stopped")
    keys.get_by_label("Requests per minute", exact=True).fill("0")
    keys.get_by_role("button", name="Issue key").click()
    page.locator("#new-key-value").wait_for()
    issued = weir.admin.get(f"/tenants/{tenant['id']}/keys").json()["data"]
    assert [(k["name"], k["rpm"]) for k in issued] == [("stopped", 0)]
    page.close()


def test_a_tenant_with_the_longest_name_fits_a_phone_screen(weir: Weir, browser: Any) -> None:
    """A tenant's name may be 200 characters with no break: its headings ("Keys of NAME") and its
    "Delete tenant NAME" button pushed the tenant's page over 2,500px wide at phone width (scrolled
    sideways to reach anything). The page fits the screen; wide tables scroll inside their own box."""
    name = "n" * 200
    tenant = weir.admin.post("/tenants", json={"name": name}).json()
    weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "k" * 200}).raise_for_status()
    page = signed_in(weir, browser, f"#/tenants/{tenant['id']}")
    page.set_viewport_size({"width": 390, "height": 844})
    page.get_by_role("button", name=f"Delete tenant {name}").wait_for()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.close()
    weir.admin.delete(f"/tenants/{tenant['id']}")
