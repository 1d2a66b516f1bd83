"""The YAML config: the issue's example verbatim, interpolation, and errors that name the key."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from gateway.cli import serve
from gateway.config import (
    ConfigError,
    interpolate,
    load_config,
    parse_config,
    tenant_models_outside_the_config,
)
from gateway.vault import generate_key
from tests.fakes import FakeOpenAI
from tests.fixtures.gateway import CONFIG as GATEWAY_CONFIG
from tests.fixtures.gateway import sqlite_weir
from tests.fixtures.vendor_gateway import EXAMPLE
from tests.fixtures.waiting import wait_for
from weir.cli import main

ENV = {"OPENAI_API_KEY": "sk-o", "ANTHROPIC_API_KEY": "sk-a", "GEMINI_API_KEY": "g", "WEIR_DEMO_KEY": "demo"}


def test_issue_example_loads_verbatim_with_defaults() -> None:
    config = parse_config(EXAMPLE, ENV)
    assert [b.name for b in config.backends] == ["openai", "anthropic", "gemini"]
    assert config.backend("openai").base_url == "https://api.openai.com/v1"
    assert config.backend("anthropic").api_key == "sk-a"
    claude = config.models[1]
    assert (claude.name, claude.backend, claude.upstream_model) == (
        "claude-sonnet",
        "anthropic",
        "claude-sonnet-4-5",
    )
    assert claude.price.cache_write_1h == Decimal("6.0")
    assert config.models[0].price.cached_input == Decimal("0.075")
    assert config.tenants is not None and config.tenants[0].api_keys == ["demo"]
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8080)


def test_environment_overrides_defaults() -> None:
    config = parse_config(EXAMPLE, {**ENV, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"})
    assert config.backend("openai").base_url == "http://127.0.0.1:9/v1"


def test_empty_variable_takes_the_default_and_text_around_it_stays() -> None:
    value = interpolate({"a": ["x-${V:-d}-y", "${W:-}"]}, {"V": ""})
    assert value == {"a": ["x-d-y", ""]}


def test_unset_variable_names_the_key_and_the_variable() -> None:
    env = {k: v for k, v in ENV.items() if k != "ANTHROPIC_API_KEY"}
    with pytest.raises(
        ConfigError, match=r"backends\[1\]\.api_key: environment variable ANTHROPIC_API_KEY is not set"
    ):
        parse_config(EXAMPLE, env)


def test_values_from_the_environment_cannot_change_the_structure() -> None:
    config = parse_config(EXAMPLE, {**ENV, "OPENAI_API_KEY": "x\nmodels: []"})
    assert config.backend("openai").api_key == "x\nmodels: []"
    assert len(config.models) == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server: {port: eighty}", r"server\.port: Expected `int`, got `str`"),
        (
            "models: [{name: m, backend: b, price: {input: lots}}]",
            r"models\[0\]\.price\.input: Invalid decimal",
        ),
        (
            "backends: [{name: x, type: bedrock, base_url: u}]",
            r"backends\[0\]\.type: Invalid enum value 'bedrock'",
        ),
        (
            "backends: [{name: x, type: openai, base_url: u, colour: red}]",
            r"backends\[0\]: Object contains unknown field `colour`",
        ),
        ("backends: [{type: openai, base_url: u}]", r"backends\[0\]: Object missing required field `name`"),
        ("backends: [{name: x, type: openai}]", r"backends\[0\]\.base_url: required"),
        ("backends: [{name: x, type: engine}]", r"backends\[0\]: an engine backend needs `url` or `model`"),
        ("models: [{name: m, backend: nowhere}]", r"models\[0\]\.backend: no backend named 'nowhere'"),
        ("tenants: [{name: t, api_keys: ['']}]", r"tenants\[0\]\.api_keys\[0\]: empty API key"),
        (
            "tenants: [{name: t, models: [ghost]}]",
            r"tenants\[0\]\.models\[0\]: no model named 'ghost': .*without an admin DB \(database_url\)",
        ),
        ("- just\n- a list", "mapping at the top level"),
        ("backends: [", "invalid YAML"),
    ],
)
def test_invalid_configs_name_the_offending_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(text, {})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "server: {port: 1 host: x}",
            "invalid YAML: line 1, column 22: expected ',' or '}', but got ':' (while parsing a flow mapping)",
        ),
        ('backends:\n  - name: "x\n', "invalid YAML: line 3, column 1: found unexpected end of stream"),
        (
            "server:\n\tport: 1",
            "invalid YAML: line 2, column 1: found character '\\t' that cannot start any token",
        ),
    ],
)
def test_invalid_yaml_is_one_line_naming_where(text: str, message: str) -> None:
    # `weir serve` and `weir config check` print the error as one `Error:` line
    with pytest.raises(ConfigError) as raised:
        parse_config(text, {})
    assert "\n" not in str(raised.value)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "proxy.internal",
            r"server\.forwarded_allow_ips\[0\]: 'proxy.internal' is not an IP address or CIDR",
        ),
        (
            "10.0.0.1/8",
            r"server\.forwarded_allow_ips\[0\]: '10.0.0.1/8' has host bits set; write the network, 10.0.0.0/8",
        ),
    ],
)
def test_forwarded_allow_ips_that_uvicorn_and_granian_would_never_match_are_refused(
    entry: str, message: str
) -> None:
    """Both servers parse a CIDR strictly and take one that fails (host bits set) as a literal host
    name, which no peer has: `10.0.0.1/8` passed the check and then trusted no proxy in 10/8, every
    client behind it sharing the proxy's failed-auth bucket."""
    from granian.utils.proxies import _Forwarders
    from uvicorn.middleware.proxy_headers import _TrustedHosts

    if "/" in entry:  # what the servers would make of it, had the config taken it
        assert "10.1.2.3" not in _Forwarders([entry]) and "10.1.2.3" not in _TrustedHosts([entry])
    with pytest.raises(ConfigError, match=message):
        parse_config(f"server: {{forwarded_allow_ips: ['{entry}']}}", {})


