"""The control plane inside the real gateway: a user's session with the official SDKs against
`weir`'s app served by uvicorn, in front of the fake OpenAI, with the admin DB (SQLite or PostgreSQL)
and the shared state (in process or Redis)."""

from __future__ import annotations

import base64
import datetime as dt
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionContentPartParam

from gateway.estimate import CHAT_TOKENS, INLINE_PART_TOKENS, MESSAGE_TOKENS, input_tokens
from gateway.types import ChatRequest, Message
from tests.fakes import FakeOpenAI
from tests.fakes.faults import Fault
from tests.fixtures.db import REDIS_URL
from tests.fixtures.gateway import ADMIN, CONFIG, PRICE, Weir
from tests.fixtures.net import free_port

# OpenAI's 429 for a request larger than the organisation's tokens-per-minute limit on its own.
TOO_LARGE_FOR_TPM = (
    "Request too large for gpt-4o-mini in organization org-abc on tokens per min (TPM): Limit 30000, "
    "Requested 50000. The input or output tokens must be reduced in order to run successfully."
)


def expected_pico(rows: list[tuple]) -> int:
    usd = sum(
        (Decimal(i) * PRICE["input"] + Decimal(c) * PRICE["cached_input"] + Decimal(o) * PRICE["output"])
        / 10**6
        for i, c, o, *_ in rows
    )
    return int(usd * 10**12)


def test_keys_limits_and_ledger(weir: Weir) -> None:
    tenant_id, key_id, key = weir.tenant_with_key("acme", rpm=5)
    client = weir.client(key)
    for _ in range(5):
        reply = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}], max_tokens=20
        )
        assert reply.choices[0].message.content
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}])
    response = caught.value.response
    assert response.status_code == 429 and 1 <= int(response.headers["retry-after"]) <= 60
    assert caught.value.body["code"] == "rate_limit_exceeded" and caught.value.body["type"] == "requests"

    rows = weir.ledger(tenant_id, expect=5)
    assert len(rows) == 5 and all(r[4] == 200 and r[5] == key_id for r in rows)  # the refusal cost nothing
    assert sum(r[3] for r in rows) == expected_pico(rows) > 0

    report = weir.admin.get("/reports/usage", params={"group_by": "tenant,model"}).json()
    row = next(r for r in report["rows"] if r["tenant"] == tenant_id)
    assert row["requests"] == 5 and row["model"] == "gpt-4o-mini"
    assert Decimal(row["cost_usd"]) == Decimal(expected_pico(rows)) / 10**12

    # Revoked: refused at once, although the key was cached a moment ago.
    assert weir.admin.delete(f"/keys/{key_id}").status_code == 204
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}])
    with pytest.raises(openai.AuthenticationError):
        weir.client("wk-not-a-key").models.list()


def test_feedback_counts_against_no_request_limit(weir: Weir) -> None:
    """RPM counts requests that reach a backend: a score for a reply (`POST /v1/feedback`) reaches none
    and costs nothing, so it neither uses the tenant's RPM nor is refused by it (docs/routing-policies.md,
    "Feedback"). A tenant that scores every reply keeps its whole request rate."""
    _, _, key = weir.tenant_with_key("scored", rpm=1)
    client = weir.client(key)
    headers = {"authorization": f"Bearer {key}"}

    def score(request_id: str) -> int:
        body = {"request_id": request_id, "score": 1.0}
        return httpx.post(f"{weir.url}/v1/feedback", json=body, headers=headers).status_code

    assert [score(f"before-{i}") for i in range(3)] == [200, 200, 200]
    reply = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    with pytest.raises(openai.RateLimitError):  # the one request a minute is used
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}])
    assert score(reply.headers["x-request-id"]) == 200


