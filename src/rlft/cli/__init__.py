"""The `rlft` command: a typer app (`app.py`) and one module per command group. Nothing imports
this package; its modules import the library lazily, so `rlft --help` starts without torch."""

from rlft.cli.app import main

__all__ = ["main"]