def test_forwarded_allow_ips_of_addresses_and_networks_are_taken() -> None:
    entries = ["10.0.0.0/8", "192.168.1.7", "::1", "fd00::/8"]
    config = parse_config(f"server: {{forwarded_allow_ips: {entries}}}", {})
    assert config.server.forwarded_allow_ips == entries


MODEL_NAMED = (
    "backends: [{name: b, type: openai, base_url: 'http://127.0.0.1:9/v1'}]\nmodels: [{name: %s, backend: b}]"
)


@pytest.mark.parametrize(
    "name",
    [
        '"mini; policy=difficulty; candidate=gpt-5"',  # would forge x-weir-route's fields
        '"mini\\r\\nx-evil: 1"',  # a control character breaks the header
        '""',
        "x" * 201,  # longer than the ledger's `route` column holds
    ],
)
def test_a_model_name_that_would_forge_or_break_x_weir_route_is_refused(name: str) -> None:
    """A model's name is sent by clients and goes into x-weir-route (`route=` of a plain model's
    request, `candidate=` of every route using it), whose fields `;` separates: the rule route names
    keep. A model named `mini; policy=difficulty; candidate=gpt-5` was taken, and its responses
    carried a forged `policy` and `candidate`."""
    with pytest.raises(
        ConfigError, match=r"models\[0\]\.name: 1 to 200 characters, no control characters or ';'"
    ):
        parse_config(MODEL_NAMED % name, {})


def test_model_names_of_the_usual_shapes_are_taken() -> None:
    names = ["meta-llama/Llama-3.1-8B-Instruct", "gpt-4o-mini", "claude sonnet 4.5", "x" * 200]
    text = MODEL_NAMED % ", backend: b}, {name: ".join(f'"{n}"' for n in names)
    assert [m.name for m in parse_config(text, {}).models] == names


def test_numbers_from_the_environment_are_converted() -> None:
    config = parse_config("server: {port: '${PORT:-9000}'}", {})
    assert config.server.port == 9000


def test_weir_serve_reports_config_errors_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "weir.yaml"
    path.write_text("server: {port: eighty}\n")
    result = CliRunner().invoke(serve, ["--config", str(path)])
    assert result.exit_code == 1
    assert "server.port: Expected `int`, got `str`" in result.output
    assert "Traceback" not in result.output


