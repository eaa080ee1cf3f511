"""The Typer app as a Click command, for tools that read Click (the docs' CLI reference: mkdocs-click)."""

import typer

from bnsurgeon.cli.commands import app

command = typer.main.get_command(app)