def test_budget_reserves_and_refuses(weir: Weir, fake_openai: FakeOpenAI) -> None:
    # Each call: 1000 input + 100 output tokens = 150 + 60 = 210 micro-USD. Budget: 1000 micro-USD.
    tenant_id, _, key = weir.tenant_with_key("frugal", budget_usd_monthly="0.001")
    client = weir.client(key)
    outcomes = []
    for _ in range(8):
        fake_openai.set_next_usage(input_tokens=1000, output_tokens=100)
        try:
            client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=100
            )
            outcomes.append("ok")
        except openai.RateLimitError as exc:
            assert exc.body["code"] == "insufficient_quota" and exc.body["type"] == "insufficient_quota"
            outcomes.append("refused")
        time.sleep(0.05)  # settlement happens off the request path
    assert outcomes[0] == "ok" and outcomes[-1] == "refused"
    assert outcomes == sorted(outcomes)  # once refused, stays refused
    rows = weir.ledger(tenant_id, expect=outcomes.count("ok"))
    assert len(rows) == outcomes.count("ok")
    # Admission reserves an estimate (prompt size + max_tokens); the fake then reports 1000 input
    # tokens, more than the tiny prompt suggests. So the budget can be overrun by what was in flight
    # (here one request at a time), never more, and a request is not refused while money is left.
    budget, one_call = 1000 * 10**6, 210 * 10**6
    spent = sum(r[3] for r in rows)
    assert spent - one_call <= budget < spent + one_call

    # /metrics exports the tenant's budget use for the budget alerts: spent (nothing reserved now)
    # over the budget, as of the last settlement.
    gauge = next(
        line
        for line in httpx.get(f"{weir.url}/metrics").text.splitlines()
        if line.startswith(f'weir_budget_usage_ratio{{tenant="{tenant_id}"}}')
    )
    assert float(gauge.split()[-1]) == pytest.approx(spent / 10**6 / 1000, rel=1e-6)


def test_a_spent_budget_is_not_retried_in_vain_and_a_rate_limit_is(
    weir: Weir, fake_openai: FakeOpenAI
) -> None:
    """A tenant whose monthly budget is spent gets `insufficient_quota`, which no wait lifts (until the
    month turns or an administrator raises it): it carries `x-should-retry: false`, so the official
    SDKs, which retry a 429 twice by default, send the request once. A rate limit's 429 lifts within
    its window: retry-after and the x-ratelimit-* headers, and no `x-should-retry: false`."""
    sent: list[str] = []
    hooks = {"request": [lambda request: sent.append(request.url.path)]}

    def sdk(key: str) -> openai.OpenAI:  # max_retries: the SDK's default (2)
        return openai.OpenAI(
            base_url=f"{weir.url}/v1", api_key=key, http_client=openai.DefaultHttpxClient(event_hooks=hooks)
        )

    hello = [{"role": "user", "content": "hello"}]
    _, _, key = weir.tenant_with_key("spent", budget_usd_monthly="0.0001")  # 100 micro-dollars
    fake_openai.set_next_usage(input_tokens=1000, output_tokens=100)  # 210 micro-dollars: all spent
    weir.client(key).chat.completions.create(model="gpt-4o-mini", messages=hello, max_tokens=10)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10  # settled off the request path
    while True:
        sent.clear()
        try:
            sdk(key).chat.completions.create(model="gpt-4o-mini", messages=hello, max_tokens=10)  # type: ignore[arg-type]
        except openai.RateLimitError as exc:
            caught = exc
            break
        assert time.monotonic() < deadline, "the spent budget was never refused"
    assert sent == ["/v1/chat/completions"]
    assert (caught.body["type"], caught.body["code"]) == ("insufficient_quota", "insufficient_quota")  # type: ignore[index]
    assert (
        caught.response.headers["x-should-retry"] == "false" and "retry-after" not in caught.response.headers
    )
    sent.clear()
    claude = anthropic.Anthropic(
        base_url=weir.url, api_key=key, http_client=anthropic.DefaultHttpxClient(event_hooks=hooks)
    )
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(
            model="gpt-4o-mini", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        )
    assert sent == ["/v1/messages"] and refused.value.response.headers["x-should-retry"] == "false"

    _, _, key = weir.tenant_with_key("limited", rpm=1)
    sdk(key).chat.completions.create(model="gpt-4o-mini", messages=hello, max_tokens=10)  # type: ignore[arg-type]
    sent.clear()
    with pytest.raises(openai.RateLimitError) as limited:
        sdk(key).with_options(max_retries=0).chat.completions.create(model="gpt-4o-mini", messages=hello)  # type: ignore[arg-type]
    headers = limited.value.response.headers
    assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-should-retry" not in headers


