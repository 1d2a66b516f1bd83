"""Gateway overhead: Weir vs LiteLLM proxy vs a bare aiohttp pass-through, in one run on this machine.

Starts a near-zero-cost OpenAI-shaped upstream (`mock_upstream.py`) and, in front of it, a bare
aiohttp pass-through proxy (the ceiling), Weir (`weir serve`, one worker process) and LiteLLM proxy
(its own venv, `benchmarks/.venv-litellm`, created from PyPI when missing). Each target, and the
upstream called directly, gets the same chat-completion load from an aiohttp client at each
concurrency, bounded by a request count and a time limit, in interleaved rounds (so a noisy neighbour
hurts every target alike); the script prints the medians over rounds of RPS and p50/p99 latency, the
p50 added over calling the upstream directly, peak resident memory of each server's process tree, and
the ratios issue 2 sets as goals (Weir added p50 at concurrency 1 <= 1 ms; at concurrency 32 Weir >= 10x LiteLLM's RPS and
>= 0.5x the bare proxy's).

    .venv/bin/python benchmarks/gateway_overhead.py                  # everything, non-streaming
    .venv/bin/python benchmarks/gateway_overhead.py --stream         # streamed replies (16 chunks)
    .venv/bin/python benchmarks/gateway_overhead.py --targets weir,bare --requests 5000 --json out.json

Everything binds 127.0.0.1. The load generator shares the machine with the servers, so absolute
numbers are a floor; the side-by-side ratios are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LITELLM_VENV = HERE / ".venv-litellm"
UPSTREAM_KEY = "sk-bench-upstream"
WEIR_KEY = "sk-weir-bench-key"
LITELLM_KEY = "sk-litellm-bench-key"
PUBLIC_MODEL = "bench-model"


# ---- processes ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    url: str  # the chat completions URL
    key: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT
    startup_timeout: float = 180.0
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def start(self, logdir: Path) -> None:
        self.log = logdir / f"{self.name}.log"
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=self.cwd,
            env={**os.environ, **self.env},
            stdout=subprocess.DEVNULL,  # request logs are part of each server's cost, but not of ours
            stderr=self.log.open("wb"),
            start_new_session=True,  # so stop() can end every worker it forks
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants."""
    total = 0
    for member in _tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) used so far by `pid` and all its descendants."""
    ticks = 0
    for member in _tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


# ---- load -----------------------------------------------------------------------------------------


@dataclass
class Result:
    target: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_request: float | None = None  # server CPU time per request: robust to a noisy machine
    ttfb_p50_ms: float = float("nan")  # time to the first byte of the body (the first SSE event)
    rss_mb: float | None = None
    added_p50_ms: float | None = None
    first_error: str | None = None


def request_body(stream: bool) -> bytes:
    body = {
        "model": PUBLIC_MODEL,
        "messages": [{"role": "user", "content": "Say hello in five words."}],
        "max_tokens": 16,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


async def run_load(
    server: Server, concurrency: int, max_requests: int, max_seconds: float, stream: bool, warmup: int
) -> Result:
    headers = {"authorization": f"Bearer {server.key}", "content-type": "application/json"}
    body = request_body(stream)
    latencies: list[float] = []
    first_bytes: list[float] = []
    errors = 0
    first_error: str | None = None
    connector = aiohttp.TCPConnector(limit=concurrency, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=60)
    rss_peak = 0

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> None:
            nonlocal errors, first_error
            started = time.perf_counter()
            try:
                async with session.post(server.url, data=body, headers=headers) as response:
                    first = await response.content.readany()
                    first_byte = time.perf_counter() - started
                    payload = first + await response.content.read()
                    ok = response.status == 200 and (not stream or payload.rstrip().endswith(b"[DONE]"))
            except (aiohttp.ClientError, TimeoutError) as exc:
                ok, payload = False, repr(exc).encode()
            if ok:
                latencies.append(time.perf_counter() - started)
                first_bytes.append(first_byte)
            else:
                errors += 1
                first_error = first_error or payload[:300].decode(errors="replace")

        # warm up connection pools, JITs and caches on both sides; not measured
        for _ in range(max(1, warmup // concurrency)):
            await asyncio.gather(*(one() for _ in range(concurrency)))
        latencies.clear()
        first_bytes.clear()
        errors, first_error = 0, None

        sent = 0
        deadline = time.perf_counter() + max_seconds

        async def worker() -> None:
            nonlocal sent
            while sent < max_requests and time.perf_counter() < deadline:
                sent += 1
                await one()

        async def sample_rss() -> None:
            nonlocal rss_peak
            if server.proc is None:
                return
            while True:
                rss_peak = max(rss_peak, tree_rss_bytes(server.proc.pid))
                await asyncio.sleep(0.5)

        cpu_before = tree_cpu_seconds(server.proc.pid) if server.proc else None
        sampler = asyncio.create_task(sample_rss())
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        sampler.cancel()
        cpu = (
            tree_cpu_seconds(server.proc.pid) - cpu_before if server.proc and cpu_before is not None else None
        )

    done = len(latencies)
    ordered = sorted(latencies)
    return Result(
        target=server.name,
        concurrency=concurrency,
        requests=done,
        errors=errors,
        seconds=round(elapsed, 3),
        rps=round(done / elapsed, 1) if elapsed else 0.0,
        p50_ms=round(statistics.median(ordered) * 1000, 3) if ordered else float("nan"),
        p99_ms=round(ordered[min(done - 1, int(done * 0.99))] * 1000, 3) if ordered else float("nan"),
        ttfb_p50_ms=round(statistics.median(first_bytes) * 1000, 3) if first_bytes else float("nan"),
        cpu_ms_per_request=round(cpu * 1000 / (done + errors), 3)
        if cpu is not None and done + errors
        else None,
        rss_mb=round(rss_peak / 2**20, 1) if rss_peak else None,
        first_error=first_error,
    )


async def wait_ready(server: Server, timeout: float, stream: bool) -> None:
    """Ready means one real request succeeds end to end."""
    deadline = time.monotonic() + timeout
    headers = {"authorization": f"Bearer {server.key}", "content-type": "application/json"}
    last = ""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.proc.returncode}; see {server.log}")
            try:
                async with session.post(server.url, data=request_body(stream), headers=headers) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}: {(await response.text())[:300]}"
            except aiohttp.ClientError as exc:
                last = repr(exc)
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f}s ({last}); see {server.log}")


# ---- targets --------------------------------------------------------------------------------------


def weir_server(upstream: str, workdir: Path, http_server: str | None = None) -> Server:
    """`weir serve --server granian` (the faster server; its numbers are the `weir` rows), or on
    `http_server` (e.g. uvicorn, the default of `weir serve`) if given."""
    port = free_port()
    config = workdir / "weir.yaml"
    config.write_text(
        f"""backends:
  - name: mock
    type: openai
    base_url: {upstream}/v1
    api_key: {UPSTREAM_KEY}
