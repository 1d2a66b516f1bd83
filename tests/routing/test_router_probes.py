"""The health prober follows the route table: routes added after start (through the admin API on a
replica that started with none) are probed, at their own interval."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.router_basic import ModelTable
from gateway.transport import Transport
from routing.breaker import Breakers
from routing.router import IDLE_PROBE_INTERVAL_S, Router
from routing.routes import Candidate, Route

CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
models:
  - {name: gpt-4o-mini, backend: openai}
"""


async def test_a_route_added_after_start_is_probed() -> None:
    router = Router(ModelTable(parse_config(CONFIG, {})))
    transport = Transport()
    await router.start(transport)
    try:
        assert router.prober is not None and router.prober.targets == {}
        assert router.prober.interval == IDLE_PROBE_INTERVAL_S

        router.set_routes(
            [Route(name="auto", candidates=[Candidate(model="gpt-4o-mini")], probe_interval=0.25)]
        )
        assert router.prober.interval == 0.25
        backend, keys = router.prober.targets["openai"]
        assert backend.name == "openai" and keys == [Breakers.key("openai", "gpt-4o-mini")]

        router.set_routes([])  # nothing left to probe: back to idling
        assert router.prober.targets == {} and router.prober.interval == IDLE_PROBE_INTERVAL_S
    finally:
        await router.stop()
        await transport.close()
