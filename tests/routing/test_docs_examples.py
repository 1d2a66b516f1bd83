"""The routing docs' own examples, read from the markdown and run: docs/routing-policies.md,
docs/routing.md and README.md's routing section. Each `routes:` snippet must load, the defaults its
comments state must be the code's, the `x-weir-route` example must be what a request through the
snippet's route answers, the admin API and feedback examples must do what the text says, and every
`weir router` command line in them must name options the command has. A docs edit that stops being
true, or a code change that makes one untrue, fails here rather than in a user's hands."""

from __future__ import annotations

import json
import re
import shlex
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import httpx
import msgspec
import openai
import pytest
import yaml
from click.testing import CliRunner

from gateway.app import create_app
from gateway.config import Config, parse_config
from gateway.estimate import CHAT_TOKENS, MESSAGE_TOKENS
from gateway.usage_sink import ListSink
from routing.cli import router as router_cli
from routing.routes import Breaker, Candidate, Compare, Conditions, Hedge, PolicyName, Retry, Route
from tests.fakes import FakeAnthropic, FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

ROOT = Path(__file__).resolve().parents[2]
POLICIES, CLASSIFIER, README = "docs/routing-policies.md", "docs/routing.md", "README.md"
ACME, OTHER, ADMIN = "sk-weir-acme-0123456789", "sk-weir-other-0123456789", "admin-token-docs-examples"


def doc(name: str) -> str:
    return (ROOT / name).read_text()


def code_blocks(name: str, *langs: str) -> list[str]:
    """The bodies of the fenced code blocks of `name` in one of `langs` ("" for an unlabelled one)."""
    found = re.findall(r"^```(\w*)\n(.*?)^```", doc(name), re.M | re.S)
    return [body for lang, body in found if lang in langs]


def route_snippets() -> list[tuple[str, list[dict[str, Any]]]]:
    """(doc, routes) for every YAML block of the routing docs that has routes: a `routes:` section, a
    config with one (only its routes are taken), or a bare list of routes."""
    snippets = []
    for name in (POLICIES, CLASSIFIER):
        for body in code_blocks(name, "yaml"):
            parsed = yaml.safe_load(body)
            routes = parsed.get("routes") if isinstance(parsed, dict) else parsed
            if routes:
                snippets.append((name, routes))
    return snippets


def _models(routes: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for route in routes:
        names += [c["model"] for c in route["candidates"]] + route.get("fallbacks", [])
        if route.get("compare"):
            names.append(route["compare"]["judge"])
    return list(dict.fromkeys(names))


# The docs' public names, served by the fakes' upstream models; any other by the OpenAI fake as named.
UPSTREAM = {
    "claude-sonnet": ("anthropic", "claude-sonnet-4-5"),
    "claude-haiku": ("anthropic", "claude-haiku-4-5"),
    "gemini-flash": ("gemini", "gemini-2.5-flash"),
}


def config_text(routes: list[dict[str, Any]], database_url: str | None = None) -> str:
    """A config serving every model the routes name from the fake vendor of its family, two tenants
    (acme, other) and the routes as written in the docs."""
    models = "".join(
        f"  - {{name: {m}, backend: {backend}, model: {upstream}, price: {{input: 1.0, output: 2.0}}}}\n"
        for m in _models(routes)
        for backend, upstream in [UPSTREAM.get(m, ("openai", m))]
    )
    return (
        "backends:\n"
        '  - {name: openai, type: openai, base_url: "${OPENAI_BASE_URL}", api_key: "${OPENAI_API_KEY}"}\n'
        '  - {name: anthropic, type: anthropic, base_url: "${ANTHROPIC_BASE_URL}", '
        'api_key: "${ANTHROPIC_API_KEY}"}\n'
        '  - {name: gemini, type: gemini, base_url: "${GEMINI_BASE_URL}", api_key: "${GEMINI_API_KEY}"}\n'
        f"models:\n{models}"
        "tenants:\n"
        f"  - {{name: acme, api_keys: [{ACME}]}}\n"
        f"  - {{name: other, api_keys: [{OTHER}]}}\n"
        + (f'database_url: "{database_url}"\n' if database_url else "")
        + yaml.safe_dump({"routes": routes})
    )


@contextmanager
def gateway(config: Config, p_strong: float | None = None) -> Iterator[tuple[str, Any]]:
    """The gateway on `config`; with `p_strong`, difficulty routes score every prompt so (as the
    shipped encoder head would say it did), instead of loading the classifier."""
    app = create_app(config, usage_sink=ListSink())
    runtime = app.state.gateway
    if p_strong is not None:
        runtime.router.context.scorer = lambda prompt: p_strong
        runtime.router.context.serving = "encoder"
    with serve(app, free_port()) as url:
        yield url, runtime


def route_header(value: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in value.split("; "))


def chat(url: str, key: str, model: str, **extra: Any) -> Any:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)
    messages: Any = [{"role": "user", "content": "hi"}]
    return client.chat.completions.with_raw_response.create(model=model, messages=messages, **extra)


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def listed(url: str, key: str) -> set[str]:
    """The model names /v1/models offers this key."""
    return {m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth(key)).json()["data"]}


