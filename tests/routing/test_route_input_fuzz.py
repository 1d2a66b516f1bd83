"""hypothesis over the routing control surfaces, fed as a hostile admin feeds them: route bodies with a
wrong type, NaN or Infinity, a huge or negative number, an empty, huge or odd string, an unknown field or
policy, duplicate candidates or nested garbage in any one field, sent to the admin routes API and written
in the config's `routes:`; feedback bodies; `weir router score` and `weir router train` arguments.

What must hold: never a 500 or a traceback; a 4xx in OpenAI's error shape naming the parameter (a
ConfigError naming the key, a usage error naming the option); nothing stored after a refused write; and
the config and the admin API accept and refuse the same routes (one validation, not two)."""

from __future__ import annotations

import copy
import json
import math
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.config import ConfigError, parse_config
from routing.cli import router as router_cli
from tests.fakes.plugin import FakeVendors
from tests.fixtures.db import fresh_pg_database
from tests.fixtures.net import free_port
from tests.fixtures.server import serve
from tests.fixtures.vendor_gateway import fakes_env, full_config_text

ADMIN = "admin-token-for-the-route-fuzz"
ROUTES = "routes:\n  - {name: auto, candidates: [{model: gpt-4o-mini}], probe_interval: null}\n"
FEW = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
NAMES = ("OPENAI", "ANTHROPIC", "GEMINI", "DEEPSEEK")
ENV = {f"{n}_BASE_URL": "http://127.0.0.1:9" for n in NAMES} | {f"{n}_API_KEY": "k" for n in NAMES}
ENV |= {"DEAD_PORT": "9", "WEIR_DEMO_KEY": "a", "WEIR_LIMITED_KEY": "b"}

# Every setting a route has, set to a valid value, so that one field made bad is the only problem.
BASE: dict[str, Any] = {
    "name": "fuzz",
    "policy": "difficulty",
    "candidates": [
        {"model": "gpt-4o-mini", "weight": 1.0, "max_in_flight": 4, "max_waiting": 2, "context_window": 8000},
        {"model": "claude-sonnet", "cache_hit_rate": 0.5},
    ],
    "when": {"tenants": ["acme"], "metadata": {"team": "a"}, "tags": ["t"], "min_prompt_tokens": 1},
    "fallbacks": ["gpt-5"],
    "retry": {"attempts": 2, "backoff": 0.1, "max_backoff": 1.0, "jitter": 0.5, "max_retry_after": 5.0},
    "failover_on": [429, "5xx"],
    "ttft_timeout": 5.0,
    "hedge": {"delay": 0.5, "min_delay": 0.05, "max_spend_usd_per_hour": 1.0},
    "breaker": {"failures": 3, "cooldown": 10.0},
    "probe_interval": None,
    "threshold": 0.5,
    "strong_share": 0.2,
    "compare": {"judge": "gpt-5", "share": 0.1, "max_spend_usd_per_hour": 2.0, "max_in_flight": 2},
    "prefix_chars": 100,
    "prefix_share": 0.3,
    "expected_output_tokens": 64,
}
PATHS = [
    ("name",),
    ("policy",),
    ("candidates",),
    ("candidates", 0),
    *(("candidates", 0, f) for f in ("model", "weight", "context_window", "tools", "vision")),
    *(("candidates", 0, f) for f in ("cache_hit_rate", "max_in_flight", "max_waiting", "settings")),
    ("when",),
    *(("when", f) for f in ("tenants", "keys", "metadata", "tags", "min_prompt_tokens", "max_prompt_tokens")),
    ("when", "tools"),
    ("fallbacks",),
    ("retry",),
    *(("retry", f) for f in ("attempts", "backoff", "max_backoff", "jitter", "max_retry_after")),
    ("failover_on",),
    ("failover_on", 0),
    ("ttft_timeout",),
    ("hedge",),
    *(("hedge", f) for f in ("delay", "min_delay", "max_spend_usd_per_hour")),
    ("breaker",),
    ("breaker", "failures"),
    ("breaker", "cooldown"),
    ("probe_interval",),
    ("threshold",),
    ("strong_share",),
    ("head",),
    ("compare",),
    *(("compare", f) for f in ("judge", "share", "max_spend_usd_per_hour", "max_in_flight", "both_orders")),
    ("prefix_chars",),
    ("prefix_share",),
    ("expected_output_tokens",),
    ("resume",),
    ("unknown_field",),
]
# JSON numbers Python's json cannot write: sent as these tokens, read by the config as the floats.
RAW = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf, "1e400": math.inf, "-1e400": -math.inf}
NUMBERS = st.sampled_from(
    [0, -1, 1, 2**31, 2**63, 2**64, 10**30, -(10**30), 0.0, -0.0, 0.5, 1.5, -0.5, 1e308, -1e308, 5e-324]
)
STRINGS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", " ", "x" * 5000, "a\u0000b", "p95", "5xx", "fixed", "gpt-4o-mini", "a,b", "\u202e"]),
)
LEAF = st.one_of(
    st.none(),
    st.booleans(),
    NUMBERS,
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    STRINGS,
    st.sampled_from([f"@@{token}@@" for token in RAW]),
)
JUNK = st.recursive(
    LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(STRINGS, inner, max_size=3)),
    max_leaves=6,
)
WHOLE: st.SearchStrategy[dict[str, Any]] = st.sampled_from(
    [
        {"policy": "no-such-policy"},
        {"candidates": []},
        {"candidates": [BASE["candidates"][0]] * 2},  # duplicate candidates
        {"candidates": [{"model": "no-such-model"}, BASE["candidates"][1]]},
        {"fallbacks": ["gpt-5", "gpt-5", "no-such-model"]},
        {"when": {"min_prompt_tokens": 10, "max_prompt_tokens": 1}},
        {"hedge": {"delay": "p95"}},
    ]
)


