"""The compiled decode step's weights as named fields, mirroring the C++ structs
(`PackedWeight`, `DecodeLayerWeights` in ragkv/kernels/cpu/decode_model.h) field for field.

They cross into C++ by keyword, so no positional order has to match, and are built once
per model (the tensors are shared, not copied)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import ModuleType

import torch


@dataclass(frozen=True)
class PackedWeight:
    """A few-row linear's tensors: int8 weight [out, in] with bf16 scales [out], or int4
    rows [out, row bytes] uint8 (scales inside) with empty scales."""

    weight: torch.Tensor
    scales: torch.Tensor

    def compiled(self, module: ModuleType):
        return module.PackedWeight(weight=self.weight, scales=self.scales)


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One Llama-style layer: float32 norms [hidden] and four packed linears."""

    input_norm: torch.Tensor
    qkv: PackedWeight  # hidden -> (Hq + 2 Hkv) * D
    o_proj: PackedWeight  # Hq * D -> hidden
    post_attention_norm: torch.Tensor
    gate_up: PackedWeight  # hidden -> 2 * intermediate
    down: PackedWeight  # intermediate -> hidden

    def compiled(self, module: ModuleType):
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        return module.DecodeLayerWeights(**{name: _compiled(value, module) for name, value in values.items()})


@dataclass(frozen=True)
class DecodeWeights:
    """A whole model as the compiled step reads it: float32 embeddings [vocab, hidden]
    (contiguous), its layers, the final norm and the LM head's packed decode weights."""

    embed: torch.Tensor
    layers: tuple[DecodeLayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: PackedWeight


def _compiled(value: torch.Tensor | PackedWeight, module: ModuleType):
    return value.compiled(module) if isinstance(value, PackedWeight) else value
