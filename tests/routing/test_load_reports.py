"""Engine replicas' own load reports (ORCA's `endpoint-load-metrics`) steer prefix affinity: a replica
whose queue holds `max_waiting` requests is skipped, though this gateway replica sent it none of them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest

from gateway.config import Backend
from gateway.transport import Transport
from routing import load
from routing.breaker import Breakers
from routing.health import HealthProber
from routing.load import LoadReports, parse_orca
from tests.fakes import FakeOpenAI
from tests.fixtures.vendor_gateway import RunningGateway
from tests.routing.routed import engine_replicas, route_header

ROUTES = """\
routes:
  - name: smol
    policy: prefix_affinity
    prefix_chars: 40
    probe_interval: null
    candidates: [{model: smol-a, max_waiting: 4}, {model: smol-b, max_waiting: 4}]
"""
PROMPT = "A shared document the replicas cache. Question one"


@pytest.fixture
def gateway(fake_openai: FakeOpenAI, fake_deepseek: FakeOpenAI) -> Iterator[RunningGateway]:
    with engine_replicas(fake_openai, fake_deepseek, ROUTES) as gateway:
        yield gateway


def ask(gateway: RunningGateway) -> dict[str, str]:
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model="smol", messages=[{"role": "user", "content": PROMPT}]
    )
    return route_header(raw)


def test_a_replica_that_reports_a_long_queue_is_skipped_until_the_report_is_stale(
    gateway: RunningGateway,
    fake_openai: FakeOpenAI,
    fake_deepseek: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    preferred = ask(gateway)["candidate"]
    fakes = {"smol-a": fake_openai, "smol-b": fake_deepseek}
    # The gateway asks engine backends for the report on every request.
    assert fakes[preferred].last_request.headers["endpoint-load-metrics-format"] == "TEXT"
    fakes[preferred].report_load(waiting=9)  # other gateway replicas' requests queue there
    assert ask(gateway)["candidate"] == preferred  # this answer brings the report
    route = ask(gateway)
    assert route["candidate"] != preferred and route["affinity"] == "miss"
    fakes[preferred].report_load(waiting=3)  # under max_waiting: a fresh report clears it ...
    monkeypatch.setattr(load, "FRESH_S", 0.2)  # ... but no request goes there to bring one; it ages
    time.sleep(0.3)
    route = ask(gateway)
    assert route["candidate"] == preferred and route["affinity"] == "hit"
    assert ask(gateway)["candidate"] == preferred  # 3 queued now: below the limit


def test_reports_are_read_in_both_formats_and_bad_ones_are_ignored() -> None:
    assert parse_orca("TEXT named_metrics.num_requests_waiting=3, cpu_utilization=0.5") == {
        "num_requests_waiting": 3.0
    }
    assert parse_orca('JSON {"named_metrics": {"num_requests_waiting": 2, "kv_cache_usage_perc": 0.5}}') == {
        "num_requests_waiting": 2.0,
        "kv_cache_usage_perc": 0.5,
    }
    for bad in ["TEXT named_metrics.num_requests_waiting=lots", "JSON [1", "XML <a/>", "", "TEXT =1, ,"]:
        assert parse_orca(bad) == {}, bad
    assert parse_orca("TEXT named_metrics.num_requests_waiting=nan") == {}
    reports = LoadReports()
    reports.observe("b", {"endpoint-load-metrics": "TEXT named_metrics.kv_cache_usage_perc=0.9"})
    assert reports.waiting("b") is None  # no queue length: nothing to go by
    reports.observe("b", {"endpoint-load-metrics": "TEXT named_metrics.num_requests_waiting=5"})
    assert reports.waiting("b") == 5.0 and reports.waiting("other") is None


async def test_health_probes_bring_the_report_of_a_replica_that_gets_no_requests(
    fake_openai: FakeOpenAI,
) -> None:
    fake_openai.report_load(waiting=2)
    loads, transport = LoadReports(), Transport()
    prober = HealthProber(transport, Breakers(), interval=1.0, loads=loads)
    engine = msgspec.convert({"name": "replica-a", "type": "engine", "url": fake_openai.base_url}, Backend)
    vendor = msgspec.convert({"name": "vendor", "type": "openai", "base_url": fake_openai.base_url}, Backend)
    try:
        prober.watch({"replica-a": (engine, []), "vendor": (vendor, [])})
        await prober.run_once()
    finally:
        await transport.close()
    probes = {r.headers.get("endpoint-load-metrics-format") for r in fake_openai.requests}
    assert len(fake_openai.requests) == 2 and probes == {"TEXT", None}  # vendors are not asked
    assert loads.waiting("replica-a") == 2.0 and loads.waiting("vendor") is None
