"""`weir serve`: run the gateway. Imports stay light until the command runs (`weir --help` is fast)."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gateway.startup import (
    EXIT_STARTUP_FAILED,
    EXIT_WORKER_DIED,
    FAILURE_FILE_ENV,
    failure_said,
    record_failure,
)

if TYPE_CHECKING:
    from gateway.config import Config

CONFIG_ENV = "WEIR_CONFIG"
LOG_LEVEL_ENV = "WEIR_LOG_LEVEL"
# Seconds the requests still running at the drain's deadline (`server.drain_timeout`, 30 s by default)
# get to write their 503 or error event and record their usage (gateway.drain) before the server
# cancels what still runs (a client not reading, say). The deployments' grace periods
# (compose stop_grace_period, Kubernetes terminationGracePeriodSeconds) must exceed both together,
# or the container is killed mid-drain (tests/deploy pins both).
STREAMS_END_S = 2
# Seconds an idle kept-alive connection stays open (uvicorn's default, made explicit). A load balancer
# pooling connections to the gateway must drop idle ones sooner, or a request it sends as the gateway
# closes one fails with a 502 it cannot retry (a POST is not idempotent).
KEEP_ALIVE_S = 5
NO_CONFIG_HINT = (
    "name one with --config; docs/configuration.md has an example, and `weir demo` serves a small "
    "model without one"
)


def app_from_env() -> Any:
    """The app for a server worker process: the config path and log level come from the environment
    (granian starts workers from an import string, not from an app object)."""
    return _config_and_app()[1]


def granian_app_from_env() -> Any:
    """`app_from_env`'s app for a granian worker, behind the proxy-headers wrapper granian ships but
    does not apply itself: an `X-Forwarded-For` from a trusted proxy names the client, as uvicorn's
    own middleware does (the failed-auth throttle and request logs count per client address). The
    worker ends with granian's main process."""
    from granian.utils.proxies import wrap_asgi_with_proxy_headers

    from gateway.parent_watch import exit_with_parent

    config, app = _config_and_app()
    # granian's main process SIGKILLed (or crashed) left this worker serving the port, unsupervised,
    # with its engines: it drains and exits instead, as on a SIGTERM, within the drain's time.
    exit_with_parent(os.getppid(), grace_s=_drain_s(config) + 5, who="granian's main process")
    app = _requests_ending_at_the_drain_deadline(app, config.server.drain_timeout)
    return wrap_asgi_with_proxy_headers(app, trusted_hosts=trusted_proxies(config))


def _drain_s(config: Config) -> float:
    """Seconds `weir serve` may take to stop once signalled, its app's own shutdown aside."""
    return config.server.drain_timeout + STREAMS_END_S


