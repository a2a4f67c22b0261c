"""Retrieval-based sparse decode attention (one selector per file) and SnapKV eviction.

    from ragkv.sparse import SparseConfig, PromptState
    attention = SparseConfig(selector="a2ats", budget=0.06).build(PromptState.from_fusion(model, result, codes), codebook)
    model.decode_step(token, result.cache, attention)

See config.py for the budget's definition and base.py for the shared procedure.
"""

from __future__ import annotations

from ragkv.sparse.base import Selector
from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.sparse.config import DEFAULT_SELECTOR, SELECTOR_NAMES, SparseConfig
from ragkv.sparse.prompt import PromptState
from ragkv.sparse.snapkv import SnapKV

__all__ = [
    "A2ATSCodebook",
    "DEFAULT_SELECTOR",
    "PromptState",
    "SELECTOR_NAMES",
    "Selector",
    "SnapKV",
    "SparseConfig",
]
