"""What a client sees of its RPM and TPM limits: OpenAI's x-ratelimit-* headers on every admitted
request and on the 429 (OpenAI's and Anthropic's error shapes alike), Anthropic's
anthropic-ratelimit-* too on the Messages API, the same count from every replica sharing one Redis,
and exactly the limit admitted however many arrive at once."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import anthropic
import httpx
import pytest

from gateway.app import create_app
from gateway.config import parse_config
from tests.fakes import FakeOpenAI
from tests.fixtures.db import REDIS_URL
from tests.fixtures.gateway import ADMIN, CONFIG, Weir
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

HELLO = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def post(url: str, key: str, path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "x-api-key": key}
    return httpx.post(f"{url}{path}", json=HELLO, headers=headers, timeout=20)


def seconds(text: str) -> float:
    """An x-ratelimit-reset-* value ("20ms", "1.5s", "6m0s") in seconds."""
    found = re.fullmatch(r"(?:(\d+)m)?(?:([\d.]+)s)?(?:(\d+)ms)?", text)
    assert found and text, text
    minutes, secs, ms = found.groups()
    return int(minutes or 0) * 60 + float(secs or 0) + int(ms or 0) / 1000


def test_reset_is_written_as_openai_writes_it() -> None:
    from gateway.accounting.admission import reset_text  # here: the other tests of this module run without it

    assert [reset_text(s) for s in (0, 0.0201, 1, 1.5, 59.9254, 60, 360, 61.25)] == [
        "0ms",
        "21ms",
        "1s",
        "1.5s",
        "59.926s",
        "1m0s",
        "6m0s",
        "1m1.25s",
    ]


def test_admitted_requests_and_the_429_say_what_is_left_and_when(weir: Weir) -> None:
    _, _, key = weir.tenant_with_key("counted", rpm=3, tpm=100_000)
    lefts, tokens_left = [], []
    for _ in range(3):
        answer = post(weir.url, key)
        assert answer.status_code == 200, answer.text
        headers = answer.headers
        assert headers["x-ratelimit-limit-requests"] == "3"
        assert headers["x-ratelimit-limit-tokens"] == "100000"
        # Counted in the current second: all of it has left the one-minute window within a minute.
        assert 59 < seconds(headers["x-ratelimit-reset-requests"]) <= 60
        assert 59 < seconds(headers["x-ratelimit-reset-tokens"]) <= 60
        lefts.append(int(headers["x-ratelimit-remaining-requests"]))
        tokens_left.append(int(headers["x-ratelimit-remaining-tokens"]))
    assert lefts == [2, 1, 0]
    # Each request's estimate is counted at admission (its prompt and max_tokens: at least 5 tokens),
    # the tokens it used once it answered. Not [1] > [2]: where the first two settle (estimate to use)
    # between the second's admission and the third's, the third sees more left than the second did.
    assert 100_000 - tokens_left[0] >= 5 and tokens_left[0] > max(tokens_left[1], tokens_left[2])

    refused = post(weir.url, key)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    headers = refused.headers
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    # retry-after: when room for one request frees; reset: when the window is empty. Here all three
    # were counted within a second or two, so both are about a minute away.
    wait, reset = int(headers["retry-after"]), seconds(headers["x-ratelimit-reset-requests"])
    assert 55 <= wait <= 60 and wait - 1 <= reset <= 60

    on_messages = post(weir.url, key, "/v1/messages")  # Anthropic's API: its error shape, same headers
    assert on_messages.status_code == 429
    assert on_messages.json()["type"] == "error"
    assert on_messages.json()["error"]["type"] == "rate_limit_error"
    assert on_messages.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(on_messages.headers["retry-after"]) >= 55


def test_anthropic_reset_is_an_rfc3339_time_rounded_up_to_the_second() -> None:
    from gateway.accounting.admission import reset_at

    now = dt.datetime(2026, 12, 5, 11, 59, 0, 500_000, tzinfo=dt.UTC).timestamp()
    # 59.2 s after 11:59:00.5 is 11:59:59.7, and the window is not empty before then: 12:00:00.
    assert reset_at(59.2, now) == "2026-12-05T12:00:00Z"
    assert reset_at(60, now) == "2026-12-05T12:00:01Z"
    assert reset_at(-1, now) == "2026-12-05T11:59:01Z"  # already empty: now


def reset_in(text: str) -> float:
    """Seconds from now until an anthropic-ratelimit-*-reset time, which is RFC 3339 in UTC."""
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", text), text
    return dt.datetime.fromisoformat(text).timestamp() - time.time()


def test_messages_clients_get_anthropics_rate_limit_headers(weir: Weir) -> None:
    """The anthropic SDK's client sees its limits as Anthropic's API writes them, on each answer and
    on the 429, from the same count as the x-ratelimit-* headers it also gets."""
    _, _, key = weir.tenant_with_key("claude-client", rpm=2, tpm=100_000)
    client = anthropic.Anthropic(base_url=weir.url, api_key=key, max_retries=0)
    lefts = []
    for _ in range(2):
        raw = client.messages.with_raw_response.create(
            model="gpt-4o-mini", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.parse().type == "message"
        headers = raw.headers
        assert headers["anthropic-ratelimit-requests-limit"] == "2"
        assert headers["anthropic-ratelimit-tokens-limit"] == "100000"
        for kind in ("requests", "tokens"):
            assert (
                headers[f"anthropic-ratelimit-{kind}-remaining"] == headers[f"x-ratelimit-remaining-{kind}"]
            )
            # Counted this second: the window is empty a minute on, written in whole seconds up.
            assert 58 < reset_in(headers[f"anthropic-ratelimit-{kind}-reset"]) <= 61
        # One combined TPM: no separate input and output allowances to report.
        assert not any(
            name.startswith(("anthropic-ratelimit-input", "anthropic-ratelimit-output")) for name in headers
        )
        lefts.append(int(headers["anthropic-ratelimit-requests-remaining"]))
    assert lefts == [1, 0]

    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(
            model="gpt-4o-mini", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    headers = refused.value.response.headers
    assert headers["anthropic-ratelimit-requests-limit"] == "2"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert int(headers["retry-after"]) >= 55 and reset_in(headers["anthropic-ratelimit-requests-reset"]) > 54

    # OpenAI's clients are told in OpenAI's headers only.
    chat = post(weir.url, key)
    assert chat.status_code == 429 and "x-ratelimit-remaining-requests" in chat.headers
    assert not any(name.startswith("anthropic-ratelimit") for name in chat.headers)


@pytest.fixture
def two_replicas(
    fake_openai: FakeOpenAI, pg_url: str, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[Weir]]:
    """Two gateways in this process, one PostgreSQL ledger and one Redis namespace between them."""
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_REDIS_PREFIX", redis_prefix)
    monkeypatch.setenv("WEIR_REDIS_URL", REDIS_URL)
    env = {"OPENAI_BASE_URL": fake_openai.base_url, "OPENAI_API_KEY": fake_openai.api_key, "DB_URL": pg_url}
    with ExitStack() as stack:
        replicas = []
        for i in range(2):
            monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / f"spool{i}"))  # read at create_app
            url = stack.enter_context(serve(create_app(parse_config(CONFIG, env)), free_port()))
            replicas.append(Weir(url, pg_url))
        yield replicas


@pytest.mark.postgres
@pytest.mark.redis
def test_two_replicas_admit_exactly_the_limit_and_agree_on_what_is_left(two_replicas: list[Weir]) -> None:
    tenant_id, _, key = two_replicas[0].tenant_with_key("shared", rpm=10)

    def timed(i: int) -> tuple[httpx.Response, float]:
        answer = post(two_replicas[i % 2].url, key)
        return answer, time.monotonic()

    with ThreadPoolExecutor(12) as pool:
        timed_answers = list(pool.map(timed, range(30)))
    answers = [answer for answer, _ in timed_answers]
    admitted = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(admitted) == 10 and len(refused) == 20
    # One count in Redis, whichever replica asked: each admitted request saw a different one.
    assert sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in admitted) == list(range(10))
    assert {a.headers["x-ratelimit-remaining-requests"] for a in refused} == {"0"}
    assert {a.headers["x-ratelimit-limit-requests"] for a in answers} == {"10"}
    # Both replicas name the same moment (Redis's clock): when the first admitted second leaves the
    # window. Whole seconds, rounded up, from when each answer was made.
    frees_at = [at + int(a.headers["retry-after"]) for a, at in timed_answers if a.status_code == 429]
    assert max(frees_at) - min(frees_at) <= 1.5
    assert all(int(a.headers["retry-after"]) >= 50 for a in refused)
    assert len(two_replicas[0].ledger(tenant_id, expect=10)) == 10