def _set(body: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    node: Any = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


def _json(body: dict[str, Any]) -> bytes:
    text = json.dumps(body)
    for token in RAW:
        text = text.replace(f'"@@{token}@@"', token)
    return text.encode()


def _native(value: Any) -> Any:
    """The body as the config reads it: the raw tokens as the floats they are."""
    if isinstance(value, str) and value.startswith("@@") and value[2:-2] in RAW:
        return RAW[value[2:-2]]
    if isinstance(value, list):
        return [_native(v) for v in value]
    if isinstance(value, dict):
        return {k: _native(v) for k, v in value.items()}
    return value


def _has_raw(value: Any) -> bool:
    return _native(value) != value or (isinstance(value, (list, dict)) and "@@" in json.dumps(value))


def _finite_json(raw: bytes) -> bool:
    """JSON without NaN, Infinity or a number beyond a float (1e400), which the gateway cannot read."""

    def finite(token: str) -> float:
        if not math.isfinite(value := float(token)):
            raise ValueError(token)
        return value

    try:
        json.loads(raw, parse_constant=finite, parse_float=finite)
    except ValueError:
        return False
    return True


def _config(body: dict[str, Any]) -> str | None:
    """None when the config takes the route, else the ConfigError's message."""
    route = {k: v for k, v in _native(body).items() if k not in ("position", "id", "updated_at")}
    text = full_config_text() + "routes:\n" + yaml.safe_dump([route], allow_unicode=True)
    try:
        parse_config(text, ENV)
    except ConfigError as exc:
        return str(exc)
    return None


@st.composite
def bad_bodies(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A valid route with one thing wrong, and the top-level key it is in."""
    if draw(st.integers(0, 9)) == 0:
        change = draw(WHOLE)
        return {**BASE, **change}, next(iter(change))
    path = draw(st.sampled_from(PATHS))
    return _set(BASE, path, draw(JUNK)), str(path[0])


class Weir:
    def __init__(self, url: str) -> None:
        self.url = url
        self.admin = httpx.Client(
            base_url=f"{url}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"}, timeout=20
        )

    def routes(self) -> Any:
        response = self.admin.get("/routes")
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def weir(
    fake_vendors: FakeVendors,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Weir]:
    """One gateway with the control plane on a fresh PostgreSQL database (no Redis: memory state)."""
    env = fakes_env(*fake_vendors)
    with fresh_pg_database("weir_route_fuzz") as url, pytest.MonkeyPatch.context() as patch:
        patch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
        patch.setenv("WEIR_USAGE_SPOOL", str(tmp_path_factory.mktemp("spool")))
        for var in ("WEIR_REDIS_URL", "WEIR_DATABASE_URL"):
            patch.delenv(var, raising=False)
        config = parse_config(full_config_text() + f'database_url: "{url}"\n' + ROUTES, env)
        with serve(create_app(config), free_port()) as base:
            weir = Weir(base)
            # The tenant BASE's `when.tenants` names: the API takes only tenants that exist.
            assert weir.admin.post("/tenants", json={"name": "acme"}).status_code == 201
            yield weir


def _openai_error(response: httpx.Response) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return dict(error)


def test_the_base_route_is_valid_everywhere(weir: Weir) -> None:
    assert _config(BASE) is None
    created = weir.admin.post("/routes", content=_json(BASE))
    assert created.status_code == 201, created.text
    assert weir.admin.delete(f"/routes/{created.json()['id']}").status_code == 204


@pytest.mark.postgres
def test_bad_route_bodies_get_a_named_400_store_nothing_and_match_the_config(weir: Weir) -> None:
    before = weir.routes()
    target = before["data"][0]

    @FEW
    @given(case=bad_bodies(), put=st.booleans())
    def check(case: tuple[dict[str, Any], str], put: bool) -> None:
        body, key = case
        if put:
            sent = weir.admin.put(f"/routes/{target['id']}", content=_json(body))
        else:
            sent = weir.admin.post("/routes", content=_json(body))
        refused_by_config = _config(body)
        if sent.is_success:
            # Accepted: the config takes it too, and it reads back as sent; then undone.
            assert refused_by_config is None, (body, refused_by_config)
            if put:
                spec = {k: v for k, v in target.items() if k not in ("id", "updated_at")}
                assert weir.admin.put(f"/routes/{target['id']}", json=spec).status_code == 200
                before["data"] = weir.routes()["data"]  # as it was, but for its updated_at
            else:
                assert weir.admin.delete(f"/routes/{sent.json()['id']}").status_code == 204
            return
        error = _openai_error(sent)
        assert error["code"] in ("invalid_value", "invalid_json"), error
        # Named: the key made bad, or what a policy that no longer fits the rest broke.
        roots = (key, "compare", "candidates") if key == "policy" else (key,)
        if error["code"] == "invalid_value":
            assert error["param"], error
            assert re.split(r"[.\[]", error["param"])[0] in roots, (key, error)
        # One validation: what the API refuses, the config refuses too (the config alone converts
        # loosely, "2" to 2, so what it takes the API may refuse as the wrong type, and never more).
        if refused_by_config is None and error["param"] in ("when.tenants", "when.keys"):
            # Names no tenant or key: only the admin DB knows its tenants and keys, the config cannot.
            assert error["message"].startswith(("no tenant is named", "no key has the id")), error
        elif refused_by_config is None:
            assert "Expected" in error["message"] and not _has_raw(body), (body, error)
        else:
            assert any(f"{root}" in refused_by_config for root in roots), (key, refused_by_config)
        assert weir.routes()["data"] == before["data"]

    check()


@pytest.mark.postgres
def test_garbage_route_ids_and_bodies_that_are_no_route(weir: Weir) -> None:
    before = weir.routes()
    for path in ("/routes/0", "/routes/-1", "/routes/99999999999999999999999", "/routes/1.5", "/routes/x%00"):
        for method in ("GET", "PUT", "DELETE"):
            sent = weir.admin.request(method, path, content=_json(BASE))
            assert sent.status_code in (400, 404, 405), (method, path, sent.status_code, sent.text)
            _openai_error(sent)
    for raw in (b"", b"[]", b"null", b"1e400", b'"route"', b"{" * 5000, b"\xff\xfe", b'{"name": "\\ud800"}'):
        _openai_error(weir.admin.post("/routes", content=raw))
    first = before["data"][0]["id"]
    for headers in ({b"if-match": '"never", W/"\u00e9"'.encode()}, {b"if-match": b"x" * 8000}):
        sent = weir.admin.delete(f"/routes/{first}", headers=headers)
        assert sent.status_code in (400, 412, 431), (sent.status_code, sent.text)
    assert weir.routes()["data"] == before["data"]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e400", "nan", "Infinity"])
@pytest.mark.parametrize(
    "field",
    [
        "compare: {judge: gpt-5, max_spend_usd_per_hour: %s}",
        "compare: {judge: gpt-5, share: %s}",
        "hedge: {max_spend_usd_per_hour: %s}",
        "hedge: {delay: %s}",
        "retry: {backoff: %s}",
        "breaker: {cooldown: %s}",
        "threshold: %s",
        "strong_share: %s",
        "prefix_share: %s",
        "ttft_timeout: %s",
        "probe_interval: %s",
    ],
)
def test_a_number_that_is_not_finite_is_refused_in_every_route_setting(field: str, value: str) -> None:
    """The admin API cannot even be sent NaN or Infinity (not JSON); YAML writes them plainly. Every
    spend cap, share and duration refuses them, naming the key: a NaN spend cap compared below
    nothing, so it capped nothing."""
    setting = field % value
    route = (
        "routes:\n  - {name: r, policy: difficulty, candidates: [{model: gpt-4o-mini}, {model: gpt-5}], "
        + setting
        + "}\n"
    )
    key = setting.split(":", 1)[0]
    with pytest.raises(ConfigError, match=rf"routes\[0\].*{key}"):
        parse_config(full_config_text() + route, ENV)


@pytest.mark.postgres
def test_a_breaker_cooldown_the_shared_state_cannot_hold_is_refused(weir: Weir) -> None:
    """An opening is published to Redis with the cooldown as its TTL: 1e20 s was an error Redis
    answered, read as Redis unreachable (every limit and budget per process), 1e308 s an overflow in
    the request that opened it. Both are refused where they are written, and a day is the most."""
    before = weir.routes()
    for cooldown in (86_400.5, 1e20, 1e308):
        body = {**BASE, "breaker": {"failures": 3, "cooldown": cooldown}}
        error = _openai_error(weir.admin.post("/routes", content=_json(body)))
        assert error["param"] == "breaker.cooldown", error
        assert "breaker.cooldown" in (_config(body) or "")
    assert weir.routes()["data"] == before["data"]
    day = {**BASE, "breaker": {"failures": 3, "cooldown": 86_400}}
    assert _config(day) is None
    created = weir.admin.post("/routes", content=_json(day))
    assert created.status_code == 201, created.text
    assert weir.admin.delete(f"/routes/{created.json()['id']}").status_code == 204


def test_a_route_name_that_could_pass_for_another_header_field_is_refused(weir: Weir) -> None:
    """x-weir-route is `route=NAME; policy=...; candidate=...`: a name holding `; candidate=x` made the
    header say another candidate answered, to clients and to anything that parses it."""
    before = weir.routes()
    body = {**BASE, "name": "auto; candidate=gpt-4o"}
    error = _openai_error(weir.admin.post("/routes", content=_json(body)))
    assert error["param"] == "name", error
    assert "name" in (_config(body) or "")
    assert weir.routes()["data"] == before["data"]


@pytest.mark.postgres
def test_bad_feedback_bodies_get_a_named_400(weir: Weir) -> None:
    tenant = weir.admin.post("/tenants", json={"name": f"fuzz-{uuid.uuid4().hex[:6]}"})
    key = weir.admin.post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "app"}).json()["key"]
    client = httpx.Client(base_url=weir.url, headers={"authorization": f"Bearer {key}"}, timeout=20)
    body = st.one_of(
        st.fixed_dictionaries({"request_id": JUNK, "score": JUNK}),
        st.fixed_dictionaries({"request_id": STRINGS, "score": st.one_of(NUMBERS, st.floats())}),
        JUNK,
    )

    @FEW
    @given(body=body)
    def check(body: Any) -> None:
        raw = _json(body) if isinstance(body, dict) else json.dumps(body).encode()
        sent = client.post("/v1/feedback", content=raw)
        if sent.is_success:
            stored = sent.json()
            assert 0.0 <= stored["score"] <= 1.0 and 0 < len(stored["request_id"]) <= 128
            return
        error = _openai_error(sent)
        if not _finite_json(raw):  # refused as a whole, as OpenAI does: "could not parse the JSON body"
            return
        # (A key of another name is refused as OpenAI refuses one, "Unrecognized", param null.)
        if isinstance(body, dict) and set(body) <= {"request_id", "score"}:
            assert error["param"] in ("request_id", "score"), (body, error)

    with client:
        check()


def _cli(args: list[str], stdin: str = "") -> Any:
    saved = structlog.get_config()  # the commands point structlog at their stderr
    try:
        return CliRunner().invoke(router_cli, args, input=stdin)
    finally:
        structlog.configure(**saved)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--epochs", "0"], "--epochs"),
        (["--epochs", "-3"], "--epochs"),
        (["--correct-at", "nan"], "--correct-at"),
        (["--correct-at", "1.5"], "--correct-at"),
        (["--correct-at", "-1"], "--correct-at"),
        (["--holdout", "nan"], "--holdout"),
        (["--holdout", "0.9"], "--holdout"),
        (["--seed", "x"], "--seed"),
    ],
)
def test_train_refuses_an_option_out_of_its_range_naming_it(
    args: list[str], option: str, tmp_path: Path
) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "hi", "weak_correct": True, "strong_correct": True}) + "\n")
    result = _cli(["train", "--feedback", str(rows), "--out", str(tmp_path / "head"), *args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert option in result.output
    assert not (tmp_path / "head").exists()


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("[1, 2]", "object"),
        ('"just a string"', "object"),
        ('{"prompt": 5, "weak_correct": true}', "prompt"),
        ('{"prompt": ["a"], "weak_correct": true}', "prompt"),
        ('{"prompt": "x", "weak_correct": "false"}', "weak_correct"),
        ('{"prompt": "x", "strong_correct": {"a": 1}}', "strong_correct"),
    ],
)
def test_train_names_the_bad_feedback_row_instead_of_a_traceback(
    line: str, what: str, tmp_path: Path
) -> None:
    """A row that is not an object, a prompt that is not text, an outcome that is not true, false or
    null ("false" the string counted as correct before)."""
    rows = tmp_path / "rows.jsonl"
    good = json.dumps({"prompt": "hi", "weak_correct": True, "strong_correct": False})
    rows.write_text(f"{good}\n{line}\n")
    result = _cli(["train", "--feedback", str(rows), "--out", str(tmp_path / "head")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert "cannot read training data: row 2" in result.output and what in result.output, result.output


def test_score_with_a_head_directory_that_holds_no_head_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "difficulty_head.json").write_text("{not json")
    (broken / "difficulty_head.safetensors").write_bytes(b"\x00" * 16)
    torn = tmp_path / "torn"  # its metadata is fine, its weights are not a safetensors file
    torn.mkdir()
    (torn / "difficulty_head.json").write_text('{"version": 5}')
    (torn / "difficulty_head.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}garbage")
    for head in (empty, broken, torn):
        result = _cli(["score", "--head", str(head)], '{"prompt": "hi"}\n')
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
        assert str(head) in result.output or "difficulty head" in result.output, result.output


@pytest.mark.parametrize(
    "url",
    [
        "not a database url",  # did not parse: a SQLAlchemy traceback
        "postgresql://127.0.0.1:1/weir",  # nothing listens: a ConnectionRefusedError traceback
        "mysql://127.0.0.1/weir",  # a driver Weir does not ship: a ModuleNotFoundError traceback
    ],
)
def test_train_with_a_database_url_it_cannot_use_is_an_error_naming_it(url: str, tmp_path: Path) -> None:
    args = ["train", "--tenant", "acme", "--route", "auto", "--database-url", url]
    result = _cli([*args, "--out", str(tmp_path / "head")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert "Error: admin DB:" in result.output, result.output
    assert not (tmp_path / "head").exists()
