"""The gateway's YAML configuration: `${VAR}` / `${VAR:-default}` interpolation, then msgspec validation.

Interpolation runs on the parsed YAML values (never on the raw text), so a value taken from the
environment can never change the file's structure, and every error names the key path it came from.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect
import yaml

from gateway.accounting.money import usd_per_mtok_to_micro
from gateway.accounting.pricing import TierName
from gateway.secret_files import SecretFileError, secret_from_env
from routing.routes import NAME_RULE, Route, fit_name

BackendType = Literal["openai", "anthropic", "gemini", "engine"]
# The API an OpenAI backend's models are asked on: chat completions, or the Responses API, which some
# of OpenAI's models are served on alone (o1-pro, o3-pro, codex-mini-latest, gpt-5-codex, ...).
UpstreamApi = Literal["chat", "responses"]

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


# A wait in seconds: above 0 and at most a day. 0 or less turned aiohttp's connect timeout off and
# ended every other wait at once (as NaN ended every one); infinity was an OverflowError in every
# request through aiohttp's connect timeout. A day is far past any wait a request or client is given.
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86_400)]
# A TCP port; 0 asks the system for a free one.
Port = Annotated[int, msgspec.Meta(ge=0, le=65_535)]
# As the admin API's tenant limits (gateway.admin.schemas.Positive): a 32-bit count.
PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]


class TierPrice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The rates (USD per 1M tokens) of one service tier (`Price.tiers`): an attempt its vendor says
    it served at that tier is billed at them; a class left out keeps the model's base price."""

    input: Decimal | None = None
    cached_input: Decimal | None = None
    cache_write_5m: Decimal | None = None
    cache_write_1h: Decimal | None = None
    output: Decimal | None = None

    def __post_init__(self) -> None:
        # Checked here, not first when the gateway prices an attempt (refused there: no cost).
        for token_class in ("input", "cached_input", "cache_write_5m", "cache_write_1h", "output"):
            value = getattr(self, token_class)
            if value is not None:
                try:
                    usd_per_mtok_to_micro(value)
                except ValueError as exc:
                    raise ValueError(f"{token_class}: {exc}") from None


