"""Benchmark variant specs: 'name' or 'name:field=value,...' over a typed config's fields."""

from __future__ import annotations

import typing


def parse_variant(spec: str, config_type: type, *, reserved: tuple[str, ...] = (), name_prefix: bool = False) -> tuple[str, dict]:
    """Split `spec` into its name and field values coerced to `config_type`'s field types.
    With `name_prefix`, 'key' also matches the field '<name>_key' (a3:exclude_sinks ->
    a3_exclude_sinks). Fields in `reserved` are set by the benchmark, not the spec."""
    name, _, options = spec.partition(":")
    hints = typing.get_type_hints(config_type)
    values: dict[str, object] = {}
    for option in filter(None, options.split(",")):
        key, _, raw = option.partition("=")
        key = key.strip()
        field_name = key if key in hints or not name_prefix else f"{name}_{key}"
        if field_name not in hints or field_name in reserved:
            raise ValueError(f"unknown option {key!r} in spec {spec!r}")
        values[field_name] = _coerce(hints[field_name], raw.strip())
    return name, values


def _coerce(kind, raw: str) -> object:
    if kind is bool:
        return raw.lower() in ("1", "true", "yes")
    if kind in (int, float, str):
        return kind(raw)
    inner = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if len(inner) == 1 and inner[0] in (int, float, str):
        return None if raw.lower() == "none" else inner[0](raw)
    raise ValueError(f"cannot set a field of type {kind} from a spec")
