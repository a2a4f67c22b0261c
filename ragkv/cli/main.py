"""Argument parsing and dispatch for `ragkv`: each command module registers itself once
(ragkv.cli.command.Command), and only the command being run builds its options, so a
command that needs no model (`docs`) never imports one."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ragkv.cli import ask, bench, calibrate, docs, ingest, serve, store
from ragkv.cli.command import Command, CommandParser
from ragkv.cli.config_file import ConfigFileError, apply_config, config_path, load_config, option_actions, values_for

COMMANDS: tuple[Command, ...] = (
    ingest.COMMAND,
    ask.COMMAND,
    docs.COMMAND,
    serve.COMMAND,
    bench.COMMAND,
    calibrate.COMMAND,
    store.COMMAND,
)

EXIT_INPUT_ERROR = 2
"""Bad input, a missing document or data folder (the message says which)."""
EXIT_STORE_ERROR = 3
"""The chunk store could not take or give what was asked (e.g. an unreachable Redis)."""


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="option values from a TOML file (also $RAGKV_CONFIG); flags given here win over it",
    )


def build_parser(only: str | None = None, config: tuple[Path, dict] | None = None) -> argparse.ArgumentParser:
    """The `ragkv` parser; with `only`, just that command gets its options (the others stay
    listed in the help; "" = none does), with defaults from `config` (path, loaded TOML) when given."""
    parser = argparse.ArgumentParser(prog="ragkv", description="RAG serving over precomputed chunk KV caches")
    _add_config_option(parser)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for command in COMMANDS:
        sub = commands.add_parser(
            command.name,
            help=command.help,
            description=command.description or command.help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(handler=command.run)
        if only is None or only == command.name:
            command.configure(sub)
            _add_config_option(sub)
            if config is not None and only == command.name:
                _apply_config_file(sub, command.name, *config)
    return parser


def _apply_config_file(parser: argparse.ArgumentParser, command: str, path: Path, config: dict) -> None:
    """The command's table strictly; top-level keys this command lacks must be another's."""
    shared, own = values_for(config, path, command, {c.name for c in COMMANDS}, set(option_actions(parser)))
    unknown = apply_config(parser, shared, path, "", strict=False)
    apply_config(parser, own, path, f"[{command}] ")
    if unknown:
        full = build_parser()
        subcommands = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction)).choices
        known = set().union(*(option_actions(sub) for sub in subcommands.values()))
        strays = [key for key in unknown if key not in known]
        if strays:
            raise ConfigFileError(
                f"{path}: unknown option(s) {', '.join(map(repr, strays))} (no ragkv command has them)"
            )


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {command.name for command in COMMANDS}
    name = next((token for token in argv if token in names), None)
    path = config_path(argv)
    try:
        # no command named (`ragkv --help`): no command's options are built, so nothing heavy
        # (torch, transformers, fastapi) is imported before the help is printed
        parser = build_parser(name or "", (path, load_config(path)) if path is not None and name else None)
    except ConfigFileError as error:
        print(f"ragkv: error: {error}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
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
