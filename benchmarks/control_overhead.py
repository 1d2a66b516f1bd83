"""Control-plane overhead: Weir with and without auth from the admin DB, RPM/TPM limits, budget
reservations and the usage ledger, side by side in one run, plus proof that the DB sees batches.

Targets, all `weir serve` (one worker) in front of `mock_upstream.py`:
  plain    config-file key, no database: the gateway core alone
  sqlite   control plane on SQLite, state in process, usage spool file
  pg       control plane on PostgreSQL, state and usage stream in Redis (needs both on 127.0.0.1)
The controlled targets call with an admin-DB key whose tenant and key both have RPM, TPM and monthly
budget limits (high enough never to refuse), so every request is authenticated against the DB cache,
counted in four limits, reserves and settles two budgets, and is priced, queued and written.

    .venv/bin/python benchmarks/control_overhead.py
    .venv/bin/python benchmarks/control_overhead.py --targets plain,sqlite --requests 3000 --rounds 5
    .venv/bin/python benchmarks/control_overhead.py --targets plain,pg,pg@base --baseline /tmp/weir-before
    .venv/bin/python benchmarks/control_overhead.py --together --requests 100000 --duration 5 --rounds 9
    .venv/bin/python benchmarks/control_overhead.py --targets plain,sqlite,sqlite@base --baseline DIR --prefill 300000

On a shared machine CPU per request moves with the neighbours as much as RPS does; `--together`
loads every target at once in each round, so the per-round ratio of gateway CPU per request compares
targets under the same load (docs/benchmarks.md, "Control plane overhead").

Prints median RPS and p50 per target and concurrency, each controlled target's RPS as a share of
plain (goal: >= 0.80 at every concurrency), and for the DB: usage rows written vs requests served
and, on PostgreSQL, how many rollup upserts (one per batch transaction) carried them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import (
    HERE,
    UPSTREAM_KEY,
    Result,
    Server,
    _use_uvloop,
    free_port,
    run_load,
    running,
    weir_server,
)

ADMIN = "bench-admin-" + uuid.uuid4().hex
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
LIMITS = {"rpm": 10**9, "tpm": 2 * 10**9, "budget_usd_monthly": "1000000"}


def controlled_server(
    name: str, upstream: str, workdir: Path, database_url: str, redis_url: str | None
) -> Server:
    server = weir_server(upstream, workdir / name)
    server.name = name
    config = Path(server.cmd[server.cmd.index("--config") + 1])
    extra = f'database_url: "{database_url}"\n' + (f'redis_url: "{redis_url}"\n' if redis_url else "")
    config.write_text(config.read_text() + extra)
    server.env |= {
        "WEIR_ADMIN_TOKEN": ADMIN,
        "WEIR_USAGE_SPOOL": str(workdir / name / "spool"),
        "WEIR_REDIS_PREFIX": f"weirbench:{uuid.uuid4().hex[:8]}:",
    }
    return server


def services_cpu_seconds() -> float:
    """CPU time so far of every Redis and PostgreSQL server process on this machine. Shared with
    whatever else uses them while the benchmark runs, so it is an upper bound for the gateway's share."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            if name.startswith(("redis-server", "postgres")):
                fields = stat.rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def weir_dir(workdir: Path, name: str) -> Path:
    (workdir / name).mkdir(parents=True, exist_ok=True)
    return workdir / name


def admin_key(server: Server, timeout: float = 120) -> tuple[str, str]:
    """Wait for the gateway, then make a limited tenant and key through the admin API."""
    base = server.url.rsplit("/v1/", 1)[0]
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/readyz").status_code == 200:
                break
        if time.monotonic() > deadline or (server.proc and server.proc.poll() is not None):
            raise RuntimeError(f"{server.name} did not start; see {server.log}")
        time.sleep(0.3)
    admin = httpx.Client(base_url=f"{base}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
    tenant = admin.post("/tenants", json={"name": f"bench-{server.name}", **LIMITS})
    tenant.raise_for_status()
    key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json=LIMITS)
    key.raise_for_status()
    return tenant.json()["id"], key.json()["key"]


async def pg_counts(url: str, tenant_id: str) -> tuple[int, int]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM usage_events WHERE tenant_id = $1", tenant_id)
        # One rollup group (one tenant, key, model, day): each batch transaction inserts or updates it once.
        stat = await conn.fetchval(
            "SELECT n_tup_ins + n_tup_upd FROM pg_stat_user_tables WHERE relname = 'usage_rollups'"
        )
        return int(rows), int(stat or 0)
    finally:
        await conn.close()