def _requests_ending_at_the_drain_deadline(app: Any, seconds: float) -> Any:
    """`app`, whose requests end with their 503 or error event `seconds` after the signal that stops
    the granian worker, which sets no deadline of its own on its drain: it waited for every request
    to end. Set up in the lifespan, once granian's worker has set its own signal handlers."""
    from gateway.drain import end_requests_after_stop_signal

    async def app_ending_requests(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            end_requests_after_stop_signal(seconds)
        await app(scope, receive, send)

    return app_ending_requests


def _config_and_app() -> tuple[Config, Any]:
    from gateway.app import create_app
    from gateway.config import load_config
    from gateway.logging import configure_logging, log_uncaught
    from gateway.startup import reporting_startup_failure

    config = load_config(os.environ[CONFIG_ENV])
    configure_logging(os.environ.get(LOG_LEVEL_ENV) or config.server.log_level)
    try:
        return config, reporting_startup_failure(create_app(config))
    except Exception as exc:
        # A granian worker calls this in a multiprocessing child, which prints what escapes it as plain
        # text on stderr (no excepthook is asked): the JSON line the hook writes, then the same exit.
        log_uncaught(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None


def trusted_proxies(config: Config) -> list[str] | str:
    """The peers whose `X-Forwarded-For` names the client: `server.forwarded_allow_ips`, else what
    uvicorn trusts by default (FORWARDED_ALLOW_IPS, else loopback), for granian as well."""
    allowed = config.server.forwarded_allow_ips
    if allowed is None:
        return os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1,::1")
    return allowed


def log_listening(host: str, port: int) -> None:
    """The one line `weir serve` writes once it listens: with port 0 the only place the port shows."""
    import structlog

    structlog.get_logger("weir.gateway").info("gateway_listening", host=host, port=port)


config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default="weir.yaml",
    show_default=True,
    help="YAML configuration (see docs/configuration.md).",
)


def checked_config(config_path: str) -> Config:
    """The config at `config_path` as the gateway loads it (`${VAR}` interpolation, validation of every
    key, backend, model and route); a ConfigError becomes one `Error: PATH: ...` line and exit status 1."""
    from gateway.config import ConfigError, load_config

    try:
        return load_config(config_path)
    except ConfigError as exc:
        # A first `weir serve` in a fresh checkout finds no weir.yaml: say where to get one.
        hint = "" if os.path.exists(config_path) else f" ({NO_CONFIG_HINT})"
        raise click.ClickException(f"{config_path}: {exc}{hint}") from None


def unwritable(path: Path, directory: bool) -> str | None:
    """Why `path` cannot be written (a directory to make or write into, else a file), or None: for a
    command to check before it spends minutes on what it would write there, without making anything.
    (The write itself can still fail, a full disk say: the command reports that too.)"""
    if path.exists():
        if path.is_dir() != directory:
            return "a directory" if path.is_dir() else "a file, not a directory"
        return None if os.access(path, os.W_OK) else "permission denied"
    parent = path.parent
    if not directory and not parent.exists():  # a file is written into a directory that is there
        return f"no directory {parent}"
    while not parent.exists() and parent != parent.parent:  # a directory is made with its parents
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent}: permission denied"


def check_before_serving(config: Config, host: str, port: int) -> None:
    """What commonly stops a gateway at start, checked before any server starts (gateway.preflight):
    the address to listen on, and the admin DB (reachable, credentials, database, schema where the
    gateway will not migrate it). A failure is one `Error:` line naming what to check, exit status 1."""
    from gateway.admin.control_plane import configured_database_url
    from gateway.preflight import PreflightError, check_admin_db, check_listen

    try:
        check_listen(host, port)
        url = configured_database_url(config)
        if url:
            from gateway.db.session import resolve_database_url

            check_admin_db(resolve_database_url(url), config.auto_migrate)
    except PreflightError as exc:
        raise click.ClickException(str(exc)) from None


def check_master_key() -> None:
    """WEIR_MASTER_KEY (and WEIR_MASTER_KEY_PREVIOUS) as the gateway reads them at start, which it
    refuses with a malformed key (`SecurityControls.build`): one `Error:` line and exit status 1. None
    set is no error, as for the gateway, which then refuses to store vendor keys and stores opted-in
    prompts in clear."""
    from gateway.vault import Vault, VaultError

    try:
        Vault.from_env()
    except VaultError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@config_option
@click.option("--host", default=None, help="Interface to bind [default: server.host, else 127.0.0.1].")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port to listen on, 0: a free one [default: server.port, else 8080].",
)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None)
@click.option(
    "--server",
    "server_kind",
    type=click.Choice(["uvicorn", "granian"]),
    default="uvicorn",
    show_default=True,
    # uvicorn is the default because it always drains in-flight streams on SIGTERM (what rolling
    # restarts rely on); granian 2.8 now and then ignores a SIGTERM (tests/reliability/test_shutdown.py).
    help="HTTP server: uvicorn, or granian (Rust I/O: about 1.5-2x the concurrent throughput, but it "
    "occasionally ignores SIGTERM, so graceful restarts are not guaranteed).",
)
def serve(
    config_path: str, host: str | None, port: int | None, log_level: str | None, server_kind: str
) -> None:
    """Serve the OpenAI- and Anthropic-compatible gateway."""
    # Both here first, so that a bad config or master key is one line before any worker starts.
    config = checked_config(config_path)
    check_master_key()
    os.environ[CONFIG_ENV] = os.path.abspath(config_path)
    if log_level:
        os.environ[LOG_LEVEL_ENV] = log_level
    # `--port 0` asks for a free port, as `server.port: 0` does: not a flag left unset
    bind_host = host if host is not None else config.server.host
    bind_port = port if port is not None else config.server.port
    check_before_serving(config, bind_host, bind_port)
    _end_with_the_demo(config)
    with tempfile.TemporaryDirectory(prefix="weir-serve-") as scratch:
        failure = Path(scratch) / "startup-failure"
        os.environ[FAILURE_FILE_ENV] = str(failure)  # the server's worker writes why it failed there
        try:
            if server_kind == "granian":
                _serve_granian(config, bind_host, bind_port)
            else:
                _serve_uvicorn(config, bind_host, bind_port)
        except SystemExit as stopped:
            _said_why(stopped, failure, server_kind)
            raise


