"""The `atlas` command."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Atlas: serve and replay hybrid LMs.")


@app.command()
def version() -> None:
    """Print the Atlas version."""
    from atlas import __version__

    typer.echo(__version__)


def main() -> None:
    app()
