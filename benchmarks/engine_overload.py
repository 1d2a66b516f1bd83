"""A burst larger than the bundled engine's batch, through a route that falls back to a vendor: the
engine queueing everything (vLLM's behaviour, Weir's default) against `--max-queued N` (the engine
refuses what would wait, with a 429 the route answers from the vendor at once), in one run.

    .venv/bin/python benchmarks/engine_overload.py [--model smollm2-135m] [--requests 48]
        [--max-num-seqs 8] [--max-queued none,0,8]

For each setting a fresh `weir engine serve` (the real model, pulled first with `weir models pull`),
the gateway in this process (uvicorn) with route `auto`: the engine, then the fake OpenAI vendor
(`--vendor-ttft` seconds to its first token, `--vendor-tps` tokens a second). All requests are sent
at once, streamed, `--max-tokens` each. Prints per setting: the share the engine answered, time to
first token and to the last token (p50 / p95 / max), and the wall time of the burst.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import openai

from gateway.config import parse_config
from gateway.logging import configure_logging
from tests.fakes import FakeOpenAI
from tests.fixtures.net import free_port
from tests.fixtures.vendor_gateway import running_gateway

KEY = "sk-bench"


def config_text(engine_port: int, vendor: FakeOpenAI) -> str:
    return f"""
backends:
  - {{name: local, type: engine, url: "http://127.0.0.1:{engine_port}"}}
  - {{name: vendor, type: openai, base_url: "{vendor.base_url}", api_key: "{vendor.api_key}"}}
models:
  - {{name: small, backend: local, model: engine-model}}
  - {{name: gpt-4o-mini, backend: vendor}}
routes:
  - {{name: auto, candidates: [{{model: small}}], fallbacks: [gpt-4o-mini], probe_interval: null}}
tenants:
  - {{name: bench, api_keys: ["{KEY}"]}}
"""


@dataclass
class Reply:
    engine: bool
    ttft: float
    total: float


def _pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def burst(url: str, requests: int, max_tokens: int) -> tuple[list[Reply], float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)

    async def one(i: int) -> Reply:
        sent = time.monotonic()
        raw = await client.chat.completions.with_raw_response.create(
            model="auto",
            messages=[{"role": "user", "content": f"Question {i}: name three colours of the rainbow."}],
            max_tokens=max_tokens,
            stream=True,
        )
        first = None
        async for chunk in raw.parse():
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - sent
        header = raw.headers.get("x-weir-route", "")
        total = time.monotonic() - sent
        return Reply("candidate=small" in header, first if first is not None else total, total)

    started = time.monotonic()
    replies = await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.monotonic() - started
    await client.close()
    return list(replies), wall


def engine(model: str, port: int, max_num_seqs: int, max_queued: int | None) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-c", "from weir.cli import main; main()", "engine", "serve"]
    command += ["--model", model, "--served-model-name", "engine-model", "--port", str(port)]
    command += ["--max-num-seqs", str(max_num_seqs), "--log-level", "warning"]
    if max_queued is not None:
        command += ["--max-queued", str(max_queued)]
    process = subprocess.Popen(command, env=os.environ.copy())
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"the engine exited ({process.returncode}); pulled the model?")
        time.sleep(0.5)
    process.kill()
    raise SystemExit("the engine did not become healthy in 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queued", default="none,0,8", help="comma-separated; none = no limit")
    parser.add_argument("--vendor-ttft", type=float, default=0.4)
    parser.add_argument("--vendor-tps", type=float, default=80.0)
    args = parser.parse_args()
    configure_logging("warning")  # a line per request would bury the table
    settings = [None if v == "none" else int(v) for v in args.max_queued.split(",")]
    print(
        f"{args.requests} streamed requests at once, max_tokens {args.max_tokens}; engine {args.model} "
        f"--max-num-seqs {args.max_num_seqs}; vendor: first token {args.vendor_ttft} s, "
        f"{args.vendor_tps:g} tokens/s"
    )
    print("max_queued | engine share | TTFT p50 / p95 / max s | total p50 / p95 / max s | burst wall s")
    with FakeOpenAI() as vendor:
        vendor.set_latency(first_token=args.vendor_ttft, per_token=1 / args.vendor_tps)
        for max_queued in settings:
            port = free_port()
            process = engine(args.model, port, args.max_num_seqs, max_queued)
            try:
                with running_gateway(parse_config(config_text(port, vendor), {})) as gateway:
                    asyncio.run(burst(gateway.url, 2, 4))  # warm-up: connections, the first step
                    replies, wall = asyncio.run(burst(gateway.url, args.requests, args.max_tokens))
            finally:
                process.terminate()
                process.wait(30)
            ttft = [r.ttft for r in replies]
            total = [r.total for r in replies]
            share = sum(r.engine for r in replies) / len(replies)
            print(
                f"{'none' if max_queued is None else max_queued:>10} | {share:12.2f} | "
                f"{_pct(ttft, 50):.2f} / {_pct(ttft, 95):.2f} / {max(ttft):.2f} | "
                f"{_pct(total, 50):.2f} / {_pct(total, 95):.2f} / {max(total):.2f} | {wall:.2f}"
            )


if __name__ == "__main__":
    main()
