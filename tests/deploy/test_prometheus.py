"""deploy/prometheus: the alert rules parse, cover what an operator needs (backend down, error rate,
budget near limit, TTFT regression), select only metrics Weir really exports, and fire on the
synthetic series of tests/deploy/prometheus/ (`promtool test rules`, when promtool is installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.artefacts import DEPLOY, ROOT, load_yaml
from tests.deploy.metrics import (
    AWAITED,
    PROMETHEUS_BUILTIN,
    RULES,
    exported_series,
    recorded,
    rules,
    selected_metrics,
)

RULE_TESTS = Path(__file__).parent / "prometheus" / "weir_rules_test.yml"
SEVERITIES = {"info", "warning", "critical"}


def test_every_expression_parses() -> None:
    for rule in rules():
        selected_metrics(rule["expr"])  # raises ValueError on a syntax error


def test_the_alerts_an_operator_needs() -> None:
    alerts = {rule["alert"]: rule for rule in rules() if "alert" in rule}
    assert {"WeirBackendDown", "WeirHighErrorRate", "WeirBudgetNearLimit", "WeirTTFTRegression"} <= set(
        alerts
    )
    assert {"WeirGatewayDown", "WeirEngineDown"} <= set(alerts)
    # A supervised engine given up on, or whose restarts are held: a gateway-side state, no scrape down.
    assert 'weir_engine_state{state=~"failed|crash_loop"}' in alerts["WeirEngineFailed"]["expr"]
    # Usage the ledger did not take (dead-letter.jsonl) is missing from reports until replayed.
    assert "WeirUsageEventsSetAside" in alerts
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] in SEVERITIES, name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name
    # Every alert is exercised by the promtool unit tests.
    tested = {
        case["alertname"]
        for test in load_yaml(RULE_TESTS)["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert tested == set(alerts)


def test_rules_select_only_metrics_the_code_exports() -> None:
    known = exported_series() | recorded() | PROMETHEUS_BUILTIN
    for rule in rules():
        unknown = selected_metrics(rule["expr"]) - known - set(AWAITED)
        assert not unknown, f"{rule.get('alert') or rule.get('record')}: no code exports {sorted(unknown)}"
    docs = (ROOT / "docs" / "deploy.md").read_text()
    for name in AWAITED:
        assert name in docs, f"docs/deploy.md must say that {name} is awaited"


def test_the_source_scan_sees_what_the_metrics_endpoints_really_expose() -> None:
    """The scan behind the previous test, checked against real registries of the gateway and engine."""
    from engine.llm_engine import EngineStats
    from engine.metrics import EngineMetrics
    from engine.speculative import SpecStats
    from gateway.metrics import Metrics

    # speculation on, with a draft model, so its series are exposed (and checked) too
    spec = SpecStats("ngram", [4, 4], [3, 1], 4, 8, 4, 8, 10.0)
    stats = EngineStats(
        num_running=1,
        num_waiting=0,
        kv_blocks_total=8,
        kv_blocks_free=4,
        prefix_cache_queries=10,
        prefix_cache_hits=5,
        num_preemptions=0,
        speculative=spec,
        draft_kv_blocks_total=8,
        draft_kv_blocks_free=6,
    )
    exposed = EngineMetrics(lambda: stats).render().decode() + Metrics().render().decode()
    families = list(text_string_to_metric_families(exposed))
    assert len(families) > 10
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    for family in families:
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamps: nothing should select them
        for suffix in suffixes[family.type]:
            assert family.name + suffix in exported_series(), family.name + suffix


def test_prometheus_config_loads_the_rules() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    k8s = load_yaml(DEPLOY / "prometheus" / "prometheus-kubernetes.yml")
    (job,) = k8s["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["weir"]


promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool is not installed (Debian: apt-get install prometheus)"
)


@needs_promtool
def test_promtool_accepts_the_rules_and_the_config(tmp_path: Path) -> None:
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # The config names the rules by their path in the container: point it at the repository's copy.
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    local = tmp_path / "prometheus.yml"
    local.write_text(config.replace("/etc/prometheus/rules/", f"{RULES.parent}/"))
    check = subprocess.run([promtool, "check", "config", str(local)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "22 rules found" in check.stdout


@needs_promtool
def test_alerts_fire_on_synthetic_series() -> None:
    result = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