def _end_with_the_demo(config: Config) -> None:
    """The gateway `weir demo` started drains and exits once that demo is gone, SIGKILLed included:
    it served on, unsupervised, holding the demo's port (its engine too, which watches the gateway)."""
    from gateway.parent_watch import GATEWAY_PARENT_PID_ENV, exit_with_parent

    parent = os.environ.pop(GATEWAY_PARENT_PID_ENV, "")  # popped: not for the engines it starts
    if parent.isdigit():
        exit_with_parent(int(parent), grace_s=_drain_s(config) + 5, who="weir demo")


class StartFailed(click.ClickException):
    """Passed the checks, then failed to start: one `Error:` line (gateway.startup)."""

    exit_code = EXIT_STARTUP_FAILED


class WorkerDied(click.ClickException):
    """Started, then its server worker died: one `Error:` line (gateway.startup)."""

    exit_code = EXIT_WORKER_DIED


def _said_why(stopped: SystemExit, failure: Path, server_kind: str) -> None:
    """A server that stopped with a failure: the line its worker wrote, or, under granian, which
    ends with status 1 whenever its worker is gone, that the worker died."""
    if stopped.code in (None, 0):
        return
    said = failure_said(failure)
    if said is not None:
        raise StartFailed(said) from None
    if server_kind == "granian":
        raise WorkerDied(
            "the gateway's server worker (granian) exited unexpectedly, so the gateway stopped: start it "
            "again, and see the log (and the system's, for a worker the OOM killer ended) for why"
        ) from None


def _serve_granian(config: Config, host: str, port: int) -> None:
    from granian import Granian

    from gateway.logging import configure_logging

    # granian's own lines (this process's and its workers') go to the root handler, as JSON
    # lines like the rest, not through its plain-text handler.
    configure_logging(os.environ.get(LOG_LEVEL_ENV) or config.server.log_level)
    server = Granian(
        "gateway.cli:granian_app_from_env",
        factory=True,
        address=host,
        port=port,
        interface="asgi",  # type: ignore[arg-type]
        workers=1,
        websockets=False,
        log_level="warning",  # type: ignore[arg-type]
        log_access=False,  # the gateway logs one structured line per request itself
        log_dictconfig={"loggers": {"_granian": {"propagate": True}}},  # no handler of its own
    )
    # Startup hooks run in the main process once the listening socket is bound, before the workers.
    server.on_startup(lambda: log_listening(host, _granian_port(server, port)))
    try:
        server.serve()
    except (OSError, RuntimeError):  # its bind (in this process, before any worker) raises the latter
        said = _listen_failure(host, port)
        if said is None:  # the address is fine: something else failed
            raise
        raise StartFailed(said) from None


def _listen_failure(host: str, port: int) -> str | None:
    """Why the server could not bind `host:port` once `check_listen` had passed (another process took
    the port in between: two gateways started at once, say; uvicorn binds only once the app has
    started), asked again; None if it can be listened on now."""
    from gateway.preflight import PreflightError, check_listen

    try:
        check_listen(host, port)
    except PreflightError as exc:
        return str(exc)
    return None


