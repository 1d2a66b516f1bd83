"""Prefix affinity on real engine replicas: the prefix-cache hit rate a route achieves, side by side
with the same traffic spread at random and with all of it on one replica, in one run.

    .venv/bin/python benchmarks/prefix_affinity.py [--replicas 3] [--model smollm2-135m]
        [--gateways 2 [--redis-url redis://127.0.0.1:6379/0]]

Starts `--replicas` bundled engines (`weir engine serve`, one thread each, prefix caching on) and a
gateway in front of them with two routes over the same replicas: `affinity` (policy
`prefix_affinity`) and `spread` (`weighted`, equal weights: what a load balancer without affinity
does). Each workload runs once per route on text of its own (so no route finds another's prefixes in
the caches), and once on a single replica, whose hit rate is the most any placement could reach.
With `--gateways N` the requests go to N gateway replicas in turn, as behind a load balancer; with
`--redis-url` they share what they remember of where prefixes went (routing/prefixes.py).

Workloads (deterministic pseudo-text; chars, not tokens):
- conversations: multi-turn chats, each with its own system prompt; every turn sends the whole
  history, the model's earlier replies included, so each turn can reuse the previous one's KV.
- documents: a few long documents, each asked several questions (the document in the system message,
  the question in the user message), in shuffled order.

Prints, per workload and placement: prompt tokens, cached tokens (the engine's
`prompt_tokens_details.cached_tokens`), the hit rate, its share of the single replica's, the gateway's
own `affinity_hit_rate`, and request latency (max_tokens 16: mostly prefill).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import openai

from gateway.app import create_app
from gateway.config import parse_config
from gateway.logging import configure_logging
from tests.fixtures.net import free_port
from tests.fixtures.server import serve

VOCABULARY = (
    "the of and to in is that for it as with was on be by this are from at or an which have not "
    "their has been more one all were when can there its also into only other some these time would "
    "system model data value process energy market water city river method result analysis report "
    "policy customer account engine memory signal network contract budget schedule design review "
    "measure sample pressure surface region history evidence theory feature package service request"
)
WORDS = VOCABULARY.split()
API_KEY = "sk-weir-bench-prefix-affinity"


def text(rng: random.Random, chars: int) -> str:
    """Plausible-looking sentences of about `chars` characters."""
    out: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))).capitalize() + "."
        out.append(sentence)
        size += len(sentence) + 1
    return " ".join(out)


@dataclass
class Outcome:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    affinity_hits: int = 0
    affinity_requests: int = 0

    def add(self, response: openai.types.chat.ChatCompletion, seconds: float, route: str) -> None:
        usage = response.usage
        assert usage is not None
        self.prompt_tokens += usage.prompt_tokens
        details = usage.prompt_tokens_details
        self.cached_tokens += (details.cached_tokens or 0) if details is not None else 0
        self.latencies.append(seconds)
        if "affinity=" in route:
            self.affinity_requests += 1
            self.affinity_hits += "affinity=hit" in route

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


class Gateways:
    """The gateway replicas' clients, taken in turn: a load balancer in front of them."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
            for url in urls
        ]
        self.turn = itertools.count()

    def next(self) -> openai.AsyncOpenAI:
        return self.clients[next(self.turn) % len(self.clients)]

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


async def ask(client: Gateways, model: str, messages: list[dict[str, str]], outcome: Outcome) -> str:
    started = time.monotonic()
    raw = await client.next().chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    response = raw.parse()
    outcome.add(response, time.monotonic() - started, raw.headers.get("x-weir-route", ""))
    return response.choices[0].message.content or ""


async def gather_limited(jobs: list, concurrency: int) -> list:
    gate = asyncio.Semaphore(concurrency)

    async def one(job):  # type: ignore[no-untyped-def]
        async with gate:
            return await job

    return await asyncio.gather(*(one(j) for j in jobs))


async def conversations(
    client: Gateways, model: str, seed: int, count: int, turns: int, concurrency: int
) -> Outcome:
    rng = random.Random(seed)
    outcome = Outcome()
    histories = [[{"role": "system", "content": text(rng, 800)}] for _ in range(count)]
    for _ in range(turns):
        for history in histories:
            history.append({"role": "user", "content": text(rng, 200)})
        order = list(range(count))
        rng.shuffle(order)
        replies = await gather_limited(
            [ask(client, model, histories[i], outcome) for i in order], concurrency
        )
        for i, reply in zip(order, replies, strict=True):
            histories[i].append({"role": "assistant", "content": reply})
    return outcome