@pytest.mark.parametrize(
    "fault",
    [
        Fault.status(429, error_code="insufficient_quota"),
        Fault.status(429, message=TOO_LARGE_FOR_TPM, error_code="rate_limit_exceeded"),
    ],
    ids=["insufficient_quota", "too_large_for_tpm"],
)
def test_a_vendor_429_no_wait_lifts_is_not_retried_by_the_client_either(
    weir: Weir, fake_openai: FakeOpenAI, fault: Fault
) -> None:
    """The gateway's vendor account out of credit (OpenAI's 429 `insufficient_quota`), or a request
    larger than the vendor's rate limit itself: routing asks that backend once, knowing no wait lifts
    either, but passed the 429 on as it came, and the official SDKs retried it twice: three requests
    upstream and three of the tenant's RPM for one answer that could not change. It says
    `x-should-retry: false`, as Weir's own such refusals do; a vendor's plain rate limit does not."""
    _, _, key = weir.tenant_with_key("vendor-out-of-credit")
    client = openai.OpenAI(base_url=f"{weir.url}/v1", api_key=key)  # max_retries: the SDK's default (2)
    hello = [{"role": "user", "content": "hello"}]
    fake_openai.reset()
    fake_openai.fail_next(fault, times=3)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="gpt-4o-mini", messages=hello)  # type: ignore[arg-type]
    assert len(fake_openai.requests) == 1
    assert caught.value.response.headers["x-should-retry"] == "false"
    fake_openai.reset()
    fake_openai.fail_next(Fault.status(429, retry_after=0), times=5)  # a rate limit: it lifts
    with pytest.raises(openai.RateLimitError) as limited:
        client.with_options(max_retries=0).chat.completions.create(model="gpt-4o-mini", messages=hello)  # type: ignore[arg-type]
    assert "x-should-retry" not in limited.value.response.headers


def test_an_image_sent_inline_is_admitted_by_what_it_costs_not_its_size(weir: Weir) -> None:
    """Admission estimates an inline image as an image (at most INLINE_PART_TOKENS), not its base64 at
    4 bytes a token: this 600 kB one was 150,000 tokens, refused for ever by a 100,000 TPM limit
    (retry-after 60 all the same), and reserved $0.0225 of a $0.01 budget, refused for ever too."""
    _, _, key = weir.tenant_with_key("vision", tpm=100_000, budget_usd_monthly="0.01")
    image = base64.b64encode(bytes(range(256)) * 1800).decode()
    try:
        reply = weir.client(key).chat.completions.create(
            model="gpt-4o-mini",
            max_tokens=50,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is in this picture?"},
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                    ],
                }
            ],
        )
    except openai.RateLimitError as exc:
        raise AssertionError(f"refused: {exc.body}") from None
    assert reply.usage is not None and reply.usage.prompt_tokens < 1000


def test_an_image_sent_by_url_is_admitted_by_what_it_costs_not_its_urls_size(weir: Weir) -> None:
    """Admission estimates an image sent by URL as one sent inline (INLINE_PART_TOKENS): the vendor
    fetches it and bills its tokens. It counted as its URL's dozen tokens: a 1,000 TPM limit let
    through requests of 1,600 tokens and more, one image each."""
    _, _, key = weir.tenant_with_key("vision-by-url", tpm=1000)
    picture: list[ChatCompletionContentPartParam] = [
        {"type": "text", "text": "what is in this picture?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/photos/a-cat-on-a-mat.jpg"}},
    ]
    with pytest.raises(openai.RateLimitError) as caught:
        weir.client(key).chat.completions.create(
            model="gpt-4o-mini",
            max_tokens=50,
            messages=[{"role": "user", "content": picture}],
        )
    assert "Request too large for this tenant on tokens per min (TPM): Limit 1000" in str(caught.value.body)
    # The same request without its image fits.
    assert weir.client(key).chat.completions.create(
        model="gpt-4o-mini",
        max_tokens=50,
        messages=[{"role": "user", "content": picture[:1]}],
    )


def test_a_route_preview_measures_its_prompt_as_a_requests(weir: Weir) -> None:
    """The preview's prompt length is a request's (`estimate.input_tokens`), an image included: it was
    its text at 4 characters a token, whatever `images` said."""
    question = "what is in this picture?"
    sample = {"model": "gpt-4o-mini", "prompt": question}
    plain = weir.admin.post("/routes/preview", json=sample)
    assert plain.status_code == 200, plain.text
    request = ChatRequest(model="gpt-4o-mini", messages=[Message(role="user", content=question)])
    assert plain.json()["prompt_tokens"] == input_tokens(request)
    pictured = weir.admin.post("/routes/preview", json={**sample, "images": True}).json()
    one_turn = CHAT_TOKENS + MESSAGE_TOKENS  # the chat template's allowance (`estimate.template_tokens`)
    assert INLINE_PART_TOKENS + one_turn < pictured["prompt_tokens"] < INLINE_PART_TOKENS + one_turn + 50


