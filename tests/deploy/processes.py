"""Run what the containers run, as local processes: `weir serve` with a shipped config, and the compose
Redis command. Each waits until it answers and is stopped (SIGTERM, as a container runtime does)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from tests.fixtures.net import free_port

WEIR = Path(sys.executable).with_name("weir")


@dataclass(frozen=True)
class Gateway:
    base: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]


@contextmanager
def weir_serve(config: Path, env: Mapping[str, str], cwd: Path, timeout: float = 60) -> Iterator[Gateway]:
    """`weir serve --config CONFIG` on a free loopback port, yielded once /healthz answers."""
    with weir_serving(config, env, [cwd], timeout) as [gateway]:
        yield gateway


@contextmanager
def weir_serving(
    config: Path, env: Mapping[str, str], cwds: list[Path], timeout: float = 60
) -> Iterator[list[Gateway]]:
    """One `weir serve --config CONFIG` per directory in `cwds`, all started before any is waited for
    (as compose starts replicas; each start is seconds of imports), yielded once each /healthz answers."""
    gateways: list[Gateway] = []
    try:
        for cwd in cwds:
            port = free_port()
            argv = [str(WEIR), "serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
            process = subprocess.Popen(
                argv, env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            gateways.append(Gateway(f"http://127.0.0.1:{port}", process))
        deadline = time.monotonic() + timeout
        for gateway in gateways:
            _wait_healthy(gateway, deadline, timeout)
        yield gateways
    finally:
        for gateway in gateways:
            gateway.process.terminate()
        for gateway in gateways:
            gateway.process.wait(timeout=60)


def _wait_healthy(gateway: Gateway, deadline: float, timeout: float) -> None:
    while True:
        assert gateway.process.poll() is None, gateway.process.stdout.read().decode()  # type: ignore[union-attr]
        try:
            if httpx.get(f"{gateway.base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the gateway did not start within {timeout:g} s"
        time.sleep(0.05)


@contextmanager
def redis_server(command: list[str], directory: Path) -> Iterator[int]:
    """A local redis-server running `command` (compose's), on a free port; yields the port."""
    port = free_port()
    argv = [*command, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert server.poll() is None, "redis-server exited"
            try:
                redis.Redis(host="127.0.0.1", port=port).ping()
                break
            except redis.AuthenticationError:
                break  # up, and asking for the password
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=10)