async def documents(
    client: Gateways,
    model: str,
    seed: int,
    count: int,
    questions: int,
    chars: int,
    concurrency: int,
) -> Outcome:
    rng = random.Random(seed)
    outcome = Outcome()
    docs = [text(rng, chars) for _ in range(count)]
    asks = [(d, text(rng, 120)) for d in range(count) for _ in range(questions)]
    rng.shuffle(asks)
    jobs = [
        ask(client, model, [{"role": "system", "content": docs[d]}, {"role": "user", "content": q}], outcome)
        for d, q in asks
    ]
    await gather_limited(jobs, concurrency)
    return outcome


async def hot_document(
    client: Gateways, model: str, seed: int, questions: int, chars: int, concurrency: int
) -> Outcome:
    """One document everybody asks about at once: its prefix hashes to one replica, whose queue grows
    while the others idle, unless the route moves requests off it when it is overloaded."""
    rng = random.Random(seed)
    outcome = Outcome()
    doc = text(rng, chars)
    jobs = [
        ask(
            client,
            model,
            [{"role": "system", "content": doc}, {"role": "user", "content": text(rng, 120)}],
            outcome,
        )
        for _ in range(questions)
    ]
    await gather_limited(jobs, concurrency)
    return outcome


def start_engines(
    model: str, ports: list[int], log_dir: str, max_num_seqs: int | None = None
) -> list[subprocess.Popen[bytes]]:
    weir = str(Path(sys.executable).parent / "weir")
    procs = []
    for port in ports:
        log = open(os.path.join(log_dir, f"engine-{port}.log"), "wb")  # noqa: SIM115  (lives with the process)
        procs.append(
            subprocess.Popen(
                [
                    weir,
                    "engine",
                    "serve",
                    "--model",
                    model,
                    "--port",
                    str(port),
                    "--threads",
                    "1",
                    "--served-model-name",
                    "replica",
                    *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + 300
    for port, proc in zip(ports, procs, strict=True):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"engine on port {port} exited; see {log_dir}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine on port {port} did not become ready")
            time.sleep(0.5)
    return procs


def gateway_config(ports: list[int], prefix_chars: int, state: str = "") -> str:
    # type engine: the gateway asks each replica for its load report (routing/load.py)
    backends = "\n".join(
        f"  - {{name: e{i}, type: engine, base_url: 'http://127.0.0.1:{p}/v1', api_key: unused}}"
        for i, p in enumerate(ports)
    )
    models = "\n".join(f"  - {{name: r{i}, backend: e{i}, model: replica}}" for i in range(len(ports)))
    names = ", ".join(f"{{model: r{i}, max_in_flight: 4}}" for i in range(len(ports)))
    blind = ", ".join(f"{{model: r{i}}}" for i in range(len(ports)))
    reported = ", ".join(f"{{model: r{i}, max_waiting: 1}}" for i in range(len(ports)))
    return f"""\
{state}
tenants:
  - {{name: bench, api_keys: ["{API_KEY}"]}}
backends:
{backends}
models:
{models}
routes:
  - {{name: affinity, policy: prefix_affinity, prefix_chars: {prefix_chars}, probe_interval: null, candidates: [{names}]}}
  - {{name: spread, policy: weighted, probe_interval: null, candidates: [{names}]}}
  - {{name: one, probe_interval: null, candidates: [{{model: r0}}]}}
  # hot: what this gateway counts cannot see the load (as with many gateway replicas) ...
  - {{name: affinity-blind, policy: prefix_affinity, prefix_chars: {prefix_chars}, probe_interval: null, candidates: [{blind}]}}
  # ... and what the engines' own load reports add
  - {{name: affinity-reported, policy: prefix_affinity, prefix_chars: {prefix_chars}, probe_interval: null, candidates: [{reported}]}}
"""


async def run_all(urls: list[str], args: argparse.Namespace) -> dict[str, dict[str, Outcome]]:
    client = Gateways(urls)
    results: dict[str, dict[str, Outcome]] = {}
    workloads = {
        "conversations": lambda route, seed: conversations(
            client, route, seed, args.conversations, args.turns, args.concurrency
        ),
        "documents": lambda route, seed: documents(
            client, route, seed, args.documents, args.questions, args.document_chars, args.concurrency
        ),
    }
    routes = {name: ("spread", "affinity", "one") for name in workloads}
    if args.hot:
        workloads = {
            "hot document": lambda route, seed: hot_document(
                client, route, seed, args.hot_questions, args.document_chars, args.hot_concurrency
            )
        }
        routes = {"hot document": ("affinity-blind", "affinity-reported", "spread")}
    seed = args.seed
    for name, workload in workloads.items():
        results[name] = {}
        for route in routes[name]:
            seed += 1  # text of its own: no route finds another's prefixes cached
            started = time.monotonic()
            results[name][route] = await workload(route, seed)
            print(f"  {name} on {route}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    await client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--prefix-chars", type=int, default=2048, help="the affinity route's prefix_chars")
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--document-chars", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hot",
        action="store_true",
        help="instead: one document asked by many at once, prefix_affinity blind to load vs with "
        "max_waiting from the engines' load reports (engines batch --max-num-seqs requests)",
    )
    parser.add_argument("--hot-questions", type=int, default=24)
    parser.add_argument("--hot-concurrency", type=int, default=6)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="per engine (default: the engine's)")
    parser.add_argument(
        "--gateways", type=int, default=1, help="gateway replicas, each request to the next in turn"
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="shared state for the gateway replicas (each with an admin DB of its own), so each finds "
        "where the others sent a prefix; without it each remembers only its own requests",
    )
    args = parser.parse_args()

    configure_logging("warning")  # one line per request would bury the table
    ports = [free_port() for _ in range(args.replicas)]
    with tempfile.TemporaryDirectory(prefix="weir-affinity-") as logs:
        procs = start_engines(args.model, ports, logs, args.max_num_seqs)
        try:
            if args.redis_url:  # keys of their own: nothing left from an earlier run is found
                os.environ["WEIR_REDIS_PREFIX"] = f"bench-affinity-{os.getpid()}:"
            with contextlib.ExitStack() as stack:
                urls = []
                for i in range(args.gateways):
                    state = ""
                    if args.redis_url:  # the shared state comes with the control plane (an admin DB)
                        state = f"database_url: sqlite+aiosqlite:///{logs}/gateway-{i}.db\nredis_url: {args.redis_url}"
                    app = create_app(parse_config(gateway_config(ports, args.prefix_chars, state), {}))
                    urls.append(stack.enter_context(serve(app, free_port())))
                results = asyncio.run(run_all(urls, args))
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                proc.wait(30)

    shared = f", shared state {args.redis_url}" if args.redis_url else ""
    print(
        f"{args.replicas} replicas of {args.model}, prefix_chars {args.prefix_chars}, "
        f"{args.gateways} gateway replica(s){shared}"
    )
    print(
        "| workload | placement | requests | prompt tokens | cached | hit rate | of one replica's "
        "| gateway affinity hits | latency p50 / mean / max (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    labels = {
        "one": "one replica (the most)",
        "spread": "spread at random",
        "affinity": "prefix_affinity",
        "affinity-blind": "prefix_affinity, no load signal",
        "affinity-reported": "prefix_affinity, max_waiting 1 (engine reports)",
    }
    for name, by_route in results.items():
        best = by_route["one"].hit_rate if "one" in by_route else max(o.hit_rate for o in by_route.values())
        for route, o in by_route.items():
            label = labels[route]
            gateway = f"{o.affinity_hits / o.affinity_requests:.2f}" if o.affinity_requests else "-"
            print(
                f"| {name} | {label} | {len(o.latencies)} | {o.prompt_tokens} | {o.cached_tokens} | "
                f"{o.hit_rate:.3f} | {o.hit_rate / best if best else float('nan'):.2f} | {gateway} | "
                f"{statistics.median(o.latencies):.2f} / {statistics.fmean(o.latencies):.2f} / "
                f"{max(o.latencies):.2f} |"
            )


if __name__ == "__main__":
    main()
