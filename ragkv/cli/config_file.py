"""`--config ragkv.toml` (or $RAGKV_CONFIG): option values from a TOML file.

The keys are the long option names, with `-` or `_` (`data-dir` or `data_dir`; `api-keys`,
`session-store`, `no-...` forms are not keys: a switch is `true`/`false`). Top-level keys
apply to every command that has the option; a `[serve]`, `[ingest]`, ... table applies to
that command only and wins over the top level:

    data-dir = "/var/lib/ragkv"
    store = "tiered+lmdb:///var/lib/ragkv/db?redis=redis://cache:6379/0"
    registry = "redis://registry:6379/0"

    [serve]
    host = "0.0.0.0"
    session-store = "redis://sessions:6379/0"
    log-format = "json"

Precedence: a flag on the command line > the config file > an environment variable
($RAGKV_HOME, $RAGKV_REGISTRY, $RAGKV_API_KEYS) > the built-in default. The file only
sets the parser's defaults, so argparse still types and checks every value and a flag
given on the command line always wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

CONFIG_ENV = "RAGKV_CONFIG"
_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


class ConfigFileError(ValueError):
    pass


def config_path(argv: list[str]) -> Path | None:
    """The file named by --config in `argv` (either form), else $RAGKV_CONFIG, else None."""
    for index, token in enumerate(argv):
        if token == "--config" and index + 1 < len(argv):
            return Path(argv[index + 1])
        if token.startswith("--config="):
            return Path(token.split("=", 1)[1])
    return Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None


def load_config(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigFileError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigFileError(f"config file {path} is not valid TOML: {error}") from None


def values_for(config: dict, path: Path, command: str, commands: set[str], option_keys: set[str]) -> tuple[dict, dict]:
    """(top-level values, the command's own table) of a loaded config. A command's name is
    its table; a scalar under a name that is also an option (`store`: the command and
    `--store`) is that option's value."""
    shared = {key: value for key, value in config.items() if key not in commands or not isinstance(value, dict)}
    own = config.get(command, {})
    if not isinstance(own, dict):
        if command not in option_keys:
            raise ConfigFileError(f"{path}: [{command}] must be a table of options")
        own = {}
    return shared, own


def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Config key (long option name without dashes, `-` and `_` both accepted) -> action."""
    actions = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option not in ("--help", "--config") and not option.startswith("--no-"):
                actions[option[2:]] = actions[option[2:].replace("-", "_")] = action
    return actions


def apply_config(
    parser: argparse.ArgumentParser, values: dict, path: Path, where: str, *, strict: bool = True
) -> list[str]:
    """Set `parser`'s defaults from `values`; return the keys it has no option for (an error
    when `strict`)."""
    actions = option_actions(parser)
    unknown, defaults = [], {}
    for key, value in values.items():
        action = actions.get(key)
        if action is None:
            unknown.append(key)
            continue
        defaults[action.dest] = _converted(action, value, f"{path}: {where}{key}")
    if unknown and strict:
        known = ", ".join(sorted(k for k in actions if "_" not in k))
        raise ConfigFileError(
            f"{path}: {where}unknown option(s) {', '.join(map(repr, unknown))} for `ragkv "
            f"{parser.prog.split()[-1]}`; known: {known}"
        )
    parser.set_defaults(**defaults)
    return unknown


def _converted(action: argparse.Action, value: object, where: str) -> object:
    if isinstance(action, _SWITCHES):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where} must be true or false, got {value!r}")
        return (not value) if isinstance(action, argparse._StoreFalseAction) else value
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or (action.nargs == "+" and not value):
            raise ConfigFileError(f"{where} must be a list, got {value!r}")
        return [_scalar(action, item, where) for item in value]
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: object, where: str) -> object:
    if isinstance(value, (bool, dict, list)):
        raise ConfigFileError(f"{where} must be a {getattr(action.type, '__name__', 'string')}, got {value!r}")
    kind = action.type or str
    if kind is int and isinstance(value, float):
        raise ConfigFileError(f"{where} must be an integer, got {value!r}")
    try:
        converted = kind(value) if kind is not str or isinstance(value, str) else None
    except (TypeError, ValueError) as error:
        raise ConfigFileError(f"{where}: bad value {value!r} ({error})") from None
    if converted is None:
        raise ConfigFileError(f"{where} must be a string, got {value!r}")
    if action.choices is not None and converted not in action.choices:
        raise ConfigFileError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return converted