NARROW_KEY = "sk-weir-narrow-0123456789"
LIMITED_CONFIG = (
    CONFIG.replace("models:\n", "models:\n  - {name: gpt-5, backend: openai}\n", 1)
    + f"""\
routes:
  - {{name: smart, candidates: [{{model: gpt-5}}, {{model: gpt-4o-mini}}], probe_interval: null}}
tenants:
  - {{name: narrow, api_keys: ["{NARROW_KEY}"], models: [gpt-4o-mini]}}
"""
)


@pytest.mark.parametrize("weir_config", [LIMITED_CONFIG])
def test_a_route_preview_for_a_tenant_limited_to_some_models_is_refused_as_its_request_is(
    weir: Weir,
) -> None:
    """A tenant's model allowlist (`tenants[].models`, an admin-DB key's `models`) refuses its request
    for another model or route with a 404; its preview planned for a caller with no allowlist and
    showed the route's candidates as if the request would take them. Now the preview plans for the
    tenant (or key) as its request is planned."""
    sample = {"model": "smart", "prompt": "hello"}
    assert weir.admin.post("/routes/preview", json=sample).json()["choices"][0]["model"] == "gpt-5"
    tenant = weir.admin.post("/tenants", json={"name": "acme"}).json()
    created = weir.admin.post(f"/tenants/{tenant['id']}/keys", json={"models": ["gpt-4o-mini"]})
    assert created.status_code == 201, created.text
    key_id, db_key = created.json()["id"], created.json()["key"]
    for key, who in ((NARROW_KEY, {"tenant": "narrow"}), (db_key, {"key_id": key_id})):
        with pytest.raises(openai.NotFoundError):
            weir.client(key).chat.completions.create(
                model="smart", messages=[{"role": "user", "content": "hello"}]
            )
        refused = weir.admin.post("/routes/preview", json={**sample, **who})
        assert refused.status_code == 400, refused.text
        assert "you do not have access to it" in refused.json()["error"]["message"]
        allowed = weir.admin.post("/routes/preview", json={**sample, **who, "model": "gpt-4o-mini"})
        assert allowed.status_code == 200, allowed.text
        assert [c["model"] for c in allowed.json()["choices"]] == ["gpt-4o-mini"]
    # A key and a tenant it does not belong to: no caller sends that.
    mismatched = weir.admin.post("/routes/preview", json={**sample, "key_id": key_id, "tenant": "narrow"})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "key_id"


