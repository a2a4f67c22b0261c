"""`dense`: the reference. Every row, exact: the same computation as the engine's default
decode path (the budget is ignored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ragkv.engine.attention import decode_attention
from ragkv.engine.kv_cache import KVCache
from ragkv.sparse.base import Selector, SelectorOptions


@dataclass(frozen=True)
class DenseOptions(SelectorOptions):
    """No options: every row, exact."""

    name: ClassVar[str] = "dense"


class Dense(Selector, options=DenseOptions):
    def select(self, layer, q, cache, start, end, k):  # pragma: no cover - never reached
        raise AssertionError("dense attends to every row")

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, scale: float) -> torch.Tensor:
        keys, values = cache.layer(layer)
        if self.observer is not None:
            rows = cache.length
            self.observer(layer, q, cache, torch.arange(rows).expand(self.spec.num_kv_heads, rows), 0, rows)
        return decode_attention(q, keys, values, scale)
