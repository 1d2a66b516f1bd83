"""Whole (non-streamed) answers the gateway gives up on are billed an estimate, not nothing.

A 2xx status line comes once the vendor generated the whole answer, which it bills to the tenant's key.
An answer whose body broke off was already billed an estimate (`estimate.whole_answer`, marked
`estimated`); one that went silent past the backend's `timeouts.read` (the client's 504), or whose
body ran past the 64 MiB cap (the client's 502), was billed 0 tokens. Each is now billed that estimate
too: its usage event, the ledger row and the tenant's budget, while the client gets the error it got
before. And the prompt's estimate counts an image sent by URL as the image it is (INLINE_PART_TOKENS,
as one sent inline), not as its URL's few bytes (docs/accounting.md, "Estimated usage").

Through a real gateway with the official OpenAI SDK as client, in front of the fake OpenAI, with the
SQLite ledger and in-process budgets, and the PostgreSQL ledger and Redis budgets.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.estimate import (
    BYTES_PER_TOKEN,
    CHAT_TOKENS,
    DEFAULT_OUTPUT_ESTIMATE,
    INLINE_PART_TOKENS,
    MESSAGE_TOKENS,
)
from gateway.providers import PROVIDERS
from gateway.transport import MAX_RESPONSE_BODY
from tests.fakes import FakeOpenAI, Fault
from tests.fixtures.gateway import (
    CONFIG,
    Weir,
    weir,  # noqa: F401  (both stores', over tests/reliability's SQLite-only fixture of that name)
)
from tests.reliability.billing import WORDS, ledger, pico

READ_TIMEOUT = 1.0


@pytest.fixture
def weir_config() -> str:
    """The control plane's config (its prices are `pico`'s), with a read timeout a test can wait out."""
    backend = 'api_key: "${OPENAI_API_KEY}"}'
    assert backend in CONFIG
    return CONFIG.replace(backend, f'api_key: "${{OPENAI_API_KEY}}", timeouts: {{read: {READ_TIMEOUT}}}}}')


BUDGET_USD = 10
ENVELOPE = len(PROVIDERS["openai"].empty_answer("gpt-4o-mini"))  # an answer with no text
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": WORDS}]
IMAGE_URL = "https://example.com/photos/a-cat-on-a-mat.jpg"


def tokens(size: int) -> int:
    return -(-size // BYTES_PER_TOKEN)


# What the prompt's estimate adds to a chat of one turn, as every request here is, for its chat
# template (`estimate.template_tokens`).
ONE_TURN = CHAT_TOKENS + MESSAGE_TOKENS


def budget_ratio(gateway: Weir, tenant_id: str, expected: float, timeout: float = 10) -> float | None:
    """The tenant's budget use as /metrics exports it (spent plus reserved, over the budget), once it
    is `expected` (settlement happens off the request path) or the time is up."""
    deadline = time.monotonic() + timeout
    prefix = f'weir_budget_usage_ratio{{tenant="{tenant_id}"}}'
    ratio = None
    while time.monotonic() < deadline:
        lines = httpx.get(f"{gateway.url}/metrics", timeout=5).text.splitlines()
        ratio = next((float(line.split()[-1]) for line in lines if line.startswith(prefix)), None)
        if ratio == pytest.approx(expected, rel=1e-6):
            break
        time.sleep(0.05)
    return ratio


def billed_estimate(gateway: Weir, tenant_id: str, status: int) -> tuple[int, int]:
    """The input and output tokens of the tenant's one ledger row, which must be the estimate of an
    attempt the client saw fail with `status`, priced, and counted by the tenant's budget."""
    [(input_tokens, output_tokens, cost, row_status, estimated)] = ledger(gateway, tenant_id)
    assert (row_status, estimated) == (status, True)
    assert cost == pico(input_tokens, output_tokens) > 0
    assert budget_ratio(gateway, tenant_id, cost / (BUDGET_USD * 10**12)) == pytest.approx(
        cost / (BUDGET_USD * 10**12), rel=1e-6
    )
    return input_tokens, output_tokens


