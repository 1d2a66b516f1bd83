"""Every error a client can meet: the OpenAI error shape (Anthropic's on /v1/messages), the right status,
the parameter named, the vendor's own message passed through, and never a stack trace."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI, Fault
from tests.fixtures.vendor_gateway import DEMO_KEY, LIMITED_KEY, RunningGateway
from tests.gateway.request_logs import logged, tagged_logs

HI = [{"role": "user", "content": "hi"}]


def post(
    gateway: RunningGateway, path: str, body: bytes | dict, key: str | None = DEMO_KEY
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, dict):
        return httpx.post(f"{gateway.url}{path}", json=body, headers=headers, timeout=10)
    return httpx.post(
        f"{gateway.url}{path}",
        content=body,
        headers={**headers, "content-type": "application/json"},
        timeout=10,
    )


def openai_error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    return body["error"]


def test_malformed_json_is_400(gateway: RunningGateway) -> None:
    response = post(gateway, "/v1/chat/completions", b'{"model": "gpt-4o-mini", "messages": [')
    assert response.status_code == 400
    assert "parse the JSON body" in openai_error(response)["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "gpt-4o-mini"}, "messages"),
        ({"messages": HI}, "model"),
        ({"model": "gpt-4o-mini", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"model": "gpt-4o-mini", "messages": HI, "temperature": "hot"}, "temperature"),
        ({"model": "gpt-4o-mini", "messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"model": "gpt-4o-mini", "messages": []}, "messages"),
        (
            {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"model": "gpt-4o-mini", "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
        ),
        ({"model": "gpt-4o-mini", "messages": HI, "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_parameter_is_400_naming_it(
    gateway: RunningGateway, fake_openai: FakeOpenAI, body: dict, param: str
) -> None:
    response = post(gateway, "/v1/chat/completions", body)
    assert response.status_code == 400
    error = openai_error(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert fake_openai.requests == []  # bad input changes nothing upstream
    assert gateway.sink.events == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"best_of": 0}, "best_of"),
        ({"n": 3, "best_of": 2}, "best_of"),
    ],
)
def test_a_bad_completions_limit_is_400_naming_it_as_chat_does(
    gateway: RunningGateway, fake_openai: FakeOpenAI, extra: dict, param: str
) -> None:
    """`max_tokens` under 1 (and `n`, `best_of` under 1, or `best_of` under `n`) went upstream, and
    came back as whatever each backend made of it (a chat backend's own 400, a completions one's
    empty answer), by route."""
    response = post(gateway, "/v1/completions", {"model": "gpt-instruct", "prompt": "once", **extra})
    assert response.status_code == 400
    error = openai_error(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert fake_openai.requests == [] and gateway.sink.events == []


def test_sdk_sees_bad_request(gateway: RunningGateway) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(model="gpt-4o-mini", messages=HI, n=0)
    assert caught.value.param == "n"


def test_missing_and_unknown_keys_are_401(gateway: RunningGateway) -> None:
    assert (
        post(gateway, "/v1/chat/completions", {"model": "gpt-4o-mini", "messages": HI}, key=None).status_code
        == 401
    )
    with pytest.raises(openai.AuthenticationError) as caught:
        gateway.openai(api_key="sk-wrong").chat.completions.create(model="gpt-4o-mini", messages=HI)
    assert caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        gateway.openai(api_key="sk-wrong").models.list()
    with pytest.raises(anthropic.AuthenticationError) as anthropic_caught:
        gateway.anthropic(api_key="sk-wrong").messages.create(
            model="claude-sonnet", max_tokens=5, messages=HI
        )  # type: ignore[arg-type]
    assert anthropic_caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_unknown_model_is_404_model_not_found(gateway: RunningGateway) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        gateway.openai().chat.completions.create(model="gpt-9", messages=HI)
    assert caught.value.code == "model_not_found" and "gpt-9" in caught.value.message
    with pytest.raises(anthropic.NotFoundError) as anthropic_caught:
        gateway.anthropic().messages.create(model="gpt-9", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    assert anthropic_caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_models_a_tenant_may_not_use_are_not_found(gateway: RunningGateway) -> None:
    limited = gateway.openai(api_key=LIMITED_KEY)
    assert [m.id for m in limited.models.list()] == ["gemini-flash"]
    with pytest.raises(openai.NotFoundError):
        limited.chat.completions.create(model="gpt-4o-mini", messages=HI)
    assert (
        limited.chat.completions.create(model="gemini-flash", messages=HI).choices[0].message.content == "hi"
    )


def test_body_over_the_limit_is_413(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    big = "x" * 250_000  # the test config allows 200,000 bytes
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai().chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": big}]
        )
    assert caught.value.status_code == 413
    assert caught.value.code == "request_too_large"
    assert fake_openai.requests == []


@pytest.mark.parametrize(
    ("model", "fake_name"),
    [("gpt-4o-mini", "fake_openai"), ("claude-sonnet", "fake_anthropic"), ("gemini-flash", "fake_gemini")],
)
def test_upstream_4xx_passes_through_with_the_vendors_message(
    gateway: RunningGateway, request: pytest.FixtureRequest, model: str, fake_name: str
) -> None:
    fake = request.getfixturevalue(fake_name)
    fake.fail_next(Fault.status(400, message="prompt is too long: 300000 tokens > 200000 maximum"))
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(model=model, messages=HI)
    assert "prompt is too long: 300000 tokens > 200000 maximum" in caught.value.message
    [event] = gateway.sink.events
    assert event.status == 400 and not event.ok


def test_upstream_429_keeps_retry_after(gateway: RunningGateway, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.fail_next(Fault.status(429, retry_after=7))
    with pytest.raises(openai.RateLimitError) as caught:
        gateway.openai().chat.completions.create(model="claude-sonnet", messages=HI)
    assert caught.value.response.headers["retry-after"] == "7"


@pytest.mark.parametrize(("status", "expected"), [(500, 502), (502, 502), (503, 503), (504, 504)])
def test_upstream_5xx_keeps_retry_after(
    gateway: RunningGateway, fake_openai: FakeOpenAI, status: int, expected: int
) -> None:
    """A vendor that says when to come back after a 5xx: the client is told it, whichever error the
    5xx becomes (a 500 or 502 once lost it, a 503 kept it)."""
    fake_openai.fail_next(Fault.status(status, retry_after=7))
    response = post(gateway, "/v1/chat/completions", {"model": "gpt-4o-mini", "messages": HI})
    assert response.status_code == expected
    assert response.headers["retry-after"] == "7"


@pytest.mark.parametrize(
    ("model", "fake_name", "status", "expected"),
    [
        ("gpt-4o-mini", "fake_openai", 500, 502),
        ("gemini-flash", "fake_gemini", 500, 502),
        ("gpt-4o-mini", "fake_openai", 503, 503),
        ("claude-sonnet", "fake_anthropic", 529, 503),
        ("claude-sonnet", "fake_anthropic", 504, 504),
    ],
)
def test_upstream_5xx_becomes_a_gateway_error(
    gateway: RunningGateway,
    request: pytest.FixtureRequest,
    model: str,
    fake_name: str,
    status: int,
    expected: int,
) -> None:
    request.getfixturevalue(fake_name).fail_next(Fault.status(status))
    response = post(gateway, "/v1/chat/completions", {"model": model, "messages": HI})
    assert response.status_code == expected
    error = openai_error(response)
    assert f"({status})" in error["message"] and error["type"] == "upstream_error"


def test_anthropic_clients_get_anthropic_error_bodies(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    fake_openai.fail_next(Fault.status(503))
    with pytest.raises(anthropic.APIStatusError) as caught:
        gateway.anthropic().messages.create(model="gpt-4o-mini", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    assert caught.value.status_code == 529  # Anthropic's status for an overload (the vendor's 503)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    response = httpx.post(
        f"{gateway.url}/v1/messages", json={"model": "claude-sonnet"}, headers={"x-api-key": DEMO_KEY}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "messages" in response.json()["error"]["message"]


# What Weir says "overloaded" for: Anthropic's own 529, an OpenAI-compatible vendor's 503, and the
# bundled engine's full queue (its 429 `engine_overloaded`), each with the wait it asked for.
OVERLOADS = [
    ("claude-sonnet", "fake_anthropic", Fault.status(529, retry_after=7), 503),
    ("gpt-4o-mini", "fake_openai", Fault.status(503, retry_after=7), 503),
    ("gpt-4o-mini", "fake_openai", Fault.status(429, retry_after=7, error_code="engine_overloaded"), 429),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("model", "fake_name", "fault", "openai_status"), OVERLOADS, ids=["529", "503", "engine"]
)
def test_an_overload_is_anthropics_529_to_anthropic_clients(
    gateway: RunningGateway,
    request: pytest.FixtureRequest,
    model: str,
    fake_name: str,
    fault: Fault,
    openai_status: int,
    stream: bool,
) -> None:
    """Anthropic's API says it is overloaded with a 529 `overloaded_error` (it has no 503): the
    anthropic SDK raises its `OverloadedError` for that status alone, and Claude Code counts 529s as
    overloads. The retry-after is kept."""
    request.getfixturevalue(fake_name).fail_next(fault)
    with pytest.raises(anthropic.OverloadedError) as caught:
        gateway.anthropic().messages.create(model=model, max_tokens=5, messages=HI, stream=stream)  # type: ignore[arg-type]
    assert caught.value.status_code == 529
    assert caught.value.body == {  # type: ignore[comparison-overlap]
        "type": "error",
        "error": {"type": "overloaded_error", "message": caught.value.body["error"]["message"]},  # type: ignore[index]
        "request_id": caught.value.response.headers["request-id"],
    }
    assert caught.value.response.headers["retry-after"] == "7"


@pytest.mark.parametrize(
    ("model", "fake_name", "fault", "openai_status"), OVERLOADS, ids=["529", "503", "engine"]
)
def test_an_overload_keeps_openais_status_for_openai_clients(
    gateway: RunningGateway,
    request: pytest.FixtureRequest,
    model: str,
    fake_name: str,
    fault: Fault,
    openai_status: int,
) -> None:
    """OpenAI says it with a 503 (or the engine's 429, as OpenAI's own "engine overloaded" is):
    unchanged on the OpenAI-shaped endpoints."""
    request.getfixturevalue(fake_name).fail_next(fault)
    response = post(gateway, "/v1/chat/completions", {"model": model, "messages": HI})
    assert response.status_code == openai_status and response.headers["retry-after"] == "7"
    openai_error(response)


def test_the_anthropic_sdk_retries_a_529_after_the_wait_it_is_told(
    gateway: RunningGateway, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.fail_next(Fault.status(529, retry_after=0.05))
    client = anthropic.Anthropic(base_url=gateway.url, api_key=DEMO_KEY, max_retries=1, timeout=20)
    answer = client.messages.create(model="claude-sonnet", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    assert answer.content and len(fake_anthropic.posts) == 2


def test_dead_backend_is_503(gateway: RunningGateway) -> None:
    response = post(gateway, "/v1/chat/completions", {"model": "dead-model", "messages": HI})
    assert response.status_code == 503
    assert "cannot connect to backend dead" in openai_error(response)["message"]
    [event] = gateway.sink.events
    assert event.status == 0  # the backend never answered


@pytest.mark.parametrize("fault", [Fault.delay(3), Fault.hang()], ids=["slow", "hang"])
def test_slow_backend_is_504(gateway: RunningGateway, fake_openai: FakeOpenAI, fault: Fault) -> None:
    fake_openai.fail_next(fault)
    response = post(gateway, "/v1/chat/completions", {"model": "impatient", "messages": HI})
    assert response.status_code == 504
    assert "did not answer within 0.5s" in openai_error(response)["message"]


@pytest.mark.parametrize(
    "fault", [Fault.reset(), Fault.garbage(), Fault.wrong_content_type()], ids=["reset", "garbage", "html"]
)
@pytest.mark.parametrize(
    ("model", "fake_name"),
    [("gpt-4o-mini", "fake_openai"), ("claude-sonnet", "fake_anthropic"), ("gemini-flash", "fake_gemini")],
)
def test_broken_backend_is_502(
    gateway: RunningGateway, request: pytest.FixtureRequest, model: str, fake_name: str, fault: Fault
) -> None:
    request.getfixturevalue(fake_name).fail_next(fault)
    response = post(gateway, "/v1/chat/completions", {"model": model, "messages": HI})
    assert response.status_code == 502
    assert openai_error(response)["code"] == "bad_gateway"


@pytest.mark.parametrize(
    ("model", "fake_name"),
    [("gpt-4o-mini", "fake_openai"), ("claude-sonnet", "fake_anthropic"), ("gemini-flash", "fake_gemini")],
)
def test_stream_error_before_the_first_token_is_an_http_error(
    gateway: RunningGateway, request: pytest.FixtureRequest, model: str, fake_name: str
) -> None:
    request.getfixturevalue(fake_name).fail_next(Fault.status(500))
    with pytest.raises(openai.InternalServerError) as caught:
        list(gateway.openai().chat.completions.create(model=model, messages=HI, stream=True))
    assert caught.value.status_code == 502


@pytest.mark.parametrize(
    "fault", [Fault.cut_stream(after=4), Fault.stream_error(after=4)], ids=["cut", "error-event"]
)
@pytest.mark.parametrize(
    ("model", "fake_name"),
    [("gpt-4o-mini", "fake_openai"), ("claude-sonnet", "fake_anthropic"), ("gemini-flash", "fake_gemini")],
)
def test_stream_broken_midway_ends_with_an_error_event(
    gateway: RunningGateway, request: pytest.FixtureRequest, model: str, fake_name: str, fault: Fault
) -> None:
    request.getfixturevalue(fake_name).fail_next(fault)
    received = []
    with pytest.raises(openai.APIError):
        for chunk in gateway.openai().chat.completions.create(
            model=model, messages=[{"role": "user", "content": "one two three four five six"}], stream=True
        ):
            received.append(chunk)
    assert received  # some text arrived before the failure was reported
    [event] = gateway.sink.events
    assert event.status >= 500 and not event.ok


def test_anthropic_stream_broken_midway_ends_with_an_error_event(
    gateway: RunningGateway, fake_gemini: FakeGemini
) -> None:
    fake_gemini.fail_next(Fault.cut_stream(after=2))
    with (
        pytest.raises(anthropic.APIStatusError),
        gateway.anthropic().messages.stream(
            model="gemini-flash",
            max_tokens=50,
            messages=[{"role": "user", "content": "one two three four five"}],
        ) as stream,
    ):
        list(stream)


def test_anthropic_error_bodies_carry_the_request_id(
    gateway: RunningGateway, fake_openai: FakeOpenAI
) -> None:
    """Anthropic's error bodies carry the request's id beside the error (`request_id`, the id of its
    `request-id` header): a client that shows the body alone (Claude Code's "API Error: 529 {...}")
    shows the id to look the request up by in the gateway's log. Weir's had none, in the status line's
    errors and in a stream's `error` event alike."""
    client = gateway.anthropic()
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    assert missing.value.body["request_id"] == missing.value.response.headers["request-id"] != ""  # type: ignore[index]
    fake_openai.fail_next(Fault.stream_error(after=2))
    asked = {
        "model": "gpt-4o-mini",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "one two three"}],
    }
    with pytest.raises(anthropic.APIStatusError) as broken, client.messages.stream(**asked) as stream:  # type: ignore[arg-type]
        list(stream)
    assert broken.value.response.status_code == 200  # the error came as an event, after the answer began
    assert broken.value.body["request_id"] == broken.value.response.headers["request-id"] != ""  # type: ignore[index]
    chat_error = post(gateway, "/v1/chat/completions", {"model": "no-such-model", "messages": HI})
    openai_error(chat_error)  # OpenAI's shape has no such field