# --- the `routes:` snippets load, and their comments say what the code does ----------------------------


def test_every_routes_snippet_in_the_docs_loads() -> None:
    snippets = route_snippets()
    assert len(snippets) >= 3
    env = {
        f"{vendor}_{key}": "http://127.0.0.1:9/x"
        for vendor in ("OPENAI", "ANTHROPIC", "GEMINI")
        for key in ("BASE_URL", "API_KEY")
    }
    for name, routes in snippets:
        config = parse_config(config_text(routes), env)  # validated as any config's routes are
        assert [r.name for r in config.routes] == [r["name"] for r in routes], name


def test_the_snippets_comments_state_the_code_defaults() -> None:
    first = code_blocks(POLICIES, "yaml")[0]
    # `policy: difficulty   # fixed | weighted | ...`: every policy there is, and no other.
    policies = re.search(r"policy: \w+ +# (.*)", first)
    assert policies is not None
    assert policies.group(1).split(" | ") == list(typing.get_args(PolicyName))
    # `failover_on: [429, 5xx]   # the default`
    default = re.search(r"failover_on: (.*?) +# the default", first)
    assert default is not None
    assert yaml.safe_load(default.group(1)) == Route(name="x", candidates=[]).failover_on
    # The `compare:` block of docs/routing.md: `(default X)` and `# the default` beside each key.
    compare = next(b for b in code_blocks(CLASSIFIER, "yaml") if "compare:" in b)
    stated = dict(re.findall(r"^ +(\w+): .*\(default ([\d.]+)\)", compare, re.M))
    stated.update({k: v for k, v in re.findall(r"^ +(\w+): (\w+) +# the default", compare, re.M)})
    assert set(stated) == {"share", "max_spend_usd_per_hour", "max_in_flight", "both_orders"}
    defaults = Compare(judge="x")
    for key, value in stated.items():
        assert yaml.safe_load(value) == getattr(defaults, key), key


def test_every_route_setting_is_named_in_the_routing_docs() -> None:
    """Each key a route, a candidate and their nested settings take (routing/routes.py) appears in
    docs/routing-policies.md or docs/routing.md, as `key`, `parent.key` or `key:` in an example: a
    setting added to the schema without a word in the docs fails here."""
    text = doc(POLICIES) + doc(CLASSIFIER)
    structs = (Route, Candidate, Conditions, Retry, Hedge, Breaker, Compare)
    missing = [
        f"{struct.__name__}.{field.name}"
        for struct in structs
        for field in msgspec.structs.fields(struct)
        if not re.search(rf"`(?:\w+\.)?{field.name}`|[\s{{]{field.name}: ", text)
    ]
    assert not missing, f"route settings the routing docs never name: {missing}"


# --- the first snippet, served: the `x-weir-route` example ---------------------------------------------