def sqlite_rows(path: Path, tenant_id: str) -> int:
    import sqlite3

    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT count(*) FROM usage_events WHERE tenant_id = ?", (tenant_id,)).fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--targets", default="plain,sqlite,pg")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--together",
        action="store_true",
        help="load every target at once in each round (same neighbours' load for all; RPS then "
        "shares one load generator, CPU per request is the measure)",
    )
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="usage events written into each controlled target's ledger before its gateway starts "
        "(benchmarks/ledger_prefill.py, ids made by the target's own tree): a ledger that has been "
        "in use, not an empty one",
    )
    parser.add_argument(
        "--baseline",
        help="a source tree of an earlier Weir (e.g. `git archive <commit> gateway routing engine kernels "
        "weir migrations alembic.ini | tar -x -C DIR`); targets named sqlite@base / pg@base run it",
    )
    args = parser.parse_args()
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    _use_uvloop()

    pg_names: dict[str, str] = {}
    measured: dict[tuple[str, int], list[Result]] = {}
    tenants: dict[str, str] = {}
    served: dict[str, int] = {}
    services_ms: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="weir-control-bench-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        mock = Server(
            "direct",
            f"{upstream}/v1/chat/completions",
            UPSTREAM_KEY,
            [sys.executable, str(HERE / "mock_upstream.py"), "--port", str(port)],
        )
        stack.enter_context(running(mock, workdir, 30, False))
        servers: list[Server] = []
        for name in targets:
            weir_dir(workdir, name)
            if name == "plain":
                server = weir_server(upstream, workdir / name)
                server.name = "plain"
            elif name.startswith("sqlite"):
                server = controlled_server(
                    name, upstream, workdir, f"sqlite:///{workdir / name / 'weir.db'}", None
                )
            else:
                pg_names[name] = pg_name = f"weir_bench_{uuid.uuid4().hex[:8]}"
                asyncio.run(_pg(f'CREATE DATABASE "{pg_name}"'))
                stack.callback(
                    lambda n=pg_name: asyncio.run(_pg(f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)'))
                )
                server = controlled_server(
                    name, upstream, workdir, PG_ADMIN.rsplit("/", 1)[0] + f"/{pg_name}", REDIS
                )
            if name.endswith("@base"):
                if not args.baseline:
                    parser.error(f"{name} needs --baseline")
                # The same gateway from another source tree (imports from it win over this checkout).
                server.env["PYTHONPATH"] = str(Path(args.baseline).resolve())
            if args.prefill and name != "plain":
                print(f"prefilling {name}'s ledger ...", file=sys.stderr, flush=True)
                url = f"sqlite:///{workdir / name / 'weir.db'}" if name.startswith("sqlite") else None
                url = url or PG_ADMIN.rsplit("/", 1)[0] + f"/{pg_names[name]}"
                tree = str(Path(args.baseline).resolve()) if name.endswith("@base") else str(HERE.parent)
                subprocess.run(
                    [sys.executable, str(HERE / "ledger_prefill.py"), url, str(args.prefill)],
                    env=os.environ | {"PYTHONPATH": tree},
                    check=True,
                )
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            if name != "plain":
                server.start(workdir)
                stack.callback(server.stop)
                tenants[name], server.key = admin_key(server)
            else:
                stack.enter_context(running(server, workdir, server.startup_timeout, False))
            servers.append(server)

        def record(server: Server, concurrency: int, result: Result, services_ms_per_request: float) -> None:
            services_ms.setdefault((server.name, concurrency), []).append(services_ms_per_request)
            measured.setdefault((server.name, concurrency), []).append(result)
            warmup = max(1, args.warmup // concurrency) * concurrency
            served[server.name] = served.get(server.name, 0) + warmup + result.requests + result.errors

        async def load(group: list[Server], concurrency: int) -> list[Result]:
            return list(
                await asyncio.gather(
                    *(
                        run_load(s, concurrency, args.requests, args.duration, False, args.warmup)
                        for s in group
                    )
                )
            )

        # --together: every target loaded at the same time, each with `concurrency` connections: the
        # neighbours' load then weighs on all of them alike, and CPU per request compares within one
        # window instead of across windows seconds apart. Otherwise one target at a time.
        groups = [servers] if args.together else [[server] for server in servers]
        for round_no in range(args.rounds):
            for group in groups:
                names = "all" if args.together else group[0].name
                for concurrency in levels:
                    print(
                        f"round {round_no + 1}/{args.rounds}: {names} c={concurrency}",
                        file=sys.stderr,
                        flush=True,
                    )
                    services_before = services_cpu_seconds()
                    results = asyncio.run(load(group, concurrency))
                    done = max(1, sum(r.requests + r.errors for r in results))
                    services_ms_per_request = (services_cpu_seconds() - services_before) * 1000 / done
                    for server, result in zip(group, results, strict=True):
                        record(server, concurrency, result, services_ms_per_request)
        time.sleep(3)  # let the batch writers finish and PostgreSQL publish its statistics
        ledger: dict[str, str] = {}
        for name, tenant_id in tenants.items():
            if name.startswith("sqlite"):
                ledger[name] = f"{sqlite_rows(workdir / name / 'weir.db', tenant_id)} usage rows"
            else:
                pg_url = PG_ADMIN.rsplit("/", 1)[0] + f"/{pg_names[name]}"
                rows, upserts = asyncio.run(pg_counts(pg_url, tenant_id))
                upserts -= -(-args.prefill // 500)  # the prefill's batches: one rollup upsert each
                ledger[name] = (
                    f"{rows} usage rows in {upserts} batch transactions ({rows / max(upserts, 1):.0f} events per batch)"
                )

    print(
        f"\nControl-plane overhead, non-streaming; {platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(f"command: {' '.join(sys.argv)}; medians of {args.rounds} interleaved rounds\n")
    print(f"{'target':<8} {'conc':>4} {'RPS':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'vs plain':>8}")
    plain = {
        c: statistics.median(r.rps for r in measured[("plain", c)])
        for c in levels
        if ("plain", c) in measured
    }
    ratios = []
    for (name, concurrency), rounds in measured.items():
        rps = statistics.median(r.rps for r in rounds)
        ratio = rps / plain[concurrency] if concurrency in plain and name != "plain" else None
        if ratio is not None:
            ratios.append((name, concurrency, ratio))
        print(
            f"{name:<8} {concurrency:>4} {rps:>9.1f} {statistics.median(r.p50_ms for r in rounds):>8.3f} "
            f"{statistics.median(r.p99_ms for r in rounds):>8.3f} {sum(r.errors for r in rounds):>6} "
            f"{'' if ratio is None else f'{ratio:.2f}':>8}"
        )
    # On a shared machine the load swings between rounds; the ratio within each round (targets run
    # back to back) is steadier than the ratio of medians, so both are shown.
    # CPU per request does not depend on what the neighbours do (much): the gateway's own process
    # (measured alone) and Redis + PostgreSQL (shared with anything else using them meanwhile).
    print("\nCPU per request, medians (ms): gateway process | Redis + PostgreSQL (upper bound)")
    plain_cpu = {
        c: statistics.median(r.cpu_ms_per_request or 0 for r in measured[("plain", c)]) for c in plain
    }
    for (name, concurrency), rounds in measured.items():
        cpu = statistics.median(r.cpu_ms_per_request or 0 for r in rounds)
        services = statistics.median(services_ms[(name, concurrency)])
        share = (
            f"  plain/this {plain_cpu[concurrency] / cpu:.2f}"
            if name != "plain" and cpu and concurrency in plain_cpu
            else ""
        )
        print(f"  {name:<8} c={concurrency:<3} {cpu:7.3f} | {services:7.3f}{share}")
    # The CPU ratio within each round: the neighbours' load moves every target's CPU per request
    # (shared cores, caches), so targets measured back to back are compared with each other.
    print("\nper round (gateway CPU ms/request; plain's / this one's in the same round):")
    for (name, concurrency), rounds in measured.items():
        if name == "plain" or ("plain", concurrency) not in measured:
            continue
        paired = [
            (r.cpu_ms_per_request, p.cpu_ms_per_request)
            for r, p in zip(rounds, measured[("plain", concurrency)], strict=False)
            if r.cpu_ms_per_request and p.cpu_ms_per_request
        ]
        if not paired:
            continue
        cells = " ".join(f"{c:.3f}/{p:.3f}" for c, p in paired)
        shares = [p / c for c, p in paired]
        print(
            f"  {name:<8} c={concurrency:<3} {cells}  ratios {' '.join(f'{x:.2f}' for x in shares)}  "
            f"median {statistics.median(shares):.2f}"
        )
    print("\nper round (RPS; ratio to plain in the same round):")
    for (name, concurrency), rounds in measured.items():
        if name == "plain" or ("plain", concurrency) not in measured:
            continue
        paired = list(zip(rounds, measured[("plain", concurrency)], strict=False))
        per_round = [r.rps / p.rps for r, p in paired if p.rps]
        cells = " ".join(f"{r.rps:.0f}/{p.rps:.0f}" for r, p in paired)
        print(
            f"  {name:<8} c={concurrency:<3} {cells}  ratios "
            f"{' '.join(f'{x:.2f}' for x in per_round)}  median {statistics.median(per_round):.2f}"
        )
    print()
    for name, concurrency, ratio in ratios:
        print(
            f"  {'PASS' if ratio >= 0.8 else 'MISS'}  {name} keeps >= 80% of plain's RPS at concurrency {concurrency}: {ratio:.2f}"
        )
    for name, text in ledger.items():
        print(f"  ledger {name}: {served[name]} requests served (warm-up included), {text}")


async def _pg(statement: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


if __name__ == "__main__":
    main()