def test_errors_on_every_path_of_the_messages_api_come_in_anthropics_shape(gateway: RunningGateway) -> None:
    """An Anthropic client's call that Weir does not serve (the Message Batches API,
    `/v1/messages/batches`) and one to `/v1/messages/` (a trailing slash, which Weir serves) were
    answered in OpenAI's error shape, which Anthropic's clients do not read (no `type: error`, a
    404 typed `invalid_request_error`): every path of the Messages API has Anthropic's."""
    with pytest.raises(anthropic.NotFoundError) as caught:
        gateway.anthropic().messages.batches.list()
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    slash = httpx.post(
        f"{gateway.url}/v1/messages/", json={"model": "claude-sonnet"}, headers={"x-api-key": DEMO_KEY}
    )
    assert slash.status_code == 400 and slash.json()["type"] == "error"
    assert slash.json()["error"]["type"] == "invalid_request_error"
    elsewhere = httpx.get(f"{gateway.url}/v1/messagesx")
    assert elsewhere.status_code == 404 and openai_error(elsewhere)["code"] == "not_found"


def test_unknown_route_and_method(gateway: RunningGateway) -> None:
    response = httpx.get(f"{gateway.url}/v1/nothing-here")
    assert response.status_code == 404
    assert openai_error(response)["code"] == "not_found"
    response = httpx.get(
        f"{gateway.url}/v1/chat/completions", headers={"authorization": f"Bearer {DEMO_KEY}"}
    )
    assert response.status_code == 405
    openai_error(response)


