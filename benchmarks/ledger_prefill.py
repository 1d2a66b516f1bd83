"""Fill a Weir ledger with N usage events before a benchmark starts its gateway, as a gateway that has
been running a while would have: `control_overhead.py --prefill N` runs this with the target's own
source tree first on PYTHONPATH, so the events' ids are made as that tree makes them (its UsageEvent
default; the request ids likewise), and its batch writer writes them, 500 per transaction.

    PYTHONPATH=TREE .venv/bin/python benchmarks/ledger_prefill.py DATABASE_URL N
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
import time


async def main(url: str, total: int) -> None:
    from gateway.accounting.events import UsageEvent
    from gateway.accounting.writer import BatchWriter
    from gateway.db import migrate
    from gateway.db.session import create_engine, normalise_url
    from gateway.usage import Usage

    url = normalise_url(url)
    await migrate.upgrade_async(url)
    engine = create_engine(url)
    writer = BatchWriter(None, engine)  # type: ignore[arg-type]  # write() needs no queue

    def event(request_id: str) -> UsageEvent:
        return UsageEvent(
            request_id=request_id,
            attempt=1,
            ts=dt.datetime.now(dt.UTC),
            tenant_id="prefill",  # not a benchmark tenant: the ledger counts per tenant stay exact
            key_id="prefill",
            route="mock",
            backend="mock",
            model="mock-model",
            usage=Usage(input_tokens=12, output_tokens=20),
            prices={"input": 1_000_000, "output": 2_000_000},
            cost_pico_usd=52_000_000,
            latency_ms=1.5,
        )

    started = time.perf_counter()
    try:
        for _ in range(0, total, 500):
            # The request id as this tree would make an id: another default event id.
            await writer.write([event(event("").event_id) for _ in range(500)])
    finally:
        await engine.dispose()
    print(f"prefilled {total} events in {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
