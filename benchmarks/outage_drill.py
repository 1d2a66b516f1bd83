"""Outage drill: steady load on a route, the primary backend killed midway, compared side by side with
the same load on the plain model (no routing) in one run.

    .venv/bin/python benchmarks/outage_drill.py [--requests 200] [--rate 50]

Prints, for each: the share of client requests that failed and the latency (p50/p95) before and after
the kill, and the routed/plain ratios. The fakes answer with a fixed first-token latency so the
numbers measure the gateway's failover, not the fake.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai

from tests.fakes import FakeAnthropic, FakeGemini, FakeOpenAI
from tests.fakes.plugin import FakeVendors
from tests.fixtures.vendor_gateway import DEMO_KEY
from tests.routing.routed import routed_gateway

ROUTE = """\
routes:
  - name: drill
    candidates: [{model: gpt-4o-mini}, {model: claude-sonnet}]
    retry: {attempts: 2, backoff: 0.02, max_backoff: 0.1}
    breaker: {failures: 3, cooldown: 5}
"""


@dataclass
class Result:
    model: str
    latencies: list[tuple[float, float, bool]] = field(default_factory=list)  # (sent at, seconds, ok)

    def summary(self, kill_at: float) -> dict[str, float]:
        before = [s for t, s, ok in self.latencies if ok and t < kill_at]
        after = [s for t, s, ok in self.latencies if ok and t >= kill_at]
        failed = sum(not ok for _, _, ok in self.latencies)
        return {
            "failed_share": failed / len(self.latencies),
            "p50_before_ms": _pct(before, 50),
            "p95_before_ms": _pct(before, 95),
            "p50_after_ms": _pct(after, 50),
            "p95_after_ms": _pct(after, 95),
        }


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0] * 1000
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


async def drive(
    url: str, model: str, requests: int, rate: float, kill: Callable[[], None]
) -> tuple[Result, float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=DEMO_KEY, max_retries=0, timeout=20)
    result = Result(model)
    start = time.monotonic()
    kill_at = start + requests / rate / 2

    async def one(i: int) -> None:
        sent = time.monotonic()
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"drill request {i} a b c"}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            ok = text == f"drill request {i} a b c"
        except openai.APIError:
            ok = False
        result.latencies.append((sent - start, time.monotonic() - sent, ok))

    tasks = []
    killed = False
    for i in range(requests):
        target = start + i / rate
        await asyncio.sleep(max(0.0, target - time.monotonic()))
        if not killed and time.monotonic() >= kill_at:
            await asyncio.to_thread(kill)
            killed = True
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    await client.close()
    return result, kill_at - start


def run_drill(requests: int = 200, rate: float = 50.0, latency: float = 0.02) -> dict[str, dict[str, float]]:
    """The drill for the routed route and the plain model; the primary (fake OpenAI) is stopped midway."""
    summaries = {}
    with (
        FakeOpenAI() as oa,
        FakeAnthropic() as an,
        FakeGemini() as ge,
        FakeOpenAI(flavour="deepseek") as ds,
        routed_gateway(FakeVendors(oa, an, ge, ds), ROUTE) as gateway,
    ):
        for model in ("drill", "gpt-4o-mini"):
            oa.start()
            for fake in (oa, an):
                fake.reset()
                fake.set_latency(first_token=latency, per_token=0.001)
            result, kill_at = asyncio.run(drive(gateway.url, model, requests, rate, oa.stop))
            summaries["routed" if model == "drill" else "plain"] = result.summary(kill_at)
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second")
    args = parser.parse_args()
    result = run_drill(args.requests, args.rate)
    for name, summary in result.items():
        print(f"{name:7s} " + "  ".join(f"{k}={v:.3f}" for k, v in summary.items()))
    routed, plain = result["routed"], result["plain"]
    print(
        f"failed share routed/plain: {routed['failed_share']:.3f}/{plain['failed_share']:.3f}; "
        f"routed p95 after/before the kill: {routed['p95_after_ms'] / routed['p95_before_ms']:.2f}x; "
        f"added p50 latency after the kill: {routed['p50_after_ms'] - routed['p50_before_ms']:.1f} ms"
    )


if __name__ == "__main__":
    main()