@pytest.fixture
def doc_gateway(fresh_fakes: None, vendor_env: dict[str, str]) -> Iterator[tuple[str, Any]]:
    routes = route_snippets()[0][1]
    # Plus a lowest_latency route over two vendors, which the docs describe but give no snippet for.
    fast = {
        "name": "fast",
        "policy": "lowest_latency",
        "candidates": [{"model": "gpt-4o-mini"}, {"model": "claude-haiku"}],
    }
    config = parse_config(config_text([*routes, fast]), vendor_env)
    with gateway(config, p_strong=0.83) as running:
        yield running


def test_the_x_weir_route_example_is_what_the_example_route_answers(
    doc_gateway: tuple[str, Any], fake_anthropic: FakeAnthropic
) -> None:
    """The doc's header: the `auto` route of its first snippet (`strong_share: 0.3`), a hard prompt
    (p_strong 0.83) after nine others, the strong candidate overloaded once (Anthropic's 529) and
    answering on the retry."""
    example = re.search(r"^ +x-weir-route: (.*)$", doc(POLICIES), re.M)
    assert example is not None
    documented = route_header(example.group(1))
    url, runtime = doc_gateway
    # With the example's, the window holds ten scores; its top 30% are the three above 0.61.
    earlier = {f"q{i}": p for i, p in enumerate([0.1, 0.2, 0.3, 0.4, 0.5, 0.55, 0.61, 0.7, 0.9])}
    runtime.router.context.scorer = lambda prompt: earlier.get(prompt, 0.83)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=ACME, max_retries=0, timeout=20)
    for prompt in earlier:
        client.chat.completions.create(model="auto", messages=[{"role": "user", "content": prompt}])
    fake_anthropic.fail_next(529)
    raw = chat(url, ACME, "auto")
    assert raw.parse().choices[0].message.content
    answered = route_header(raw.headers["x-weir-route"])
    assert list(answered) == list(documented)  # the same keys, in the same order
    assert answered == documented


def test_the_cheap_route_example_by_tenant_and_tools(doc_gateway: tuple[str, Any]) -> None:
    """`when: {tenants: [acme], tools: false}`: acme's requests without tools take it (the cheapest
    candidate that fits, its expected USD as the score); other tenants do not see it; a request with
    tools meets none of the routes of that name and is told so, not that the model does not exist."""
    url = doc_gateway[0]
    raw = chat(url, ACME, "cheap")
    header = route_header(raw.headers["x-weir-route"])
    assert (header["policy"], header["candidate"], header["reason"]) == (
        "cheapest",
        "gpt-4o-mini",
        "cheapest_fit",
    )
    # "hi" as sent, [[{"role":"user","content":"hi"}],[]], is 10 tokens at 4 bytes a token, and the
    # gateway's estimate adds a chat template's allowance for its one turn; 256 expected output
    # tokens; $1 and $2 per 1M.
    prompt = 10 + CHAT_TOKENS + MESSAGE_TOKENS
    assert float(header["score"]) == pytest.approx((prompt * 1.0 + 256 * 2.0) / 1e6)
    assert "cheap" in listed(url, ACME) and "cheap" not in listed(url, OTHER)
    with pytest.raises(openai.NotFoundError) as other:
        chat(url, OTHER, "cheap")
    assert "does not exist" in other.value.message  # another tenant's route is not revealed
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.NotFoundError) as refused:
        chat(url, ACME, "cheap", tools=tools)
    assert refused.value.code == "model_not_found"
    assert "does not exist" not in refused.value.message and "conditions" in refused.value.message


def test_lowest_latency_measures_candidates_without_streaming(
    doc_gateway: tuple[str, Any], fake_openai: FakeOpenAI
) -> None:
    """The docs: unmeasured candidates go first so each gets measured. Also when clients do not
    stream: timed by streams only, a route whose clients never stream measured nobody and sent every
    request to the first listed candidate, however slow."""
    url, runtime = doc_gateway
    fake_openai.set_latency(first_token=0.3)  # gpt-4o-mini, listed first, is the slow one
    went = []
    for _ in range(3):
        header = route_header(chat(url, ACME, "fast").headers["x-weir-route"])
        went.append((header["candidate"], header["reason"]))
    assert went[:2] == [("gpt-4o-mini", "unmeasured"), ("claude-haiku", "unmeasured")]
    assert went[2] == ("claude-haiku", "expected_seconds")
    assert runtime.router.stats.get("openai", "gpt-4o-mini").latency_s >= 0.3