models:
  - {{name: {PUBLIC_MODEL}, backend: mock, model: gpt-4o-mini, price: {{input: 0.15, output: 0.60}}}}
tenants:
  - {{name: bench, api_keys: ["${{WEIR_BENCH_KEY}}"]}}
"""
    )
    weir = ROOT / ".venv" / "bin" / "weir"
    cmd = [str(weir) if weir.exists() else "weir", "serve", "--config", str(config), "--port", str(port)]
    cmd += ["--server", http_server or "granian"]
    return Server(
        f"weir-{http_server}" if http_server else "weir",
        f"http://127.0.0.1:{port}/v1/chat/completions",
        WEIR_KEY,
        cmd,
        {"WEIR_BENCH_KEY": WEIR_KEY},
        cwd=workdir,
    )


def litellm_server(upstream: str, workdir: Path, workers: int) -> Server:
    port = free_port()
    config = workdir / "litellm.yaml"
    config.write_text(
        f"""model_list:
  - model_name: {PUBLIC_MODEL}
    litellm_params:
      model: openai/gpt-4o-mini
      api_base: {upstream}/v1
      api_key: {UPSTREAM_KEY}
general_settings:
  master_key: {LITELLM_KEY}
litellm_settings:
  drop_params: true
"""
    )
    cmd = [
        str(LITELLM_VENV / "bin" / "litellm"),
        "--config", str(config),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--num_workers", str(workers),
    ]  # fmt: skip
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "NO_DOCS": "True"}
    return Server(
        "litellm", f"http://127.0.0.1:{port}/v1/chat/completions", LITELLM_KEY, cmd, env, cwd=workdir
    )


def bare_server(upstream: str) -> Server:
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-bare-proxy", str(port), upstream]
    return Server("bare", f"http://127.0.0.1:{port}/v1/chat/completions", "unused", cmd)


def floor_server(kind: str, upstream: str) -> Server:
    """A pass-through on Weir's own stack (uvicorn, optionally Litestar): the floor under Weir's cost."""
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-floor", kind, str(port), upstream]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    return Server(kind, f"http://127.0.0.1:{port}/v1/chat/completions", "unused", cmd, env)


def ensure_litellm() -> None:
    if (LITELLM_VENV / "bin" / "litellm").exists():
        return
    print(f"creating {LITELLM_VENV} and installing litellm[proxy] from PyPI ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
    subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True)


def serve_bare_proxy(port: int, upstream: str) -> None:
    """The ceiling: forward the body to the upstream and the answer back, nothing else."""
    from aiohttp import web

    async def make_app() -> web.Application:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            headers = {"content-type": "application/json", "authorization": f"Bearer {UPSTREAM_KEY}"}
            async with session.post(
                f"{upstream}{request.path}", data=body, headers=headers
            ) as upstream_response:
                content_type = upstream_response.headers.get("content-type", "application/json")
                if content_type.startswith("text/event-stream"):
                    response = web.StreamResponse(
                        status=upstream_response.status, headers={"content-type": content_type}
                    )
                    await response.prepare(request)
                    async for chunk in upstream_response.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                    return response
                return web.Response(
                    body=await upstream_response.read(),
                    status=upstream_response.status,
                    headers={"content-type": content_type},
                )

        app = web.Application()
        app.router.add_post("/v1/chat/completions", forward)
        return app

    _use_uvloop()
    web.run_app(make_app(), host="127.0.0.1", port=port, access_log=None, print=None)


FLOOR_APP_ENV = "WEIR_BENCH_FLOOR_APP"  # "asgi" or "litestar"
FLOOR_UPSTREAM_ENV = "WEIR_BENCH_FLOOR_UPSTREAM"


def floor_app() -> Any:
    """The pass-through app of a floor, from the environment (granian imports it by name):
    `asgi` is a raw ASGI app, `litestar` a one-route Litestar app; both forward through one shared
    aiohttp session, as Weir does."""
    kind, upstream = os.environ[FLOOR_APP_ENV], os.environ[FLOOR_UPSTREAM_ENV]
    sessions: list[aiohttp.ClientSession] = []
    headers = {"content-type": "application/json", "authorization": f"Bearer {UPSTREAM_KEY}"}

    def session() -> aiohttp.ClientSession:
        if not sessions:
            sessions.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
        return sessions[0]

    async def relay(upstream_response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        async with upstream_response:
            async for chunk in upstream_response.content.iter_any():
                yield chunk

    if kind == "asgi":

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
                return
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            response = await session().post(f"{upstream}{scope['path']}", data=body, headers=headers)
            content_type = response.headers.get("content-type", "application/json").encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [(b"content-type", content_type)],
                }
            )
            async for chunk in relay(response):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        return app

    from litestar import Litestar, Request, Response, post
    from litestar.response import Stream

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        body = await request.body()
        response = await session().post(f"{upstream}{request.url.path}", data=body, headers=headers)
        content_type = response.headers.get("content-type", "application/json")
        if content_type.startswith("text/event-stream"):
            return Stream(relay(response), media_type=content_type)
        async with response:
            return Response(await response.read(), media_type=content_type)

    # annotations are strings here (__future__), and these names are local: tell Litestar
    return Litestar(
        route_handlers=[chat], signature_namespace={"Request": Request, "Response": Response, "Any": Any}
    )


def serve_floor(kind: str, port: int, upstream: str) -> None:
    """Serve a floor (`<server>-<app>`: uvicorn or granian, asgi or litestar) as `weir serve` would."""
    server, _, app = kind.partition("-")
    os.environ[FLOOR_APP_ENV], os.environ[FLOOR_UPSTREAM_ENV] = app, upstream
    if server == "granian":
        from granian import Granian

        sys.path.insert(0, str(HERE))
        Granian(
            f"{Path(__file__).stem}:floor_app",
            factory=True,
            address="127.0.0.1",
            port=port,
            interface="asgi",  # type: ignore[arg-type]
            workers=1,
            websockets=False,
            log_level="warning",  # type: ignore[arg-type]
            log_access=False,
        ).serve()
        return
    import uvicorn

    uvicorn.run(floor_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# ---- report ---------------------------------------------------------------------------------------


def print_table(results: list[Result], stream: bool) -> None:
    ttfb = f"{'TTFB p50':>10}" if stream else ""  # streams: when the first event arrived
    header = (
        f"{'target':<17}{'conc':>5}{'requests':>9}{'errors':>7}{'RPS':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{ttfb}{'+p50 ms':>9}{'CPU ms/req':>11}{'RSS MB':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        added = f"{r.added_p50_ms:.3f}" if r.added_p50_ms is not None else "-"
        rss = f"{r.rss_mb:.0f}" if r.rss_mb is not None else "-"
        first = f"{r.ttfb_p50_ms:>10.3f}" if stream else ""
        cpu = f"{r.cpu_ms_per_request:.3f}" if r.cpu_ms_per_request is not None else "-"
        print(
            f"{r.target:<17}{r.concurrency:>5}{r.requests:>9}{r.errors:>7}{r.rps:>9.1f}{r.p50_ms:>9.3f}"
            f"{r.p99_ms:>9.3f}{first}{added:>9}{cpu:>11}{rss:>9}"
        )
    for r in results:
        if r.first_error:
            print(f"  first error from {r.target} at concurrency {r.concurrency}: {r.first_error}")


def ratios(results: list[Result], high: int) -> dict[str, float]:
    by = {(r.target, r.concurrency): r for r in results}
    out: dict[str, float] = {}
    weir_low = by.get(("weir", 1))
    if weir_low and weir_low.added_p50_ms is not None:
        out["weir_added_p50_ms_c1"] = weir_low.added_p50_ms
    weir_high = by.get(("weir", high))
    for other in ("litellm", "bare"):
        ref = by.get((other, high))
        if weir_high and ref and ref.rps:
            out[f"weir_over_{other}_rps_c{high}"] = round(weir_high.rps / ref.rps, 2)
    litellm_low = by.get(("litellm", 1))
    if litellm_low and litellm_low.added_p50_ms is not None:
        out["litellm_added_p50_ms_c1"] = litellm_low.added_p50_ms
    return out


def verdicts(found: dict[str, float], high: int) -> list[str]:
    goals = [
        ("weir_added_p50_ms_c1", "<=", 1.0, "Weir added p50 at concurrency 1 <= 1 ms"),
        (f"weir_over_litellm_rps_c{high}", ">=", 10.0, f"Weir RPS >= 10x LiteLLM at concurrency {high}"),
        (f"weir_over_bare_rps_c{high}", ">=", 0.5, f"Weir RPS >= 0.5x bare proxy at concurrency {high}"),
    ]
    lines = []
    for key, op, bound, text in goals:
        if key not in found:
            lines.append(f"  n/a   {text}")
            continue
        ok = found[key] <= bound if op == "<=" else found[key] >= bound
        lines.append(f"  {'PASS' if ok else 'MISS'}  {text}: {found[key]}")
    return lines


# ---- main -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def running(server: Server, logdir: Path, timeout: float, stream: bool) -> Iterator[Server]:
    server.start(logdir)
    try:
        asyncio.run(wait_ready(server, timeout, stream))
        yield server
    finally:
        server.stop()


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def combine(rounds: list[Result]) -> Result:
    """The median of repeated measurements of one (target, concurrency); memory is the peak."""
    first = rounds[0]
    rss = [r.rss_mb for r in rounds if r.rss_mb is not None]
    errors = [r.first_error for r in rounds if r.first_error]
    return Result(
        target=first.target,
        concurrency=first.concurrency,
        requests=sum(r.requests for r in rounds),
        errors=sum(r.errors for r in rounds),
        seconds=round(sum(r.seconds for r in rounds), 3),
        rps=round(statistics.median(r.rps for r in rounds), 1),
        p50_ms=round(statistics.median(r.p50_ms for r in rounds), 3),
        p99_ms=round(statistics.median(r.p99_ms for r in rounds), 3),
        ttfb_p50_ms=round(statistics.median(r.ttfb_p50_ms for r in rounds), 3),
        cpu_ms_per_request=_median_or_none([r.cpu_ms_per_request for r in rounds]),
        rss_mb=max(rss) if rss else None,
        first_error=errors[0] if errors else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Weir vs LiteLLM vs bare proxy overhead, side by side.")
    parser.add_argument(
        "--targets",
        default="bare,weir,litellm",
        help="comma-separated: bare, weir, litellm, weir-uvicorn (weir serve --server uvicorn), and the "
        "floors under Weir's stack: "
        "{uvicorn,granian}-{asgi,litestar} (that server with a raw ASGI or a one-route Litestar pass-through)",
    )
    parser.add_argument("--concurrency", default="1,32", help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=int, default=3000, help="max requests per measurement")
    parser.add_argument("--duration", type=float, default=10.0, help="max seconds per measurement")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured requests before each measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows medians")
    parser.add_argument("--stream", action="store_true", help="streamed replies (SSE) instead of JSON")
    parser.add_argument("--litellm-workers", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--serve-bare-proxy", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--serve-floor", nargs=3, metavar=("KIND", "PORT", "UPSTREAM"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve_bare_proxy:
        serve_bare_proxy(int(args.serve_bare_proxy[0]), args.serve_bare_proxy[1])
        return
    if args.serve_floor:
        serve_floor(args.serve_floor[0], int(args.serve_floor[1]), args.serve_floor[2])
        return

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    if "litellm" in targets:
        ensure_litellm()
    _use_uvloop()

    measured: dict[tuple[str, int], list[Result]] = {}
    with tempfile.TemporaryDirectory(prefix="weir-bench-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        mock_port = free_port()
        upstream = f"http://127.0.0.1:{mock_port}"
        mock = Server(
            "direct",
            f"{upstream}/v1/chat/completions",
            UPSTREAM_KEY,
            [sys.executable, str(HERE / "mock_upstream.py"), "--port", str(mock_port)],
        )
        factories = {
            "bare": lambda: bare_server(upstream),
            **{
                floor: (lambda floor=floor: floor_server(floor, upstream))
                for floor in ("uvicorn-asgi", "uvicorn-litestar", "granian-asgi", "granian-litestar")
            },
            "weir": lambda: weir_server(upstream, workdir),
            "weir-uvicorn": lambda: weir_server(upstream, workdir, "uvicorn"),
            "litellm": lambda: litellm_server(upstream, workdir, args.litellm_workers),
        }
        servers = [stack.enter_context(running(mock, workdir, 30, args.stream))]
        for name in targets:
            server = factories[name]()
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            try:
                servers.append(
                    stack.enter_context(running(server, workdir, server.startup_timeout, args.stream))
                )
            except RuntimeError as exc:
                print(f"  {name} failed to start: {exc}", file=sys.stderr)
                if server.log and server.log.exists():
                    print(server.log.read_text()[-2000:], file=sys.stderr)
        # every server stays up (idle) while the others are measured, and the rounds interleave the
        # targets, so the load other processes put on a shared machine spreads over all of them
        for round_no in range(args.rounds):
            for server in servers:
                for concurrency in levels:
                    print(
                        f"round {round_no + 1}/{args.rounds}: {server.name} at concurrency {concurrency}",
                        file=sys.stderr,
                        flush=True,
                    )
                    result = asyncio.run(
                        run_load(server, concurrency, args.requests, args.duration, args.stream, args.warmup)
                    )
                    measured.setdefault((server.name, concurrency), []).append(result)

    results = [combine(rounds) for rounds in measured.values()]
    direct = {r.concurrency: r for r in results if r.target == "direct"}
    for r in results:
        if r.target != "direct" and r.concurrency in direct:
            r.added_p50_ms = round(r.p50_ms - direct[r.concurrency].p50_ms, 3)

    mode = "streaming (16 chunks)" if args.stream else "non-streaming"
    print(
        f"\nGateway overhead, {mode}; {platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(f"command: {' '.join(sys.argv)}; medians of {args.rounds} interleaved rounds\n")
    print_table(results, args.stream)
    high = max(levels)
    found = ratios(results, high)
    print("\nratios:", json.dumps(found))
    print("goals (issue 2):")
    print("\n".join(verdicts(found, high)))
    if args.json:
        payload = {
            "mode": mode,
            "results": [asdict(r) for r in results],
            "rounds": {f"{k[0]}@{k[1]}": [asdict(r) for r in v] for k, v in measured.items()},
            "ratios": found,
        }
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
