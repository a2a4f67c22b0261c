"""`oracle`: exact scores, the upper bound. A KV head keeps the rows that carry the most
attention mass summed over its query heads (exact softmax of q.K over all rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.sparse.base import Selector, SelectorOptions, top_rows


def attention_mass(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact attention probabilities of q [Hq, 1, D] over keys [Hkv, T, D], summed over
    each KV head's query heads: [Hkv, T] float32 (each row sums to the group size)."""
    hkv, _, d = keys.shape
    grouped = q.reshape(hkv, -1, d).float()
    logits = torch.einsum("hgd,htd->hgt", grouped, keys.float()) * scale
    return logits.softmax(-1).sum(1)


@dataclass(frozen=True)
class OracleOptions(SelectorOptions):
    """No options: exact attention mass decides."""

    name: ClassVar[str] = "oracle"


class Oracle(Selector, options=OracleOptions):
    def select(self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int, k: int) -> torch.Tensor:
        keys, _ = cache.layer(layer)
        mass = attention_mass(q, keys, self.model.scale)
        return top_rows(mass[:, start:end], k, start)
