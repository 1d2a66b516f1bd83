"""Issue 4's ledger gap: a stream cut before the vendor's usage report is billed, not free.

The gateway cancels the upstream when the client leaves and bills an estimate of what the backend
produced (docs/reliability.md, "Answers cut short"), marked `estimated` in the ledger.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.gateway import Weir
from tests.reliability.billing import WORDS, ledger, pico


def test_client_leaving_mid_stream_is_billed_for_what_was_produced(
    weir: Weir, fake_openai: FakeOpenAI
) -> None:
    tenant_id, _, key = weir.tenant_with_key("leaver")
    fake_openai.fail_next(Fault.slow_stream(0.1))  # 40 chunks: 4 s if the gateway drained them
    seen = 0
    with httpx.stream(
        "POST",
        f"{weir.url}/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": WORDS}], "stream": True},
        headers={"authorization": f"Bearer {key}"},
        timeout=20,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen += sum(bool(c["delta"].get("content")) for c in json.loads(line[6:])["choices"])
            if seen == 5:
                break  # the client goes away
    [(input_tokens, output_tokens, cost, status, estimated)] = ledger(weir, tenant_id)
    assert status == 499 and estimated
    # At least what the client saw, and not the whole answer: the upstream was cancelled, not drained.
    assert 5 <= output_tokens < 40
    assert input_tokens > 0
    assert cost == pico(input_tokens, output_tokens) > 0


def test_upstream_cut_before_its_usage_report_is_billed_as_estimated(
    weir: Weir, fake_openai: FakeOpenAI
) -> None:
    tenant_id, _, key = weir.tenant_with_key("cut")
    fake_openai.fail_next(Fault.cut_stream(after=6))
    client = weir.client(key)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": WORDS}], stream=True
        ):
            pass
    [(input_tokens, output_tokens, cost, status, estimated)] = ledger(weir, tenant_id)
    assert status == 502 and estimated
    assert 1 <= output_tokens <= 6 and input_tokens > 0
    assert cost == pico(input_tokens, output_tokens)


def test_a_complete_stream_bills_the_vendors_report_exactly(weir: Weir, fake_openai: FakeOpenAI) -> None:
    tenant_id, _, key = weir.tenant_with_key("finisher")
    client = weir.client(key)
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": WORDS}], stream=True
        )
        if chunk.choices
    )
    assert text.split() == WORDS.split()
    reported = fake_openai.last_usage
    [(input_tokens, output_tokens, cost, status, estimated)] = ledger(weir, tenant_id)
    assert (status, estimated) == (200, False)
    assert (input_tokens, output_tokens) == (reported.input_tokens, reported.output_tokens)
    assert cost == pico(input_tokens, output_tokens)
