"""What a `ragkv` subcommand is: its name, its options and the handler that runs it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    """Adds the command's options; may import heavy modules (only the command run pays)."""
    run: Callable[[argparse.Namespace], int]
    """Runs the command; returns the exit status."""
    description: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.help:
            raise ValueError("a command needs a name and a help line")


class CommandParser(argparse.ArgumentParser):
    """A (sub)command parser that reports an unknown option with its own usage, not the
    top-level one (argparse hands a subparser's leftovers up to `ragkv` by default)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras
