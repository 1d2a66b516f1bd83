"""N `weir serve` replicas sharing one throwaway PostgreSQL database and one Redis key prefix, as a
horizontally scaled deployment runs them, plus a client-side round-robin load balancer. The processes
are started with the deploy tests' `weir_serving` helper; the benchmark uses this module too."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import redis

from tests.deploy.processes import WEIR, Gateway, weir_serving

PG_ADMIN = os.environ.get("WEIR_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("WEIR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ADMIN_TOKEN = "weir-scaleout-admin-token"
DEMO_KEY = "sk-weir-scaleout-demo"
# USD per 1M tokens, as the config below sets them.
PRICES = {
    "gpt-4o-mini": {"input": "0.15", "output": "0.60"},
    "deepseek-chat": {"input": "0.27", "output": "1.10"},
}

CONFIG = """\
server: {{log_level: warning}}  # the replicas' output goes to a pipe nobody reads: keep it small
auto_migrate: false
backends:
  - {{name: openai, type: openai, base_url: "{openai_url}", api_key: "{openai_key}"}}
  - {{name: flaky, type: openai, base_url: "{flaky_url}", api_key: "{flaky_key}"}}
models:
  - {{name: gpt-4o-mini, backend: openai, model: gpt-4o-mini, price: {{input: 0.15, output: 0.60}}}}
  - {{name: deepseek-chat, backend: flaky, model: deepseek-chat, price: {{input: 0.27, output: 1.10}}}}
routes:  # seeded into the admin DB by the first replica; probed every 0.5 s by each
  - name: guarded
    candidates: [{{model: deepseek-chat}}, {{model: gpt-4o-mini}}]
    retry: {{attempts: 1}}
    breaker: {{failures: 2, cooldown: 120}}
    probe_interval: 0.5
tenants:
  - {{name: demo, api_keys: ["{demo_key}"]}}
"""


def pg_admin(statement: str) -> None:
    # CREATE/DROP DATABASE cannot run in a transaction: plain asyncpg, no SQLAlchemy.
    async def run() -> None:
        conn = await asyncpg.connect(PG_ADMIN)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


def pg_query(database: str, sql: str, *args: object) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(PG_ADMIN.rsplit("/", 1)[0] + f"/{database}")
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()

    return asyncio.run(run())


@dataclass
class Cluster:
    replicas: list[Gateway]
    database: str  # the PostgreSQL database name
    redis_prefix: str

    @property
    def bases(self) -> list[str]:
        return [r.base for r in self.replicas]

    def kill(self, replica: int) -> None:
        """SIGKILL the replica's server and its worker processes at once, as a crashed container."""
        for pid in [*process_tree(self.replicas[replica].process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.replicas[replica].process.wait(timeout=10)

    def admin(self, replica: int = 0) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.bases[replica]}/admin/api/v1",
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
        )


@contextmanager
def cluster(
    n: int, *, openai_url: str, openai_key: str, flaky_url: str, flaky_key: str, workdir: Path
) -> Iterator[Cluster]:
    """`n` replicas of `weir serve` on free ports; the database and the Redis keys are removed after."""
    database = f"weir_scale_{uuid.uuid4().hex[:12]}"
    prefix = f"weir-scale-{uuid.uuid4().hex[:10]}:"
    config = workdir / "weir.yaml"
    config.write_text(
        CONFIG.format(
            openai_url=openai_url,
            openai_key=openai_key,
            flaky_url=flaky_url,
            flaky_key=flaky_key,
            demo_key=DEMO_KEY,
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEIR_", "OPENAI_", "ANTHROPIC_"))}
    env.update(
        WEIR_DATABASE_URL=PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
        + f"/{database}",
        WEIR_REDIS_URL=REDIS_URL,
        WEIR_REDIS_PREFIX=prefix,
        WEIR_ADMIN_TOKEN=ADMIN_TOKEN,
    )
    pg_admin(f'CREATE DATABASE "{database}"')
    try:
        # Migrated once, before the replicas start, as the deployment's `migrate` step does.
        done = subprocess.run(
            [str(WEIR), "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        cwds = [workdir / f"replica-{i}" for i in range(n)]
        for cwd in cwds:
            cwd.mkdir(exist_ok=True)
        with weir_serving(config, env, cwds) as replicas:
            yield Cluster(replicas, database, prefix)
    finally:
        pg_admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


class RoundRobin(httpx.BaseTransport):
    """A client-side load balancer, as a sidecar or nginx does it: each request goes to the next
    replica. A replica that refuses connections is passed over (nothing was sent, so trying the next
    one is safe) and left out for `down_s`; a request cut mid-flight surfaces as a transport error,
    which the SDK retries (`max_retries`), and the retry lands on a live replica."""

    def __init__(self, bases: Sequence[str], down_s: float = 5.0) -> None:
        self._targets = [httpx.URL(b) for b in bases]
        self._next = itertools.count()
        self._down_until = [0.0] * len(self._targets)
        self._down_s = down_s
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        start = next(self._next)
        order = [(start + i) % len(self._targets) for i in range(len(self._targets))]
        now = time.monotonic()
        live = [i for i in order if self._down_until[i] <= now] or order
        for n, i in enumerate(live):
            target = self._targets[i]
            request.url = request.url.copy_with(host=target.host, port=target.port)
            request.headers["host"] = f"{target.host}:{target.port}"
            try:
                return self._inner.handle_request(request)
            except httpx.ConnectError:
                self._down_until[i] = time.monotonic() + self._down_s
                if n == len(live) - 1:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._inner.close()


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (the HTTP server runs its workers as child processes)."""
    pids = [pid]
    for p in pids:
        with contextlib.suppress(FileNotFoundError):
            for task in Path(f"/proc/{p}/task").iterdir():
                pids.extend(int(c) for c in (task / "children").read_text().split())
    return pids


def rss_bytes(pid: int) -> int:
    """Resident memory of a replica: its server process and the workers under it."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total