@pytest.fixture
def uvicorn_runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `weir serve` would have served with, without serving it."""
    import uvicorn

    from gateway.cli import CONFIG_ENV

    monkeypatch.setenv(CONFIG_ENV, "restored after the test")  # serve sets it for its app factory
    ran: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: ran.update(vars(server.config)))
    return ran


@pytest.mark.parametrize(("flag", "bound"), [([], 9123), (["--port", "0"], 0), (["--port", "9124"], 9124)])
def test_weir_serve_port_flag_overrides_server_port_zero_included(
    tmp_path: Path, uvicorn_runs: dict[str, Any], flag: list[str], bound: int
) -> None:
    """`--port 0` asks for a free port, as `server.port: 0` does (docs/configuration.md); it used to be
    read as no flag, so the config's port was bound instead."""
    path = tmp_path / "weir.yaml"
    path.write_text("server: {port: 9123}\n")
    result = CliRunner().invoke(serve, ["--config", str(path), *flag])
    assert result.exit_code == 0, result.output
    assert uvicorn_runs["port"] == bound


def test_weir_serve_refuses_a_port_out_of_range(tmp_path: Path, uvicorn_runs: dict[str, Any]) -> None:
    """As `server.port` is: a usage error naming the range (70000 used to listen on 4464, modulo 2^16)."""
    path = tmp_path / "weir.yaml"
    path.write_text("{}\n")
    result = CliRunner().invoke(serve, ["--config", str(path), "--port", "70000"])
    assert result.exit_code == 2 and "70000 is not in the range 0<=x<=65535" in result.output
    assert not uvicorn_runs


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modles: []", "Object contains unknown field `modles` (did you mean `models`?)"),
        ("server: {prot: 9000}", "server: Object contains unknown field `prot` (did you mean `port`?)"),
        (
            "backends: [{name: b, type: openai, base_url: u, timeouts: {conect: 3}}]",
            "backends[0].timeouts: Object contains unknown field `conect` (did you mean `connect`?)",
        ),
        (
            "routes: [{name: auto, candidates: [{model: m, max_ouput_tokens: 8}]}]",
            "routes[0].candidates[0]: Object contains unknown field `max_ouput_tokens` "
            "(did you mean `max_output_tokens`?)",
        ),
        (
            "routes: [{name: auto, candidates: [], hedge: {max_spend_usd_per_hr: 1}}]",
            "routes[0].hedge: Object contains unknown field `max_spend_usd_per_hr` "
            "(did you mean `max_spend_usd_per_hour`?)",
        ),
        ("zzzz: 1", "Object contains unknown field `zzzz`"),  # nothing like it: no guess
    ],
)
def test_a_misspelt_key_is_named_with_the_key_meant(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(text, {})
    assert str(refused.value) == message


def test_weir_serve_without_a_config_file_says_where_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first `weir serve` in a fresh checkout (the default --config, weir.yaml, not there): the file
    named once, then what to do, not `weir.yaml: cannot read weir.yaml: No such file or directory`."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(serve, [])
    assert result.exit_code == 1
    assert result.output.startswith("Error: weir.yaml: cannot read the file: No such file or directory")
    assert result.output.count("weir.yaml") == 1
    assert "--config" in result.output and "weir demo" in result.output
    assert "Traceback" not in result.output


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


BACKEND = "backends: [{name: b, type: openai, base_url: 'http://127.0.0.1:9/v1', %s}]"
ENGINE = "backends: [{name: e, type: engine, model: m, %s}]"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        # aiohttp's connect timeout: infinity was an OverflowError in every request, 0 or less no
        # timeout at all, NaN a timeout on every connection.
        *(
            (BACKEND % f"timeouts: {{connect: {v}}}", r"backends\[0\]\.timeouts\.connect")
            for v in (".inf", ".nan", 0, -1)
        ),
        # The others: 0, less or NaN timed out every request at once (a 504 before any answer).
        *((BACKEND % f"timeouts: {{first_byte: {v}}}", r"timeouts\.first_byte") for v in (".nan", 0, -5)),
        *((BACKEND % f"timeouts: {{read: {v}}}", r"timeouts\.read") for v in (".nan", 0, 86401)),
        (ENGINE % "startup_timeout: .nan", r"backends\[0\]\.startup_timeout"),
        (ENGINE % "startup_timeout: 0", r"backends\[0\]\.startup_timeout"),
        (ENGINE % "port: 70000", r"backends\[0\]\.port"),
        (ENGINE % "port: 0", r"backends\[0\]\.port"),  # read as "unset": the engine went to 8000
        ("server: {port: 70000}", r"server\.port"),
        ("server: {port: -1}", r"server\.port"),
        ("server: {max_body_bytes: 0}", r"server\.max_body_bytes"),  # every request a 413
        # uvicorn's slow-client deadlines: 0 or NaN answered every connection with a 408.
        ("server: {header_timeout: 0}", r"server\.header_timeout"),
        ("server: {body_timeout: .nan}", r"server\.body_timeout"),
        ("server: {body_timeout: .inf}", r"server\.body_timeout"),
        # As the admin API's tenant limits: a 32-bit count.
        ("limits: {max_output_tokens: 2147483648}", r"limits\.max_output_tokens"),
        ("tenants: [{name: t, max_messages: 2147483648}]", r"tenants\[0\]\.max_messages"),
    ],
)
def test_numbers_out_of_their_range_are_refused_at_start(text: str, key: str) -> None:
    """A number that could only break requests later (an error in each one, a timeout that never ends
    or always has) is a config error naming its key, at start."""
    with pytest.raises(ConfigError, match=key):
        parse_config(text, {})


