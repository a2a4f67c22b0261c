"""The one list of sparse decode selectors (ragkv.engine.registry, the convention fusion
strategies follow too).

Each selector's options are a small frozen dataclass (its own fields, validated in
__post_init__; base :class:`ragkv.sparse.base.SelectorOptions`) that knows how to build
the per-request :class:`ragkv.sparse.base.Selector`. A selector is chosen by a spec
string, 'name' or 'name:option=value,...' (ragkv.engine.spec_string), the same syntax
fusion strategies use.
"""

from __future__ import annotations

from ragkv.engine.registry import Registry
from ragkv.sparse.a2ats import A2ATSOptions
from ragkv.sparse.base import SelectorOptions
from ragkv.sparse.dense import DenseOptions
from ragkv.sparse.lrqk import LRQKOptions
from ragkv.sparse.oracle import OracleOptions
from ragkv.sparse.pqcache import PQCacheOptions

SELECTORS = Registry("sparse selector", (DenseOptions, OracleOptions, A2ATSOptions, PQCacheOptions, LRQKOptions))
"""Name -> options dataclass, in the order users see them."""

DEFAULT_SELECTOR = A2ATSOptions.name


def selector_options(spec: str) -> SelectorOptions:
    """The options dataclass a spec names, with the spec's values (ValueError when unknown)."""
    return SELECTORS.build(spec)


def selector_names() -> tuple[str, ...]:
    return SELECTORS.names()
