"""Argument parsing and dispatch for `ragkv`: each command module registers itself once
(ragkv.cli.command.Command), and only the command being run builds its options, so a
command that needs no model (`docs`) never imports one."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ragkv.cli import ask, bench, calibrate, docs, ingest, serve
from ragkv.cli.command import Command, CommandParser

COMMANDS: tuple[Command, ...] = (
    ingest.COMMAND, ask.COMMAND, docs.COMMAND, serve.COMMAND, bench.COMMAND, calibrate.COMMAND,
)

EXIT_INPUT_ERROR = 2
"""Bad input, a missing document or data folder (the message says which)."""
EXIT_STORE_ERROR = 3
"""The chunk store could not take or give what was asked (e.g. an unreachable Redis)."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `ragkv` parser; with `only`, just that command gets its options (the others stay
    listed in the help)."""
    parser = argparse.ArgumentParser(prog="ragkv", description="RAG serving over precomputed chunk KV caches")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for command in COMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.description or command.help,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.set_defaults(handler=command.run)
        if only is None or only == command.name:
            command.configure(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {command.name for command in COMMANDS}
    args = build_parser(argv[0] if argv and argv[0] in names else None).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ragkv.store.errors import StoreError

    try:
        return args.handler(args)
    except (ValueError, KeyError, FileNotFoundError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"ragkv {args.command}: error: {message}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except StoreError as error:
        print(f"ragkv {args.command}: error: {error}", file=sys.stderr)
        return EXIT_STORE_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