def test_a_whole_answer_that_went_silent_past_the_read_timeout_is_billed_an_estimate(
    weir: Weir,  # noqa: F811
    fake_openai: FakeOpenAI,
) -> None:
    tenant_id, _, key = weir.tenant_with_key("silent", budget_usd_monthly=str(BUDGET_USD))
    fake_openai.fail_next(Fault.stall())  # the headers and half the body, then nothing
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        weir.client(key).chat.completions.create(model="gpt-4o-mini", messages=HI)
    # What the client saw before: a 504 in the OpenAI shape, once the read timeout ran out.
    assert caught.value.status_code == 504
    assert caught.value.body == {
        "message": "backend openai stopped sending its response",
        "type": "upstream_error",
        "param": None,
        "code": "timeout",
    }
    assert READ_TIMEOUT <= time.monotonic() - started < READ_TIMEOUT + 4
    input_tokens, output_tokens = billed_estimate(weir, tenant_id, 504)
    sent = fake_openai.posts[-1]
    assert input_tokens == tokens(len(sent.body)) + ONE_TURN
    # The output from the answer's announced length less an OpenAI answer's envelope: what the fake
    # sends for the same request (the same answer, of the same length) tells that length here.
    replay = httpx.post(
        f"{fake_openai.base_url}/chat/completions",
        content=sent.body,
        headers={"authorization": f"Bearer {fake_openai.api_key}", "content-type": "application/json"},
    )
    assert output_tokens == tokens(len(replay.content) - ENVELOPE)


@pytest.mark.parametrize("max_tokens", [4000, None])
def test_a_whole_answer_larger_than_the_body_cap_is_billed_an_estimate(
    weir: Weir,  # noqa: F811
    fake_openai: FakeOpenAI,
    max_tokens: int | None,
) -> None:
    """Billed what admission reserved for the request: its max_tokens, else the default reservation;
    not 64 MiB at 4 bytes a token (16M tokens), a size no model writes (a broken backend's gzip bomb)."""
    tenant_id, _, key = weir.tenant_with_key(f"flooded-{max_tokens}", budget_usd_monthly=str(BUDGET_USD))
    fake_openai.fail_next(Fault.huge(MAX_RESPONSE_BODY + 2**20))
    capped = {} if max_tokens is None else {"max_tokens": max_tokens}
    with pytest.raises(openai.APIStatusError) as caught:
        weir.client(key).chat.completions.create(model="gpt-4o-mini", messages=HI, **capped)
    assert caught.value.status_code == 502
    assert caught.value.body == {
        "message": f"backend openai sent a response larger than {MAX_RESPONSE_BODY} bytes",
        "type": "upstream_error",
        "param": None,
        "code": "bad_gateway",
    }
    input_tokens, output_tokens = billed_estimate(weir, tenant_id, 502)
    assert input_tokens == tokens(len(fake_openai.posts[-1].body)) + ONE_TURN
    assert output_tokens == (max_tokens or DEFAULT_OUTPUT_ESTIMATE)


def test_an_image_sent_by_url_counts_as_an_image_in_the_estimate(
    weir: Weir,  # noqa: F811
    fake_openai: FakeOpenAI,
) -> None:
    """A stream cut before its usage report bills the prompt estimated from the request: an image by
    URL costs the vendor an image's tokens, as one sent inline does, not its URL's 12 tokens."""
    tenant_id, _, key = weir.tenant_with_key("pictures", budget_usd_monthly=str(BUDGET_USD))
    fake_openai.fail_next(Fault.cut_stream(after=6))
    messages: list[ChatCompletionMessageParam] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": WORDS},
                {"type": "image_url", "image_url": {"url": IMAGE_URL}},
            ],
        }
    ]
    with pytest.raises(openai.APIError):
        for _ in weir.client(key).chat.completions.create(
            model="gpt-4o-mini", messages=messages, stream=True
        ):
            pass
    input_tokens, _ = billed_estimate(weir, tenant_id, 502)
    sent = fake_openai.posts[-1].body
    assert IMAGE_URL.encode() in sent
    assert input_tokens == tokens(len(sent) - len(IMAGE_URL)) + INLINE_PART_TOKENS + ONE_TURN
