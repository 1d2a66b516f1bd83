"""deploy/grafana: the dashboard is well-formed Grafana JSON whose every query parses and selects
metrics the gateway and engine really export, and the provisioning wires it to the compose Prometheus."""

from __future__ import annotations

import re
from itertools import combinations
from typing import Any

import pytest

from tests.deploy.artefacts import DEPLOY, load_yaml
from tests.deploy.metrics import (
    AWAITED,
    DASHBOARD,
    PROMETHEUS_BUILTIN,
    exported_series,
    queries,
    recorded,
    selected_metrics,
)
from tests.deploy.metrics import dashboard as load_dashboard

GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load_dashboard()


def as_promql(expr: str) -> str:
    """What Prometheus receives: Grafana's interval variables become a duration and the others a regex."""
    return _VARIABLE.sub(lambda m: "5m" if m.group(1) in GRAFANA_BUILTINS else ".*", expr)


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    boxes = []
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        boxes.append((panel["title"], grid))
        if panel["type"] != "row":
            assert panel["targets"] and panel["fieldConfig"]["defaults"]["unit"], panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]
    for (a, ga), (b, gb) in combinations(boxes, 2):
        overlap = (
            ga["x"] < gb["x"] + gb["w"]
            and gb["x"] < ga["x"] + ga["w"]
            and ga["y"] < gb["y"] + gb["h"]
            and gb["y"] < ga["y"] + ga["h"]
        )
        assert not overlap, f"panels {a!r} and {b!r} overlap"


def test_every_query_parses_and_selects_exported_metrics(dashboard: dict[str, Any]) -> None:
    known = exported_series() | recorded() | PROMETHEUS_BUILTIN | set(AWAITED)
    for title, expr in queries(dashboard):
        unknown = selected_metrics(as_promql(expr)) - known
        assert not unknown, f"{title}: no code exports {sorted(unknown)}"
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
            assert match, variable["name"]
            assert selected_metrics(as_promql(match.group(1))) <= known, variable["name"]


def test_every_variable_used_is_defined(dashboard: dict[str, Any]) -> None:
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    for title, expr in queries(dashboard):
        used = set(_VARIABLE.findall(expr)) - GRAFANA_BUILTINS
        assert used <= defined, f"{title}: undefined {used - defined}"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert all(t["datasource"] == panel["datasource"] for t in panel["targets"]), panel["title"]


def test_gateway_and_engine_sections(dashboard: dict[str, Any]) -> None:
    sections: dict[str, set[str]] = {}
    current = None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            current = panel["title"]
            sections[current] = set()
        else:
            assert current is not None
            for target in panel["targets"]:
                sections[current] |= selected_metrics(as_promql(target["expr"]))
    assert set(sections) == {"Gateway", "Engine", "Routing"}
    assert {
        "weir_route_attempts_total",
        "weir_route_head_ranking_auc",
        "weir_prefix_affinity_prompt_tokens_total",
        "weir_prefix_affinity_requests_total",
    } <= sections["Routing"]
    engine = {m for m in sections["Engine"] if m != "up"}
    assert engine and all(m.startswith("weir_engine_") for m in engine)
    assert {
        "weir_requests_total",
        "weir_time_to_first_token_seconds_bucket",
        "weir_tokens_total",
        "weir_server_tool_uses_total",  # web searches by tenant: billed per search, run by agents
    } <= sections["Gateway"]
    assert not any(m.startswith("weir_engine_") for m in sections["Gateway"])


def test_provisioning_points_grafana_at_the_compose_prometheus_and_this_dashboard(
    compose: dict[str, Any], dashboard: dict[str, Any]
) -> None:
    (datasource,) = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")[
        "datasources"
    ]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == datasource["uid"]
    (provider,) = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "weir.yaml")["providers"]
    mounts = {
        target: (DEPLOY / source).resolve()
        for source, target, *_ in (v.split(":") for v in compose["services"]["grafana"]["volumes"])
        if source.startswith(".")
    }
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    assert mounts["/etc/grafana/provisioning"] == (DEPLOY / "grafana" / "provisioning")
    prometheus_port = compose["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert datasource["url"].endswith(f":{prometheus_port}")
