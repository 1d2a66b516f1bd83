"""The `weir` command. Subcommands live beside the code they drive and are imported only when used,
so `weir --help` stays fast and never imports torch."""

from __future__ import annotations

import importlib
import os

import click

from weir import __version__

# name -> "module:attribute" of a click command or group.
SUBCOMMANDS: dict[str, str] = {
    "serve": "gateway.cli:serve",
    "config": "gateway.cli:config_group",
    "demo": "weir.demo:demo",
    "engine": "engine.cli:engine",
    "models": "engine.cli:models",
    "router": "routing.cli:router",
    "db": "gateway.db.cli:db",
    "admin": "gateway.admin.ui:admin",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in SUBCOMMANDS if self._load(name) is not None)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._load(cmd_name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A subcommand whose module is not part of this build yet is simply not offered.
            if exc.name and module_name.startswith(exc.name):
                return None
            raise
        return getattr(module, attr, None)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="weir")
def main() -> None:
    """Weir: an LLM gateway and control plane with a bundled inference engine."""
    from gateway.secret_files import SecretFileError, export_secret_files

    # Secrets mounted as files (`WEIR_ADMIN_TOKEN_FILE=/run/secrets/...`), read once for every command.
    try:
        export_secret_files(os.environ)
    except SecretFileError as exc:
        raise click.ClickException(str(exc)) from None


if __name__ == "__main__":
    main()
