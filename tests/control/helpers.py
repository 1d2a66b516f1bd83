"""Small helpers for the control-plane tests: a TCP proxy that can play a dead database, events."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import uuid

from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import PriceCatalog
from gateway.usage import Usage
from tests.fixtures.net import free_port


class TcpProxy:
    """127.0.0.1:<port> -> target. `stop()` makes the port refuse connections and cuts live ones,
    which is what clients see when PostgreSQL goes down; `start()` brings it back on the same port.
    A subclass that overrides `forward` holds back or drops what passes (a slow or hanging server)."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    await self.forward(data, dst, upstream)
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))
        self._writers.difference_update((writer, up_writer))

    async def forward(self, data: bytes, dst: asyncio.StreamWriter, upstream: bool) -> None:
        """Pass on what one side sent: the client's bytes to the target (`upstream`), or the target's
        answer to the client."""
        dst.write(data)
        await dst.drain()


def random_usage(rng: random.Random) -> Usage:
    output = rng.randint(1, 800)
    return Usage(
        input_tokens=rng.randint(0, 5000),
        cached_input_tokens=rng.choice([0, 0, rng.randint(1, 20000)]),
        cache_write_5m_tokens=rng.choice([0, 0, 0, rng.randint(1, 3000)]),
        cache_write_1h_tokens=rng.choice([0, 0, 0, 0, rng.randint(1, 3000)]),
        output_tokens=output,
        reasoning_tokens=rng.choice([0, rng.randint(0, output)]),
    )


def priced_event(
    catalog: PriceCatalog,
    *,
    tenant_id: str | None,
    backend: str,
    model: str,
    usage: Usage,
    ts: dt.datetime,
    key_id: str | None = None,
    status: int = 200,
    attempt: int = 1,
    request_id: str | None = None,
) -> UsageEvent:
    cost = catalog.price(usage, backend, model, ts)
    return UsageEvent(
        request_id=request_id or uuid.uuid4().hex,
        attempt=attempt,
        ts=ts,
        tenant_id=tenant_id,
        key_id=key_id,
        route=model,
        backend=backend,
        model=model,
        usage=usage,
        prices=cost.prices,
        cost_pico_usd=cost.cost_pico_usd,
        savings_pico_usd=cost.savings_pico_usd,
        latency_ms=12.5,
        ttft_ms=3.0,
        status=status,
        fallback=attempt > 1,
    )