class LongContextPrice(TierPrice, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The rates (USD per 1M tokens) that bill a WHOLE request whose prompt (input, cache reads and
    cache writes together) is above `above_prompt_tokens`, as Anthropic's 1M-context Sonnet and
    Gemini 2.5 Pro bill one; a class left out keeps the model's base price."""

    above_prompt_tokens: PositiveInt


class Price(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """USD per 1M tokens, by token class (see gateway.usage.Usage)."""

    input: Decimal = Decimal(0)
    cached_input: Decimal | None = None  # None: cache reads cost the full input price
    cache_write_5m: Decimal | None = None
    cache_write_1h: Decimal | None = None
    output: Decimal = Decimal(0)
    # USD per 1,000 web searches (Anthropic's web search tool: 10), as vendors quote it; None: searches
    # cost nothing. Every service tier and long prompt pays this one price.
    web_search_per_1k: Decimal | None = None
    long_context: LongContextPrice | None = None  # higher rates above a prompt size
    # Rates by the service tier the vendor reports serving an attempt at (OpenAI's flex at about half
    # price, priority above it); a tier not listed, or none reported, is billed at the base price.
    tiers: dict[TierName, TierPrice] = {}

    def __post_init__(self) -> None:
        for name, tier in self.tiers.items():
            if tier == TierPrice():
                raise ValueError(f"tiers.{name}: sets no price")
        if self.web_search is not None:
            try:
                usd_per_mtok_to_micro(self.web_search)
            except ValueError:
                raise ValueError(
                    "web_search_per_1k: USD per 1,000 searches must be a number from 0 to 1000 with at "
                    f"most 9 decimals, got {self.web_search_per_1k}"
                ) from None

    @property
    def web_search(self) -> Decimal | None:
        """The `web_search` class's price as the catalog holds every class: USD per 1M searches."""
        return None if self.web_search_per_1k is None else self.web_search_per_1k * 1000


class Timeouts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    connect: Seconds = 10.0  # seconds to open a connection to the backend
    first_byte: Seconds = 600.0  # seconds until the response headers (a whole reply, when not streaming)
    read: Seconds = 300.0  # seconds of silence allowed between two chunks of a stream


class Backend(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    type: BackendType
    base_url: str | None = None  # engine: the running engine's URL (alias `url`)
    url: str | None = None
    api_key: str | None = None
    headers: dict[str, str] = {}  # extra headers on every upstream request (e.g. Azure's `api-key`)
    query: dict[str, str] = {}  # extra query parameters (e.g. Azure's `api-version`)
    timeouts: Timeouts = Timeouts()
    anthropic_version: str = "2023-06-01"
    # OpenAI-compatible: send earlier assistant turns' reasoning_content back (DeepSeek refuses a
    # thinking-mode tool loop without it; Kimi's and vLLM's chat templates read it). None: only to
    # DeepSeek's and Moonshot's APIs, since OpenAI, Azure, Cerebras and Mistral refuse unknown fields.
    send_reasoning: bool | None = None
    # OpenAI-compatible: the body field that carries the output limit. None: `max_completion_tokens` to
    # OpenAI's and Azure OpenAI's APIs and to reasoning-model ids (o1, o3, o4-mini, gpt-5...: they
    # refuse `max_tokens`), `max_tokens` to DeepSeek's and Mistral's APIs (they know no other), else the
    # name the client used. Set it for a server that refuses one name (an older vLLM refuses
    # `max_completion_tokens`; an Azure deployment of o3 may be named anything).
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] | None = None
    # How this backend is asked to go on writing an unfinished answer (a resumed stream, a prefill):
    # `prefill` (a trailing assistant message, which Claude up to 4.5 continues), `continue_final_message`
    # (vLLM's and the engine's flag) or `instruction` (the partial answer, then a user turn asking to
    # continue it). None: the engine's flag for `type: engine`, a prefill for Claude models that take
    # one, else the instruction (OpenAI, Gemini, Claude 4.6 on: a prefill there is refused or answered
    # afresh). Set `continue_final_message` for a vLLM or SGLang server.
    continuation: Literal["prefill", "continue_final_message", "instruction"] | None = None
    # `type: openai` only: the API its models are asked on, unless a model says otherwise (`chat`).
    api: UpstreamApi = "chat"
    # type: engine without url: Weir starts and supervises `weir engine serve --model M --port P`.
    model: str | None = None
    port: Annotated[int, msgspec.Meta(ge=1, le=65_535)] | None = None  # 0 read as unset: 8000
    args: list[str] = []  # more `weir engine serve` flags, e.g. ["--max-queued", "16", "--threads", "8"]
    command: list[str] | None = None  # overrides the engine command line (tests, custom builds)
    startup_timeout: Seconds = 600.0


class Model(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str  # the public name clients send as `model`
    backend: str
    model: str | None = None  # upstream model id; defaults to `name`
    price: Price = Price()
    # The most output tokens the model writes in one answer (None: unknown): every candidate of it
    # without its own (`routes[].candidates[].max_output_tokens`), a request for it by name and a
    # route's fallback to it send at most this (`routing.plan.Choice.max_output_tokens`).
    max_output_tokens: PositiveInt | None = None
    api: UpstreamApi | None = None  # `type: openai` backends only; None: the backend's `api`

    @property
    def upstream_model(self) -> str:
        return self.model or self.name


class Tenant(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Its id in the ledger (usage_events.tenant_id): at most as long as an admin-DB tenant's name.
    name: Annotated[str, msgspec.Meta(max_length=200)]
    api_keys: list[str] = []
    models: list[str] | None = None  # public model names this tenant may use; None: all
    max_messages: PositiveInt | None = None  # None: `limits.max_messages`
    max_concurrent_streams: PositiveInt | None = None  # None: `limits.max_concurrent_streams`
    max_output_tokens: PositiveInt | None = None  # None: `limits.max_output_tokens`


class Limits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Request limits for every tenant that sets none of its own (None: no limit); see gateway.limits."""

    max_messages: PositiveInt | None = None  # messages in one chat request (more: 400)
    max_concurrent_streams: PositiveInt | None = None  # open streams per tenant and replica (more: 429)
    # output tokens one request may ask for (more: 400; none asked: this many are asked for the client)
    max_output_tokens: PositiveInt | None = None


# `server.drain_timeout`'s default. The deployments' grace periods must exceed it (with
# gateway.cli.STREAMS_END_S), or the container is killed mid-drain (tests/deploy pins both).
DRAIN_TIMEOUT_S = 30.0


class Server(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    host: str = "127.0.0.1"
    port: Port = 8080
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 20 * 1024 * 1024  # larger request bodies get 413
    # Slow clients (`weir serve` with uvicorn): seconds to send the request headers, then the body;
    # a client that takes longer gets 408 and its connection is closed (gateway/slow_clients.py).
    header_timeout: Seconds = 10.0
    body_timeout: Seconds = 60.0
    # The request line and headers together (`weir serve` with uvicorn); larger: 431, closed.
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 1024
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Seconds a stopping `weir serve` (SIGTERM, SIGINT) gives in-flight requests and streams; a stream
    # still running then ends with its API's error event (`server_shutting_down`, gateway.drain).
    drain_timeout: Seconds = DRAIN_TIMEOUT_S
    # Wrong API keys one client address may present a minute, per replica, before it gets 429 (its
    # keys already known valid still work), and wrong admin tokens on the admin API (429 even with
    # the right one, or the throttle would not slow guessing). 0: no throttle. See gateway/throttle.py.
    auth_failures_per_minute: Annotated[int, msgspec.Meta(ge=0)] = 30
    admin_auth_failures_per_minute: Annotated[int, msgspec.Meta(ge=0)] = 10
    # Peers whose `X-Forwarded-For` names the client (the address those throttles and the request logs
    # count): addresses or CIDRs, or "*" for any. None: FORWARDED_ALLOW_IPS, else 127.0.0.1 and ::1.
    forwarded_allow_ips: list[str] | Literal["*"] | None = None


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    backends: list[Backend] = []
    models: list[Model] = []
    tenants: list[Tenant] | None = None  # None: no authentication (local development only)
    routes: list[Route] = []  # public names -> policy and candidates; see docs/routing-policies.md
    # The classifier difficulty routes use: "encoder" (head v4, better on MMLU; p99 3.4-5.4 ms a prompt
    # on a Zen 5 with AVX-512 VNNI, 19-26 ms on an AVX2-only Zen 3), "static" (head v3; p99 about 3 ms on
    # that Zen 3) or "auto" (the encoder if it fits 5 ms p99 here, timed at start). See docs/routing.md.
    difficulty_head: Literal["auto", "encoder", "static"] = "auto"
    server: Server = Server()
    limits: Limits = Limits()
    # The control plane (admin DB, keys, limits, budgets, usage ledger) is on when a database is set;
    # WEIR_DATABASE_URL and WEIR_REDIS_URL win over these. See docs/accounting.md.
    database_url: str | None = None
    redis_url: str | None = None
    # How many gateway replicas share `redis_url`: while Redis is away each admits 1/replicas of every
    # rate limit. Only until this replica has counted the live ones in Redis (every 10 s), which then
    # wins: for a replica that starts during an outage. None: 1. See docs/reliability.md.
    replicas: Annotated[int, msgspec.Meta(ge=1)] | None = None
    auto_migrate: bool = True  # upgrade the admin DB schema at start

    def backend(self, name: str) -> Backend:
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise KeyError(name)


def interpolate(value: Any, env: Mapping[str, str], path: str = "$") -> Any:
    """Replace `${VAR}` and `${VAR:-default}` in every string of a parsed YAML tree. `VAR` unset,
    `VAR_FILE` names a file that holds the value (gateway.secret_files)."""
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            try:
                found = secret_from_env(name, env)
            except SecretFileError as exc:
                raise ConfigError(f"{_show(path)}: {exc}") from None
            if found is not None and (found != "" or default is None):
                return found
            if default is not None:
                return default
            raise ConfigError(
                f"{_show(path)}: environment variable {name} is not set "
                f"(write ${{{name}:-}} to allow it to be empty, or set {name}_FILE to a file that holds it)"
            )

        return _VAR.sub(substitute, value)
    if isinstance(value, list):
        return [interpolate(item, env, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        return {key: interpolate(item, env, f"{path}.{key}") for key, item in value.items()}
    return value


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line (its text spans several, with the offending line and a caret):
    where (line and column, counted from 1), what it found, and what it was parsing."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem is None:
        return " ".join(str(exc).split())
    mark = exc.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{exc.problem}" + (f" ({exc.context})" if exc.context else "")


def parse_config(text: str, env: Mapping[str, str] | None = None) -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {yaml_problem(exc)}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError("the configuration must be a mapping at the top level")
    env = os.environ if env is None else env
    raw = interpolate(raw, env)
    try:
        config = msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    # WEIR_DATABASE_URL wins over `database_url` (gateway.admin.control_plane.configured_database_url).
    _check_references(config, admin_db=bool(env.get("WEIR_DATABASE_URL") or config.database_url))
    return config


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        # No path here: like every ConfigError, the caller says which file (`weir serve` prefixes it).
        raise ConfigError(f"cannot read the file: {exc.strerror}") from None
    try:
        # UTF-8 whatever the locale says (YAML's own encoding); another one (UTF-16 from an editor, a
        # Latin-1 comment) was a UnicodeDecodeError traceback from `weir serve` and `weir config check`.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the file is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    return parse_config(text, env)


def tenant_models_outside_the_config(config: Config) -> list[tuple[str, str]]:
    """(where, name) of each name in a tenant's `models` that is no model or route of the config. With
    an admin DB it may be a route created there (/admin/api/v1/routes), which only the DB can say: the
    gateway warns at start of any that is not (`Gateway.start`); without one it is refused."""
    known = {m.name for m in config.models} | {r.name for r in config.routes}
    return [
        (f"tenants[{i}].models[{j}]", name)
        for i, tenant in enumerate(config.tenants or [])
        for j, name in enumerate(tenant.models or [])
        if name not in known
    ]


def _check_references(config: Config, admin_db: bool = False) -> None:
    _check_forwarded_allow_ips(config.server.forwarded_allow_ips)
    backends: set[str] = set()
    for i, backend in enumerate(config.backends):
        where = f"backends[{i}]"
        if backend.name in backends:
            raise ConfigError(f"{where}.name: duplicate backend name {backend.name!r}")
        backends.add(backend.name)
        if backend.args and (
            backend.type != "engine" or backend.url or backend.base_url or backend.command is not None
        ):
            # They go only on the `weir engine serve` command line Weir starts itself: anywhere else
            # they reached nothing (an engine's `--max-queued` silently limited no queue).
            raise ConfigError(
                f"{where}.args: only for an engine Weir starts (`type: engine` with `model`, without "
                "`url` or `command`); put the flags on the engine's own command line"
            )
        if backend.continuation == "continue_final_message" and backend.type in ("anthropic", "gemini"):
            raise ConfigError(
                f"{where}.continuation: continue_final_message is a flag of OpenAI-compatible servers "
                f"(vLLM, SGLang, the engine); a {backend.type} backend takes `prefill` or `instruction`"
            )
        if backend.api != "chat" and backend.type != "openai":
            raise ConfigError(f"{where}.api: only `type: openai` backends serve the Responses API")
        if backend.type == "engine":
            if not (backend.url or backend.base_url or backend.model):
                raise ConfigError(f"{where}: an engine backend needs `url` or `model`")
        elif not backend.base_url:
            raise ConfigError(f"{where}.base_url: required for a {backend.type} backend")
    names: set[str] = set()
    for i, model in enumerate(config.models):
        if not fit_name(model.name):
            raise ConfigError(f"models[{i}].name: {NAME_RULE}")
        if model.name in names:
            raise ConfigError(f"models[{i}].name: duplicate model name {model.name!r}")
        names.add(model.name)
        if model.backend not in backends:
            raise ConfigError(f"models[{i}].backend: no backend named {model.backend!r}")
        if model.api is not None and config.backend(model.backend).type != "openai":
            raise ConfigError(f"models[{i}].api: only models of `type: openai` backends take `api`")
    _check_one_price_per_upstream_model(config.models)
    if config.routes:
        from routing.router import RouteError, validate  # the routing engine imports this module

        try:
            validate(config.routes, names)
        except RouteError as exc:
            raise ConfigError(str(exc)) from None
    keys: set[str] = set()
    for i, tenant in enumerate(config.tenants or []):
        for j, key in enumerate(tenant.api_keys):
            if not key:
                raise ConfigError(f"tenants[{i}].api_keys[{j}]: empty API key")
            if key in keys:
                raise ConfigError(f"tenants[{i}].api_keys[{j}]: the same key is given to two tenants")
            keys.add(key)
    outside = tenant_models_outside_the_config(config)
    if outside and not admin_db:
        where, name = outside[0]
        raise ConfigError(
            f"{where}: no model named {name!r}: no model or route of the config, and without an admin "
            "DB (database_url) there is no other route it could be"
        )


def _check_forwarded_allow_ips(allowed: list[str] | str | None) -> None:
    # uvicorn and granian take an entry that is no address as a literal host name the peer never
    # has: a typo would silently trust no one. So, too, a CIDR with host bits set (10.0.0.1/8): both
    # parse networks strictly, and take one that fails as such a literal.
    for i, entry in enumerate(allowed if isinstance(allowed, list) else []):
        where = f"server.forwarded_allow_ips[{i}]: {entry!r}"
        try:
            ipaddress.ip_network(entry)
        except ValueError:
            try:
                network = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ConfigError(
                    f'{where} is not an IP address or CIDR (write "*" instead of the list to trust any peer)'
                ) from None
            raise ConfigError(f"{where} has host bits set; write the network, {network}") from None


def _check_one_price_per_upstream_model(models: list[Model]) -> None:
    """Two public names for one upstream model on one backend (another max_output_tokens, another
    tenant group) must price it alike: the vendor bills the upstream model, and the admin DB's price
    catalog and ledger price an attempt by (backend, upstream model), so only one price could apply
    (seeding both at start failed on the catalog's unique key and the gateway did not start)."""
    first: dict[tuple[str, str], tuple[int, Model]] = {}
    for i, model in enumerate(models):
        key = (model.backend, model.upstream_model)
        if key not in first:
            first[key] = (i, model)
            continue
        j, other = first[key]
        if model.price != other.price:
            raise ConfigError(
                f"models[{i}].price: {model.name!r} and models[{j}] {other.name!r} both serve "
                f"{model.upstream_model!r} on backend {model.backend!r} at different prices; a price "
                "is the upstream model's (the ledger bills by backend and upstream model): give both "
                "the same price (a YAML anchor, &price and *price, shares one)"
            )


def _show(path: str) -> str:
    return path.removeprefix("$.").removeprefix("$")


def _describe(exc: msgspec.ValidationError) -> str:
    # msgspec says "Expected `int`, got `str` - at `$.server.port`"; lead with the key path instead
    # (a top-level problem comes without one).
    message = str(exc)
    # A mapping's key (a price tier's name): "... - at `key` in `$.models[0].price.tiers`".
    match = re.search(r" - at (`key` in )?`(.*)`$", message)
    path, problem = (match.group(2), message[: match.start()]) if match else ("$", message)
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", problem)
    if unknown:
        # A misspelt key (`max_ouput_tokens`): name the one meant, from the keys taken there.
        close = difflib.get_close_matches(unknown.group(1), _keys_at(path), n=1)
        problem += f" (did you mean `{close[0]}`?)" if close else ""
    if not match:
        return problem
    key = " (a key)" if match.group(1) else ""
    return f"{_show(path)}{key}: {problem}"


def _keys_at(path: str) -> list[str]:
    """The keys the config takes at a msgspec error path such as `$.routes[0].candidates[1]`."""
    node: Any = msgspec.inspect.type_info(Config)
    for name in re.findall(r"\.(\w+)|\[\d+\]", path):
        node = _unwrapped(node)
        if name:
            fields = node.fields if isinstance(node, msgspec.inspect.StructType) else ()
            node = next((f.type for f in fields if f.name == name), None)
        else:
            node = node.item_type if isinstance(node, msgspec.inspect.ListType) else None
    node = _unwrapped(node)
    return [f.name for f in node.fields] if isinstance(node, msgspec.inspect.StructType) else []


def _unwrapped(node: Any) -> Any:
    """`X | None` -> X, where X is the one struct or list the union allows."""
    if isinstance(node, msgspec.inspect.UnionType):
        kinds = (msgspec.inspect.StructType, msgspec.inspect.ListType)
        inner = [t for t in node.types if isinstance(t, kinds)]
        return inner[0] if len(inner) == 1 else None
    return node
