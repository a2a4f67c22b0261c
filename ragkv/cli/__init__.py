"""The `ragkv` command."""

from ragkv.cli.main import main

__all__ = ["main"]