def test_numbers_at_the_edges_of_their_ranges_are_taken() -> None:
    config = parse_config(
        BACKEND % "timeouts: {connect: 0.001, first_byte: 86400, read: 86400}"
        + "\nserver: {port: 0, max_body_bytes: 1, header_timeout: 86400, body_timeout: 0.001}"
        + "\nlimits: {max_output_tokens: 2147483647}",
        {},
    )
    assert config.backends[0].timeouts.first_byte == 86400 and config.server.port == 0
    engine = parse_config(ENGINE % "port: 65535, startup_timeout: 86400", {})
    assert engine.backends[0].port == 65535


TWO_NAMES = """\
backends:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1"}
  - {name: azure, type: openai, base_url: "http://127.0.0.1:9/v1"}
models:
  - {name: mini, backend: openai, model: gpt-4o-mini, price: {input: 0.15, output: 0.60}}
  - {name: mini-short, backend: %s, model: %s, max_output_tokens: 64%s}
"""


@pytest.mark.parametrize(
    "price",
    [
        ", price: {input: 0.3, output: 1.2}",
        ", price: {input: 0.15, output: 0.60, cached_input: 0.075}",
        ", price: {input: 0.15, output: 0.60, long_context: {above_prompt_tokens: 1000, input: 0.3}}",
        "",  # no price: $0
    ],
)
def test_two_names_for_one_upstream_model_at_different_prices_are_refused(price: str) -> None:
    """The admin DB's price catalog and ledger bill an attempt by (backend, upstream model), as its
    vendor does: two prices for one could not both apply (seeding both crashed the gateway's start)."""
    with pytest.raises(
        ConfigError,
        match=r"^models\[1\]\.price: 'mini-short' and models\[0\] 'mini' both serve 'gpt-4o-mini' on "
        r"backend 'openai' at different prices",
    ):
        parse_config(TWO_NAMES % ("openai", "gpt-4o-mini", price), {})


@pytest.mark.parametrize(
    ("backend", "upstream", "price"),
    [
        ("openai", "gpt-4o-mini", ", price: {input: 0.150, output: 0.6}"),  # the same, written otherwise
        ("azure", "gpt-4o-mini", ", price: {input: 0.3, output: 1.2}"),  # another backend's price
        ("openai", "gpt-4o", ", price: {input: 2.5, output: 10}"),  # another upstream model
    ],
)
def test_prices_of_other_upstream_models_or_the_same_price_are_taken(
    backend: str, upstream: str, price: str
) -> None:
    config = parse_config(TWO_NAMES % (backend, upstream, price), {})
    assert [m.name for m in config.models] == ["mini", "mini-short"]


