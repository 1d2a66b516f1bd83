"""What the dashboards and alert rules may reference: the metric names Weir's code really exports,
found by reading the source (every prometheus_client metric and metric family it declares), the
metric names a PromQL expression selects, and the shipped rules and dashboard's expressions."""

from __future__ import annotations

import ast
import json
from functools import cache
from pathlib import Path
from typing import Any

import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "weir.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "weir.json"
PACKAGES = ("gateway", "routing", "engine", "kernels", "weir")

# Series each metric type exposes, as prometheus_client writes them (`_created` is left out on purpose:
# nothing should alert on it).
_SUFFIXES = {
    "Counter": ("_total",),
    "CounterMetricFamily": ("_total",),
    "Gauge": ("",),
    "GaugeMetricFamily": ("",),
    "Histogram": ("_bucket", "_sum", "_count"),
    "HistogramMetricFamily": ("_bucket", "_sum", "_count"),
    "Summary": ("", "_sum", "_count"),
    "SummaryMetricFamily": ("", "_sum", "_count"),
    "Info": ("_info",),
    "InfoMetricFamily": ("_info",),
    "Enum": ("",),
    "StateSetMetricFamily": ("",),
    "GaugeHistogramMetricFamily": ("_bucket", "_gsum", "_gcount"),
}

# Metrics the rules rely on that the code does not export yet, with what will export them. docs/deploy.md
# lists each under "Metrics the alerts expect", so an operator knows the alert is silent until then.
AWAITED: dict[str, str] = {}

# Series Prometheus itself adds to every scrape target, and its ALERTS series.
PROMETHEUS_BUILTIN = {"up", "scrape_duration_seconds", "scrape_samples_scraped", "ALERTS", "ALERTS_FOR_STATE"}


def _name_of(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _const(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def declared_metrics(source: str) -> dict[str, str]:
    """{metric name: metric type} for every metric a Python module declares with literal names."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or _name_of(node) not in _SUFFIXES:
            continue
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        name = _const(node.args[0]) if node.args else _const(kwargs.get("name"))
        if name is None:
            continue
        parts = [_const(kwargs.get("namespace")), _const(kwargs.get("subsystem")), name]
        full = "_".join(p for p in parts if p)
        kind = _name_of(node)
        assert kind is not None
        if kind.startswith("Counter"):
            full = full.removesuffix("_total")
        found[full] = kind
    return found


@cache
def exported_series() -> frozenset[str]:
    """Every series name the code base can expose on a /metrics endpoint."""
    series: set[str] = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name, kind in declared_metrics(path.read_text()).items():
                series.update(name + suffix for suffix in _SUFFIXES[kind])
    return frozenset(series)


def selected_metrics(expr: str) -> set[str]:
    """Metric names an expression selects (raises ValueError when it does not parse)."""
    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            else:
                names.update(m.value for m in node.matchers.matchers if m.name == "__name__")

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def recorded() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query in the dashboard."""
    out = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    out += [(a["name"], a["expr"]) for a in board["annotations"]["list"] if "expr" in a]
    return out
