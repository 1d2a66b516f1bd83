"""What the Overview and Finance pages left out or drew wrongly: the token subtitle had no cache writes,
the day charts' time axis ticked hours ("12am, 6am, 12pm"), and a Finance report wider than the page
scrolled sideways with nothing to say so."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.ui.helpers import Weir, serve_ui, signed_in

DAY = 86400


@pytest.fixture
def cached(
    fake_openai: FakeOpenAI, fake_anthropic: FakeAnthropic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Weir]:
    """A gateway with an Anthropic backend: its vendor reports cache writes (OpenAI's reports none)."""
    config = f"""\
backends:
  - {{name: anthropic, type: anthropic, base_url: "{fake_anthropic.base_url}", api_key: "{fake_anthropic.api_key}"}}
models:
  - {{name: claude-sonnet-4-5, backend: anthropic, price: {{input: 3, output: 15}}}}
tenants:
  - {{name: team, api_keys: ["sk-team-key"]}}
database_url: "${{DB_URL}}"
"""
    yield from serve_ui(config, fake_openai, tmp_path, monkeypatch)


def test_overview_counts_cache_writes_and_finance_charts_days_and_scrolls_a_wide_report(
    cached: Weir, browser: Any, fake_anthropic: FakeAnthropic, shots: Path
) -> None:
    fake_anthropic.set_next_usage(
        input_tokens=1200, cached_input_tokens=3400, cache_write_5m_tokens=5600, output_tokens=780
    )
    client = openai.OpenAI(base_url=f"{cached.url}/v1", api_key="sk-team-key", max_retries=0, timeout=20)
    client.chat.completions.create(
        model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    deadline = time.monotonic() + 15
    while not cached.admin.get("/requests").json()["data"] and time.monotonic() < deadline:
        time.sleep(0.1)

    page = signed_in(cached, browser, "#/")
    tokens = page.locator(".stat", has_text="Tokens this month").locator(".stat-sub")
    assert tokens.inner_text() == "in 1,200 · cached 3,400 · cache write 5,600 · out 780"

    # Three group-bys at 1280 px: wider than the page.
    page.goto(f"{cached.url}/admin/#/finance?group_by=tenant,model,backend")
    wrap = page.locator("main > .table-wrap").first
    wrap.locator("thead th", has_text="backend").wait_for()
    first = wrap.locator("tbody tr").first.locator("td").first
    first.wait_for()
    assert wrap.evaluate("(w) => w.scrollWidth > w.clientWidth")
    left = wrap.bounding_box()["x"]
    wrap.evaluate("(w) => { w.scrollLeft = w.scrollWidth; }")
    page.wait_for_function("() => document.querySelector('main > .table-wrap').scrollLeft > 0")
    # The tenant column stays in view as the others scroll under it.
    assert abs(first.bounding_box()["x"] - left) <= 2
    assert first.inner_text() == "team"
    page.screenshot(path=shots / "finance-wide-report-scrolled.png", full_page=True)

    # A few days' chart: one tick a day, each at a UTC midnight, labelled with its date and no hour.
    page.goto(f"{cached.url}/admin/#/finance?start=2026-03-01&end=2026-03-04&group_by=tenant")
    page.get_by_text("No usage in this range.").wait_for()
    figure = page.locator("figure.chart", has_text="Spend by token class per day")
    figure.locator("canvas").first.wait_for()
    page.wait_for_function("() => document.querySelector('figure.chart')?.plot?.axes[0]._values?.length > 0")
    splits, values = figure.evaluate("(f) => [f.plot.axes[0]._splits, f.plot.axes[0]._values]")
    assert splits and all(s % DAY == 0 for s in splits)
    assert [b - a for a, b in itertools.pairwise(splits)] == [DAY] * (len(splits) - 1)
    assert not any(v.endswith(("am", "pm")) for v in values), values
    page.close()