CHECKED = """
backends:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: "${OPENAI_API_KEY}"}
models:
  - {name: gpt-4o-mini, backend: openai}
  - {name: gpt-4o, backend: openai}
routes:
  - {name: auto, candidates: [{model: gpt-4o-mini}], fallbacks: [gpt-4o]}
tenants:
  - {name: demo, api_keys: ["${WEIR_DEMO_KEY}"]}
"""


def config_check(path: Path, env: dict[str, str | None]) -> Result:
    """`weir config check --config PATH` with these environment variables set (None: unset)."""
    return CliRunner().invoke(main, ["config", "check", "--config", str(path)], env=env)


@pytest.mark.parametrize(
    ("text", "env"),
    [
        ("database_url: sqlite:///x.db\n", {"WEIR_DATABASE_URL": None}),
        ("", {"WEIR_DATABASE_URL": "sqlite:///x.db"}),
    ],
)
def test_weir_config_check_says_a_config_without_tenants_needs_admin_db_keys(
    tmp_path: Path, text: str, env: dict[str, str | None]
) -> None:
    """With the admin DB, no `tenants:` is not open access (every request needs a key it issued), and
    the summary said "no authentication" all the same."""
    path = tmp_path / "weir.yaml"
    path.write_text(text)
    result = config_check(path, env)
    assert (
        result.output
        == f"{path}: OK: 0 backends, 0 models, 0 routes, no config tenants (admin-DB keys only)\n"
    )


async def test_the_open_access_warning_only_where_nothing_checks_keys() -> None:
    """`no_tenants_configured` ("every request is accepted without an API key") was logged by a gateway
    whose admin DB authenticates every request, which refuses one without a key (401)."""
    from structlog.testing import capture_logs

    from gateway.auth import StaticAuthenticator
    from gateway.runtime import Gateway

    config = parse_config("{}", {})
    for gateway, warned in [
        (Gateway(config), True),
        (Gateway(config, authenticator=StaticAuthenticator([])), False),
    ]:
        with capture_logs() as logs:
            await gateway.start()
        await gateway.stop()
        assert ("no_tenants_configured" in [line["event"] for line in logs]) is warned


@pytest.mark.parametrize(
    ("text", "env"),
    [("database_url: sqlite:///x.db\n", {}), ("", {"WEIR_DATABASE_URL": "sqlite:///x.db"})],
)
def test_with_an_admin_db_a_tenants_models_may_name_a_route_only_the_db_has(
    text: str, env: dict[str, str]
) -> None:
    """A config tenant's `models` naming a route created through the admin API (/admin/api/v1/routes)
    was refused at load, as if a typo: such a tenant could never be given a route of the DB. With an
    admin DB (`database_url` or WEIR_DATABASE_URL) the loader cannot tell, so it loads; the gateway
    says at start which it does not find (below). Without one it is still refused (above)."""
    config = parse_config(text + "tenants: [{name: t, models: [from-the-db]}]", env)
    assert config.tenants is not None and config.tenants[0].models == ["from-the-db"]
    assert tenant_models_outside_the_config(config) == [("tenants[0].models[0]", "from-the-db")]


def test_a_config_tenant_is_served_a_route_created_in_the_admin_db(
    fake_openai: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway starts, warns that no route `from-the-db` is there yet (the tenant's requests for it
    answer 404 meanwhile), and once an admin creates it the tenant's requests for it are answered."""
    import openai
    from structlog.testing import capture_logs

    config = GATEWAY_CONFIG + (
        'tenants:\n  - {name: acme, api_keys: ["${ACME_KEY}"], models: [gpt-4o-mini, from-the-db]}\n'
    )
    hi: Any = [{"role": "user", "content": "hello"}]
    with (
        capture_logs() as logs,
        sqlite_weir(config, fake_openai, tmp_path, monkeypatch, {"ACME_KEY": "acme-key"}) as weir,
    ):
        warned = [(line["at"], line["model"]) for line in logs if line["event"] == "tenant_model_not_served"]
        assert warned == [("tenants[0].models[1]", "from-the-db")]
        client = weir.client("acme-key")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="from-the-db", messages=hi)
        route = {"candidates": [{"model": "gpt-4o-mini"}]}
        created = weir.admin.post("/routes", json={"name": "from-the-db", **route})
        assert created.status_code == 201, created.text

        def answered() -> bool:
            try:
                reply = client.chat.completions.create(model="from-the-db", messages=hi)
            except openai.NotFoundError:
                return False
            return reply.choices[0].message.content == "hello"

        wait_for(answered)
        # A route the tenant was not given stays refused: the list still holds.
        assert weir.admin.post("/routes", json={"name": "other", **route}).status_code == 201
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=hi)


