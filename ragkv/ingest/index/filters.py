"""Metadata filters: which documents a query may retrieve from, by their metadata.

    {"team": "legal"}                       equality (also a number or a boolean)
    {"team": {"$in": ["legal", "hr"]}}      membership
    {"year": {"$gte": 2020, "$lt": 2025}}   numeric ranges ($gt, $gte, $lt, $lte)
    {"team": {"$ne": "legal"}}              inequality (documents without the key match)

Every key must hold; a key's operators must all hold. The filter is parsed once into a
`MetadataFilter` (a clear InputError for anything malformed) and applied per document
inside the search, so a filtered query still returns k hits when k exist.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ragkv.errors import InputError

_RANGES = {
    "$gt": lambda a, b: a > b,
    "$gte": lambda a, b: a >= b,
    "$lt": lambda a, b: a < b,
    "$lte": lambda a, b: a <= b,
}
OPERATORS = ("$eq", "$ne", "$in", *_RANGES)
MAX_KEYS = 32
MAX_VALUES = 1024

Scalar = str | int | float | bool


def _bad(message: str) -> InputError:
    return InputError("bad_filter", message)


def _scalar(key: str, value: object) -> Scalar:
    if isinstance(value, bool | str) or (isinstance(value, int | float) and math.isfinite(value)):
        return value
    raise _bad(f"filter value for {key!r} must be a string, a finite number or a boolean, got {value!r}")


def _number(key: str, op: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"filter {key!r}: {op} needs a finite number, got {value!r}")
    return value


def _same(a: object, b: Scalar) -> bool:
    """Equality that keeps booleans apart from the numbers 0 and 1."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


@dataclass(frozen=True)
class Condition:
    key: str
    op: str
    value: Scalar | tuple[Scalar, ...]

    def holds(self, metadata: dict) -> bool:
        if self.op == "$ne":
            return self.key not in metadata or not _same(metadata[self.key], self.value)
        if self.key not in metadata:
            return False
        actual = metadata[self.key]
        if self.op == "$eq":
            return _same(actual, self.value)
        if self.op == "$in":
            return any(_same(actual, option) for option in self.value)
        if isinstance(actual, bool) or not isinstance(actual, int | float):
            return False  # a range never matches a string, a list or a missing number
        return _RANGES[self.op](actual, self.value)


@dataclass(frozen=True)
class MetadataFilter:
    conditions: tuple[Condition, ...]

    @classmethod
    def parse(cls, raw: object) -> MetadataFilter:
        """The filter a JSON object describes; InputError("bad_filter") naming what is wrong."""
        if not isinstance(raw, dict) or not raw:
            raise _bad("filter must be a non-empty JSON object of metadata key -> value or {operator: value}")
        if len(raw) > MAX_KEYS:
            raise _bad(f"filter has {len(raw)} keys; at most {MAX_KEYS}")
        conditions = []
        for key, spec in raw.items():
            if not isinstance(key, str) or not key or key.startswith("$"):
                raise _bad(f"filter keys must be metadata names, got {key!r}")
            if not isinstance(spec, dict):
                conditions.append(Condition(key, "$eq", _scalar(key, spec)))
                continue
            if not spec:
                raise _bad(f"filter {key!r}: empty operator object; use one of {', '.join(OPERATORS)}")
            for op, value in spec.items():
                conditions.append(cls._condition(key, op, value))
        return cls(tuple(conditions))

    @staticmethod
    def _condition(key: str, op: object, value: object) -> Condition:
        if op in ("$eq", "$ne"):
            return Condition(key, op, _scalar(key, value))
        if op == "$in":
            if not isinstance(value, list) or not value or len(value) > MAX_VALUES:
                raise _bad(f"filter {key!r}: $in needs a list of 1-{MAX_VALUES} values, got {value!r}")
            return Condition(key, op, tuple(_scalar(key, item) for item in value))
        if op in _RANGES:
            return Condition(key, op, _number(key, op, value))
        raise _bad(f"filter {key!r}: unknown operator {op!r}; use one of {', '.join(OPERATORS)}")

    @classmethod
    def from_pairs(cls, pairs: list[str]) -> MetadataFilter:
        """`key=value` strings (the CLI's repeatable --filter): equality each. A value that
        reads as a JSON number or boolean matches it as that or as the text itself; a key
        given twice means either value."""
        values: dict[str, list[Scalar]] = {}
        for pair in pairs:
            key, sep, text = pair.partition("=")
            if not sep or not key.strip():
                raise _bad(f"--filter expects key=value, got {pair!r}")
            options = values.setdefault(key.strip(), [])
            try:
                typed = json.loads(text)
            except ValueError:
                typed = None
            if isinstance(typed, bool | int | float) and not (isinstance(typed, float) and not math.isfinite(typed)):
                options.append(typed)
            options.append(text)
        return cls.parse({key: {"$in": list(dict.fromkeys(options))} for key, options in values.items()})

    def matches(self, metadata: dict) -> bool:
        return all(condition.holds(metadata) for condition in self.conditions)
