"""Retrieval-based sparse decode attention (one selector per file) and SnapKV eviction.

    from ragkv.sparse import SparseConfig, PromptState
    state = PromptState.from_fusion(model, result, codes)
    attention = SparseConfig(selector="a2ats", budget=0.06).build(state, codebook)
    model.decode_step(token, result.cache, attention)

See config.py for the budget's definition, base.py for the shared procedure and
registry.py for how selectors are chosen ('name:option=value,...').
"""

from __future__ import annotations

from ragkv.sparse.base import Selector
from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.sparse.config import SparseConfig
from ragkv.sparse.prompt import PromptState
from ragkv.sparse.registry import DEFAULT_SELECTOR, SELECTORS, selector_names
from ragkv.sparse.snapkv import SnapKV

SELECTOR_NAMES = selector_names()

__all__ = [
    "A2ATSCodebook",
    "DEFAULT_SELECTOR",
    "PromptState",
    "SELECTORS",
    "SELECTOR_NAMES",
    "Selector",
    "SnapKV",
    "SparseConfig",
    "selector_names",
]
