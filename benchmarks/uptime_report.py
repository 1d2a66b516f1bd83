"""The uptime report (`GET /admin/api/v1/reports/uptime`) on a big ledger: this tree against another,
on the same events, in one run.

Each side gets a fresh database (SQLite file, PostgreSQL database or both), migrated and filled by its
own source tree's batch writer with the same `--events` attempts (same seed): four weeks of client
requests from six tenants (one anonymous), most answered at once, some failed over, retried, hedged
or cut short by their client, and a share compared by a difficulty route (the comparison's other
answer and its judge, Weir's own calls). Then each times `reports.uptime_report` over whole days (the
month, as the admin UI asks it), over the same rows as a range of times (not whole days) and over the
last hour, and prints the median of `--rounds` runs, the ratio to the baseline and each side's tenant
totals.

    .venv/bin/python benchmarks/uptime_report.py --baseline /tmp/weir-before --events 200000
    (git archive <commit> gateway routing engine kernels weir migrations alembic.ini | tar -x -C DIR)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
TENANTS = ["acme", "globex", "initech", "umbrella", "hooli", None]
DAYS = 28


def _attempts(rng: random.Random) -> list[tuple[str, int]]:
    """One client request's attempts, (backend, status) in order."""
    roll = rng.random()
    if roll < 0.93:
        return [("openai", 200)]
    if roll < 0.95:
        return [("openai", 502), ("anthropic", 200)]  # failed over
    if roll < 0.96:
        return [("openai", 429), ("openai", 200)]  # retried
    if roll < 0.97:
        return [("openai", 499), ("anthropic", 200)]  # hedged: the primary lost the race
    if roll < 0.98:
        return [("openai", 499)]  # the client left
    return [("openai", 503), ("anthropic", 500)]  # nothing answered


def events(total: int, now: dt.datetime) -> list[Any]:
    """`total` attempts of client requests and comparisons over the `DAYS` days before `now`."""
    from gateway.accounting.events import UsageEvent
    from gateway.ids import ordered_id
    from gateway.usage import Usage

    rng = random.Random(20261205)
    out: list[UsageEvent] = []

    def add(
        request_id: str,
        tenant: str | None,
        backend: str,
        status: int,
        attempt: int,
        ts: dt.datetime,
        purpose: str | None = None,
    ) -> None:
        out.append(
            UsageEvent(
                request_id=request_id,
                attempt=attempt,
                ts=ts,
                tenant_id=tenant,
                key_id=f"{tenant}-key" if tenant else None,
                route="auto",
                backend=backend,
                model=f"{backend}-model",
                usage=Usage(input_tokens=rng.randint(10, 4000), output_tokens=rng.randint(1, 500)),
                prices={},
                cost_pico_usd=rng.randint(1, 10**9),
                latency_ms=50.0,
                status=status,
                purpose=purpose,
            )
        )

    while len(out) < total:
        tenant = rng.choice(TENANTS)
        ts = now - dt.timedelta(seconds=rng.uniform(0, DAYS * 86400))
        request_id = ordered_id()
        for n, (backend, status) in enumerate(_attempts(rng), start=1):
            add(request_id, tenant, backend, status, n, ts + dt.timedelta(milliseconds=200 * (n - 1)))
        if rng.random() < 0.03:  # a difficulty route's comparison: the other answer, then the judge
            add(ordered_id(), tenant, "anthropic", 200, 1, ts + dt.timedelta(seconds=1), "compare")
            add(
                ordered_id(),
                tenant,
                "openai",
                rng.choice([200, 200, 500]),
                1,
                ts + dt.timedelta(seconds=2),
                "judge",
            )
    out.sort(key=lambda e: e.ts)  # as the writer would see them: in time order
    return out[:total]


async def child(url: str, total: int, rounds: int, now_text: str) -> dict[str, Any]:
    """Run in the measured tree (first on PYTHONPATH): migrate, fill, time the report."""
    from gateway.accounting import reports
    from gateway.accounting.writer import BatchWriter
    from gateway.db import migrate
    from gateway.db.session import create_engine, normalise_url, sessionmaker

    now = dt.datetime.fromisoformat(now_text)
    url = normalise_url(url)
    await migrate.upgrade_async(url)
    engine = create_engine(url)
    writer = BatchWriter(None, engine)  # type: ignore[arg-type]  # write() needs no queue
    started = time.perf_counter()
    batch = events(total, now)
    for i in range(0, len(batch), 2000):
        await writer.write(batch[i : i + 2000])
    filled_s = time.perf_counter() - started
    async with engine.begin() as conn:  # statistics, as autovacuum (PostgreSQL) or an operator would keep
        await conn.exec_driver_sql("ANALYZE")
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    first = today - dt.timedelta(days=DAYS + 1)
    ranges = {
        "whole days": (first, today + dt.timedelta(days=1)),
        "times": (first + dt.timedelta(minutes=1), now + dt.timedelta(minutes=1)),
        "last hour": (now - dt.timedelta(hours=1), now + dt.timedelta(minutes=1)),
    }
    sessions = sessionmaker(engine)
    timings: dict[str, float] = {}
    tenants: dict[str, Any] = {}
    for name, (lo, hi) in ranges.items():
        took = []
        for _ in range(rounds):
            async with sessions() as session:
                t0 = time.perf_counter()
                report = await reports.uptime_report(session, lo, hi)
                took.append(time.perf_counter() - t0)
        timings[name] = statistics.median(took) * 1000
        tenants[name] = [
            sum(t["requests"] for t in report["tenants"]),
            sum(t["succeeded"] for t in report["tenants"]),
        ]
    await engine.dispose()
    return {"filled_s": round(filled_s, 1), "ms": timings, "requests_succeeded": tenants}


async def _pg(statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


def run_side(tree: Path, url: str, args: argparse.Namespace, now: str) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            url,
            "--events",
            str(args.events),
            "--rounds",
            str(args.rounds),
            "--now",
            now,
        ],
        env=os.environ | {"PYTHONPATH": str(tree)},
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--db", default="sqlite,pg")
    parser.add_argument("--baseline", help="an earlier Weir's source tree, measured as `base`")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--now", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.child, args.events, args.rounds, args.now))))
        return
    now = dt.datetime.now(dt.UTC).isoformat()
    sides = {"this": HERE.parent} | ({"base": Path(args.baseline).resolve()} if args.baseline else {})
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {args.events} attempts, "
        f"median of {args.rounds}",
        flush=True,
    )
    results: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="weir-uptime-bench-") as tmp:
        for db in [d.strip() for d in args.db.split(",") if d.strip()]:
            for side, tree in sides.items():
                if db == "sqlite":
                    results[db, side] = run_side(tree, f"sqlite:///{tmp}/{side}.db", args, now)
                    continue
                name = f"weir_bench_{uuid.uuid4().hex[:8]}"
                asyncio.run(_pg(f'CREATE DATABASE "{name}"'))
                try:
                    results[db, side] = run_side(tree, PG_ADMIN.rsplit("/", 1)[0] + f"/{name}", args, now)
                finally:
                    with contextlib.suppress(Exception):
                        asyncio.run(_pg(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    for (db, side), r in results.items():
        base = results.get((db, "base"))
        for name, ms in r["ms"].items():
            ratio = f"  {base['ms'][name] / ms:5.1f}x faster than base" if base and side == "this" else ""
            print(
                f"{db:6} {side:4} {name:10} {ms:9.1f} ms  requests, succeeded {r['requests_succeeded'][name]}{ratio}"
            )
        print(f"{db:6} {side:4} filled in {r['filled_s']} s")


if __name__ == "__main__":
    main()
