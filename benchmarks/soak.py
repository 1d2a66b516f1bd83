"""Soak: a steady open-loop load, streaming and not mixed, through `weir serve` with the control plane
on (auth, limits, budgets, pricing, the usage queue and its batch writer), in front of the fake OpenAI.

    .venv/bin/python benchmarks/soak.py                       # 3 minutes, 40 req/s, SQLite ledger
    .venv/bin/python benchmarks/soak.py --minutes 10 --rate 100 --db postgres   # PostgreSQL + Redis

Prints one line per window: requests, errors, p50/p99 latency and the gateway's resident memory; then
the totals, the memory growth after warm-up, and whether the ledger holds exactly one row per request
served. Goals: zero errors, memory flat after warm-up, ledger exact.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gateway_overhead import free_port, tree_rss_bytes  # noqa: E402

from tests.fakes import FakeOpenAI  # noqa: E402

ADMIN = "soak-admin-" + uuid.uuid4().hex
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/0"
PROMPT = " ".join(f"word{i}" for i in range(24))  # the fake echoes it: 24 output tokens, 24 chunks


@dataclass
class Window:
    started: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    rss: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_request(client: httpx.AsyncClient, url: str, key: str, stream: bool) -> None:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": PROMPT}], "stream": stream}
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {(await response.aread())[:200]!r}")
        if not stream:
            reply = json.loads(await response.aread())
            if reply["choices"][0]["message"]["content"].split() != PROMPT.split():
                raise RuntimeError("wrong reply")
            return
        words: list[str] = []
        done = False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:])["choices"]:
                    words += (choice["delta"].get("content") or "").split()
        if not done or words != PROMPT.split():
            raise RuntimeError("incomplete stream")


async def load(
    url: str, key: str, rate: float, seconds: float, window_s: float, stream_share: float, pid: int
) -> tuple[list[Window], int, list[str]]:
    windows: list[Window] = []
    samples: list[str] = []
    served = 0
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        tasks: set[asyncio.Task[None]] = set()
        start = time.perf_counter()

        async def timed(window: Window, stream: bool) -> None:
            nonlocal served
            t0 = time.perf_counter()
            try:
                await one_request(client, url, key, stream)
            except Exception as exc:  # every failure is counted and a few are shown
                window.errors += 1
                if len(samples) < 5:
                    samples.append(f"{type(exc).__name__}: {exc}")
            else:
                window.latencies.append(time.perf_counter() - t0)
                served += 1

        n = 0
        while (now := time.perf_counter() - start) < seconds:
            if not windows or now - windows[-1].started >= window_s:
                if windows:
                    windows[-1].rss = tree_rss_bytes(pid)
                    report(len(windows), windows[-1])
                windows.append(Window(now))
            task = asyncio.create_task(timed(windows[-1], random.random() < stream_share))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))  # open loop
        await asyncio.gather(*tasks)
        windows[-1].rss = tree_rss_bytes(pid)
        report(len(windows), windows[-1])
    return windows, served, samples


def report(index: int, w: Window) -> None:
    count = len(w.latencies) + w.errors
    print(
        f"  t={w.started:6.0f}s  window {index:3d}: {count:6d} requests  {w.errors:3d} errors  "
        f"p50 {percentile(w.latencies, 0.5) * 1000:7.1f} ms  p99 {percentile(w.latencies, 0.99) * 1000:7.1f} ms  "
        f"RSS {w.rss / 2**20:7.1f} MiB",
        flush=True,
    )


async def pg_create(name: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def pg_drop(name: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def pg_rows(name: str, tenant_id: str) -> int:
    conn = await asyncpg.connect(PG_ADMIN.rsplit("/", 1)[0] + f"/{name}")
    try:
        return int(await conn.fetchval("SELECT count(*) FROM usage_events WHERE tenant_id = $1", tenant_id))
    finally:
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second (open loop)")
    parser.add_argument("--stream-share", type=float, default=0.5)
    parser.add_argument("--windows", type=int, default=12, help="report lines over the run")
    parser.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    args = parser.parse_args()
    seconds = args.minutes * 60

    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="weir-soak-") as tmp:
        work = Path(tmp)
        fake = stack.enter_context(FakeOpenAI())
        pg_name = f"weir_soak_{uuid.uuid4().hex[:10]}"
        if args.db == "postgres":
            asyncio.run(pg_create(pg_name))
            stack.callback(lambda: asyncio.run(pg_drop(pg_name)))
            db_url = (
                PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://") + f"/{pg_name}"
            )
            extra = f'database_url: "{db_url}"\nredis_url: "{REDIS}"\n'
        else:
            extra = f'database_url: "sqlite+aiosqlite:///{work}/weir.db"\n'
        config = work / "weir.yaml"
        config.write_text(
            f"""backends:
  - {{name: openai, type: openai, base_url: "{fake.base_url}", api_key: "{fake.api_key}"}}
