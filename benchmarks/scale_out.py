"""Scale-out: requests per second through 1, 2 and 3 `weir serve` replicas sharing one PostgreSQL
database and one Redis, with the load spread round robin over them, and the memory of each replica.

Every replica is the full production path: a key from the admin DB whose tenant has RPM, TPM and
budget limits (high enough never to refuse) counted in Redis, usage events through the Redis stream
into the PostgreSQL ledger. The upstream is `mock_upstream.py` (no model time). The replicas are
started by `tests/scaleout/cluster.py` (the multi-replica tests' helper), each count with a fresh
database.

    .venv/bin/python benchmarks/scale_out.py
    .venv/bin/python benchmarks/scale_out.py --replicas 1,2,3 --concurrency 32 --duration 10

Prints, per replica count: RPS, p50/p99 latency, errors, ledger rows written vs requests answered,
RSS per replica, the load average, and RPS as a multiple of one replica's. Read the ratios with the
machine in mind: on a 2-core box the replicas, the load generator, the mock upstream, PostgreSQL
and Redis all compete for the same two cores, so more replicas cannot add CPU; what this shows there
is that spreading over replicas costs little and stays correct, not how throughput scales on
separate machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from gateway_overhead import UPSTREAM_KEY, Server, free_port, running  # noqa: E402

from tests.scaleout.cluster import Cluster, cluster, pg_query, rss_bytes  # noqa: E402

LIMITS = {"rpm": 10**9, "tpm": 2 * 10**9, "budget_usd_monthly": "1000000"}
BODY = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 32}'


@dataclass
class Measured:
    replicas: int
    rps: float
    p50_ms: float
    p99_ms: float
    ok: int
    errors: int
    first_error: str | None
    ledger_rows: int
    rss_mib: list[float]
    load: tuple[float, float, float]


async def load(
    urls: list[str], key: str, concurrency: int, seconds: float, warmup: int
) -> tuple[list[float], int, str | None]:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    latencies: list[float] = []
    errors = 0
    first_error: str | None = None
    turn = 0
    connector = aiohttp.TCPConnector(limit=concurrency * 2, ttl_dns_cache=None)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def one(record: bool) -> None:
            nonlocal turn, errors, first_error
            url = urls[turn % len(urls)]  # round robin, as a load balancer in front of the replicas
            turn += 1
            started = time.perf_counter()
            try:
                async with session.post(url, data=BODY, headers=headers) as response:
                    payload = await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError) as exc:
                ok, payload = False, repr(exc).encode()
            if not record:
                return
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1
                first_error = first_error or payload[:300].decode(errors="replace")

        for _ in range(max(1, warmup // concurrency)):
            await asyncio.gather(*(one(False) for _ in range(concurrency)))
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                await one(True)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        latencies.append(-(time.perf_counter() - started))  # the elapsed time rides along, negated
    return latencies, errors, first_error


def tenant_key(c: Cluster) -> tuple[str, str]:
    with c.admin() as admin:
        tenant = admin.post("/tenants", json={"name": "bench", **LIMITS}).json()
        key = admin.post(f"/tenants/{tenant['id']}/keys", json=dict(LIMITS)).json()
    return tenant["id"], key["key"]


def measure(n: int, upstream: str, workdir: Path, args: argparse.Namespace) -> Measured:
    print(f"starting {n} replica(s) ...", file=sys.stderr, flush=True)
    with cluster(
        n,
        openai_url=upstream,
        openai_key=UPSTREAM_KEY,
        flaky_url=upstream,
        flaky_key=UPSTREAM_KEY,
        workdir=workdir,
    ) as c:
        tenant_id, key = tenant_key(c)
        urls = [f"{b}/v1/chat/completions" for b in c.bases]
        latencies, errors, first_error = asyncio.run(
            load(urls, key, args.concurrency, args.duration, args.warmup)
        )
        elapsed = -latencies.pop()
        rss = [rss_bytes(r.process.pid) / 2**20 for r in c.replicas]
        avg = os.getloadavg()
        # The ledger must hold every answered request (warm-up included): wait for the writers.
        answered = len(latencies) + args.warmup // args.concurrency * args.concurrency
        deadline = time.monotonic() + 60
        rows = 0
        while time.monotonic() < deadline:
            rows = pg_query(
                c.database, "SELECT count(*) AS n FROM usage_events WHERE tenant_id = $1", tenant_id
            )[0]["n"]
            if rows >= answered:
                break
            time.sleep(0.5)
    latencies.sort()
    return Measured(
        replicas=n,
        rps=len(latencies) / elapsed,
        p50_ms=statistics.median(latencies) * 1000 if latencies else float("nan"),
        p99_ms=latencies[int(len(latencies) * 0.99) - 1] * 1000 if latencies else float("nan"),
        ok=len(latencies),
        errors=errors,
        first_error=first_error,
        ledger_rows=rows - (answered - len(latencies)),  # measured requests' rows (warm-up excluded)
        rss_mib=rss,
        load=avg,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--replicas", default="1,2,3")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    counts = [int(n) for n in args.replicas.split(",")]
    results: list[Measured] = []
    with tempfile.TemporaryDirectory(prefix="weir-scale-bench-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        port = free_port()
        mock = Server(
            "mock",
            f"http://127.0.0.1:{port}/v1/chat/completions",
            UPSTREAM_KEY,
            [sys.executable, str(HERE / "mock_upstream.py"), "--port", str(port)],
        )
        stack.enter_context(running(mock, workdir, 30, False))
        for n in counts:
            (workdir / f"n{n}").mkdir()
            results.append(measure(n, f"http://127.0.0.1:{port}/v1", workdir / f"n{n}", args))

    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"concurrency {args.concurrency}, {args.duration:g} s per replica count, round robin over the replicas"
    )
    print(
        f"{'replicas':>8} {'RPS':>8} {'p50 ms':>8} {'p99 ms':>8} {'ok':>7} {'err':>5} {'ledger':>7}  RSS MiB per replica  load avg"
    )
    for m in results:
        rss = ", ".join(f"{r:.0f}" for r in m.rss_mib)
        load_avg = " ".join(f"{x:.1f}" for x in m.load)
        print(
            f"{m.replicas:>8} {m.rps:>8.0f} {m.p50_ms:>8.1f} {m.p99_ms:>8.1f} {m.ok:>7} {m.errors:>5} "
            f"{m.ledger_rows:>7}  {rss:<20} {load_avg}"
        )
        if m.first_error:
            print(f"         first error: {m.first_error}")
    base = results[0]
    print()
    for m in results[1:]:
        print(f"{m.replicas} replicas / {base.replicas}: {m.rps / base.rps:.2f}x RPS")
    print(
        f"note: {os.cpu_count()} CPUs shared by every replica, the load generator, the mock upstream, PostgreSQL and "
        "Redis; more replicas add no CPU here"
    )
    if any(m.ledger_rows != m.ok for m in results):
        print("WARNING: ledger rows differ from answered requests")


if __name__ == "__main__":
    main()
