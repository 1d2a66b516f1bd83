"""`weir serve`: run the gateway. Imports stay light until the command runs (`weir --help` is fast)."""

from __future__ import annotations

import click


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default="weir.yaml",
    show_default=True,
    help="YAML configuration (see docs/configuration.md).",
)
@click.option("--host", default=None, help="Interface to bind [default: server.host, else 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port to listen on [default: server.port, else 8080].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None)
def serve(config_path: str, host: str | None, port: int | None, log_level: str | None) -> None:
    """Serve the OpenAI- and Anthropic-compatible gateway."""
    import uvicorn

    from gateway.app import create_app
    from gateway.config import ConfigError, load_config
    from gateway.logging import configure_logging

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(f"{config_path}: {exc}") from None
    configure_logging(log_level or config.server.log_level)
    uvicorn.run(
        create_app(config),
        host=host or config.server.host,
        port=port or config.server.port,
        log_level="warning",
        access_log=False,  # the gateway logs one structured line per request itself
        timeout_graceful_shutdown=30,
    )
