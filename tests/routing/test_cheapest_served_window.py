"""`cheapest` fits its candidates in the context window their backends serve, as the gateway learns it
from their model lists (`max_model_len`, `routing.windows`), not only in the one a route declares:
a cheap model declared with a large window but served with a small one is passed over for a prompt
it cannot hold, with no refused attempt, and still takes the prompts it can. The admin API's route
preview shows the choice a request gets. A real gateway with the admin DB (SQLite) in front of the
fake OpenAI, whose model list says `gpt-4o-mini`'s window as vLLM's does (`serve_windows`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes import FakeOpenAI
from tests.fixtures.gateway import sqlite_weir
from tests.fixtures.waiting import wait_for
from tests.routing.routed import route_header

SERVED = 1_000  # what the fake's `/v1/models` says of `gpt-4o-mini`: far below the declared 128,000
CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: cheap, backend: openai, model: gpt-4o-mini, price: {input: 0.15, output: 0.60}}
  - {name: dear, backend: openai, model: gpt-4o, price: {input: 2.5, output: 10}}
routes:
  - name: thrifty
    policy: cheapest
    probe_interval: 0.1
    retry: {attempts: 1}
    candidates: [{model: cheap, context_window: 128000}, {model: dear, context_window: 128000}]
database_url: "${DB_URL}"
"""
LONG = "word " * 1000  # ~1,250 tokens by the gateway's estimate: above the served window
SHORT = "hi"


def model_lists_read(fake: FakeOpenAI) -> int:
    return sum(r.method == "GET" and r.path == "/v1/models" for r in fake.requests)


def test_cheapest_skips_a_candidate_whose_served_window_is_too_small_and_the_preview_agrees(
    fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_openai.serve_windows({"gpt-4o-mini": SERVED})
    with sqlite_weir(CONFIG, fake_openai, tmp_path, monkeypatch) as weir:
        # The probes ask one at a time: once a second list is asked for, the first has been read.
        wait_for(lambda: model_lists_read(fake_openai) >= 2, timeout=10)
        _, _, key = weir.tenant_with_key("acme")
        for prompt, expected in ((LONG, "dear"), (SHORT, "cheap")):
            preview = weir.admin.post("/routes/preview", json={"model": "thrifty", "prompt": prompt})
            assert preview.status_code == 200, preview.text
            choices = [(c["model"], c["reason"]) for c in preview.json()["choices"]]
            raw = weir.client(key).chat.completions.with_raw_response.create(
                model="thrifty", messages=[{"role": "user", "content": prompt}]
            )
            header = route_header(raw)
            assert choices[0] == (header["candidate"], header["reason"]) == (expected, "cheapest_fit")
            assert header["attempts"] == "1" and "tried" not in header
            if prompt is LONG:  # the misfit is not in the failover order either
                assert choices == [("dear", "cheapest_fit")]
    chats = [r.json["model"] for r in fake_openai.requests if r.path == "/v1/chat/completions"]
    assert chats == ["gpt-4o", "gpt-4o-mini"]  # the long prompt never went to the 1,000-token server
