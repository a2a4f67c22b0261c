"""Spec strings: 'name' or 'name:option=value,option=value' pick a registered dataclass by
name and set its fields, each value coerced to the field's annotated type.

One syntax everywhere a pluggable component is chosen (CLI flags, API fields, benchmark
variants); the dataclass validates the values itself when it is constructed.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'a3:ratio=0.3,exclude_sinks=true' -> ('a3', {'ratio': '0.3', 'exclude_sinks': 'true'})."""
    name, _, options = spec.strip().partition(":")
    values: dict[str, str] = {}
    for option in filter(None, (part.strip() for part in options.split(","))):
        key, equals, raw = option.partition("=")
        if not equals or not key.strip():
            raise ValueError(f"option {option!r} in spec {spec!r} is not key=value")
        if key.strip() in values:
            raise ValueError(f"option {key.strip()!r} given twice in spec {spec!r}")
        values[key.strip()] = raw.strip()
    return name.strip(), values


def build_from_spec(spec: str, registry: Mapping[str, type], kind: str):
    """Construct the registered dataclass `spec` names, with its options as field values.
    `kind` names the registry in error messages ('fusion strategy')."""
    name, raw_values = split_spec(spec)
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {', '.join(registry)}")
    cls = registry[name]
    hints = typing.get_type_hints(cls)
    settable = {item.name for item in dataclasses.fields(cls) if item.init}
    values = {}
    for key, raw in raw_values.items():
        if key not in settable:
            options = ", ".join(sorted(settable)) or "none"
            raise ValueError(f"{kind} {name!r} has no option {key!r} (options: {options})")
        values[key] = coerce(hints[key], raw, key)
    return cls(**values)


def spec_of(instance) -> str:
    """The spec string that rebuilds `instance`: its name plus every non-default field."""
    options = [
        f"{item.name}={_format(getattr(instance, item.name))}"
        for item in dataclasses.fields(instance)
        if item.init and getattr(instance, item.name) != item.default
    ]
    return instance.name + (":" + ",".join(options) if options else "")


def coerce(kind, raw: str, key: str = "value") -> object:
    """`raw` as an instance of the annotation `kind` (bool, int, float, str, or X | None)."""
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"{key} must be true or false, got {raw!r}")
    if kind in (int, float, str):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{key} must be {kind.__name__}, got {raw!r}") from None
    inner = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if len(inner) == 1 and type(None) in typing.get_args(kind):
        return None if raw.lower() == "none" else coerce(inner[0], raw, key)
    raise ValueError(f"{key} cannot be set from a spec string")


def _format(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
