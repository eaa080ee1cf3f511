"""The command line: parse, call one API function, render. The entry point is ``bnsurgeon.cli:main``."""

from bnsurgeon.cli.commands import main

__all__ = ["main"]
