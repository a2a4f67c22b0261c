"""From a SparseConfig and a prompt to the DecodeAttention a request decodes with."""

from __future__ import annotations

from ragkv.sparse.a2ats import A2ATS
from ragkv.sparse.base import Selector
from ragkv.sparse.config import SparseConfig
from ragkv.sparse.dense import Dense
from ragkv.sparse.lrqk import LRQK
from ragkv.sparse.oracle import Oracle
from ragkv.sparse.pqcache import PQCache
from ragkv.sparse.prompt import PromptState
from ragkv.sparse.snapkv import SnapKV

SELECTORS: dict[str, type[Selector]] = {cls.name: cls for cls in (Dense, Oracle, A2ATS, PQCache, LRQK)}


def build_decode_attention(config: SparseConfig, prompt: PromptState, codebook=None) -> Selector:
    """Build the selector on the prompt's cache, then (when configured) evict with SnapKV
    and let the selector follow the compaction. Call it once the first token's logits
    exist and before the first decode step: that is 'after the first token'."""
    selector = SELECTORS[config.selector](config, prompt, codebook)
    if config.snapkv_capacity is not None and config.snapkv_capacity < prompt.length:
        kept = SnapKV(config.snapkv_capacity, config.snapkv_kernel).evict(prompt)
        selector.compact(kept, prompt.cache.next_position)
    return selector
