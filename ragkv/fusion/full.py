"""`full`: recompute everything (vanilla prefill); the reference every strategy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.fusion.base import FusionStrategy
from ragkv.fusion.layout import Layout


@dataclass
class Full(FusionStrategy):
    name = "full"
    reuses_stored_kv = False

    def initial_rows(self, layout: Layout) -> torch.Tensor:
        return torch.arange(layout.length)