@pytest.mark.parametrize(
    ("method", "path", "headers", "anthropic_shaped"),
    [
        ("GET", "/v1/nothing-here", {}, False),
        ("GET", "/v1/chat/completions", {}, False),  # a 405
        ("GET", "/v1/messages/batches", {}, True),
        ("DELETE", "/v1/models", {"anthropic-version": "2023-06-01"}, True),  # a 405
    ],
)
def test_unknown_routes_and_methods_carry_the_request_id_and_are_logged(
    gateway: RunningGateway, method: str, path: str, headers: dict[str, str], anthropic_shaped: bool
) -> None:
    """Litestar answers a path no route serves (404) and a method a route lacks (405) before any
    middleware of the gateway's runs: those responses had no `x-request-id` (nor `request-id` on the
    Messages API's paths, nor `request_id` in Anthropic's body) and no request line in the log."""
    with tagged_logs() as logs:
        response = httpx.request(method, f"{gateway.url}{path}", headers=headers, timeout=10)
        line = logged(logs, "request")
    request_id = response.headers["x-request-id"]
    assert len(request_id) == 32
    assert (line["request_id"], line["path"], line["status"]) == (request_id, path, response.status_code)
    assert line["error"] == "invalid_request_error"
    if anthropic_shaped:
        assert response.json()["type"] == "error" and response.json()["request_id"] == request_id
        if path.startswith("/v1/messages"):
            assert response.headers["request-id"] == request_id
    else:
        openai_error(response)
    assert response.status_code in (404, 405)


