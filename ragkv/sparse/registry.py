"""The one list of sparse decode selectors.

Each selector's options are a small frozen dataclass (its own fields, validated in
__post_init__) that registers itself here with :func:`register` and knows how to build
the per-request :class:`ragkv.sparse.base.Selector`. A selector is chosen by a spec
string, 'name' or 'name:option=value,...' (ragkv.engine.spec_string), the same syntax
fusion strategies use. The registry fills when ragkv.sparse is imported (its __init__
imports every selector module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ragkv.engine.spec_string import build_from_spec

DEFAULT_SELECTOR = "a2ats"

SELECTORS: dict[str, type[SelectorOptions]] = {}
"""Name -> options dataclass, in registration order."""


@dataclass(frozen=True)
class SelectorOptions:
    """A selector's own settings; subclasses add fields and define `attach`."""

    name: ClassVar[str] = ""
    default_head_aggregation: ClassVar[str] = "probs"
    """SparseConfig.head_aggregation when a request leaves it unset."""

    def attach(self, config, prompt, codebook):
        """The per-request Selector for `prompt` (a PromptState) under `config` (a SparseConfig)."""
        raise NotImplementedError


def register(cls: type[SelectorOptions]) -> type[SelectorOptions]:
    """Class decorator: make `cls` choosable by its name."""
    if not cls.name or cls.name in SELECTORS:
        raise ValueError(f"selector name {cls.name!r} is empty or already registered")
    SELECTORS[cls.name] = cls
    return cls


def selector_options(spec: str) -> SelectorOptions:
    """The options dataclass a spec names, with the spec's values (ValueError when unknown)."""
    return build_from_spec(spec, SELECTORS, "sparse selector")


def selector_names() -> tuple[str, ...]:
    return tuple(SELECTORS)
