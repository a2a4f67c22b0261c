"""Command-line options generated from the typed config dataclasses.

Each field's type, default and attribute docstring become an option, so the CLI cannot
drift from the config it fills.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import cache


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under a field) of a dataclass."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _scalar_type(annotation) -> type | None:
    if annotation in (int, float, str):
        return annotation
    if annotation is bool:
        return bool
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1 and args[0] in (int, float, str):
        return args[0]
    return None


def add_config_options(
    parser: argparse.ArgumentParser, cls: type, prefix: str = "", skip: tuple[str, ...] = ()
) -> None:
    """Add --<prefix><field> for every scalar field of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for item in dataclasses.fields(cls):
        if item.name in skip:
            continue
        kind = _scalar_type(hints[item.name])
        if kind is None:
            continue
        flag = "--" + (prefix + item.name).replace("_", "-")
        default = item.default if item.default is not dataclasses.MISSING else None
        if kind in (int, float) and item.default_factory is not dataclasses.MISSING:
            default = item.default_factory()  # a number derived from the machine: its value here
        help_text = f"{docs.get(item.name, '')} (default: {default})".strip()
        dest = prefix + item.name
        if kind is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)


def config_from_args(cls: type, args: argparse.Namespace, prefix: str = "", **overrides):
    """Build `cls` from parsed options, leaving unset options at the dataclass default."""
    values = {}
    for item in dataclasses.fields(cls):
        value = getattr(args, prefix + item.name, None)
        if value is not None:
            values[item.name] = value
    values.update(overrides)
    return cls(**values)