def test_client_leaving_mid_stream_is_recorded(gateway: RunningGateway, fake_openai: FakeOpenAI) -> None:
    fake_openai.fail_next(Fault.slow_stream(0.2))
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "one two three four five six seven"}],
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {DEMO_KEY}"},
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first event, then the client goes away
    deadline = time.monotonic() + 10
    while not gateway.sink.events and time.monotonic() < deadline:
        time.sleep(0.05)
    [event] = gateway.sink.events
    assert event.status == 499 and not event.ok


@pytest.mark.parametrize(
    ("path", "prompt"), [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"})]
)
def test_stream_options_without_stream_is_a_400(
    gateway: RunningGateway, fake_openai: FakeOpenAI, path: str, prompt: dict
) -> None:
    """OpenAI's 400, given before any backend is asked: passed on, the request was refused by OpenAI
    and vLLM but answered by other backends, by route."""
    body = {"model": "gpt-4o-mini", "stream_options": {"include_usage": True}, **prompt}
    for sent in (body, body | {"stream": False}):
        response = post(gateway, path, sent)
        assert response.status_code == 400, response.text
        error = openai_error(response)
        assert (error["param"], error["type"]) == ("stream_options", "invalid_request_error")
        assert error["message"] == "The 'stream_options' parameter is only allowed when 'stream' is enabled."
    assert fake_openai.requests == []
    assert post(gateway, path, body | {"stream": True}).status_code == 200