def _granian_port(server: Any, asked: int) -> int:
    """The port granian bound: on Linux its socket spec (private in granian 2.8) holds the system's
    choice for port 0 once built; elsewhere the port asked for."""
    spec = getattr(server, "_ssp", None)
    try:  # a later granian may shape it otherwise: the line must never stop a start
        return int(spec.__getstate__()[1]) if spec is not None else asked
    except (AttributeError, IndexError, TypeError, ValueError):
        return asked


def _serve_uvicorn(config: Config, host: str, port: int) -> None:
    import asyncio
    import math

    import uvicorn

    from gateway.drain import end_requests
    from gateway.slow_clients import uvicorn_protocol

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            try:
                await super().startup(sockets)
            except SystemExit:
                if not self.lifespan.should_exit:  # the app started: it is the bind that failed
                    record_failure(
                        _listen_failure(host, port)
                        or f"cannot listen on {host}:{port}: another process held it as the server "
                        "started (start again)"
                    )
                raise
            if self.started:  # its own "running on" line is at info, below the level `serve` gives it
                bound = self.servers[0].sockets[0].getsockname()
                log_listening(bound[0], bound[1])

        async def shutdown(self, sockets: Any = None) -> None:
            # uvicorn's own deadline (`timeout_graceful_shutdown`) cancels what still runs (a 500, or a
            # stream cut off mid-body): requests end with their 503 or error event just before it.
            deadline = asyncio.get_running_loop().call_later(config.server.drain_timeout, end_requests)
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

    server = Server(
        uvicorn.Config(
            app_from_env(),
            host=host,
            port=port,
            http=uvicorn_protocol(
                config.server.header_timeout, config.server.body_timeout, config.server.max_header_bytes
            ),
            log_level="warning",
            access_log=False,
            log_config=None,  # no plain-text handlers of its own: its lines reach the JSON root handler
            timeout_graceful_shutdown=math.ceil(_drain_s(config)),
            timeout_keep_alive=KEEP_ALIVE_S,
            forwarded_allow_ips=trusted_proxies(config),
        )
    )
    # Once drained, uvicorn puts back the SIGTERM and SIGINT handlers it found and raises the signal
    # again, so the default ones ended the process "killed by SIGTERM" (status 143), or with
    # "Aborted!" and status 1 (KeyboardInterrupt), after a clean stop. Finding these instead,
    # `weir serve` exits 0: the stop was the one asked for.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda *_: None)
    server.run()


@click.group("config")
def config_group() -> None:
    """The gateway's YAML configuration."""


@config_group.command()
@config_option
def check(config_path: str) -> None:
    """Load the config as `weir serve` would, without serving: print a one-line summary and exit 0, or
    the first error and exit 1 (for CI, or a Kubernetes init container before the gateway starts).

    The environment variables the config reads (`${VAR}`) must be set as the gateway will see them, and
    WEIR_MASTER_KEY too: a malformed one stops `weir serve` as well.
    """
    from gateway.config import tenant_models_outside_the_config

    config = checked_config(config_path)
    check_master_key()
    # With an admin DB the loader lets a tenant's `models` name a route it cannot see: said, not refused.
    for where, name in tenant_models_outside_the_config(config):
        click.echo(
            f"{config_path}: note: {where}: {name!r} is no model or route of the config: it must be a "
            "route of the admin DB (/admin/api/v1/routes); the gateway warns at start if it is not",
            err=True,
        )
    tenants = _count(config.tenants, "tenant") if config.tenants is not None else _no_tenants(config)
    counts = [
        _count(config.backends, "backend"),
        _count(config.models, "model"),
        _count(config.routes, "route"),
    ]
    click.echo(f"{config_path}: OK: {', '.join(counts)}, {tenants}")


def _no_tenants(config: Config) -> str:
    """What a config without `tenants:` means: open to all, unless the admin DB's keys are checked."""
    from gateway.admin.control_plane import configured_database_url

    if configured_database_url(config):
        return "no config tenants (admin-DB keys only)"
    return "no tenants (no authentication)"


def _count(items: list[Any], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"