models:
  - {{name: gpt-4o-mini, backend: openai, price: {{input: 0.15, cached_input: 0.075, output: 0.60}}}}
{extra}"""
        )
        port = free_port()
        weir = ROOT / ".venv" / "bin" / "weir"
        env = {
            **os.environ,
            "WEIR_ADMIN_TOKEN": ADMIN,
            "WEIR_USAGE_SPOOL": str(work / "spool"),
            "WEIR_REDIS_PREFIX": f"weirsoak:{uuid.uuid4().hex[:8]}:",
        }
        log = (work / "weir.log").open("wb")
        proc = subprocess.Popen(
            [str(weir), "serve", "--config", str(config), "--port", str(port)],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
        stack.callback(lambda: (proc.terminate(), proc.wait(30)))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                sys.exit(f"weir serve did not start:\n{(work / 'weir.log').read_text()[-3000:]}")
            time.sleep(0.3)
        admin = httpx.Client(base_url=f"{base}/admin/api/v1", headers={"authorization": f"Bearer {ADMIN}"})
        limits = {"rpm": 10**9, "tpm": 2 * 10**9, "budget_usd_monthly": "1000000"}
        tenant = admin.post("/tenants", json={"name": "soak", **limits}).raise_for_status().json()
        key = admin.post(f"/tenants/{tenant['id']}/keys", json={}).raise_for_status().json()["key"]

        print(
            f"soak: {args.minutes:g} min at {args.rate:g} req/s, {args.stream_share:.0%} streamed, "
            f"ledger on {args.db}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            flush=True,
        )
        windows, served, samples = asyncio.run(
            load(
                f"{base}/v1/chat/completions",
                key,
                args.rate,
                seconds,
                seconds / args.windows,
                args.stream_share,
                proc.pid,
            )
        )

        deadline = time.monotonic() + 60
        while True:
            if args.db == "postgres":
                rows = asyncio.run(pg_rows(pg_name, tenant["id"]))
            else:
                with contextlib.closing(sqlite3.connect(work / "weir.db")) as db:
                    rows = db.execute(
                        "SELECT count(*) FROM usage_events WHERE tenant_id = ?", (tenant["id"],)
                    ).fetchone()[0]
            if rows >= served or time.monotonic() > deadline:
                break
            time.sleep(0.5)

    errors = sum(w.errors for w in windows)
    latencies = [x for w in windows for x in w.latencies]
    warm = windows[min(1, len(windows) - 1)].rss  # after the first window: imports, pools, caches
    peak_after = max(w.rss for w in windows[1:]) if len(windows) > 1 else warm
    last = windows[-1].rss
    print(
        f"total: {served + errors} requests, {errors} errors, p50 {percentile(latencies, 0.5) * 1000:.1f} ms, "
        f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms"
    )
    print(
        f"RSS: after warm-up {warm / 2**20:.1f} MiB, peak {peak_after / 2**20:.1f} MiB, end {last / 2**20:.1f} MiB "
        f"(growth {100 * (last - warm) / warm:+.1f}%); median of windows "
        f"{statistics.median(w.rss for w in windows) / 2**20:.1f} MiB"
    )
    print(f"ledger: {rows} rows for {served} requests served ({'exact' if rows == served else 'MISMATCH'})")
    for sample in samples:
        print(f"  error sample: {sample}")
    sys.exit(0 if errors == 0 and rows == served else 1)


if __name__ == "__main__":
    main()
