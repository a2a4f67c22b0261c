"""`pie`: reuse every chunk's KV with keys re-rotated to global positions (position
recovery, exact because keys are stored before RoPE); only the question is computed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.fusion.base import FusionStrategy
from ragkv.fusion.layout import Layout


@dataclass
class Pie(FusionStrategy):
    name = "pie"

    def initial_rows(self, layout: Layout) -> torch.Tensor:
        return layout.question_rows
