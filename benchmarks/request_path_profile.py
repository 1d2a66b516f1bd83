"""The controlled request path's own work, counted rather than timed: N chat completions through
`create_app` in process (SQLite admin DB, a key whose tenant and key both have RPM, TPM and budget
limits, as `control_overhead.py`'s `sqlite` target), sent as raw ASGI calls (no HTTP client or server
in the count) to `mock_upstream.py`. The periodic background tasks (DB pollers, probes, uptime
flushes and, unless `--keep-writer`, the usage writer) are cancelled before the measured requests:
they run per wall-clock second, so on a loaded machine they would count more per request.

Two measures that do not move with the neighbours' load:
  --profile OUT.prof   cProfile of the measured requests (Python calls per function; compare two
                       trees' files with pstats)
  under callgrind      instructions per request; the measured requests alone are instrumented:

    PYTHONPATH=TREE valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=cg.out \\
        .venv/bin/python benchmarks/request_path_profile.py --callgrind --requests 300

    (instructions per request = the "Collected" total / --requests)

Run it once per source tree (`git archive <commit> gateway routing engine kernels weir migrations
alembic.ini | tar -x -C DIR`, then PYTHONPATH=DIR); docs/benchmarks.md has results.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import HERE, free_port

LIMITS = {"rpm": 10**9, "tpm": 2 * 10**9, "budget_usd_monthly": "1000000"}
BODY = json.dumps(
    {
        "model": "bench-model",
        "messages": [{"role": "user", "content": "Say hello in five words."}],
        "max_tokens": 16,
    }
).encode()


def config_text(upstream: str, database: Path) -> str:
    return f"""backends:
  - {{name: mock, type: openai, base_url: "{upstream}/v1", api_key: sk-bench-upstream}}
models:
  - {{name: bench-model, backend: mock, model: gpt-4o-mini, price: {{input: 0.15, output: 0.60}}}}
database_url: "sqlite:///{database}"
"""


def toggle_callgrind(state: str) -> None:
    """Instrumentation on or off (callgrind_control). Callgrind reads the command while the program
    runs code, so this wakes every 10 ms until it is done; a busy wait would count thousands of its
    own instructions, more on a loaded machine."""
    control = subprocess.Popen(
        ["callgrind_control", "-i", state, str(os.getpid())], stdout=subprocess.DEVNULL
    )
    while control.poll() is None:
        time.sleep(0.01)


class Asgi:
    """Raw ASGI calls into the app: its lifespan, and requests with a whole body."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self._lifespan: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._lifespan_out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.lifespan_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.lifespan_task = asyncio.create_task(
            self.app(scope, self._lifespan.get, self._lifespan_out.put)  # type: ignore[arg-type]
        )
        await self._lifespan.put({"type": "lifespan.startup"})
        started = await self._lifespan_out.get()
        if started["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {started}")

    async def request(self, method: str, path: str, token: str, body: bytes) -> tuple[int, bytes]:
        done = asyncio.Event()
        sent = False
        status: list[int] = []
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    done.set()

        headers = [
            (b"host", b"bench"),
            (b"authorization", f"Bearer {token}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": headers,
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        await self.app(scope, receive, send)
        return status[0], b"".join(chunks)


def prepare(upstream: str, workdir: Path) -> str:
    """The config, the migrated admin DB and the environment the app reads: its admin token."""
    admin = "bench-admin-" + uuid.uuid4().hex
    os.environ |= {"WEIR_ADMIN_TOKEN": admin, "WEIR_USAGE_SPOOL": str(workdir / "spool")}
    (workdir / "weir.yaml").write_text(config_text(upstream, workdir / "weir.db"))
    # Before the migration: alembic.ini's prepend_sys_path puts the working directory first on
    # sys.path, whose tree would then win over PYTHONPATH's for modules not imported yet.
    import gateway
    import gateway.app

    print(f"source tree: {Path(gateway.__file__).parent.parent}", file=sys.stderr)
    try:
        from gateway.db.migrate import upgrade
    except ImportError:  # a tree from before `weir db upgrade`: the gateway made its DB at start
        pass
    else:
        upgrade(f"sqlite:///{workdir / 'weir.db'}")
    return admin


async def run(args: argparse.Namespace, admin: str, workdir: Path) -> None:
    from gateway.app import create_app
    from gateway.config import load_config

    asgi = Asgi(create_app(load_config(str(workdir / "weir.yaml"))))
    await asgi.start()

    async def admin_post(path: str, fields: dict[str, Any]) -> dict[str, Any]:
        status, body = await asgi.request("POST", f"/admin/api/v1{path}", admin, json.dumps(fields).encode())
        if status >= 300:
            raise RuntimeError(f"{path}: {status} {body[:300]!r}")
        answer: dict[str, Any] = json.loads(body)
        return answer

    tenant = await admin_post("/tenants", {"name": "bench", **LIMITS})
    key = (await admin_post(f"/tenants/{tenant['id']}/keys", LIMITS))["key"]

    async def wave() -> None:
        for status, body in await asyncio.gather(
            *(asgi.request("POST", "/v1/chat/completions", key, BODY) for _ in range(args.concurrency))
        ):
            if status != 200:
                raise RuntimeError(f"chat completion: {status} {body[:300]!r}")

    for _ in range(max(1, args.warmup // args.concurrency)):
        await wave()
    current = asyncio.current_task()
    periodic = [
        task
        for task in asyncio.all_tasks()
        if task is not current
        and task is not asgi.lifespan_task
        and not (args.keep_writer and "BatchWriter" in task.get_coro().__qualname__)  # type: ignore[union-attr]
    ]
    for task in periodic:
        task.cancel()
    await asyncio.sleep(0.2)
    waves = max(1, args.requests // args.concurrency)
    profile = cProfile.Profile(time.thread_time) if args.profile else None
    if args.callgrind:
        toggle_callgrind("on")
    if profile is not None:
        profile.enable()
    cpu = time.process_time()
    for _ in range(waves):
        await wave()
    cpu = time.process_time() - cpu
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    if args.callgrind:
        toggle_callgrind("off")
    print(
        f"{waves * args.concurrency} requests, {cpu * 1000 / (waves * args.concurrency):.3f} ms CPU each "
        "(with the profiler's or callgrind's own cost)",
        file=sys.stderr,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--profile", help="write a cProfile of the measured requests here")
    parser.add_argument("--callgrind", action="store_true", help="instrument the measured requests alone")
    parser.add_argument("--keep-writer", action="store_true", help="count the usage writer's work too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weir-request-path-") as tmp:
        port = free_port()
        mock = subprocess.Popen(
            [sys.executable, str(HERE / "mock_upstream.py"), "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(2)
            admin = prepare(f"http://127.0.0.1:{port}", Path(tmp))
            asyncio.run(run(args, admin, Path(tmp)))
        finally:
            mock.terminate()


if __name__ == "__main__":
    main()
