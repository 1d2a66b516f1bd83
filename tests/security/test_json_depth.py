"""A request body nested nearly as deep as the JSON decoder takes (about 970 levels: a tool schema
485 levels deep) ran the translators' own recursion out of stack: a 500, its thousand-frame
traceback logged for each such request (any tenant could flood the log; the development console
renderer took seconds per line, holding the event loop). It is a 400, as a body the decoder itself
refuses is, on both inbound APIs, to every vendor, whole and streamed; the log says so in one line."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from structlog.testing import capture_logs

from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import DEMO_KEY, RunningGateway, full_config_text, gateway_on_fakes

HEADERS = {"authorization": f"Bearer {DEMO_KEY}", "content-type": "application/json"}


@pytest.fixture(scope="module")
def weir(fake_vendors: FakeVendors) -> Iterator[RunningGateway]:
    with gateway_on_fakes(full_config_text(), fake_vendors, {}) as gateway:
        yield gateway


def _schema(levels: int) -> str:
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


def _body(path: str, model: str, levels: int, stream: bool) -> str:
    schema, flag = _schema(levels), "true" if stream else "false"
    message = '"messages":[{"role":"user","content":"hi"}]'
    if path == "/v1/messages":
        tool = f'{{"name":"f","input_schema":{schema}}}'
        return f'{{"model":"{model}","max_tokens":20,"stream":{flag},{message},"tools":[{tool}]}}'
    tool = f'{{"type":"function","function":{{"name":"f","parameters":{schema}}}}}'
    return f'{{"model":"{model}","stream":{flag},{message},"tools":[{tool}]}}'


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("model", ["gemini-flash", "claude-sonnet", "gpt-4o-mini"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_body_nested_nearly_as_deep_as_the_decoder_takes_is_a_400(
    weir: RunningGateway, fresh_fakes: None, path: str, model: str, stream: bool
) -> None:
    statuses = set()
    with capture_logs() as logs:
        # Around the decoder's own limit: each is served, or refused as nested too deeply.
        for levels in range(470, 500, 3):
            response = httpx.post(
                f"{weir.url}{path}", content=_body(path, model, levels, stream), headers=HEADERS, timeout=10
            )
            statuses.add(response.status_code)
            assert response.status_code in (200, 400), response.text
            if response.status_code == 400:
                assert "nested too deeply" in response.text
    assert 400 in statuses
    assert not [entry for entry in logs if entry.get("exc_info") or entry["log_level"] == "error"]
    assert httpx.get(f"{weir.url}/healthz", timeout=5).status_code == 200  # still serving