def test_weir_config_check_notes_a_tenants_model_left_to_the_admin_db(tmp_path: Path) -> None:
    path = tmp_path / "weir.yaml"
    path.write_text(
        CHECKED.replace(
            'api_keys: ["${WEIR_DEMO_KEY}"]}', 'api_keys: ["${WEIR_DEMO_KEY}"], models: [auto, from-the-db]}'
        )
        + "database_url: sqlite:///x.db\n"
    )
    result = config_check(
        path, {"OPENAI_API_KEY": "sk-o", "WEIR_DEMO_KEY": "demo", "WEIR_DATABASE_URL": None}
    )
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"{path}: note: tenants[0].models[1]: 'from-the-db' is no model or route of the config: it must be a "
        "route of the admin DB (/admin/api/v1/routes); the gateway warns at start if it is not",
        f"{path}: OK: 1 backend, 2 models, 1 route, 1 tenant",
    ]


def test_weir_config_check_summarises_a_valid_config(tmp_path: Path) -> None:
    path = tmp_path / "weir.yaml"
    path.write_text(CHECKED)
    result = config_check(path, {"OPENAI_API_KEY": "sk-o", "WEIR_DEMO_KEY": "demo"})
    assert result.exit_code == 0, result.output
    assert result.output == f"{path}: OK: 1 backend, 2 models, 1 route, 1 tenant\n"
    path.write_text("")
    assert (
        config_check(path, {}).output
        == f"{path}: OK: 0 backends, 0 models, 0 routes, no tenants (no authentication)\n"
    )


@pytest.mark.parametrize(
    ("edit", "env", "message"),
    [
        # A misspelt key: the loader names the one meant.
        (
            ("max_output_tokens", "max_ouput_tokens"),
            {},
            "models[0]: Object contains unknown field `max_ouput_tokens` (did you mean `max_output_tokens`?)",
        ),
        # A `${VAR}` left unset is an error, as at `weir serve`.
        (
            (),
            {"WEIR_DEMO_KEY": None},
            "tenants[0].api_keys[0]: environment variable WEIR_DEMO_KEY is not set",
        ),
        # Routes are validated too: a fallback to a model the config does not have.
        (("fallbacks: [gpt-4o]", "fallbacks: [gpt-4o-maxi]"), {}, "gpt-4o-maxi"),
        # A tenant's (so its keys') models naming nothing the config serves: a key that could never work.
        (
            ('api_keys: ["${WEIR_DEMO_KEY}"]}', 'api_keys: ["${WEIR_DEMO_KEY}"], models: [auto, gtp-4o]}'),
            {},
            "tenants[0].models[1]: no model named 'gtp-4o'",
        ),
    ],
)
def test_weir_config_check_fails_with_the_loaders_error(
    tmp_path: Path, edit: tuple[str, ...], env: dict[str, str | None], message: str
) -> None:
    text = CHECKED.replace(
        "{name: gpt-4o-mini, backend: openai}", "{name: gpt-4o-mini, backend: openai, max_output_tokens: 100}"
    )
    path = tmp_path / "weir.yaml"
    path.write_text(text.replace(*edit) if edit else text)
    # No admin DB from the environment: with one, a tenant's unknown model name loads (a DB-only route).
    result = config_check(
        path, {"OPENAI_API_KEY": "sk-o", "WEIR_DEMO_KEY": "demo", "WEIR_DATABASE_URL": None, **env}
    )
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: {path}: ") and message in result.output, result.output
    assert result.output.count("\n") == 1, result.output  # one line, no traceback