@pytest.mark.parametrize("weir_config", [LIMITED_CONFIG])
def test_a_key_limited_to_a_name_the_gateway_does_not_serve_is_refused(weir: Weir) -> None:
    """A key's `models` are checked against what the gateway serves: its routes (of the config, or
    stored through the admin API a moment ago) and its models; a typo is a 400 naming it."""
    tenant = weir.admin.post("/tenants", json={"name": "acme"}).json()
    keys = f"/tenants/{tenant['id']}/keys"
    refused = weir.admin.post(keys, json={"models": ["gpt-4o-mini", "gpt-4o-mni"]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (
        error["code"] == "invalid_value" and error["param"] == "models" and "'gpt-4o-mni'" in error["message"]
    )
    route = weir.admin.post("/routes", json={"name": "fresh", "candidates": [{"model": "gpt-5"}]})
    assert route.status_code == 201, route.text
    issued = weir.admin.post(keys, json={"models": ["gpt-4o-mini", "gpt-5", "smart", "fresh"]})
    assert issued.status_code == 201, issued.text
    reply = weir.client(issued.json()["key"]).chat.completions.create(
        model="smart", messages=[{"role": "user", "content": "hello"}]
    )
    assert reply.choices[0].message.content


def test_a_request_larger_than_a_whole_limit_or_budget_is_not_retried_in_vain(
    weir: Weir, fake_openai: FakeOpenAI
) -> None:
    """A request whose estimate alone is over its tenant's TPM limit or whole monthly budget can never
    be admitted. It was a 429 saying "try again in 60s" (retry-after: 60, or none for the budget), which
    the official SDKs retry by default, in vain (their two retries waited out a minute each). It is
    OpenAI's own answer to such a request, "Request too large ... on tokens per min (TPM): Limit N,
    Requested M" (429, `tokens`, `rate_limit_exceeded`), with no retry-after and `x-should-retry:
    false`, which the OpenAI and Anthropic SDKs obey: one request, then the error."""
    sent: list[str] = []
    hooks = {"request": [lambda request: sent.append(request.url.path)]}

    def sdk(key: str) -> openai.OpenAI:  # max_retries: the SDK's default (2)
        return openai.OpenAI(
            base_url=f"{weir.url}/v1", api_key=key, http_client=openai.DefaultHttpxClient(event_hooks=hooks)
        )

    hello = [{"role": "user", "content": "hello"}]
    _, _, key = weir.tenant_with_key("tpm-small", tpm=100)
    with pytest.raises(openai.RateLimitError) as caught:
        sdk(key).chat.completions.create(model="gpt-4o-mini", messages=hello, max_tokens=500)  # type: ignore[arg-type]
    assert sent == ["/v1/chat/completions"]
    body, headers = caught.value.body, caught.value.response.headers
    assert (body["type"], body["code"]) == ("tokens", "rate_limit_exceeded")  # type: ignore[index]
    assert "Request too large for this tenant on tokens per min (TPM): Limit 100, Requested 5" in str(body)
    assert "retry-after" not in headers and headers["x-should-retry"] == "false"
    client = anthropic.Anthropic(
        base_url=weir.url, api_key=key, http_client=anthropic.DefaultHttpxClient(event_hooks=hooks)
    )
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(
            model="gpt-4o-mini", max_tokens=500, messages=[{"role": "user", "content": "hi"}]
        )
    assert sent[1:] == ["/v1/messages"] and "Request too large" in str(refused.value.body)
    assert "retry-after" not in refused.value.response.headers
    # A request that fits is admitted: the limit itself is as it was.
    assert sdk(key).chat.completions.create(model="gpt-4o-mini", messages=hello, max_tokens=20)  # type: ignore[arg-type]

    sent.clear()  # 100 micro-dollars a month; 1000 output tokens at $0.60 per 1M are 600 of them
    _, _, key = weir.tenant_with_key("budget-small", budget_usd_monthly="0.0001")
    with pytest.raises(openai.RateLimitError) as caught:
        sdk(key).chat.completions.create(model="gpt-4o-mini", messages=hello, max_tokens=1000)  # type: ignore[arg-type]
    assert sent == ["/v1/chat/completions"]
    body, headers = caught.value.body, caught.value.response.headers
    assert (body["type"], body["code"]) == ("insufficient_quota", "insufficient_quota")  # type: ignore[index]
    assert "more than this tenant's whole monthly budget (USD 0.0001)" in str(body)
    assert "retry-after" not in headers and headers["x-should-retry"] == "false"
    fake_openai.set_next_usage(input_tokens=5, output_tokens=10)
    assert sdk(key).chat.completions.create(model="gpt-4o-mini", messages=hello, max_tokens=10)  # type: ignore[arg-type]


CONFIG_FILE = """\
backends:
  - {name: openai, type: openai, base_url: "%(base_url)s", api_key: "%(api_key)s"}
models:
  - {name: gpt-4o-mini, backend: openai, price: {input: 0.15, output: 0.60}}
database_url: "%(db_url)s"
redis_url: "%(redis_url)s"
"""


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_two_replicas_share_one_limit(
    fake_openai: FakeOpenAI, pg_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    config = tmp_path / "weir.yaml"
    config.write_text(
        CONFIG_FILE
        % {
            "base_url": fake_openai.base_url,
            "api_key": fake_openai.api_key,
            "db_url": pg_url,
            "redis_url": REDIS_URL,
        }
    )
    ports = [free_port(), free_port()]
    env = {**os.environ, "WEIR_ADMIN_TOKEN": ADMIN, "WEIR_REDIS_PREFIX": redis_prefix}
    weir_bin = str(Path(sys.executable).with_name("weir"))
    procs = [
        subprocess.Popen(
            [weir_bin, "serve", "--config", str(config), "--port", str(port), "--log-level", "warning"],
            env=env,
            cwd=tmp_path,
        )
        for port in ports
    ]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        deadline = time.monotonic() + 120  # two cold starts on a busy machine
        for url in urls:
            while True:
                try:
                    if httpx.get(f"{url}/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "replica did not start"
                time.sleep(0.2)
        first = Weir(urls[0], pg_url)
        tenant_id, _, key = first.tenant_with_key("shared", rpm=60)
        clients = [Weir(url, pg_url).client(key) for url in urls]

        def call(i: int) -> int:
            try:
                clients[i % 2].chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=5
                )
                return 200
            except openai.RateLimitError:
                return 429

        started = dt.datetime.now(dt.UTC)
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(call, range(200)))
        assert (dt.datetime.now(dt.UTC) - started).total_seconds() < 60  # all inside one window
        assert statuses.count(200) == 60 and statuses.count(429) == 140
        assert len(first.ledger(tenant_id, expect=60)) == 60
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