# --- the admin API and feedback examples, with the admin DB --------------------------------------------


def curl_examples(name: str) -> list[tuple[str, str, Any]]:
    """(method, path, JSON body or None) of each `curl ... localhost:8080/...` in `name`'s code blocks:
    a command runs on over lines ending in a backslash and inside an open quote."""
    found = []
    for body in code_blocks(name, "sh", "bash"):
        lines = body.splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("curl "):
                continue
            command, j = line, i
            while True:
                try:
                    args = shlex.split(command)
                except ValueError:  # a quote still open
                    args = None
                if args is not None and not command.endswith("\\"):
                    break
                j += 1
                command = command.removesuffix("\\") + "\n" + lines[j]
            method = args[args.index("-X") + 1] if "-X" in args else "GET"
            path = next(a for a in args if a.startswith("localhost:8080")).removeprefix("localhost:8080")
            data = args[args.index("-d") + 1] if "-d" in args else None
            found.append((method, path, json.loads(data) if data else None))
    return found


@pytest.fixture
def db_gateway(
    fresh_fakes: None,
    vendor_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[str]:
    monkeypatch.setenv("WEIR_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("WEIR_USAGE_SPOOL", str(tmp_path / "spool"))
    config = parse_config(
        config_text(route_snippets()[0][1], f"sqlite+aiosqlite:///{tmp_path}/weir.db"),
        vendor_env,
    )
    with gateway(config, p_strong=0.1) as (url, _):
        yield url


def test_the_admin_api_curl_examples(db_gateway: str) -> None:
    """Each `curl` of the routing docs, sent as written (curl's -d: no JSON content type)."""
    admin = httpx.Client(base_url=db_gateway, headers=auth(ADMIN))
    examples = curl_examples(POLICIES) + curl_examples(CLASSIFIER)
    posts = [(m, p, b) for m, p, b in examples if (m, p) == ("POST", "/admin/api/v1/routes")]
    assert len(posts) == 2
    # The cheapest route: stored, listed, and in force at once.
    created = admin.post("/admin/api/v1/routes", content=json.dumps(posts[0][2]))
    assert created.status_code == 201, created.text
    listing = admin.get("/admin/api/v1/routes").json()
    assert set(listing) == {"version", "data", "left_out", "routes_rejected", "model_max_output_tokens"}
    assert listing["left_out"] == [] and listing["routes_rejected"] is None
    assert created.json()["id"] in [r["id"] for r in listing["data"]]
    assert "auto" in admin.get("/admin/api/v1/routes/status").json()["routes"]
    # The difficulty route that names a trained head: refused while no head of that name is stored
    # ("A route naming a head that is not stored is refused (400, param: "head")"), as a POST and as
    # the PUT of docs/routing.md.
    for method, path, body in [posts[1], *[e for e in examples if e[0] == "PUT" and "/routes/" in e[1]]]:
        refused = admin.request(method, path, content=json.dumps(body))
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "head"
    # A bundle that is no bundle: 400 and nothing stored.
    put_head = next(e for e in examples if "/difficulty-heads/" in e[1])
    bad = admin.put(
        put_head[1], content=b"not safetensors", headers={"content-type": "application/octet-stream"}
    )
    assert bad.status_code == 400
    assert admin.get(put_head[1]).status_code == 404


def test_feedback_as_documented(db_gateway: str) -> None:
    """`POST /v1/feedback {"request_id": "<x-request-id of the reply>", "score": 0..1}` with the
    client's own key; read back, replaced, another tenant's is a 404, a bad id a 400."""
    reply = chat(db_gateway, ACME, "gpt-4o-mini")
    request_id = reply.headers["x-request-id"]
    acme = httpx.Client(base_url=db_gateway, headers=auth(ACME))
    first = acme.post("/v1/feedback", json={"request_id": request_id, "score": 0.2})
    assert first.status_code == 200, first.text
    time.sleep(0.01)
    second = acme.post("/v1/feedback", json={"request_id": request_id, "score": 0.9}).json()
    assert second["score"] == 0.9 and second["created_at"] == first.json()["created_at"]
    assert second["updated_at"] > second["created_at"]
    assert acme.get(f"/v1/feedback/{request_id}").json()["score"] == 0.9
    other = httpx.get(f"{db_gateway}/v1/feedback/{request_id}", headers=auth(OTHER))
    assert other.status_code == 404
    for bad in ("", "x" * 129, "a\x00b"):
        assert acme.post("/v1/feedback", json={"request_id": bad, "score": 1}).status_code == 400
    assert acme.get(f"/v1/feedback/{'x' * 129}").status_code == 404
    assert acme.post("/v1/feedback", json={"request_id": "r", "score": 1.5}).status_code == 400


def test_feedback_needs_the_control_plane(doc_gateway: tuple[str, Any]) -> None:
    answer = httpx.post(
        f"{doc_gateway[0]}/v1/feedback", json={"request_id": "r", "score": 1}, headers=auth(ACME)
    )
    assert answer.status_code == 501


# --- `weir router` on the command line ------------------------------------------------------------------


def router_commands() -> list[list[str]]:
    """Every `weir router ...` command line in the routing docs' code blocks and inline code, split
    into words, without its comment and pipes, placeholders as written."""
    texts = []
    for name in (POLICIES, CLASSIFIER, README):
        texts += code_blocks(name, "sh", "bash", "")
        texts += re.findall(r"`(weir router [^`]*)`", doc(name).replace("\n", " "))
    commands = []
    for text in texts:
        for line in text.splitlines():
            at = line.find("weir router ")
            if at < 0:
                continue
            line = line[at:].split(" #")[0].split(" | ")[0].split(";")[0]
            words = shlex.split(line)[2:]
            # `weir router heads install/list/export/delete`: each of them.
            alternatives = words[1].split("/") if len(words) > 1 and "/" in words[1] else [None]
            for alternative in alternatives:
                commands.append(words if alternative is None else [words[0], alternative, *words[2:]])
    return commands


def test_every_weir_router_command_in_the_docs_parses() -> None:
    """Each documented `weir router` invocation names a real subcommand and real options (values
    such as NAME and M are placeholders; only the words are checked)."""
    commands = router_commands()
    assert len(commands) >= 10
    for words in commands:
        group: click.Command = router_cli
        while isinstance(group, click.Group) and words and words[0] in group.commands:
            group, words = group.commands[words[0]], words[1:]
        assert not isinstance(group, click.Group), f"no such command: weir router {' '.join(words)}"
        options = {o for p in group.params for o in getattr(p, "opts", [])}
        flags = [w.split("=")[0] for w in words if w.startswith("--")]
        assert set(flags) <= options, f"weir router {group.name}: {set(flags) - options} are not options"


def test_the_weir_router_score_example() -> None:
    """The first example of docs/routing.md, run as written: the score it prints is the shipped head's
    it names, and a line that cannot be scored gets `{"error": "line N: ..."}` and exit status 1."""
    body = code_blocks(CLASSIFIER, "sh")[0]
    command, printed = body.strip().splitlines()
    match = re.fullmatch(r"echo '(.*)' \| weir router score( .*)?", command)
    assert match is not None, command
    args = shlex.split(match.group(2) or "")
    assert "--shipped" in args, "the example's number depends on the head: it must name it"
    result = CliRunner().invoke(router_cli, ["score", *args], input=match.group(1) + "\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(printed)
    result = CliRunner().invoke(router_cli, ["score", *args], input=match.group(1) + "\nnot json\n")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert json.loads(lines[0]) == json.loads(printed)
    assert json.loads(lines[1])["error"].startswith("line 2: ")