def test_weir_config_check_of_a_missing_file(tmp_path: Path) -> None:
    result = config_check(tmp_path / "nowhere.yaml", {})
    assert result.exit_code == 1
    assert f"{tmp_path / 'nowhere.yaml'}: cannot read the file: No such file or directory" in result.output


@pytest.mark.parametrize("raw", [b"\xff\xfeserver: {port: 8080}\n", b"# caf\xe9 (Latin-1)\nmodels: []\n"])
def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path, raw: bytes) -> None:
    """A file saved in another encoding (UTF-16 from an editor, a Latin-1 comment) was a
    UnicodeDecodeError traceback from `weir config check` and `weir serve`, not a config error."""
    path = tmp_path / "weir.yaml"
    path.write_bytes(raw)
    result = config_check(path, {})
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # reported, not raised
    assert result.output.startswith(f"Error: {path}: the file is not UTF-8"), result.output
    assert result.output.count("\n") == 1, result.output
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"WEIR_MASTER_KEY": "not-a-key"}, "WEIR_MASTER_KEY key 1 is not a master key"),
        (
            {"WEIR_MASTER_KEY": f"{generate_key()},{generate_key()[:20]}"},
            "WEIR_MASTER_KEY key 2 is not a master key",
        ),
        (
            {"WEIR_MASTER_KEY": None, "WEIR_MASTER_KEY_PREVIOUS": generate_key()},
            "WEIR_MASTER_KEY_PREVIOUS is set but WEIR_MASTER_KEY is not",
        ),
    ],
)
def test_weir_config_check_refuses_the_master_key_weir_serve_refuses(
    tmp_path: Path, keys: dict[str, str | None], message: str
) -> None:
    """The gateway will not start with a malformed WEIR_MASTER_KEY; a check that passed it anyway
    let an init container go green in front of a gateway that then crash-looped."""
    path = tmp_path / "weir.yaml"
    path.write_text(CHECKED)
    env = {"OPENAI_API_KEY": "sk-o", "WEIR_DEMO_KEY": "demo", "WEIR_MASTER_KEY_PREVIOUS": None, **keys}
    checked = config_check(path, env)
    assert checked.exit_code == 1 and checked.output.startswith("Error: ") and message in checked.output
    assert checked.output.count("\n") == 1, checked.output  # one line, no traceback
    served = CliRunner().invoke(main, ["serve", "--config", str(path)], env=env)
    assert (served.exit_code, served.output) == (1, checked.output)


@pytest.mark.parametrize(
    "keys",
    [
        {"WEIR_MASTER_KEY": None},  # the gateway starts without one (vendor keys refused, prompts in clear)
        {"WEIR_MASTER_KEY": f" {generate_key()} , {generate_key()} "},  # rotating: new,old
        {"WEIR_MASTER_KEY": generate_key(), "WEIR_MASTER_KEY_PREVIOUS": generate_key()},
    ],
)
def test_weir_config_check_takes_the_master_keys_weir_serve_takes(
    tmp_path: Path, keys: dict[str, str | None]
) -> None:
    path = tmp_path / "weir.yaml"
    path.write_text(CHECKED)
    env = {"OPENAI_API_KEY": "sk-o", "WEIR_DEMO_KEY": "demo", "WEIR_MASTER_KEY_PREVIOUS": None, **keys}
    result = config_check(path, env)
    assert result.output == f"{path}: OK: 1 backend, 2 models, 1 route, 1 tenant\n" and result.exit_code == 0


def test_a_tenant_name_the_ledger_cannot_hold_is_refused_at_start() -> None:
    """A config tenant is its name in the ledger (`usage_events.tenant_id`, 200 characters, as an
    admin-DB tenant's name): a longer one is a config error at start, not a usage batch that
    PostgreSQL refuses, retried for ever, with every later event behind it."""
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.name"):
        parse_config(f"tenants: [{{name: {'t' * 201}}}]", {})
    assert parse_config(f"tenants: [{{name: {'t' * 200}}}]", {}).tenants[0].name == "t" * 200
